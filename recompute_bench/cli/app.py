"""The `recompute-bench` command line (Typer): one small function per subcommand.

`main()` normalises argv before Typer sees it, so every spelling a Megatron user types works:
`--recompute_modules core_attn layernorm` (underscores, space-separated list),
`--recompute-modules core_attn,layernorm` (comma list), repeated flags, and Megatron Bridge's
short flags (`-rl N`, `-ol N`, `-tp`, `-pp`, `-mb`, `-gb`, `-sl`). Data goes to stdout (`--json`),
people's output to stderr. Exit codes: 0 ok, 1 a failed point or check, 2 bad input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from recompute_bench.spec.config import ATTENTION_BACKENDS, ConfigError
from recompute_bench.spec.presets import DEFAULT_WORKLOAD, load_preset, resolve, workload_names

err = Console(stderr=True, width=None if sys.stderr.isatty() else 140)
app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Measure, predict and gate activation-recomputation settings of GPT training.")

# Options that take a list: each following word up to the next flag is one more value.
LIST_OPTIONS = {"--recompute-modules", "--modules", "--methods", "--num-layers-recompute"}
SHORT_FLAGS = {"-rl": "--recompute-num-layers", "-ol": "--activation-offload-layers",
               "-tp": "--tensor-model-parallel-size", "-pp": "--pipeline-model-parallel-size",
               "-dp": "--data-parallel-size", "-mb": "--micro-batch-size", "-gb": "--global-batch-size",
               "-sl": "--seq-length"}


def normalize_argv(argv: list[str]) -> list[str]:
    """Rewrite Megatron-style spellings into the repeated dashed flags Typer parses."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--":
            out += argv[i - 1:]
            break
        token = SHORT_FLAGS.get(token, token)
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            name = name.replace("_", "-")
            if name in LIST_OPTIONS:
                values = [value] if eq else []
                while i < len(argv) and not argv[i].startswith("-"):
                    values.append(argv[i])
                    i += 1
                for v in values or [""]:
                    out += [name, v]
                continue
            token = name + eq + value
        out.append(token)
    return out


def _split_list(values: Optional[list[str]]) -> Optional[list[str]]:
    """Flatten comma lists; "[]" or "" mean an explicitly empty list."""
    if values is None:
        return None
    return [v.strip() for item in values for v in item.strip().strip("[]").split(",") if v.strip()]


def fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


# ----- shared options (the names are the config fields) -------------------------------------
Workload = Annotated[str, typer.Option("--workload", "-w", help="Preset name (see `workloads`) or path to a .toml preset.",
                                       rich_help_panel="Workload")]
NumLayers = Annotated[Optional[int], typer.Option(help="Override model.num_layers.", rich_help_panel="Workload")]
SeqLength = Annotated[Optional[int], typer.Option(help="Override training.seq_length.", rich_help_panel="Workload")]
MicroBatch = Annotated[Optional[int], typer.Option(help="Override training.micro_batch_size.", rich_help_panel="Workload")]
GlobalBatch = Annotated[Optional[int], typer.Option(help="Override training.global_batch_size.", rich_help_panel="Workload")]
Precision = Annotated[Optional[str], typer.Option(help="Override training.precision: bf16, fp16 or fp32.", rich_help_panel="Workload")]
AttentionBackend = Annotated[Optional[str], typer.Option(help="Override model.attention_backend: sdpa or math.",
                                                         rich_help_panel="Workload")]
Sets = Annotated[Optional[list[str]], typer.Option("--set", help="Override any field: section.key=value (repeatable), "
                                                   "e.g. --set model.hidden_dropout=0.1.", rich_help_panel="Workload")]
Gpu = Annotated[Optional[str], typer.Option(help="GPU kind for per-GPU preset tables (h100, h200, ...); default: this machine's.",
                                            rich_help_panel="Workload")]
TP = Annotated[Optional[int], typer.Option("--tensor-model-parallel-size", "--tp", help="Override parallel.tensor_model_parallel_size.",
                                           rich_help_panel="Parallelism")]
PP = Annotated[Optional[int], typer.Option("--pipeline-model-parallel-size", "--pp", help="Override parallel.pipeline_model_parallel_size.",
                                           rich_help_panel="Parallelism")]
DP = Annotated[Optional[int], typer.Option("--data-parallel-size", "--dp", help="Override parallel.data_parallel_size.",
                                           rich_help_panel="Parallelism")]
