"""`recompute-bench verify`: every setting leaves the loss and every gradient unchanged."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from recompute_bench.cli.common import (DEFAULT_WORKLOAD, JsonOut, PolicyFile, Workload, err, fail, resolve_point,
                                        show_notes, with_policy_file)
from recompute_bench.cli.options import PointOptions, point_options
from recompute_bench.cli.ranks import launch_options
from recompute_bench.launch.torchrun import Launch, check_launch, check_schedule_recompute
from recompute_bench.measure.record import layout_label
from recompute_bench.config.choices import ATTENTION_BACKENDS
from recompute_bench.config.schema import BadInput


@point_options(panels=("Workload", "Parallelism", "Recompute"),
               exclude=("global_batch_size", "precision", "fp8_recipe", "attention_backend", "activation_offload_layers",
                        "data_parallel_size"), gpu=False)
@launch_options
def verify(
    *,
    launch: Launch,
    workload: Workload = DEFAULT_WORKLOAD,
    point: PointOptions,
    policy: PolicyFile = None,
    attention_backend: Annotated[Optional[list[str]], typer.Option(help="Backends to check (repeatable); default both.",
                                                                   rich_help_panel="Workload")] = None,
    device: Annotated[str, typer.Option(help="torch device; default cpu, where equality is exact.")] = "cpu",
    json_out: JsonOut = False,
) -> None:
    """Prove that every recompute setting (or the one given) leaves the loss and every gradient
    unchanged: fp32, dropout on, same seed and inputs as the no-recompute baseline (on CUDA under
    torch's deterministic algorithms, so atomics cannot make equal math differ)."""
    import torch

    from recompute_bench.measure.verify import determinism, verify as run_verify
    from recompute_bench.recompute.settings import all_settings

    try:
        for b in attention_backend or []:
            if b not in ATTENTION_BACKENDS:
                raise BadInput(f"attention_backend {b!r} is not one of {', '.join(ATTENTION_BACKENDS)}; "
                                  "pass --attention-backend sdpa or math")
        cfg, notes = resolve_point(workload, point, gpu="cpu")
        # Under context parallel only sdpa splits (`config.rules`); the explicit math path does not.
        backends = attention_backend or (["sdpa"] if cfg.parallel.context_parallel_size > 1 else ["sdpa", "math"])
        if cfg.parallel.context_parallel_size > 1 and "math" in backends:
            from recompute_bench.config.rules import validate
            from recompute_bench.workload import resolved
            validate(resolved(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_backend="math"))))
        cfg = with_policy_file(cfg, point, policy)
        if cfg.training.compile:  # inductor fuses each setting's graph its own way: not the same bits
            raise BadInput("verify checks the eager layers bit for bit, and compiled ones are fused differently per "
                           "setting; drop --compile (`run --compile` measures compiled)")
        if any("offload" in e for e in cfg.recompute.layer_policy):
            raise BadInput("verify checks recompute, and offload recomputes nothing; write none for offloaded layers")
        cfg = check_launch(cfg, launch, "cuda" if device.startswith("cuda") else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise BadInput(f"--device {device} asks for CUDA but torch sees no CUDA device; pass --device cpu")
    except BadInput as e:
        raise fail(str(e)) from None
    show_notes(notes)
    targets = cfg.spec.recompute_targets
    settings = ([cfg.recompute] if point.given("recompute") or policy
                else all_settings(cfg.model.num_layers, targets))
    if cfg.parallel.pipeline_model_parallel_size > 1:
        try:
            check_schedule_recompute(cfg.parallel.schedule, settings[0])  # every setting but none recomputes
        except BadInput as e:
            raise fail(str(e)) from None
    if launch.world_size > 1:
        outcomes = _over_ranks(cfg, settings, backends, launch, device)
    else:
        from recompute_bench.measure.point import pick_device
        outcomes = run_verify(cfg, settings, backends, pick_device(device))

    how = determinism(device.split(":")[0])  # why equal bits mean equal math on this device
    table = Table(title=f"verify {cfg.workload}: fp32, dropout on, against no recompute; {how}")
    for col in ("setting", "attention", "|loss diff|", "max |grad diff|", "worst parameter", "result"):
        table.add_column(col, justify="right" if "diff" in col else "left")
    for o in outcomes:
        table.add_row(escape(o.setting), o.attention_backend, f"{o.loss_diff:.3g}", f"{o.max_grad_diff:.3g}",
                      o.worst_parameter, "[green]exact[/]" if o.exact else "[red]DIFFERS[/]")
    err.print(table)
    if json_out:
        typer.echo(json.dumps([{**o.__dict__, "exact": o.exact, "determinism": how} for o in outcomes], indent=2))
    bad = [o for o in outcomes if not o.exact]
    if bad:
        err.print(f"[red]{len(bad)} of {len(outcomes)} settings change the loss or a gradient[/]")
        raise typer.Exit(1)
    err.print(f"[green]all {len(outcomes)} settings leave the loss and every gradient bitwise equal[/]")


def _over_ranks(cfg, settings, backends: list[str], launch: Launch, device: str) -> list:
    """Each setting against no recompute under `launch`'s layout (data, tensor, pipeline parallel), run with torchrun;
    prints how far that baseline is from one rank running every rank's micro-batch."""
    from pathlib import Path

    from recompute_bench.launch.torchrun import verify_over_ranks
    from recompute_bench.measure.verify import Outcome

    layout = layout_label(launch.world_size, launch.data_parallel, cfg.parallel.tensor_model_parallel_size,
                          cfg.parallel.sequence_parallel, cfg.parallel.pipeline_model_parallel_size,
                          cfg.parallel.context_parallel_size)
    err.print(f"verifying over {launch.world_size} ranks ({layout}) ...", highlight=False)
    try:
        result = verify_over_ranks(cfg, settings, backends, launch, work=Path("results") / "ranks" / "verify",
                                   timeout_s=600.0, device=device)
    except BadInput as e:
        raise fail(str(e), code=1) from None
    for o in result["single_rank"]:
        err.print(f"{launch.world_size} ranks vs one rank running every micro-batch ({o['attention_backend']}): "
                  f"|loss diff| {o['loss_diff']:.3g}, max |grad diff| {o['max_grad_diff']:.3g} ({o['worst_parameter']})",
                  highlight=False)
    return [Outcome(**o) for o in result["outcomes"]]
