"""`recompute-bench report`: the Markdown report and the Pareto plot of a run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import pandas as pd
import typer

from recompute_bench.cli.common import ResultsArg, ResultsDir, err, fail
from recompute_bench.config.schema import BadInput


def report(
    results: ResultsArg,
    *,
    out: Annotated[Optional[Path], typer.Option(help="Folder for report.md and pareto.png; default: the results' folder.")] = None,
    results_dir: ResultsDir = Path("results"),
) -> None:
    """Write a Markdown report and a Pareto plot (TFLOP/s/GPU against memory, one point per setting)."""
    from recompute_bench.render.plot import write_report
    from recompute_bench.results.rows import load_result_records, record_row
    from recompute_bench.results.store import resolve_results

    try:
        path = resolve_results(results, results_dir)
        records = load_result_records(path)
        df = pd.DataFrame([record_row(r) for r in records])
        folder = out or (path if path.is_dir() else path.parent)
        md, png = write_report(df, folder, f"recompute-bench report: {results}", records)
    except BadInput as e:
        raise fail(str(e)) from None
    err.print(f"wrote {md} and {png}", highlight=False)