SP = Annotated[Optional[bool], typer.Option("--sequence-parallel/--no-sequence-parallel", help="Override parallel.sequence_parallel.",
                                            rich_help_panel="Parallelism")]
Granularity = Annotated[Optional[str], typer.Option(help="none, selective or full. Implied by --recompute-modules "
                                                    "(selective) or --recompute-num-layers alone (full, block).",
                                                    rich_help_panel="Recompute")]
Modules = Annotated[Optional[list[str]], typer.Option(help="Selective modules: core_attn mlp layernorm (space or comma "
                                                      "separated, or repeated); [] means none.", rich_help_panel="Recompute")]
Method = Annotated[Optional[str], typer.Option(help="Full recompute method: uniform or block.", rich_help_panel="Recompute")]
RecomputeLayers = Annotated[Optional[int], typer.Option(help="Full recompute: N layers per chunk (uniform) or checkpointed (block).",
                                                        rich_help_panel="Recompute")]
OffloadLayers = Annotated[Optional[int], typer.Option(help="Keep saved activations of the first N layers in host memory (CUDA only).",
                                                      rich_help_panel="Recompute")]


def _this_gpu() -> str:
    from recompute_bench.launch.devices import visible_gpu_name  # NVML: the parent holds no CUDA context
    from recompute_bench.spec.presets import gpu_type
    return gpu_type(visible_gpu_name())


def shape_overrides(*, num_layers=None, seq_length=None, micro_batch_size=None, global_batch_size=None,
                    precision=None, attention_backend=None, tp=None, pp=None, dp=None, sequence_parallel=None) -> dict[str, Any]:
    """The workload flags of a command as `resolve` overrides ("section.key" -> value; None = not given)."""
    return {
        "model.num_layers": num_layers, "training.seq_length": seq_length,
        "training.micro_batch_size": micro_batch_size, "training.global_batch_size": global_batch_size,
        "training.precision": precision, "model.attention_backend": attention_backend,
        "parallel.tensor_model_parallel_size": tp, "parallel.pipeline_model_parallel_size": pp,
        "parallel.data_parallel_size": dp, "parallel.sequence_parallel": sequence_parallel,
    }


def resolve_cli(workload: str, *, num_layers=None, seq_length=None, micro_batch_size=None, global_batch_size=None,
                precision=None, attention_backend=None, sets=None, gpu=None, tp=None, pp=None, dp=None,
                sequence_parallel=None, granularity=None, modules=None, method=None, recompute_num_layers=None,
                activation_offload_layers=None):
    """Options of a command -> (Config, notes); ConfigError on bad input."""
    overrides: dict[str, Any] = {
        **shape_overrides(num_layers=num_layers, seq_length=seq_length, micro_batch_size=micro_batch_size,
                          global_batch_size=global_batch_size, precision=precision,
                          attention_backend=attention_backend, tp=tp, pp=pp, dp=dp,
                          sequence_parallel=sequence_parallel),
        "recompute.granularity": granularity, "recompute.modules": _split_list(modules),
        "recompute.method": method, "recompute.num_layers": recompute_num_layers,
        "recompute.activation_offload_layers": activation_offload_layers,
    }
    return resolve(workload, overrides=overrides, sets=sets or (), gpu=gpu or _this_gpu())


def _show_notes(notes: list[str]) -> None:
    for note in notes:
        err.print(f"[yellow]note:[/] {escape(note)}", highlight=False)


@app.command()
def workloads(json_out: Annotated[bool, typer.Option("--json", help="Print the presets as JSON on stdout.")] = False) -> None:
    """List the built-in workload presets with their shapes."""
    rows = []
    for name in workload_names():
        cfg, _ = resolve(name, gpu="cpu")
        m, t = cfg.model, cfg.training
        rows.append({"workload": name, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
                     "num_attention_heads": m.num_attention_heads, "num_query_groups": m.groups,
                     "ffn_hidden_size": m.ffn_hidden_size, "vocab_size": m.vocab_size, "seq_length": t.seq_length,
                     "normalization": m.normalization, "activation": m.activation,
                     "position_embedding_type": m.position_embedding_type,
                     "micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
                     "precision": t.precision, "description": load_preset(name).get("description", "")})
    if json_out:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="workload presets")
    for col in ("workload", "L", "h", "a", "g", "ffn", "vocab", "s", "b/B", "norm", "act", "pos"):
        table.add_column(col, justify="left" if col in ("workload", "norm", "act", "pos") else "right")
    for r in rows:
        table.add_row(r["workload"], str(r["num_layers"]), str(r["hidden_size"]), str(r["num_attention_heads"]),
                      str(r["num_query_groups"]), str(r["ffn_hidden_size"]), str(r["vocab_size"]), str(r["seq_length"]),
                      f"{r['micro_batch_size']}/{r['global_batch_size']}", r["normalization"], r["activation"],
                      r["position_embedding_type"])
    err.print(table)


