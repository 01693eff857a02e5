"""`recompute-bench sweep`: several recompute settings, each measured in its own process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from recompute_bench.cli.common import (GoldenFile, ResultsDir, Strict, err, fail, hardware_kind, json_flag, show_notes,
                                        workload_flag)
from recompute_bench.cli.hints import command_line, print_command, run_locator, update_command
from recompute_bench.cli.options import PointOptions, point_options, split_list
from recompute_bench.cli.ranks import OPTIONS as LAUNCH_OPTIONS, launch_options
from recompute_bench.cli.run import check_runnable
from recompute_bench.launch.torchrun import Launch
from recompute_bench.config.schema import BadInput

SweepWorkload = workload_flag("Preset name or .toml path; default tiny (or the grid file's workload).", Optional[str])
SweepJson = json_flag("the plan (with --dry-run) or the comparison")


@point_options(panels=("Workload", "Parallelism"))
@launch_options
def sweep(
    ctx: typer.Context,
    *,
    launch: Launch,
    workload: SweepWorkload = None,
    point: PointOptions,
    modules: Annotated[Optional[list[str]], typer.Option(help="Each non-empty subset of these modules as a selective "
                                                         "setting (space or comma separated).", rich_help_panel="Sweep")] = None,
    methods: Annotated[Optional[list[str]], typer.Option(help="Full recompute methods (uniform, block), crossed with "
                                                         "the layer counts below.", rich_help_panel="Sweep")] = None,
    num_layers_recompute: Annotated[Optional[list[str]], typer.Option(help="Full recompute layer counts N; alone they "
                                                                      "mean method block.", rich_help_panel="Sweep")] = None,
    baseline: Annotated[bool, typer.Option("--baseline", help="Add the point without recompute (Baseline).", rich_help_panel="Sweep")] = False,
    grid: Annotated[Optional[Path], typer.Option(help="TOML file listing the points ([[point]] tables) instead of the flags.",
                                                 rich_help_panel="Sweep")] = None,
    policy: Annotated[Optional[str], typer.Option(help="Add a per-layer policy point named Auto: `auto` (what `plan "
                                                  "--auto` chooses for --memory-gb) or a policy file.",
                                                  rich_help_panel="Sweep")] = None,
    memory_gb: Annotated[Optional[float], typer.Option(help="With --policy auto: device memory per GPU in GiB (fractions "
                                                       "allowed; on a CPU no allocator allowance is added).",
                                                       rich_help_panel="Sweep")] = None,
    dry_run: Annotated[bool, typer.Option(help="Print the plan and exit without measuring.", rich_help_panel="Sweep")] = False,
    run_id: Annotated[Optional[str], typer.Option(help="Name of the run folder; default: UTC time and 4 hex digits.",
                                                  rich_help_panel="Sweep")] = None,
    resume: Annotated[Optional[str], typer.Option(help="Continue the sweep RUN_ID with its saved plan; points with an ok "
                                                  "or oom record are skipped.", rich_help_panel="Sweep")] = None,
    timeout: Annotated[float, typer.Option(help="Time limit of one point in seconds (from the moment its process has started; the start has its own limit of 300 s).",
                                           rich_help_panel="Sweep")] = 600.0,
    device: Annotated[Optional[str], typer.Option(help="torch device of every point; default CUDA if present.",
                                                  rich_help_panel="Sweep")] = None,
    peak_tflops: Annotated[Optional[float], typer.Option(help="Peak TFLOP/s of the device for MFU.", rich_help_panel="Sweep")] = None,
    golden: GoldenFile = None,
    no_golden: Annotated[bool, typer.Option("--no-golden", help="Do not compare with a golden file.", rich_help_panel="Golden")] = False,
    strict: Strict = False,
    results_dir: ResultsDir = Path("results"),
    json_out: SweepJson = False,
) -> None:
    """Measure several recompute settings, each in its own process, and compare them with the golden.

    Results go to results/<run-id>/; with no flag every setting of the workload is measured."""
    from recompute_bench.gate import golden as gold, verdicts
    from recompute_bench.results.rows import record_row
    from recompute_bench.render.comparison import details_table, experiment_table, headline, to_json
    from recompute_bench.launch.sweep import (RunSettings, SweepRequest, load_run_settings, plan_points, plan_to_dict,
                                              resume_command, run_sweep)
    from recompute_bench.results.store import check_run_id, new_run_id

    try:
        if timeout <= 0:
            raise BadInput(f"--timeout must be a positive number of seconds, got {timeout:g}")
        settings = RunSettings(launch, device, timeout, peak_tflops)
        saved = load_run_settings(results_dir / check_run_id(resume)) if resume else None
        if saved is not None:  # the resumed sweep's ranks, device, limits: as saved, unless retried otherwise
            settings = saved.resumed(settings, _given_on_the_command_line(ctx), resume)
            launch, device, timeout = settings.launch, settings.device, settings.timeout_s
        kind = hardware_kind(device, point.gpu)
        request = SweepRequest(workload, point.overrides, point.sets, point.gpu or kind, split_list(modules),
                               split_list(methods), split_list(num_layers_recompute), baseline, grid,
                               results_dir / check_run_id(resume) if resume else None, run_id, policy, memory_gb, device)
        points, notes = plan_points(request)
        for p in points:
            p.cfg = check_runnable(p.cfg, device, launch)
        golden_file, golden_rows = (None, None) if no_golden else gold.choose_golden(golden, kind, results_dir)
        run = check_run_id(resume or run_id or new_run_id())
    except BadInput as e:
        raise fail(str(e)) from None
    show_notes(notes)

    if dry_run:
        err.print(plan_table(points, f"plan: {len(points)} points, each in its own process "
                                      f"(time limit {timeout:g} s); nothing is measured with --dry-run"))
        if golden_rows is not None:
            err.print(f"would compare with {golden_file}", highlight=False)
        if json_out:
            typer.echo(json.dumps(plan_to_dict(points), indent=2))
        return

    run_dir = results_dir / run
    err.print(f"sweep {run}: {len(points)} points into {run_dir}/", highlight=False)
    try:
        with SweepProgress(len(points)) as progress:
            records = run_sweep(points, run_dir, settings, resume=bool(resume), on_start=progress.start,
                                on_done=progress.done)
    except BadInput as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        # the ranks, device, time limits and peak are in the plan (`RunSettings`); what compares is not
        same = [*(["--gpu", point.gpu] if point.gpu else []),
                *(["--no-golden"] if no_golden else ["--golden", golden] if golden else []), *(["--strict"] if strict else [])]
        print_command(f"interrupted: finished points are in {run_dir}/results.jsonl; continue with",
                      resume_command(run_dir, *map(str, same)))
        raise typer.Exit(130) from None

    rows = [record_row(r) for r in records]
    planned = {verdicts.row_key(r) for r in rows}
    comparison = verdicts.compare(rows, golden_rows, strict=strict, only_keys=planned, golden_path=golden_file)
    title = f"sweep {run}: {points[0].cfg.workload} on {rows[0].get('device_name') if rows else '?'}"
    if golden_rows is not None:
        title += f" vs {golden_file}"
    err.print(experiment_table(comparison, title))
    details = details_table(comparison)
    if details is not None and golden_rows is not None:
        err.print(details)
    if golden_rows is None:
        err.print(f"no golden compared ({'--no-golden' if no_golden else f'{golden_file} does not exist'})", highlight=False)
    else:
        err.print(headline(comparison), highlight=False)
    err.print(f"results: {run_dir / 'results.jsonl'}; logs: {run_dir / 'logs'}/", highlight=False, soft_wrap=True)
    print_command("report:", command_line("recompute-bench", "report", run, *run_locator(results_dir)))
    selection = comparison.update_selection() if golden_rows is not None and not comparison.passed else []
    if selection != []:
        print_command("to accept these numbers as the new golden (then review the git diff):",
                       update_command(run, golden_file, selection, results_dir))
    if json_out:
        typer.echo(json.dumps(to_json(comparison, run_id=run, results=str(run_dir / "results.jsonl"),
                                      golden=str(golden_file) if golden_rows is not None else None), indent=2))
    if not comparison.passed:
        raise typer.Exit(1)


def _given_on_the_command_line(ctx: typer.Context) -> set[str]:
    """The run settings (`launch.sweep.RunSettings` field names) this command line gave itself."""
    fields = {"device": "device", "timeout": "timeout_s", "peak_tflops": "peak_tflops", **{n: n for n in LAUNCH_OPTIONS}}
    given = {param: ctx.get_parameter_source(param) for param in fields}
    return {fields[param] for param, source in given.items() if source is not None
            and source.name in ("COMMANDLINE", "ENVIRONMENT")}


def plan_table(points, title: str) -> Table:
    table = Table(title=escape(title), header_style="bold")
    for col in ("Experiment", "recompute setting", "workload", "L", "s", "b/B", "precision", "tp/pp/dp"):
        table.add_column(col, justify="right" if col in ("L", "s", "b/B", "tp/pp/dp") else "left")
    for p in points:
        c = p.cfg
        table.add_row(escape(p.name), escape(p.setting), c.workload, str(c.model.num_layers), str(c.training.seq_length),
                      f"{c.training.micro_batch_size}/{c.training.global_batch_size}", c.training.precision,
                      f"{c.parallel.tensor_model_parallel_size}/{c.parallel.pipeline_model_parallel_size}/"
                      f"{c.parallel.data_parallel_size}")
    return table


class SweepProgress:
    """A rich progress bar (point, elapsed, ETA) on a terminal; one line per point otherwise."""

    def __init__(self, total: int):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)
        self.total, self.finished = total, 0
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=err,
                                 transient=True, disable=not err.is_terminal)
        self.task = self.progress.add_task("starting", total=total)

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        self.progress.__exit__(*exc)

    def start(self, point, index: int) -> None:
        self.progress.update(self.task, description=escape(f"{point.name} {point.setting}"))

    def done(self, point, record: dict, seconds: float, skipped: bool) -> None:
        self.finished += 1
        if skipped:
            self.progress.update(self.task, total=self.progress.tasks[0].total - 1)
            line = f"[{self.finished}/{self.total}] {point.name} {point.setting}: {record['status']} (done before, skipped)"
        else:
            self.progress.advance(self.task)
            failure = record.get("failure") or {}
            why = f" ({failure.get('message')})" if failure else ""
            line = f"[{self.finished}/{self.total}] {point.name} {point.setting}: {record['status']} in {seconds:.1f} s{why}"
        self.progress.console.print(escape(line), highlight=False, soft_wrap=True)
