"""`recompute-bench compare` and `golden update`: the CI gate and the explicit way goldens change."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from recompute_bench.cli.common import GoldenFile, ResultsArg, ResultsDir, Strict, err, fail, json_flag, records_kind
from recompute_bench.cli.hints import print_command, update_command
from recompute_bench.config.schema import BadInput

CompareJson = json_flag("the comparison")


def compare(
    results: ResultsArg,
    *,
    golden: GoldenFile = None,
    tolerance: Annotated[Optional[list[str]], typer.Option(help="METRIC:TOLERANCE overriding every row, e.g. "
                                                           "tflops_per_gpu:10%, activation_bytes:0, step_time_s:off "
                                                           "(repeatable).", rich_help_panel="Golden")] = None,
    strict: Strict = False,
    details: Annotated[bool, typer.Option("--details", help="List every metric of every row, not only the failing ones.",
                                          rich_help_panel="Output")] = False,
    junit: Annotated[Optional[Path], typer.Option(help="Write JUnit XML here (one test case per row and metric).",
                                                  rich_help_panel="Output")] = None,
    markdown: Annotated[Optional[Path], typer.Option(help="Write a Markdown summary here (also appended to "
                                                     "$GITHUB_STEP_SUMMARY when set).", rich_help_panel="Output")] = None,
    json_out: CompareJson = False,
    workload: Annotated[Optional[list[str]], typer.Option("--workload", "-w", help="Gate only the golden rows of this "
                                                          "workload (repeatable); the golden's other workloads are not "
                                                          "missing. Default: every row of the golden.",
                                                          rich_help_panel="Golden")] = None,
    results_dir: ResultsDir = Path("results"),
) -> None:
    """Compare results with a golden file: a verdict per row, exit 0 pass, 1 a failing verdict, 2 bad input."""

    from recompute_bench.gate import golden as gold, tolerances as tol, verdicts
    from recompute_bench.results.rows import load_result_records, record_row
    from recompute_bench.results.store import resolve_results
    from recompute_bench.render.comparison import details_table, experiment_table, headline, junit_xml, markdown as to_markdown, to_json

    try:
        path = resolve_results(results, results_dir)
        rows = [record_row(r) for r in load_result_records(path)]
        golden_file = golden or gold.golden_path_for(records_kind(rows), results_dir)
        golden_rows = _of_workloads(gold.read_golden(golden_file), workload, golden_file)
        overrides = tol.parse_tolerances(tolerance)
    except BadInput as e:
        raise fail(str(e)) from None
    comparison = verdicts.compare(rows, golden_rows, tolerances=overrides, strict=strict, golden_path=golden_file)
    title = f"compare {results} with {golden_file}"
    err.print(experiment_table(comparison, title))
    table = details_table(comparison, everything=details)
    if table is not None:
        err.print(table)
    selection = comparison.update_selection()
    command = (update_command(results, golden_file, selection, results_dir)
               if not comparison.passed and selection != [] else None)
    style = "green" if comparison.passed else "red"
    err.print(f"[{style}]{escape(headline(comparison))}[/]", highlight=False)
    if command:
        print_command("if the change is intended, update the golden (then review the git diff):", command)

    md = to_markdown(comparison, title, command)
    for target in (junit, markdown):
        if target is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
    if junit is not None:
        junit.write_text(junit_xml(comparison))
    if markdown is not None:
        markdown.write_text(md)
    summary_file = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary_file:
        with open(summary_file, "a") as f:
            f.write(md + "\n")
    if json_out:
        typer.echo(json.dumps(to_json(comparison, results=str(path), golden=str(golden_file)), indent=2, default=str))
    if not comparison.passed:
        raise typer.Exit(1)


def _of_workloads(rows: list[dict] | None, workloads: Optional[list[str]], path: Path) -> list[dict] | None:
    """The golden rows of `workloads` (every row where none is named); a named workload the golden
    has no row of is bad input."""
    if not workloads or rows is None:
        return rows
    held = sorted({str(r["workload"]) for r in rows})
    unknown = [w for w in workloads if w not in held]
    if unknown:
        raise BadInput(f"{path} has no golden row of workload {', '.join(unknown)}: it holds {', '.join(held) or 'none'}; "
                       "name one of those with --workload, or leave --workload out")
    return [r for r in rows if str(r["workload"]) in workloads]


def golden_update(
    results: ResultsArg,
    *,
    golden: GoldenFile = None,
    select: Annotated[Optional[list[str]], typer.Option(help="Promote only this experiment (Exp 1) or setting "
                                                        "(selective[mlp]); repeatable. Default: every row.")] = None,
    results_dir: ResultsDir = Path("results"),
) -> None:
    """Promote measured rows into a golden file: rows with the same key are replaced (their
    tolerance overrides kept), new rows added, every other row kept. Review the result with git diff."""
    from recompute_bench.gate import golden as gold
    from recompute_bench.results.rows import load_result_records, record_row
    from recompute_bench.results.store import resolve_results

    try:
        rows = [record_row(r) for r in load_result_records(resolve_results(results, results_dir))]
        golden_file = golden or gold.golden_path_for(records_kind(rows), results_dir)
        summary = gold.update_golden(golden_file, rows, select)
    except BadInput as e:
        raise fail(str(e)) from None
    for label, names in (("replaced", summary.replaced), ("added", summary.added), ("skipped (not ok or oom)", summary.skipped)):
        if names:
            err.print(f"{label}: {escape(', '.join(names))}", highlight=False)
    if not (summary.added or summary.replaced):
        err.print(f"[red]nothing promoted[/]; {golden_file} is unchanged", highlight=False)
        raise typer.Exit(1)
    if summary.migrated_columns:
        err.print(f"migrated the key: every row now has the column(s) {escape(', '.join(summary.migrated_columns))}",
                  highlight=False, soft_wrap=True)
    err.print(f"wrote {golden_file}: {len(summary.added)} added, {len(summary.replaced)} replaced, {summary.kept} kept; "
              f"review with `git diff {golden_file}`", highlight=False)