@app.command()
def run(
    *,
    workload: Workload = DEFAULT_WORKLOAD,
    num_layers: NumLayers = None, seq_length: SeqLength = None, micro_batch_size: MicroBatch = None,
    global_batch_size: GlobalBatch = None, precision: Precision = None, attention_backend: AttentionBackend = None,
    sets: Sets = None, gpu: Gpu = None,
    tp: TP = None, pp: PP = None, dp: DP = None, sequence_parallel: SP = None,
    recompute_granularity: Granularity = None, recompute_modules: Modules = None, recompute_method: Method = None,
    recompute_num_layers: RecomputeLayers = None, activation_offload_layers: OffloadLayers = None,
    device: Annotated[Optional[str], typer.Option(help="torch device, e.g. cuda:1 or cpu; default: CUDA if present.",
                                                  rich_help_panel="Output")] = None,
    peak_tflops: Annotated[Optional[float], typer.Option(help="Peak TFLOP/s of the device for MFU, overriding the built-in table.",
                                                         rich_help_panel="Output")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result record as JSON on stdout.", rich_help_panel="Output")] = False,
    save: Annotated[bool, typer.Option("--save/--no-save", help="Append the record to --results.", rich_help_panel="Output")] = True,
    results: Annotated[Path, typer.Option(help="JSONL file the record is appended to.", rich_help_panel="Output")] = Path("results/runs.jsonl"),
) -> None:
    """Measure one recompute setting of a workload on this machine and record the result."""
    try:
        cfg, notes = resolve_cli(workload, num_layers=num_layers, seq_length=seq_length, micro_batch_size=micro_batch_size,
                                 global_batch_size=global_batch_size, precision=precision,
                                 attention_backend=attention_backend, sets=sets, gpu=gpu, tp=tp, pp=pp, dp=dp,
                                 sequence_parallel=sequence_parallel, granularity=recompute_granularity,
                                 modules=recompute_modules, method=recompute_method,
                                 recompute_num_layers=recompute_num_layers,
                                 activation_offload_layers=activation_offload_layers)
        check_runnable(cfg, device)
    except ConfigError as e:
        raise fail(str(e)) from None
    _show_notes(notes)

    from recompute_bench.measure.point import pick_device, run_point
    from recompute_bench.render.tables import run_table
    from recompute_bench.results.store import append_record

    err.print(f"measuring {cfg.workload} with recompute {escape(cfg.recompute.label)} ...", highlight=False)
    record = run_point(cfg, device=pick_device(device), peak_tflops=peak_tflops)
    err.print(run_table(record))
    if save:
        append_record(results, record)
        err.print(f"appended to {results}", highlight=False)
    if json_out:
        typer.echo(json.dumps(record, indent=2, default=str))
    if record["status"] != "ok":
        raise typer.Exit(1)


def check_runnable(cfg, device: str | None) -> None:
    """What `run` can measure on one process: no model parallelism, and offload only on CUDA."""
    import torch

    p = cfg.parallel
    if p.tensor_model_parallel_size > 1 or p.pipeline_model_parallel_size > 1 or p.data_parallel_size > 1:
        raise ConfigError("run measures one rank without tensor, pipeline or data parallelism; pass "
                          "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --data-parallel-size 1 "
                          "(use `estimate` for parallel layouts)")
    on_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if cfg.recompute.activation_offload_layers and not on_cuda:
        raise ConfigError("activation offload moves saved tensors from a CUDA device to host memory and there is "
                          "no CUDA device here; drop --activation-offload-layers")
    if device and device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device} asks for CUDA but torch sees no CUDA device; pass --device cpu")


