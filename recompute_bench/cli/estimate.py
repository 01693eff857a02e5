"""`recompute-bench estimate`: the analytical model, nothing measured (`plan` is `cli/plan.py`)."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.markup import escape

from recompute_bench.analysis.allowance import ALLOWANCE_BYTES, ALLOWANCE_FRACTION
from recompute_bench.cli.common import DEFAULT_WORKLOAD, JsonOut, err, fail, resolve_point, show_notes
from recompute_bench.cli.options import PointOptions, point_options
from recompute_bench.cli.run_from import FromFile, read_from, show_source
from recompute_bench.config.rules import check_expert_parallel_world
from recompute_bench.config.schema import BadInput

ModelDevice = Annotated[str, typer.Option("--device", help="What to model: cuda (the default; masks, norm statistics and "
                                          "attention kernels as on a GPU) or cpu (as `run` measures on a CPU).",
                                          rich_help_panel="Estimate")]
AllowanceFraction = Annotated[float, typer.Option(help="Allocator allowance: fraction of the allocated peak added for "
                                                  "fragmentation (reserved minus allocated).", rich_help_panel="Estimate")]
AllowanceGb = Annotated[float, typer.Option(help="Fixed allowance in GiB: CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers.",
                                            rich_help_panel="Estimate")]
Gpus = Annotated[Optional[int], typer.Option(
    "--gpus", help="With --from: the run's GPU count (world size) where the file does not state it.",
    rich_help_panel="Workload", show_default=False)]


def check_inputs(device: str, allowance_fraction: float, allowance_gb: float) -> None:
    if device.split(":")[0] not in ("cuda", "cpu"):
        raise BadInput(f"--device {device!r} is not cuda or cpu; pass --device cuda (a GPU) or --device cpu")
    if allowance_fraction < 0 or allowance_gb < 0:
        raise BadInput("the allowance cannot be negative; pass --allowance-fraction 0.1 --allowance-gb 1")


WorkloadBesideFrom = Annotated[Optional[str], typer.Option(
    "--workload", "-w", help=f"Preset name (see `workloads`) or path to a .toml preset; default {DEFAULT_WORKLOAD}. "
    "With --from, only for a Megatron Bridge log (the GPT model's own fields).",
    rich_help_panel="Workload", show_default=False)]
"""-w of `estimate` and `plan`, which also read a run --from a file."""


@point_options()
def estimate(
    *,
    workload: WorkloadBesideFrom = None,
    from_: FromFile = None,
    gpus: Gpus = None,
    point: PointOptions,
    device: ModelDevice = "cuda",
    allowance_fraction: AllowanceFraction = ALLOWANCE_FRACTION, allowance_gb: AllowanceGb = ALLOWANCE_BYTES / 2**30,
    json_out: JsonOut = False,
) -> None:
    """Predict activation memory per layer, the whole-rank peak and FLOPs of every recompute setting,
    without running anything (the paper's Table 2 beside the layer built here)."""
    from recompute_bench.analysis.harness import planner
    from recompute_bench.analysis.megatron import estimate_report as megatron_report
    from recompute_bench.ingest.record import logged_memory
    from recompute_bench.render.estimate import (breakdown_table, layout_line, logged_memory_table, paper_notes,
                                                 paper_table, settings_table, stages_table, terms_table, time_table)

    source = None
    try:
        check_inputs(device, allowance_fraction, allowance_gb)
        if from_ is not None:
            source = read_from(from_, workload, gpus, point, device)
            cfg, run, notes = source.config, source.run, list(source.notes)
            report = megatron_report(cfg, run, allowance_fraction, allowance_gb * 2**30)
            report["source"] = source.to_dict()
            if source.parsed is not None and (logged := logged_memory(source.parsed, cfg, run)):
                report["logged_memory"] = logged
        else:
            if gpus is not None:
                raise BadInput("--gpus goes with --from (a file's run); for a preset pass --dp N")
            cfg, notes = resolve_point(workload or DEFAULT_WORKLOAD, point)
            check_expert_parallel_world(cfg)  # no launch here: the data-parallel size is as given
            if cfg.training.framework == "megatron":
                run = megatron_run(point.gpu, device, notes)
                report = megatron_report(cfg, run, allowance_fraction, allowance_gb * 2**30)
            else:
                report = planner.estimate_report(cfg, harness_device(device), allowance_fraction, allowance_gb * 2**30)
    except BadInput as e:
        raise fail(str(e)) from None
    if source is not None:
        show_source(source)
    show_notes(notes)
    err.print(escape(layout_line(report)), highlight=False)
    err.print(settings_table(report["settings"], "every setting: activations per micro-batch, whole-rank peak, FLOPs",
                             current=cfg.recompute.label))
    if (times := time_table(report["settings"], f"every setting: predicted step per GPU on {report.get('gpu')} at its achieved "
                            "rates; where it goes, ms a step", current=cfg.recompute.label)) is not None:
        err.print(times)
    err.print(paper_table(report))
    for note in paper_notes(report):
        err.print(f"[dim]note:[/] {escape(note)}", highlight=False)
    err.print(breakdown_table(report))
    if len(report["stages"]) > 1:
        err.print(stages_table(report))
    if report.get("framework") == "megatron":
        err.print(terms_table(report))
    if report.get("logged_memory"):
        err.print(logged_memory_table(report))
    if json_out:
        typer.echo(json.dumps(report, indent=2))


def harness_device(device: str) -> str:
    """The device this harness's estimate models, with torch's CUBLAS_WORKSPACE_CONFIG from this
    environment on CUDA (it sizes the cuBLAS workspaces, `analysis.cuda_workspaces`), as a run here
    would read it; the compute capability stays an H100's (32 MiB workspaces, as on every Hopper and
    Blackwell GPU), which `run` replaces with its device's."""
    import os

    from recompute_bench.models import DeviceKernels

    if device.split(":")[0] != "cuda":
        return device
    return DeviceKernels(device, cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


def megatron_run(gpu: Optional[str], device: str, notes: list[str]):
    """Where framework megatron runs: the GPU kind (--gpu, else this machine's, else h100 with a
    note) and torch's CUBLAS_WORKSPACE_CONFIG from this environment, as the run would read it."""
    import os

    from recompute_bench.analysis.megatron import DEFAULT_GPU, MegatronRun
    from recompute_bench.cli.common import this_gpu
    from recompute_bench.ingest.run_source import pick_gpu

    if device.split(":")[0] != "cuda":
        raise BadInput("Megatron runs on CUDA; drop --device cpu with --framework megatron")
    kind, origin = pick_gpu(None, None, gpu or this_gpu())  # --gpu as this machine's: cpu is none
    if origin == "the default":
        notes.append(f"no GPU here: Megatron's GPU-dependent terms (workspaces, TE's attention kernel) are "
                     f"{DEFAULT_GPU}'s; pass --gpu a100, gb200, ... for another")
    return MegatronRun(kind, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
