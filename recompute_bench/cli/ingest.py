"""`recompute-bench import`: runs measured elsewhere (Megatron-LM, Megatron Bridge, torchtitan logs
and golden files) appended to a results file as records of this product, with the estimate beside."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from recompute_bench.cli.common import err, fail, workload_flag
from recompute_bench.cli.options import PointOptions, point_options
from recompute_bench.ingest.formats import FORMATS
from recompute_bench.config.schema import BadInput

ImportWorkload = workload_flag("Preset for what a file does not state (Bridge logs and goldens, torchtitan logs); "
                               "Megatron-LM logs and golden values state the whole run.", Optional[str])


@point_options()
def import_(
    paths: Annotated[list[Path], typer.Argument(help="Log or golden-values files (Megatron-LM, Megatron Bridge, torchtitan).",
                                                show_default=False)],
    *,
    results: Annotated[Path, typer.Option(help="JSONL file the records are appended to.", rich_help_panel="Output")],
    fmt: Annotated[Optional[str], typer.Option("--format", help=f"The files' format, one of {', '.join(FORMATS)}; "
                                               "default: detected from each file.", rich_help_panel="Import")] = None,
    workload: ImportWorkload = None,
    device_name: Annotated[Optional[str], typer.Option(help="GPU the runs used, where a file names none "
                                                       "(e.g. \"NVIDIA H100 80GB HBM3\").", rich_help_panel="Import")] = None,
    world_size: Annotated[Optional[int], typer.Option(help="GPU count of a run whose file does not state it (a Megatron "
                                                      "functional test's model_config.yaml).", rich_help_panel="Import")] = None,
    name: Annotated[Optional[str], typer.Option(help="Workload name of the records (part of the golden key); default: "
                                                "the preset's, the functional-test case's or the format's.",
                                                rich_help_panel="Import")] = None,
    point: PointOptions,
) -> None:
    """Import training logs and golden values as result records: exit 0 when every file imported,
    2 when one could not be read (the others' records are still written)."""
    from recompute_bench.ingest.config import run_config
    from recompute_bench.ingest.formats import read
    from recompute_bench.ingest.record import import_record
    from recompute_bench.results.store import append_record
    from recompute_bench.config.presets import gpu_type

    table = Table(title=escape(f"imported into {results}"), header_style="bold")
    for col in ("file", "format", "setting", "status", "TFLOP/s/GPU", "peak allocated", "estimate"):
        table.add_column(col, justify="right" if col in ("TFLOP/s/GPU", "peak allocated", "estimate") else "left")
    failed = 0
    for path in paths:
        try:
            run = read(path, fmt)
            device = run.device_name or device_name
            cfg = run_config(run, workload=workload, overrides=point.overrides, sets=point.sets,
                             gpu=point.gpu or (gpu_type(device) if device else None), world_size=world_size, name=name)
            record = import_record(run, cfg, device_name=device_name)
        except BadInput as e:
            fail(str(e))  # one line per file; the other files go on
            failed += 1
            continue
        append_record(results, record)
        table.add_row(*map(escape, _cells(record)))
    if table.rows:
        err.print(table)
    if failed:
        raise typer.Exit(2)


def _cells(record: dict) -> list[str]:
    from recompute_bench.render.comparison import fmt_tflops
    from recompute_bench.render.tables import fmt_bytes
    from recompute_bench.results.rows import setting_label

    m, src = record["metrics"], record["source"]
    status = record["status"] + (f" ({record['failure']['summary']})" if record.get("failure") else "")
    return [Path(src["file"]).name, src["format"], setting_label(record), status, fmt_tflops(m["tflops_per_gpu"]),
            fmt_bytes(m["peak_allocated_bytes"]), fmt_bytes(m["estimated_peak_allocated_bytes"])]