@app.command()
def verify(
    *,
    workload: Workload = DEFAULT_WORKLOAD,
    num_layers: NumLayers = None, seq_length: SeqLength = None, micro_batch_size: MicroBatch = None,
    attention_backend: Annotated[Optional[list[str]], typer.Option(help="Backends to check (repeatable); default both.")] = None,
    sets: Sets = None,
    recompute_granularity: Granularity = None, recompute_modules: Modules = None, recompute_method: Method = None,
    recompute_num_layers: RecomputeLayers = None,
    device: Annotated[Optional[str], typer.Option(help="torch device; default cpu, where equality is exact.")] = "cpu",
    json_out: Annotated[bool, typer.Option("--json", help="Print the outcomes as JSON on stdout.")] = False,
) -> None:
    """Prove that every recompute setting (or the one given) leaves the loss and every gradient
    unchanged: fp32, dropout on, same seed and inputs as the no-recompute baseline."""
    import torch

    from recompute_bench.measure.verify import all_settings, verify as run_verify

    backends = attention_backend or ["sdpa", "math"]
    try:
        given = recompute_granularity or recompute_modules is not None or recompute_num_layers is not None
        cfg, notes = resolve_cli(workload, num_layers=num_layers, seq_length=seq_length,
                                 micro_batch_size=micro_batch_size, sets=sets, gpu="cpu",
                                 granularity=recompute_granularity, modules=recompute_modules, method=recompute_method,
                                 recompute_num_layers=recompute_num_layers,
                                 attention_backend=backends[0])
        for b in backends:
            if b not in ATTENTION_BACKENDS:
                raise ConfigError(f"attention_backend {b!r} is not one of {', '.join(ATTENTION_BACKENDS)}; pass --attention-backend sdpa or math")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device {device} asks for CUDA but torch sees no CUDA device; pass --device cpu")
    except ConfigError as e:
        raise fail(str(e)) from None
    _show_notes(notes)
    settings = [cfg.recompute] if given else all_settings(cfg.model.num_layers)
    outcomes = run_verify(cfg, settings, backends, torch.device(device))

    table = Table(title=f"verify {cfg.workload}: fp32, dropout on, against no recompute")
    for col in ("setting", "attention", "|loss diff|", "max |grad diff|", "worst parameter", "result"):
        table.add_column(col, justify="right" if "diff" in col else "left")
    for o in outcomes:
        table.add_row(escape(o.setting), o.attention_backend, f"{o.loss_diff:.3g}", f"{o.max_grad_diff:.3g}", o.worst_parameter,
                      "[green]exact[/]" if o.exact else "[red]DIFFERS[/]")
    err.print(table)
    if json_out:
        typer.echo(json.dumps([{**o.__dict__, "exact": o.exact} for o in outcomes], indent=2))
    bad = [o for o in outcomes if not o.exact]
    if bad:
        err.print(f"[red]{len(bad)} of {len(outcomes)} settings change the loss or a gradient[/]")
        raise typer.Exit(1)
    err.print(f"[green]all {len(outcomes)} settings leave the loss and every gradient bitwise equal[/]")


# ----- estimate and plan: the analytical model (estimate.py), no measurement ----------------
ModelDevice = Annotated[str, typer.Option("--device", help="What to model: cuda (the default; masks, norm statistics and "
                                          "attention kernels as on a GPU) or cpu (as `run` measures on a CPU).",
                                          rich_help_panel="Estimate")]
AllowanceFraction = Annotated[float, typer.Option(help="Allocator allowance: fraction of the allocated peak added for "
                                                  "fragmentation (reserved minus allocated).", rich_help_panel="Estimate")]
AllowanceGb = Annotated[float, typer.Option(help="Fixed allowance in GiB: CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers.",
                                            rich_help_panel="Estimate")]


def _estimate_inputs(device: str, allowance_fraction: float, allowance_gb: float) -> None:
    if device.split(":")[0] not in ("cuda", "cpu"):
        raise ConfigError(f"--device {device!r} is not cuda or cpu; pass --device cuda (a GPU) or --device cpu")
    if allowance_fraction < 0 or allowance_gb < 0:
        raise ConfigError("the allowance cannot be negative; pass --allowance-fraction 0.1 --allowance-gb 1")


