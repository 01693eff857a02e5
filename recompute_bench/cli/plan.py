"""`recompute-bench plan`: the settings that fit a memory budget, fastest first; nothing measured
(but `--profile`'s short profile).

One command, one function per mode, chosen once the point is resolved:

- framework megatron (`--framework megatron`, `--from`): `cli/plan_megatron.py`, and with
  `--search-layouts` the best layouts of the GPUs (`plan_layouts`);
- `--auto`: a per-layer policy for this harness, written as a policy file (`_plan_auto`);
- `--gpus N`: this harness's context-parallel layouts of N GPUs (`_plan_context_parallel`);
- otherwise this harness's uniform settings side by side (`_plan_settings`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from recompute_bench.analysis.allowance import ALLOWANCE_BYTES, ALLOWANCE_FRACTION
from recompute_bench.cli.common import DEFAULT_WORKLOAD, JsonOut, err, fail, show_notes
from recompute_bench.cli.estimate import (AllowanceFraction, AllowanceGb, ModelDevice, WorkloadBesideFrom, check_inputs,
                                          harness_device, megatron_run)
from recompute_bench.cli.options import PointOptions, point_options
from recompute_bench.cli.plan_megatron import plan_layouts, plan_megatron, resolve_on_gpus
from recompute_bench.cli.run_from import FromFile, read_from
from recompute_bench.config.rules import check_expert_parallel_world
from recompute_bench.config.schema import BadInput


@point_options(panels=("Workload", "Parallelism"), gpu=False)
def plan(
    *,
    workload: WorkloadBesideFrom = None,
    from_: FromFile = None,
    point: PointOptions,
    memory_gb: Annotated[Optional[float], typer.Option(help="Device memory per GPU in GiB, e.g. 80.",
                                                       rich_help_panel="Estimate")] = None,
    device: ModelDevice = "cuda",
    allowance_fraction: AllowanceFraction = ALLOWANCE_FRACTION, allowance_gb: AllowanceGb = ALLOWANCE_BYTES / 2**30,
    auto: Annotated[bool, typer.Option("--auto", help="Choose recompute layer by layer: the policy with the least "
                                       "recompute FLOPs that fits, written as a policy file for `run --policy`.",
                                       rich_help_panel="Estimate")] = False,
    output: Annotated[Optional[Path], typer.Option(help="With --auto: the policy file to write; default "
                                                   "results/plans/, named after the workload and the budget (llama3-8b-72g.toml).",
                                                   rich_help_panel="Estimate")] = None,
    profile: Annotated[bool, typer.Option("--profile", help="With --auto: price recompute by a short measured profile "
                                          "of each module's forward time on this machine's device (one layer of each "
                                          "kind, medians), cached under results/profiles/. With --framework megatron: "
                                          "price time at this GPU's measured matmul (bf16, FP8) and HBM rates instead "
                                          "of its datasheet's, cached there too.",
                                          rich_help_panel="Estimate")] = False,
    profile_steps: Annotated[int, typer.Option(help="With --profile: measured steps (medians over them).",
                                               rich_help_panel="Estimate")] = 5,
    host_link_gbps: Annotated[Optional[float], typer.Option(help="With --profile on CUDA: the host link's bandwidth "
                                                            "in GB/s for offload's cost (default: measured).",
                                                            rich_help_panel="Estimate")] = None,
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="With --framework megatron: the GPU kind (h100, a100, "
                                               "h200, b200, gb200), whose achieved rates (config/gpus.py) price time and whose compute "
                                               "capability picks the kernels; default this machine's, else h100.",
                                               rich_help_panel="Megatron")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", help="The GPU count. With --framework megatron the "
                                                "data-parallel size is what tensor, pipeline and context parallel "
                                                "leave (with --from: where the file states no GPU count, or to change "
                                                "it); for this harness, plan context parallel too: lay the GPUs out "
                                                "as dp x cp (x the --tp and --pp given) for every cp the sequence "
                                                "allows, each with its fastest fitting recompute setting.",
                                                rich_help_panel="Estimate")] = None,
    explain: Annotated[bool, typer.Option("--explain", help="With --framework megatron: show the predicted step of the "
                                          "setting to use op by op (which ops, how many ms).",
                                          rich_help_panel="Megatron")] = False,
    all_rows: Annotated[bool, typer.Option("--all", help="With --framework megatron: every setting Megatron can run, "
                                           "and the flags of every setting that fits.", rich_help_panel="Megatron")] = False,
    search_layouts: Annotated[bool, typer.Option("--search-layouts", help="With --framework megatron and --gpus: rank "
                                                 "tensor, pipeline, virtual, context and expert parallel sizes and the "
                                                 "micro-batch size with recompute and offload, keep what fits, print "
                                                 "the best with their flags; --tp, --pp, ... given stay fixed.",
                                                 rich_help_panel="Megatron")] = False,
    top: Annotated[int, typer.Option(help="With --search-layouts: how many layouts to list.",
                                     rich_help_panel="Megatron")] = 3,
    json_out: JsonOut = False,
) -> None:
    """List the recompute settings that fit a memory budget, fastest first, and recommend one (or
    with --auto choose per layer); exit 1 when nothing fits (and say what would). With --framework
    megatron: every setting Megatron can run, each stage's peak and the predicted step time, with
    the flags for Megatron-LM, Megatron Bridge and NeMo."""
    source = None
    try:
        check_inputs(device, allowance_fraction, allowance_gb)
        if memory_gb is None or memory_gb <= 0:
            raise BadInput(f"plan needs the device memory per GPU; pass --memory-gb 80 (got {memory_gb})")
        if search_layouts and from_ is not None:
            raise BadInput("--search-layouts searches a workload's layouts; pass -w PRESET with --framework megatron "
                           "instead of --from (or drop --search-layouts to plan the file's own layout)")
        if from_ is not None:  # a Megatron run as its user has it: framework megatron
            source = read_from(from_, workload, gpus, point, device)
            cfg, run, notes = source.config, source.run, list(source.notes)
        else:  # a layout search checks the sizes given as they are; the layouts then take the GPUs
            cfg, notes = resolve_on_gpus(workload or DEFAULT_WORKLOAD, point, None if search_layouts else gpus)
        megatron = cfg.training.framework == "megatron"
        if search_layouts:
            _check_search(megatron, gpus, auto, all_rows, explain)
        gpu = point.gpu  # the option is declared here, and point_options hands it over in `point`
        for flag, given in (("--gpu", gpu is not None), ("--explain", explain), ("--all", all_rows)):
            if given and not megatron:
                raise BadInput(f"{flag} goes with --framework megatron; add it or drop {flag}")
        if megatron:
            for flag, given in (("--output", output is not None), ("--host-link-gbps", host_link_gbps is not None)):
                if given:
                    raise BadInput(f"{flag} belongs to this harness's plan --auto (a policy file for `run --policy`); "
                                   f"Megatron runs no per-layer policy: drop {flag}")
            if source is None:
                run = megatron_run(gpu, device, notes)
        else:
            check_expert_parallel_world(cfg)  # this harness: no launch here, the data-parallel size is as given
    except BadInput as e:
        raise fail(str(e)) from None
    if search_layouts:
        return plan_layouts(cfg, notes, run=run, memory_gb=memory_gb, gpus=gpus, allowance_fraction=allowance_fraction,
                            allowance_gb=allowance_gb, profile=profile, fixed=fixed_dimensions(point), top=top,
                            json_out=json_out)
    if megatron:
        return plan_megatron(cfg, notes, run=run, memory_gb=memory_gb, gpus=gpus, allowance_fraction=allowance_fraction,
                             allowance_gb=allowance_gb, auto=auto, profile=profile, explain=explain, all_rows=all_rows,
                             json_out=json_out, source=source)
    show_notes(notes)
    device = harness_device(device)
    if auto:
        costs = _profile_costs(cfg, device, profile_steps, host_link_gbps) if profile else None
        if host_link_gbps is not None and not profile:
            raise fail("--host-link-gbps prices offload with measured costs; add --profile or drop --host-link-gbps")
        return _plan_auto(cfg, memory_gb, device, allowance_fraction, allowance_gb, output, json_out, costs)
    for flag, given in (("--output", output is not None), ("--profile", profile), ("--host-link-gbps", host_link_gbps is not None)):
        if given:
            raise fail(f"{flag} goes with plan --auto; add --auto or drop {flag}")
    if gpus is not None:
        return _plan_context_parallel(cfg, gpus, memory_gb, device, allowance_fraction, allowance_gb, json_out)
    return _plan_settings(cfg, memory_gb, device, allowance_fraction, allowance_gb, json_out)


def _check_search(megatron: bool, gpus: Optional[int], auto: bool, all_rows: bool, explain: bool) -> None:
    """BadInput naming what --search-layouts lacks or does not take."""
    if not megatron:
        raise BadInput("--search-layouts plans Megatron's layouts; add --framework megatron")
    if gpus is None:
        raise BadInput("--search-layouts lays out a GPU count; pass --gpus N (e.g. --gpus 64)")
    for flag, given in (("--auto", auto), ("--all", all_rows), ("--explain", explain)):
        if given:
            raise BadInput(f"{flag} plans one layout; drop {flag}, or plan the chosen layout without --search-layouts")


def fixed_dimensions(point: PointOptions) -> set[str]:
    """What of the layout search's dimensions (`analysis.megatron.layouts.SEARCHED`) the user gave,
    by flag or by --set; any recompute or offload field fixes the setting."""
    from recompute_bench.analysis.megatron.layouts import SEARCHED

    paths = list(point.overrides) + [item.split("=", 1)[0].strip() for item in point.sets]
    out = set()
    for path in paths:
        section, _, name = path.partition(".")
        if section == "recompute":
            out.add("recompute")
        elif name in SEARCHED:
            out.add(name)
    return out


def _plan_settings(cfg, memory_gb: float, device: str, allowance_fraction: float, allowance_gb: float,
                   json_out: bool) -> None:
    """plan (this harness): every uniform setting side by side, those that fit fastest first."""
    from recompute_bench.analysis.harness import planner
    from recompute_bench.render.estimate import plan_table, would_fit_table

    result = planner.plan(cfg, memory_gb * 2**30, device, allowance_fraction, allowance_gb * 2**30)
    if result["fits"]:
        err.print(plan_table(result))
        err.print(f"[green]recommended:[/] {escape(result['recommended'])}: {escape(result['reason'])}", highlight=False)
        flags = result["fits"][0]["megatron_flags"]
        err.print(f"in Megatron-LM: {escape(' '.join(flags)) if flags else 'no recompute flags'}", highlight=False)
    else:
        err.print(f"[red]{escape(result['reason'])}[/]", highlight=False)
        err.print(would_fit_table(result))
    if json_out:
        typer.echo(json.dumps(result, indent=2))
    if not result["fits"]:
        raise typer.Exit(1)


def _plan_context_parallel(cfg, gpus: int, memory_gb: float, device: str, allowance_fraction: float,
                           allowance_gb: float, json_out: bool) -> None:
    """plan --gpus: every context-parallel layout of the GPUs with its fastest fitting recompute setting."""
    from recompute_bench.analysis.harness.cp_plan import plan_context_parallel
    from recompute_bench.render.estimate import cp_plan_table

    try:
        result = plan_context_parallel(cfg, gpus, memory_gb * 2**30, device, allowance_fraction, allowance_gb * 2**30)
    except BadInput as e:
        raise fail(str(e)) from None
    err.print(cp_plan_table(result))
    best = result["recommended"]
    if best:
        err.print(f"[green]recommended:[/] {escape(result['reason'])}", highlight=False)
        flags = [f"--context-parallel-size {best['context_parallel_size']}", *best["megatron_flags"]]
        err.print(f"in Megatron-LM: {escape(' '.join(flags))}", highlight=False)
    else:
        err.print(f"[red]{escape(result['reason'])}[/]", highlight=False)
    if json_out:
        typer.echo(json.dumps(result, indent=2))
    if not best:
        raise typer.Exit(1)


def _profile_costs(cfg, device: str, steps: int, host_link_gbps: Optional[float]):
    """The measured costs of `--profile` (cached per device and shape), or exit 2 naming the fix."""
    from recompute_bench.analysis.harness.profile_costs import ProfileCosts
    from recompute_bench.launch.devices import default_device_type
    from recompute_bench.measure.point import pick_device
    from recompute_bench.measure.profile import cached_profile

    here = pick_device(default_device_type())  # the device `run` and `sweep` measure on
    for flag, size in (("--tp", cfg.parallel.tensor_model_parallel_size), ("--cp", cfg.parallel.context_parallel_size)):
        if size > 1:
            raise fail(f"--profile measures one device's whole layer; with {flag} > 1 plan with analytical costs "
                       "(drop --profile)")
    if here.type != device.split(":")[0]:
        raise fail(f"--profile measures on this machine's {here.type}, but --device is {device}; "
                   f"pass --device {here.type} or profile on the target device")
    if steps < 1 or (host_link_gbps is not None and host_link_gbps <= 0):
        raise fail("--profile-steps and --host-link-gbps must be positive; pass --profile-steps 5")
    profile, path, cached = cached_profile(cfg, here, steps)
    err.print(f"profile: {'read from' if cached else 'measured on ' + escape(profile['key']['device_name']) + ', cached in'} "
              f"{escape(str(path))}", highlight=False)
    for kind, v in profile["kinds"].items():
        off = {t: (b, v["analytical_saved_bytes"][t]) for t, b in v["saved_bytes"].items() if b != v["analytical_saved_bytes"][t]}
        err.print(f"profile, {kind} layer: forward {1e3 * v['seconds']['layer']:.3f} ms; saved bytes "
                  + ("equal the analysis for every target" if not off else f"differ from the analysis: {off}"), highlight=False)
    return ProfileCosts(profile, host_link_gbps)


def _plan_auto(cfg, memory_gb: float, device: str, allowance_fraction: float, allowance_gb: float,
               output: Optional[Path], json_out: bool, costs=None) -> None:
    """plan --auto: solve, write the policy file, show it beside the best uniform setting."""
    from recompute_bench.analysis.harness.auto import auto_plan
    from recompute_bench.recompute.policy_file import write_policy
    from recompute_bench.render.estimate import auto_stages_table, auto_table, would_fit_table

    try:
        result = auto_plan(cfg, memory_gb * 2**30, device, allowance_fraction, allowance_gb * 2**30, costs)
    except BadInput as e:
        raise fail(str(e)) from None
    if result["policy"] is None:
        where = "" if cfg.parallel.pipeline_model_parallel_size == 1 else \
            " stage " + ", ".join(str(s) for s in result["unfit_stages"])
        err.print(f"[red]no per-layer policy fits{where} either: {escape(result['reason'])}[/]", highlight=False)
        err.print(would_fit_table(result))
        if json_out:
            typer.echo(json.dumps(result, indent=2))
        raise typer.Exit(1)
    path = output or Path("results/plans") / f"{Path(cfg.workload).stem}-{memory_gb:g}g.toml"
    auto, uniform = result["predicted"], result["uniform"]
    figures = {"budget_bytes": result["budget_bytes"], "device": result["device"],
               "peak_allocated_bytes": auto["peak_allocated_bytes"], "device_bytes_needed": auto["device_bytes_needed"],
               "hardware_flops_per_step": auto["hardware_flops_per_step"], "recompute_overhead": auto["recompute_overhead"],
               "costs": result["costs"], "recompute_cost": auto["recompute_cost"], "megatron": result["megatron"]["note"]}
    if uniform:
        figures.update({"uniform_setting": uniform["label"], "uniform_device_bytes_needed": uniform["device_bytes_needed"],
                        "uniform_recompute_overhead": uniform["recompute_overhead"],
                        "uniform_recompute_cost": uniform["recompute_cost"]})
    try:
        write_policy(path, cfg, result["policy"], figures, [s["policy"] for s in result["stages"]])
    except OSError as e:
        raise fail(f"cannot write the policy file {path} ({e}); pass --output to a writable path") from None
    err.print(auto_table(result))
    if len(result["stages"]) > 1:
        err.print(auto_stages_table(result))
    kinds = result["layer_kinds"]
    if len(set(kinds)) > 1:
        err.print(f"layer kinds: {escape(' '.join(kinds))} (each kind chooses from its own modules)", highlight=False)
    err.print(f"costs: {escape(result['costs'])}; {escape(result['offload'])}", highlight=False)
    err.print(f"[green]policy:[/] {escape(auto['label'])} ({escape(result['solver'])}); written to {escape(str(path))}",
              highlight=False)
    err.print(("" if result["megatron"]["runs"] else "[yellow]") + escape(result["megatron"]["note"])
              + ("" if result["megatron"]["runs"] else "[/]"), highlight=False)
    if json_out:
        typer.echo(json.dumps({**result, "output": str(path)}, indent=2))
