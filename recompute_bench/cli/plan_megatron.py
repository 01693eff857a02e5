"""`plan --framework megatron`: the settings Megatron can run that fit the GPUs, priced in time.

`plan_megatron(cfg, ...)` takes a resolved Config from any source: today the workload and flags
(`cli/plan.py` `plan`); a Bridge config, `model_config.yaml`, argument list or log read by
`--from` is one more way to make that Config (and its GPU count), handed here the same way.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

import typer
from rich.markup import escape

from recompute_bench.cli.common import err, fail
from recompute_bench.config.schema import BadInput, Config, data_parallel_size


def resolve_on_gpus(workload: str, point, gpus: Optional[int]) -> tuple[Config, list[str]]:
    """The workload and flags resolved; for framework megatron with the data-parallel size `gpus`
    leaves, so that Megatron's rules that depend on it (the experts' layout over tp x cp x dp) judge
    the run as it will be laid out (without --gpus, and for this harness, as given). BadInput when
    tp x pp x cp does not divide `gpus` or a given --dp says otherwise."""
    from recompute_bench.config.presets import read_point
    from recompute_bench.config.rules import validate
    from recompute_bench.workload import resolved

    cfg, notes = read_point(workload, overrides=point.overrides, sets=point.sets, gpu="cpu")
    par = cfg.parallel
    sizes = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size)
    if gpus is not None and cfg.training.framework == "megatron" and all(size > 0 for size in sizes):  # a size below 1 is the rules' to refuse
        dp = data_parallel_size(gpus, *sizes)
        if "parallel.data_parallel_size" in point.overrides and dp != par.data_parallel_size:
            raise BadInput(f"--gpus {gpus} makes the data-parallel size {dp}, but --dp says {par.data_parallel_size}; "
                           "drop one of them")
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(par, data_parallel_size=dp))
    cfg = resolved(cfg)
    validate(cfg)
    return cfg, notes


def gpu_rates(run, profile: bool, cfg: Config | None = None):
    """The rates of the run's GPU kind: what it achieves (the GPU table's), or with --profile measured
    on this machine's GPU (the GEMMs of cfg's own shapes among them) and cached; without a GPU here,
    a cached or shipped profile of the run's kind (`gpu_rates.find_profile`)."""
    from recompute_bench.analysis.gpu_rates import ACHIEVED, GpuRates, achieved_rates, find_profile, with_profile

    if not profile:
        return achieved_rates(run.gpu)
    from recompute_bench.cli.common import this_gpu

    here = this_gpu()
    if here == "cpu":
        found = find_profile(run.gpu)
        if found is None:
            raise BadInput(f"--profile measures this machine's GPU, and there is none here, nor a cached or shipped "
                           f"{run.gpu} profile; drop --profile (the GPU table's rates price the plan) or profile on a {run.gpu}")
        measured, path = found
        err.print(f"rates profile: no GPU here; {run.gpu}'s profile read from {escape(str(path))}", highlight=False)
    else:
        if here != run.gpu:
            raise BadInput(f"--profile measures this machine's {here}, but --gpu is {run.gpu}; pass --gpu {here} or "
                           "profile on that GPU")
        from recompute_bench.analysis.megatron.time_model import gemm_shapes
        from recompute_bench.measure.rates import cached_rates

        measured, path, cached = cached_rates(shapes=gemm_shapes(cfg, run) if cfg is not None else ())
        err.print(f"rates profile: {'read from' if cached else 'measured on ' + escape(measured['device_name']) + ', cached in'} "
                  f"{escape(str(path))}", highlight=False)
    base = ACHIEVED.get(run.gpu) or GpuRates(run.gpu, measured["device_name"], {}, 0.0, 0.0, None, "")
    return with_profile(base, measured)