@app.command()
def estimate(
    *,
    workload: Workload = DEFAULT_WORKLOAD,
    num_layers: NumLayers = None, seq_length: SeqLength = None, micro_batch_size: MicroBatch = None,
    global_batch_size: GlobalBatch = None, precision: Precision = None, attention_backend: AttentionBackend = None,
    sets: Sets = None, gpu: Gpu = None,
    tp: TP = None, pp: PP = None, dp: DP = None, sequence_parallel: SP = None,
    recompute_granularity: Granularity = None, recompute_modules: Modules = None, recompute_method: Method = None,
    recompute_num_layers: RecomputeLayers = None, activation_offload_layers: OffloadLayers = None,
    device: ModelDevice = "cuda",
    allowance_fraction: AllowanceFraction = 0.10, allowance_gb: AllowanceGb = 1.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the estimate as JSON on stdout.", rich_help_panel="Output")] = False,
) -> None:
    """Predict activation memory per layer, the whole-rank peak and FLOPs of every recompute setting,
    without running anything (the paper's Table 2 beside the layer built here)."""
    from recompute_bench.analysis import memory as model
    from recompute_bench.render.estimate import breakdown_table, layout_line, paper_notes, paper_table, settings_table

    try:
        cfg, notes = resolve_cli(workload, num_layers=num_layers, seq_length=seq_length, micro_batch_size=micro_batch_size,
                                 global_batch_size=global_batch_size, precision=precision,
                                 attention_backend=attention_backend, sets=sets, gpu=gpu, tp=tp, pp=pp, dp=dp,
                                 sequence_parallel=sequence_parallel, granularity=recompute_granularity,
                                 modules=recompute_modules, method=recompute_method,
                                 recompute_num_layers=recompute_num_layers,
                                 activation_offload_layers=activation_offload_layers)
        _estimate_inputs(device, allowance_fraction, allowance_gb)
    except ConfigError as e:
        raise fail(str(e)) from None
    _show_notes(notes)
    report = model.estimate_report(cfg, device, allowance_fraction, allowance_gb * 2**30)
    err.print(escape(layout_line(report)), highlight=False)
    err.print(settings_table(report["settings"], "every setting: activations per micro-batch, whole-rank peak, FLOPs",
                             current=cfg.recompute.label))
    err.print(paper_table(report))
    for note in paper_notes(report):
        err.print(f"[dim]note:[/] {escape(note)}", highlight=False)
    err.print(breakdown_table(report))
    if json_out:
        typer.echo(json.dumps(report, indent=2))


@app.command()
def plan(
    *,
    workload: Workload = DEFAULT_WORKLOAD,
    num_layers: NumLayers = None, seq_length: SeqLength = None, micro_batch_size: MicroBatch = None,
    global_batch_size: GlobalBatch = None, precision: Precision = None, attention_backend: AttentionBackend = None,
    sets: Sets = None, tp: TP = None, pp: PP = None, dp: DP = None, sequence_parallel: SP = None,
    memory_gb: Annotated[Optional[float], typer.Option(help="Device memory per GPU in GiB, e.g. 80.",
                                                       rich_help_panel="Estimate")] = None,
    device: ModelDevice = "cuda",
    allowance_fraction: AllowanceFraction = 0.10, allowance_gb: AllowanceGb = 1.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON on stdout.", rich_help_panel="Output")] = False,
) -> None:
    """List the recompute settings that fit a memory budget, fastest first, and recommend one;
    exit 1 when nothing fits (and say what would)."""
    from recompute_bench.analysis import memory as model
    from recompute_bench.render.estimate import plan_table, would_fit_table

    try:
        cfg, notes = resolve_cli(workload, num_layers=num_layers, seq_length=seq_length, micro_batch_size=micro_batch_size,
                                 global_batch_size=global_batch_size, precision=precision,
                                 attention_backend=attention_backend, sets=sets, gpu="cpu", tp=tp, pp=pp, dp=dp,
                                 sequence_parallel=sequence_parallel)
        _estimate_inputs(device, allowance_fraction, allowance_gb)
        if memory_gb is None or memory_gb <= 0:
            raise ConfigError(f"plan needs the device memory per GPU; pass --memory-gb 80 (got {memory_gb})")
    except ConfigError as e:
        raise fail(str(e)) from None
    _show_notes(notes)
    result = model.plan(cfg, memory_gb * 2**30, device, allowance_fraction, allowance_gb * 2**30)
    if result["fits"]:
        err.print(plan_table(result))
        err.print(f"[green]recommended:[/] {escape(result['recommended'])}: {escape(result['reason'])}", highlight=False)
    else:
        err.print(f"[red]{escape(result['reason'])}[/]", highlight=False)
        err.print(would_fit_table(result))
    if json_out:
        typer.echo(json.dumps(result, indent=2))
    if not result["fits"]:
        raise typer.Exit(1)


# ----- sweep, compare, golden, report ----------------------------------------------------------
ResultsDir = Annotated[Path, typer.Option(help="Folder holding run folders (results/<run-id>/) and golden/.",
                                          rich_help_panel="Output")]
