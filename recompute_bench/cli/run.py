"""`recompute-bench run` (and `run_performance_workload`): measure one point on this machine."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from recompute_bench.cli.common import (DEFAULT_WORKLOAD, JsonOut, PolicyFile, Workload, err, fail, resolve_point,
                                        show_notes, with_policy_file)
from recompute_bench.cli.options import PointOptions, point_options
from recompute_bench.cli.ranks import launch_options
from recompute_bench.launch.torchrun import Launch
from recompute_bench.measure.record import layout_label
from recompute_bench.config.schema import Config, BadInput

Device = Annotated[Optional[str], typer.Option(help="torch device, e.g. cuda:1 or cpu; default: CUDA if present.",
                                               rich_help_panel="Output")]
PeakTflops = Annotated[Optional[float], typer.Option(help="Peak TFLOP/s of the device for MFU, overriding the built-in "
                                                     "table.", rich_help_panel="Output")]


@point_options()
@launch_options
def run(
    *,
    workload: Workload = DEFAULT_WORKLOAD,
    point: PointOptions,
    policy: PolicyFile = None,
    device: Device = None,
    peak_tflops: PeakTflops = None,
    json_out: JsonOut = False,
    save: Annotated[bool, typer.Option("--save/--no-save", help="Append the record to --results.", rich_help_panel="Output")] = True,
    results: Annotated[Path, typer.Option(help="JSONL file the record is appended to.", rich_help_panel="Output")] = Path("results/runs.jsonl"),
    launch: Launch,
    timeout: Annotated[float, typer.Option(help="Time limit of a multi-rank point in seconds (start included); "
                                           "every rank is killed past it.", rich_help_panel="Ranks (torchrun)")] = 600.0,
) -> None:
    """Measure one recompute setting of a workload on this machine and record the result."""
    try:
        cfg, notes = resolve_point(workload, point)
        cfg = with_policy_file(cfg, point, policy)
        cfg = check_runnable(cfg, device, launch)
    except BadInput as e:
        raise fail(str(e)) from None
    show_notes(notes)

    from recompute_bench.render.tables import run_table
    from recompute_bench.results.store import append_record

    layout = layout_label(launch.world_size, launch.data_parallel, cfg.parallel.tensor_model_parallel_size,
                          cfg.parallel.sequence_parallel, cfg.parallel.pipeline_model_parallel_size,
                          cfg.parallel.context_parallel_size)
    ranks = f" over {launch.world_size} ranks ({layout})" if launch.world_size > 1 else ""
    err.print(f"measuring {cfg.workload} with recompute {escape(cfg.recompute.label)}{ranks} ...", highlight=False)
    if launch.world_size > 1:
        from recompute_bench.launch.torchrun import run_ranks
        # The ranks' pieces and logs go with the results; with nothing saved, to a scratch folder
        # that is removed when the point is ok (kept, and named, when it is not).
        scratch = None if save else Path(tempfile.mkdtemp(prefix="recompute-bench-ranks-"))
        work = (scratch or results.parent / "ranks") / (launch.rdzv_id or "run")
        record = run_ranks(cfg, launch, name="run", pieces=work, log_path=work / f"node{launch.node_rank}.log",
                           timeout_s=timeout, device=device, peak_tflops=peak_tflops)
        if scratch is not None and record["status"] == "ok":
            shutil.rmtree(scratch, ignore_errors=True)
        elif scratch is not None:
            err.print(f"the ranks' pieces and logs are kept in {work}", highlight=False)
    else:
        from recompute_bench.launch.devices import default_device_type
        from recompute_bench.measure.memory import limit_memory
        from recompute_bench.measure.point import pick_device, run_point
        torch_device = pick_device(device or default_device_type())  # the device check_runnable checked
        limit_memory(torch_device, launch.memory_limit_gb)
        record = run_point(cfg, device=torch_device, peak_tflops=peak_tflops)
        record["launch"] = launch.record()
    err.print(run_table(record))
    if save:
        append_record(results, record)
        err.print(f"appended to {results}", highlight=False)
    if json_out:
        typer.echo(json.dumps(record, indent=2, default=str))
    if record["status"] != "ok":
        raise typer.Exit(1)


def check_runnable(cfg: Config, device: str | None, launch: Launch | None = None) -> Config:
    """What `run` can measure with `launch` (default one rank): the config it measures (data
    parallel over the launched ranks), offload only on CUDA. Asks NVML, not torch: a sweep checks
    its plan in the parent, which holds no CUDA context."""
    from recompute_bench.launch.devices import default_device_type
    from recompute_bench.launch.torchrun import check_launch

    cuda_here = default_device_type() == "cuda"
    on_cuda = (device or ("cuda" if cuda_here else "cpu")).startswith("cuda")
    device_type = "cuda" if on_cuda else "cpu"
    index = (device or "").partition(":")[2]  # "0" of cuda:0; empty without one
    launch = launch or Launch()
    cfg = check_launch(cfg, launch, device_type)
    offloads = cfg.recompute.activation_offload_layers or any("offload" in e for e in cfg.recompute.layer_policy)
    if offloads and not on_cuda:
        raise BadInput("activation offload moves saved tensors from a CUDA device to host memory and there is "
                          "no CUDA device here; " + ("write none for the policy's offload layers" if cfg.recompute.layer_policy
                                                     else "drop --activation-offload-layers"))
    if cfg.training.compile:
        from recompute_bench.launch.compiler import compile_problem
        problem = compile_problem(device_type)
        if problem:
            raise BadInput(f"{problem}; drop --compile")
    if cfg.training.precision == "fp8" and cfg.training.framework == "recompute-bench":
        from recompute_bench.launch.devices import visible_gpu_capability
        from recompute_bench.measure.float8 import float8_problem
        problem = float8_problem(device_type,
                                 visible_gpu_capability(int(index) if index.isdigit() else 0) if on_cuda else None)
        if problem:
            raise BadInput(problem)
    if device and device.startswith("cuda") and not cuda_here:
        raise BadInput(f"--device {device} asks for CUDA but no CUDA device is visible here; pass --device cpu")
    if on_cuda and index.isdigit():
        from recompute_bench.launch.devices import visible_gpu_count
        gpus = visible_gpu_count()
        if gpus is not None and int(index) >= gpus:
            raise BadInput(f"--device {device}: this machine shows {gpus} GPU(s), cuda:0 to cuda:{gpus - 1}; "
                              f"pass --device cuda:{gpus - 1} or lower")
    return cfg