def plan_megatron(cfg: Config, notes: list[str], *, run, memory_gb: float, gpus: Optional[int], allowance_fraction: float,
                  allowance_gb: float, auto: bool, profile: bool, explain: bool, all_rows: bool, json_out: bool,
                  source=None) -> None:
    """Plan cfg for Megatron and print it; exit 1 when nothing fits, 2 on bad input. `source`: the
    run read by `--from` (`ingest.run_source.RunSource`), echoed as `estimate --from` echoes it."""
    from recompute_bench.analysis.megatron.plan import megatron_plan
    from recompute_bench.cli.common import show_notes
    from recompute_bench.render.plan_megatron import (allowance_lines, auto_table, classes_line, flags_lines, layout_line,
                                                      parts_table, settings_table, would_fit_table)

    budget, fixed = memory_gb * 2**30, allowance_gb * 2**30
    try:
        rates = gpu_rates(run, profile, cfg)
        rates.matrix_rate(cfg.training.precision)  # a precision the GPU has no rate for: one line now
        result = megatron_plan(cfg, run, rates, budget, allowance_fraction, fixed, gpus, mark_current=source is not None,
                               auto=auto)
    except BadInput as e:
        raise fail(str(e)) from None
    if source is not None:
        from recompute_bench.cli.run_from import show_source

        show_source(source)
        result["source"] = source.to_dict()
    show_notes(notes)
    err.print(escape(layout_line(result)), highlight=False)
    if all_rows:
        err.print(settings_table(result, result["settings"], "every setting Megatron can run, fastest first"))
    if result["fits"]:
        err.print(settings_table(result, result["fits"], f"settings that fit in {memory_gb:g} GiB, fastest first, then "
                                 f"the tight ones (rel. TFLOP/s: predicted, against no recompute"
                                 + ("; *: the run's own setting)" if result["current"] else ")")))
    same = [x for x in result["same_as_shown"] if "offload[" not in x["setting"]]
    if same:
        more = len(result["same_as_shown"]) - len(same)
        err.print("same step and peak as another setting, asking for more: "
                  + escape(", ".join(f"{x['setting']} = {x['same_as']}" for x in same))
                  + (f"; and {more} with fine-grained offload (--json: same_as_shown)" if more else ""), highlight=False)
    if result["dominated"] and not all_rows:
        n = len(result["dominated"])
        err.print(f"{n} more setting{'s' if n > 1 else ''} fit but run slower than one listed while peaking no lower "
                  "(--all lists every setting)", highlight=False)
    for note in result["time_notes"]:
        err.print(f"[dim]time model: {escape(note)}[/]", highlight=False)
    if result["recommended"]:
        tight = next(r for r in result["fits"] if r["label"] == result["recommended"])["fit"] == "tight"
        colour = "yellow" if tight else "green"
        err.print(f"[{colour}]use:[/] {escape(result['recommended'])}: {escape(result['reason'])}", highlight=False)
        for line in flags_lines(result["flags"]):
            err.print(escape(line), highlight=False, soft_wrap=True)
        if all_rows:
            for row in result["fits"]:
                if row["label"] != result["recommended"]:
                    err.print(f"{escape(row['label'])}:", highlight=False)
                    for line in flags_lines(row["flags"], indent="    "):
                        err.print(escape(line), highlight=False, soft_wrap=True)
    else:
        err.print(f"[red]{escape(result['reason'])}[/]", highlight=False)
        err.print(would_fit_table(result))
    for line in allowance_lines(result):
        err.print(f"[dim]{escape(line)}[/]", highlight=False)
    for x in result["excluded"]:
        err.print(f"[dim]not planned: {escape(x['settings'])}: {escape(x['reason'])}[/]", highlight=False)
    if explain and result["time_parts"]:
        err.print(parts_table(result))
        err.print(escape(classes_line(result["time_parts"]["by_class"], result["time_parts"]["step_seconds"])),
                  highlight=False)
    if auto:
        err.print(auto_table(result["auto"]))
        note = result["auto"]["megatron"]
        err.print(("[yellow]" if note.startswith("Megatron cannot") else "") + escape(note)
                  + ("[/]" if note.startswith("Megatron cannot") else ""), highlight=False)
    if json_out:
        typer.echo(json.dumps(result, indent=2))
    if not result["recommended"]:
        raise typer.Exit(1)


def plan_layouts(cfg: Config, notes: list[str], *, run, memory_gb: float, gpus: int, allowance_fraction: float,
                 allowance_gb: float, profile: bool, fixed: set[str], top: int, json_out: bool) -> None:
    """plan --search-layouts: the best layouts of `gpus` GPUs with their setting and flags; exit 1
    when no layout fits, 2 on bad input (`analysis.megatron.layouts.search_layouts`)."""
    from recompute_bench.analysis.megatron.layouts import search_layouts
    from recompute_bench.cli.common import show_notes
    from recompute_bench.render.layouts import layouts_table, search_line
    from recompute_bench.render.plan_megatron import flags_lines

    try:
        if top < 1:
            raise BadInput(f"--top {top} lists no layout; pass --top 3")
        rates = gpu_rates(run, profile)
        rates.matrix_rate(cfg.training.precision)  # a precision the GPU has no rate for: one line now
        result = search_layouts(cfg, run, rates, gpus, memory_gb * 2**30, allowance_fraction, allowance_gb * 2**30,
                                fixed, top)
    except BadInput as e:
        raise fail(str(e)) from None
    show_notes(notes)
    err.print(escape(search_line(result)), highlight=False)
    if result["layouts"]:
        err.print(layouts_table(result))
        err.print(f"[green]use:[/] {escape(result['recommended'])}: {escape(result['reason'])}", highlight=False)
        for i, row in enumerate(result["layouts"], 1):
            err.print(f"{i}. {escape(row['layout_label'])}, {escape(row['setting'])}:", highlight=False)
            for line in flags_lines(row["flags"], indent="    "):
                err.print(escape(line), highlight=False, soft_wrap=True)
        err.print("[dim]plan the chosen layout without --search-layouts (its --tp, --pp, ... and --gpus) for every "
                  "recompute setting, the time's parts and the allowance[/]", highlight=False)
    else:
        err.print(f"[red]{escape(result['reason'])}[/]", highlight=False)
    if json_out:
        typer.echo(json.dumps(result, indent=2))
    if not result["layouts"]:
        raise typer.Exit(1)