ResultsArg = Annotated[str, typer.Argument(help="A run id (folder under --results-dir), a results folder or a JSONL file.",
                                           show_default=False)]
GoldenFile = Annotated[Optional[Path], typer.Option(help="Golden CSV; default: <results-dir>/golden/<device kind>.csv "
                                                    "(cpu.csv, h100.csv, ...).", rich_help_panel="Golden")]
Strict = Annotated[bool, typer.Option(help="Also fail on unexpected improvements, now-fits and new rows (goldens stay honest).",
                                      rich_help_panel="Golden")]


def _device_kind(device: str | None, gpu: str | None) -> str:
    return "cpu" if (device or "").startswith("cpu") else (gpu or _this_gpu())


def _records_kind(rows: list[dict]) -> str:
    from recompute_bench.spec.presets import gpu_type
    return gpu_type(str(rows[0].get("device_name") or "cpu")) if rows else "cpu"


def _update_command(results: str, golden_file: Path, selection: list[str] | None) -> str:
    import shlex
    words = ["recompute-bench", "golden", "update", results, "--golden", str(golden_file)]
    for name in selection or []:
        words += ["--select", name]
    return " ".join(shlex.quote(w) for w in words)


def _plan_table(points, title: str) -> Table:
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


class _SweepProgress:
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


@app.command()
def sweep(
    *,
    workload: Annotated[Optional[str], typer.Option("--workload", "-w", help="Preset name or .toml path; default tiny "
                                                   "(or the grid file's workload).", rich_help_panel="Workload")] = None,
    num_layers: NumLayers = None, seq_length: SeqLength = None, micro_batch_size: MicroBatch = None,
    global_batch_size: GlobalBatch = None, precision: Precision = None, attention_backend: AttentionBackend = None,
    sets: Sets = None, gpu: Gpu = None,
    tp: TP = None, pp: PP = None, dp: DP = None, sequence_parallel: SP = None,
    modules: Annotated[Optional[list[str]], typer.Option(help="Each non-empty subset of these modules as a selective "
                                                         "setting (space or comma separated).", rich_help_panel="Sweep")] = None,
    methods: Annotated[Optional[list[str]], typer.Option(help="Full recompute methods (uniform, block), crossed with "
                                                         "--num-layers-recompute.", rich_help_panel="Sweep")] = None,
    num_layers_recompute: Annotated[Optional[list[str]], typer.Option(help="Full recompute layer counts N; alone they "
                                                                      "mean method block.", rich_help_panel="Sweep")] = None,
    baseline: Annotated[bool, typer.Option(help="Add the point without recompute (Baseline).", rich_help_panel="Sweep")] = False,
    grid: Annotated[Optional[Path], typer.Option(help="TOML file listing the points ([[point]] tables) instead of the flags.",
                                                 rich_help_panel="Sweep")] = None,
    dry_run: Annotated[bool, typer.Option(help="Print the plan and exit without measuring.", rich_help_panel="Sweep")] = False,
    run_id: Annotated[Optional[str], typer.Option(help="Name of the run folder; default: UTC time and 4 hex digits.",
                                                  rich_help_panel="Sweep")] = None,
    resume: Annotated[Optional[str], typer.Option(help="Continue the sweep RUN_ID with its saved plan; points with an ok "
                                                  "or oom record are skipped.", rich_help_panel="Sweep")] = None,
    timeout: Annotated[float, typer.Option(help="Time limit of one point in seconds (process start included).",
                                           rich_help_panel="Sweep")] = 600.0,
    device: Annotated[Optional[str], typer.Option(help="torch device of every point; default CUDA if present.",
                                                  rich_help_panel="Sweep")] = None,
    peak_tflops: Annotated[Optional[float], typer.Option(help="Peak TFLOP/s of the device for MFU.", rich_help_panel="Sweep")] = None,
    golden: GoldenFile = None,
    no_golden: Annotated[bool, typer.Option("--no-golden", help="Do not compare with a golden file.", rich_help_panel="Golden")] = False,
    strict: Strict = False,
    results_dir: ResultsDir = Path("results"),
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan (with --dry-run) or the comparison as JSON on stdout.",
                                           rich_help_panel="Output")] = False,
) -> None:
    """Measure several recompute settings, each in its own process, and compare them with the golden.

    Results go to results/<run-id>/; with no flag every setting of the workload is measured."""
    from recompute_bench.gate import golden as gold
    from recompute_bench.results.records import record_row
    from recompute_bench.render.comparison import details_table, experiment_table, headline, to_json
    from recompute_bench.launch.sweep import load_grid, load_plan, plan_from_flags, plan_from_grid, plan_to_dict, run_sweep
    from recompute_bench.results.store import check_run_id, new_run_id

    plan_flags = [n for n, v in (("--modules", modules), ("--methods", methods), ("--num-layers-recompute", num_layers_recompute),
                                 ("--baseline", baseline or None), ("--grid", grid)) if v is not None]
    try:
        if timeout <= 0:
            raise ConfigError(f"--timeout must be a positive number of seconds, got {timeout:g}")
        counts = None
        if num_layers_recompute is not None:
            try:
                counts = [int(n) for n in _split_list(num_layers_recompute)]
            except ValueError:
                raise ConfigError(f"--num-layers-recompute takes integers, got {' '.join(num_layers_recompute)}; "
                                  "pass for example --num-layers-recompute 1 2") from None
        overrides = shape_overrides(num_layers=num_layers, seq_length=seq_length, micro_batch_size=micro_batch_size,
                                    global_batch_size=global_batch_size, precision=precision,
                                    attention_backend=attention_backend, tp=tp, pp=pp, dp=dp,
                                    sequence_parallel=sequence_parallel)
        kind = gpu or _device_kind(device, None)
        notes: list[str] = []
        if resume:
            given = plan_flags + [n for n, v in (("--workload", workload), ("--set", sets), ("--run-id", run_id)) if v]
            given += [f"--{k.split('.')[1].replace('_', '-')}" for k, v in overrides.items() if v is not None]
            if given:
                raise ConfigError(f"--resume reruns the plan saved in {results_dir / resume}/plan.json; "
                                  f"drop {', '.join(given)}")
            points = load_plan(results_dir / check_run_id(resume))
        elif grid is not None:
            if len(plan_flags) > 1:
                raise ConfigError(f"--grid lists the points itself; drop {', '.join(f for f in plan_flags if f != '--grid')}")
            spec = load_grid(grid)
            points, notes = plan_from_grid(spec, workload or spec.workload or DEFAULT_WORKLOAD, overrides=overrides,
                                           sets=list(sets or ()), gpu=kind)
        else:
            points, notes = plan_from_flags(workload or DEFAULT_WORKLOAD, overrides=overrides, sets=list(sets or ()), gpu=kind,
                                            modules=_split_list(modules), methods=_split_list(methods),
                                            num_layers_recompute=counts, baseline=baseline)
        for p in points:
            check_runnable(p.cfg, device)
        golden_file = None if no_golden else (golden or gold.golden_path_for(_device_kind(device, gpu), results_dir))
        golden_rows = None
        if golden_file is not None and (golden is not None or golden_file.is_file()):
            golden_rows = gold.read_golden(golden_file)
        run = check_run_id(resume or run_id or new_run_id())
    except ConfigError as e:
        raise fail(str(e)) from None
    _show_notes(notes)

    if dry_run:
        err.print(_plan_table(points, f"plan: {len(points)} points, each in its own process "
                                      f"(time limit {timeout:g} s); nothing is measured with --dry-run"))
        if golden_rows is not None:
            err.print(f"would compare with {golden_file}", highlight=False)
        if json_out:
            typer.echo(json.dumps(plan_to_dict(points), indent=2))
        return

    run_dir = results_dir / run
    err.print(f"sweep {run}: {len(points)} points into {run_dir}/", highlight=False)
    try:
        with _SweepProgress(len(points)) as progress:
            records = run_sweep(points, run_dir, timeout_s=timeout, device=device, peak_tflops=peak_tflops,
                                resume=bool(resume), on_start=progress.start, on_done=progress.done)
    except ConfigError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        err.print(f"[yellow]interrupted[/]: finished points are in {run_dir}/results.jsonl; continue with "
                  f"`recompute-bench sweep --resume {run}`", highlight=False)
        raise typer.Exit(130) from None

    rows = [record_row(r) for r in records]
    planned = {gold.row_key(r) for r in rows}
    comparison = gold.compare(rows, golden_rows, strict=strict, only_keys=planned, golden_path=golden_file)
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
    err.print(f"results: {run_dir / 'results.jsonl'}; logs: {run_dir / 'logs'}/; "
              f"report: recompute-bench report {run}", highlight=False)
    selection = comparison.update_selection() if golden_rows is not None and not comparison.passed else []
    if selection != []:
        err.print("to accept these numbers as the new golden (then review the git diff):\n  "
                  + _update_command(run, golden_file, selection), highlight=False, soft_wrap=True)
    if json_out:
        typer.echo(json.dumps(to_json(comparison, run_id=run, results=str(run_dir / "results.jsonl"),
                                      golden=str(golden_file) if golden_rows is not None else None), indent=2))
    if not comparison.passed:
        raise typer.Exit(1)


@app.command()
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
    json_out: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON on stdout.", rich_help_panel="Output")] = False,
    results_dir: ResultsDir = Path("results"),
) -> None:
    """Compare results with a golden file: a verdict per row, exit 0 pass, 1 a failing verdict, 2 bad input."""
    import os

    from recompute_bench.gate import golden as gold
    from recompute_bench.results.records import load_result_records, record_row
    from recompute_bench.results.store import resolve_results
    from recompute_bench.render.comparison import details_table, experiment_table, headline, junit_xml, markdown as to_markdown, to_json

    try:
        path = resolve_results(results, results_dir)
        rows = [record_row(r) for r in load_result_records(path)]
        golden_file = golden or gold.golden_path_for(_records_kind(rows), results_dir)
        golden_rows = gold.read_golden(golden_file)
        overrides = gold.parse_tolerances(tolerance)
    except ConfigError as e:
        raise fail(str(e)) from None
    comparison = gold.compare(rows, golden_rows, tolerances=overrides, strict=strict, golden_path=golden_file)
    title = f"compare {results} with {golden_file}"
    err.print(experiment_table(comparison, title))
    table = details_table(comparison, everything=details)
    if table is not None:
        err.print(table)
    selection = comparison.update_selection()
    command = _update_command(results, golden_file, selection) if not comparison.passed and selection != [] else None
    style = "green" if comparison.passed else "red"
    err.print(f"[{style}]{escape(headline(comparison))}[/]", highlight=False)
    if command:
        err.print("if the change is intended, update the golden (then review the git diff):\n  " + command,
                  highlight=False, soft_wrap=True)

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


golden_app = typer.Typer(no_args_is_help=True, help="Golden files: promote measured rows, explicitly.")
app.add_typer(golden_app, name="golden")


@golden_app.command("update")
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
    from recompute_bench.results.records import load_result_records, record_row
    from recompute_bench.results.store import resolve_results

    try:
        rows = [record_row(r) for r in load_result_records(resolve_results(results, results_dir))]
        golden_file = golden or gold.golden_path_for(_records_kind(rows), results_dir)
        summary = gold.update_golden(golden_file, rows, select)
    except ConfigError as e:
        raise fail(str(e)) from None
    for label, names in (("replaced", summary.replaced), ("added", summary.added), ("skipped (not ok or oom)", summary.skipped)):
        if names:
            err.print(f"{label}: {escape(', '.join(names))}", highlight=False)
    if not (summary.added or summary.replaced):
        err.print(f"[red]nothing promoted[/]; {golden_file} is unchanged", highlight=False)
        raise typer.Exit(1)
    err.print(f"wrote {golden_file}: {len(summary.added)} added, {len(summary.replaced)} replaced, {summary.kept} kept; "
              f"review with `git diff {golden_file}`", highlight=False)


@app.command()
def report(
    results: ResultsArg,
    *,
    out: Annotated[Optional[Path], typer.Option(help="Folder for report.md and pareto.png; default: the results' folder.")] = None,
    results_dir: ResultsDir = Path("results"),
) -> None:
    """Write a Markdown report and a Pareto plot (TFLOP/s/GPU against memory, one point per setting)."""
    from recompute_bench.render.plot import write_report
    from recompute_bench.results.records import load_results
    from recompute_bench.results.store import resolve_results

    try:
        path = resolve_results(results, results_dir)
        df = load_results(path)
        folder = out or (path if path.is_dir() else path.parent)
        md, png = write_report(df, folder, f"recompute-bench report: {results}")
    except ConfigError as e:
        raise fail(str(e)) from None
    err.print(f"wrote {md} and {png}", highlight=False)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `recompute-bench`."""
    app(args=normalize_argv(sys.argv[1:] if argv is None else argv), prog_name="recompute-bench")


def run_performance_workload(argv: list[str] | None = None) -> None:
    """Entry point of `run_performance_workload`: Megatron Bridge's spelling of `recompute-bench run`."""
    args = sys.argv[1:] if argv is None else argv
    app(args=["run", *normalize_argv(args)], prog_name="run_performance_workload")
