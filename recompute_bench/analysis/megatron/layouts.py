"""`plan --framework megatron --search-layouts`: the parallel layouts of a GPU count, each with its
fastest recompute or offload setting that fits, ranked by predicted TFLOP/s per GPU.

A layout is tensor, pipeline, virtual pipeline, context and expert parallel sizes and the
micro-batch size (data parallel takes what the others leave of the GPUs), with sequence parallel
wherever tensor parallel runs and the distributed optimizer, unless the user fixed them. Every
dimension the user gave (`fixed`) keeps its value; the others take every value Megatron accepts
(`config.rules.validate`, `check_expert_parallel_world`): tensor parallel within the GPU's NVLink
domain, pipeline parallel dividing the layers, virtual stages only with pipeline parallel, context
parallel dividing the sequence, expert parallel only for a mixture-of-experts model.

The search prices what it must and no more:

1. each layout's static memory (parameters, gradients, optimizer state, buffers: `static_items`, a
   lower bound of any setting's peak) against the budget; a layout over it is out for every setting;
2. each remaining layout's step without recompute (`Planner`, the plan's own pricing: the time model's
   `step_time`), a lower bound of its step under any setting (recompute and offload only add work),
   so the most TFLOP/s per GPU it can reach (Megatron's model FLOPs of the step,
   `analysis.flops.model_flops_per_step`, over that step and the GPU count);
3. layouts in order of that bound: each one's fastest fitting setting (`setting_chains`: chains
   of settings, each slower and needing no more memory than the one before), chains tried in order
   of their first setting's time; a chain is out when its first setting cannot beat the best so
   far or its last (least memory) does not fit, else the memory model finds the first that fits by
   bisection; a layout whose bound cannot beat the `top`-th best found so far ends the search. The
   answer equals pricing every chain's every setting on every layout (`price_every_layout`;
   `tests/test_layouts.py` checks it on a small model, `bench/layout_search.py` times both). Pure Python.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Iterable

from recompute_bench.analysis.allowance import FITS, allowance_row, fit
from recompute_bench.analysis.flops import model_flops_per_step
from recompute_bench.analysis.gpu_rates import GpuRates, rates_row
from recompute_bench.analysis.megatron.flags import run_pasteable
from recompute_bench.analysis.megatron.gpu import MegatronRun
from recompute_bench.analysis.megatron.parameters import stage_parameter_groups
from recompute_bench.analysis.megatron.plan import Planner, offload_groups
from recompute_bench.analysis.megatron.stage import stage_peaks, static_items
from recompute_bench.analysis.megatron.time_model import step_time
from recompute_bench.config.rules import check_expert_parallel_world, layers_per_model_chunk, validate
from recompute_bench.config.schema import BadInput, Config, RecomputeConfig, with_setting

LAYOUTS_SCHEMA = "recompute-bench/layouts-megatron/v1"

SEARCHED = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
            "context_parallel_size", "expert_model_parallel_size", "micro_batch_size", "sequence_parallel",
            "use_distributed_optimizer", "data_parallel_size", "recompute")
"""What the search chooses, by Megatron's names (the micro-batch size is a training field; `recompute`
the recompute and offload setting); what the user gave of them stays fixed."""

MICRO_BATCH_SIZES = (1, 2)
"""Micro-batch sizes tried where the user gives none (more rarely fits a large model, and a larger
micro-batch leaves fewer micro-batches to fill the pipeline)."""

MIN_CHUNK_LAYERS = 2
"""Virtual stages tried where the user gives none leave at least this many layers in each model chunk
(every chunk boundary is one more pipeline send per micro-batch, which the time model does not price)."""

SHORT = (("tp", "tensor_model_parallel_size"), ("pp", "pipeline_model_parallel_size"),
         ("vp", "virtual_pipeline_model_parallel_size"), ("cp", "context_parallel_size"),
         ("ep", "expert_model_parallel_size"), ("dp", "data_parallel_size"))


def _powers_of_two(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_label(cfg: Config) -> str:
    """A layout in a few words: "tp8 pp4 vp5 cp1 ep1 dp2 mbs1" (vp only where it interleaves, ep
    only for MoE)."""
    par = cfg.parallel
    words = []
    for short, name in SHORT:
        value = getattr(par, name)
        if (short == "vp" and not value) or (short == "ep" and not cfg.model.num_moe_experts):
            continue
        words.append(f"{short}{value}")
    return " ".join(words) + f" mbs{cfg.training.micro_batch_size}"


def layout_row(cfg: Config) -> dict[str, Any]:
    """The layout's fields by Megatron's names, with its micro-batch count."""
    par = cfg.parallel
    out = {name: getattr(par, name) for _, name in SHORT}
    out.update(sequence_parallel=par.sequence_parallel, use_distributed_optimizer=par.use_distributed_optimizer,
               micro_batch_size=cfg.training.micro_batch_size, num_microbatches=cfg.num_microbatches)
    return out


def candidate_layouts(cfg: Config, gpus: int, fixed: Iterable[str], rates: GpuRates) -> tuple[list[Config], Counter]:
    """Every layout of `gpus` GPUs the rules accept, cfg's values kept for the `fixed` names (of
    SEARCHED), each with no recompute unless the recompute setting is fixed; and the refused ones,
    counted by the rules' reason."""
    fixed = set(fixed)
    m, tr, par = cfg.model, cfg.training, cfg.parallel

    def values(name: str, free: list) -> list:
        return [getattr(tr if name == "micro_batch_size" else par, name)] if name in fixed else free

    tps = values("tensor_model_parallel_size", _powers_of_two(min(rates.nvlink_domain, m.num_attention_heads, gpus)))
    pps = values("pipeline_model_parallel_size", [d for d in _divisors(m.num_layers) if gpus % d == 0])
    cps = values("context_parallel_size", [c for c in _powers_of_two(gpus) if tr.seq_length % (2 * c) == 0])
    experts = m.num_moe_experts or 0
    eps = values("expert_model_parallel_size", [e for e in _divisors(experts) if gpus % e == 0] if experts else [1])
    mbss = values("micro_batch_size", list(MICRO_BATCH_SIZES))
    setting = cfg.recompute if "recompute" in fixed else RecomputeConfig()
    accepted: list[Config] = []
    refused: Counter = Counter()
    for tp in tps:
        for pp in pps:
            for cp in cps:
                if tp * cp > rates.nvlink_domain and not {"tensor_model_parallel_size", "context_parallel_size"} <= fixed:
                    continue  # the search keeps tp x cp within the NVLink domain (both exchange every layer)
                if gpus % (tp * pp * cp):
                    refused[f"{gpus} GPUs are not a multiple of tp x pp x cp = {tp} x {pp} x {cp}"] += 1
                    continue
                dp = gpus // (tp * pp * cp)
                if "data_parallel_size" in fixed and dp != par.data_parallel_size:
                    continue
                stage = m.num_layers // pp if m.num_layers % pp == 0 else 0
                vps = values("virtual_pipeline_model_parallel_size",
                             [None] + ([v for v in _divisors(stage) if 1 < v and stage // v >= MIN_CHUNK_LAYERS]
                                       if pp > 1 else []))
                sp = par.sequence_parallel if "sequence_parallel" in fixed else tp > 1
                dist = par.use_distributed_optimizer if "use_distributed_optimizer" in fixed else True
                for ep in eps:
                    for vp in vps:
                        for mbs in mbss:
                            c = with_setting(cfg, setting, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vp, context_parallel_size=cp,
                                             data_parallel_size=dp, expert_model_parallel_size=ep, sequence_parallel=sp,
                                             use_distributed_optimizer=dist)
                            if mbs != tr.micro_batch_size:
                                c = dataclasses.replace(c, training=dataclasses.replace(tr, micro_batch_size=mbs))
                            try:
                                validate(c)
                                check_expert_parallel_world(c)
                            except BadInput as e:
                                refused[str(e).split(";")[0]] += 1
                                continue
                            accepted.append(c)
    return accepted, refused


def static_bytes(cfg: Config, run: MegatronRun) -> float:
    """The most any pipeline stage's rank holds before any activation (`static_items`)."""
    return max(sum(static_items(cfg, s, run).values()) for s in range(cfg.parallel.pipeline_model_parallel_size))


def static_key(cfg: Config) -> str:
    """What a layout's static memory depends on: its parallel fields, but not the virtual stages
    where every layer is of one kind and precision (each stage then holds as many of the same
    layers however they are chunked), and the micro-batch size only with CUDA graphs (whose static
    buffers hold a micro-batch's data); `tests/test_layouts.py` checks both."""
    m, tr = cfg.model, cfg.training
    kinds = {m.is_moe_layer(i) for i in range(m.num_layers)}
    uniform = len(kinds) == 1 and not (tr.precision == "fp8" and tr.first_last_layers_bf16)
    par = dataclasses.replace(cfg.parallel, virtual_pipeline_model_parallel_size=None) if uniform else cfg.parallel
    return repr(par) + (f" mbs{tr.micro_batch_size}" if tr.cuda_graph_impl != "none" else "")


def setting_chains(cfg: Config, moving: list[str], fixed: bool) -> list[list[RecomputeConfig]]:
    """The recompute and offload settings tried on a layout, as chains: each chain's settings in
    order of more work (no faster) and no more memory, so that bisection finds the first that fits.
    Selective recompute adding the model's modules one at a time in Megatron's order (none,
    [core_attn], [core_attn,mlp], ...), and the same with fine-grained offloading of every module
    that moves bytes (`moving`); full block with 1 ... n layers per model chunk, then full uniform 1,
    with and without distributed checkpoint inputs; CPU offloading of 1 ... L - 1 layers. Megatron's
    rules drop what it refuses as the search prices them. With `fixed`, cfg's own setting only.
    Fewer settings than `plan` prices for one layout (every subset of the modules, every layer
    count of uniform): plan the chosen layout without --search-layouts for every one."""
    if fixed:
        return [[cfg.recompute]]
    n = layers_per_model_chunk(cfg)
    targets = list(cfg.spec.recompute_targets)
    selective = [RecomputeConfig()] + [RecomputeConfig("selective", targets[:k]) for k in range(1, len(targets) + 1)]
    out = [selective]
    for distribute in (False, True):
        out.append([RecomputeConfig("full", [], "block", k, distribute_saved_activations=distribute)
                    for k in range(1, n + 1)] + [RecomputeConfig("full", [], "uniform", 1,
                                                                 distribute_saved_activations=distribute)])
    out.append([RecomputeConfig(activation_offload_layers=k) for k in range(1, cfg.model.num_layers)])
    if moving:
        out.append([dataclasses.replace(r, fine_grained_activation_offloading=True, offload_modules=list(moving))
                    for r in selective])
    return out


def best_setting(planner: Planner, chains: list[list[RecomputeConfig]], bound: float) -> dict[str, Any] | None:
    """The fastest setting of `planner`'s layout that fits with the allowance and whose step is
    under `bound` (None: none). Chains Megatron accepts (their first setting) in order of their
    first setting's step (no later one is faster); a chain whose last setting (the least memory)
    does not fit is out; within one, only the settings faster than the best so far can matter, and
    of those the last needs the least memory: when it does not fit, none of them does; when it
    does, the first that fits is found by bisection on the memory model."""
    heads = []
    for chain in chains:
        try:
            validate(with_setting(planner.cfg, chain[0]))
            heads.append((planner.time(chain[0]).step_seconds, chain))
        except BadInput:
            continue
    best: dict[str, Any] | None = None
    for head, chain in sorted(heads, key=lambda x: x[0]):
        limit = min(bound, best["step_seconds"]) if best else bound
        if head >= limit:
            break
        if not _fits(planner, chain[-1]):
            continue
        row = _first_fit(planner, chain[:_faster(planner, chain, limit) + 1])
        if row is not None and row["step_seconds"] < limit:
            best = row
    return best


def _fits(planner: Planner, r: RecomputeConfig) -> bool:
    """Whether setting `r` of `planner`'s layout fits with the allowance (False where Megatron refuses it)."""
    cfg = with_setting(planner.cfg, r)
    try:
        validate(cfg)
        peak = max(s.peak_allocated_bytes for s in stage_peaks(cfg, planner.run))
    except BadInput:
        return False
    return fit(peak, planner.budget, planner.fraction, planner.fixed) == FITS


def _faster(planner: Planner, chain: list[RecomputeConfig], limit: float) -> int:
    """The last index of `chain` whose step is under `limit` (the first's is), by bisection on the
    time model; a setting it cannot price counts as no faster."""

    def under(i: int) -> bool:
        try:
            return planner.time(chain[i]).step_seconds < limit
        except BadInput:
            return False

    lo, hi = 0, len(chain) - 1
    if under(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if under(mid) else (lo, mid)
    return lo


def _first_fit(planner: Planner, chain: list[RecomputeConfig]) -> dict[str, Any] | None:
    """The priced row of the first setting of `chain` that fits (bisection on the memory model
    alone: a later setting needs no more memory; the time model prices the one found), or None."""
    last = len(chain) - 1
    if not _fits(planner, chain[last]):
        return None
    found, lo, hi = last, 0, last - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if _fits(planner, chain[mid]):
            found, hi = mid, mid - 1
        else:
            lo = mid + 1
    try:
        return planner.row(chain[found])
    except BadInput:
        return None


def search_layouts(cfg: Config, run: MegatronRun, rates: GpuRates, gpus: int, budget: float, fraction: float,
                   fixed_bytes: float, fixed: Iterable[str] = (), top: int = 3) -> dict[str, Any]:
    """The `top` layouts of `gpus` GPUs with their fastest fitting setting, by predicted TFLOP/s per
    GPU, and what the search priced. BadInput when Megatron accepts no layout with the `fixed`
    values, or when the budget is below every accepted layout's static memory."""
    fixed = set(fixed)
    layouts, refused = candidate_layouts(cfg, gpus, fixed, rates)
    if not layouts:
        reason = refused.most_common(1)[0][0] if refused else "no layout is left"
        raise BadInput(f"no layout of {gpus} GPUs is one Megatron accepts{_with_fixed(cfg, fixed)}: {reason}; "
                       "change the fixed sizes or --gpus")
    by_key: dict[str, float] = {}
    for c in layouts:
        key = static_key(c)
        if key not in by_key:
            by_key[key] = static_bytes(c, run)
    statics = [(by_key[static_key(c)], c) for c in layouts]
    within = [c for s, c in statics if s + fixed_bytes <= budget]
    if not within:
        least, c = min(statics, key=lambda x: x[0])
        raise BadInput(f"--memory-gb {budget / 2**30:g} is below what a rank holds before any activation in every "
                       f"layout of {gpus} GPUs: the least is {least / 2**30:.1f} GiB ({layout_label(c)}) plus the "
                       f"{fixed_bytes / 2**30:g} GiB fixed allowance; pass a larger --memory-gb or more --gpus")
    priced: list[tuple[float, Planner]] = []  # (the most TFLOP/s per GPU the layout can reach, its planner)
    for c in within:
        try:
            planner = Planner(c, run, rates, budget, fraction, fixed_bytes)
        except BadInput as e:
            refused[str(e).split(";")[0]] += 1
            continue
        priced.append((_tflops(c, planner.none_step, gpus), planner))
    priced.sort(key=lambda x: (-x[0], layout_label(x[1].cfg)))
    moving = offload_groups(within[0], run)[0] if "recompute" not in fixed else []
    found: list[dict[str, Any]] = []
    evaluated = 0
    for most, planner in priced:
        floor = found[top - 1]["tflops_per_gpu"] if len(found) >= top else 0.0
        if most <= floor:
            break
        evaluated += 1
        # a setting must beat the top-th best's TFLOP/s: a step under the model FLOPs over it
        bound = model_flops_per_step(planner.cfg) / (floor * 1e12 * gpus) if floor else float("inf")
        row = best_setting(planner, setting_chains(planner.cfg, moving, "recompute" in fixed), bound)
        if row is not None:
            found.append(_ranked(planner.cfg, row, gpus))
            found.sort(key=lambda r: (-r["tflops_per_gpu"], r["layout_label"]))
    rows = found[:top]
    for r in rows:
        r["relative_to_best"] = r["tflops_per_gpu"] / rows[0]["tflops_per_gpu"]
    out: dict[str, Any] = {
        "schema": LAYOUTS_SCHEMA, "framework": "megatron", "workload": cfg.workload, "gpu": run.gpu, "gpus": gpus,
        "rates": rates_row(rates), "budget_bytes": budget, "allowance": allowance_row(fraction, fixed_bytes),
        "fixed": sorted(fixed), "layouts": rows,
        "searched": {"layouts": len(layouts) + sum(refused.values()), "refused": sum(refused.values()),
                     "accepted": len(layouts), "over_static_memory": len(layouts) - len(within),
                     "priced": len(priced), "searched_settings": evaluated, "pruned": len(priced) - evaluated},
        "refused": [{"reason": reason, "layouts": n} for reason, n in refused.most_common()],
        "recommended": rows[0]["layout_label"] if rows else None, "reason": None,
    }
    if rows:
        best = rows[0]
        out["reason"] = (f"{best['tflops_per_gpu']:.0f} TFLOP/s per GPU predicted ({best['step_seconds']:.2f} s a step) "
                         f"with {best['setting']}, needing {best['device_bytes_needed'] / 2**30:.1f} of "
                         f"{budget / 2**30:g} GiB on stage {best['peak_stage']}")
    else:
        out["reason"] = (f"no layout of {gpus} GPUs fits {budget / 2**30:g} GiB with any recompute or offload setting "
                         f"({len(within)} hold their static memory, but not the activations); pass a larger "
                         "--memory-gb or more --gpus")
    return out


def price_every_layout(cfg: Config, run: MegatronRun, rates: GpuRates, gpus: int, budget: float, fraction: float,
                       fixed_bytes: float, top: int) -> list[tuple[float, str]]:
    """What the search must find, without its pruning: every chain's every setting priced on every
    accepted layout, each layout's fastest that fits; the `top` layouts by TFLOP/s per GPU as
    (step seconds, layout label). Slow: for checking `search_layouts` on a small model."""
    layouts, _ = candidate_layouts(cfg, gpus, set(), rates)
    moving = offload_groups(layouts[0], run)[0]
    best = []
    for c in layouts:
        params = [stage_parameter_groups(c, s) for s in range(c.parallel.pipeline_model_parallel_size)]
        steps = []
        for chain in setting_chains(c, moving, False):
            for r in chain:
                run_cfg = with_setting(c, r)
                try:
                    validate(run_cfg)
                    peak = max(s.peak_allocated_bytes for s in stage_peaks(run_cfg, run))
                    if fit(peak, budget, fraction, fixed_bytes) == FITS:
                        steps.append(step_time(run_cfg, run, rates, params).step_seconds)
                except BadInput:
                    continue
        if steps:
            best.append((-_tflops(c, min(steps), gpus), round(min(steps), 12), layout_label(c)))
    return [(step, label) for _, step, label in sorted(best)[:top]]


def _ranked(cfg: Config, row: dict[str, Any], gpus: int) -> dict[str, Any]:
    """A layout's best setting as the search lists it."""
    run_cfg = with_setting(cfg, RecomputeConfig(**row["recompute"]))
    return {"layout_label": layout_label(cfg), "layout": layout_row(cfg), "setting": row["label"],
            "recompute": row["recompute"], "peak_allocated_bytes": row["peak_allocated_bytes"],
            "peak_stage": row["peak_stage"], "device_bytes_needed": row["device_bytes_needed"], "fit": row["fit"],
            "step_seconds": row["step_seconds"],
            "tflops_per_gpu": _tflops(cfg, row["step_seconds"], gpus),
            "flags": run_pasteable(run_cfg)}


def _tflops(cfg: Config, step_seconds: float, gpus: int) -> float:
    """Megatron's model FLOPs of a step over the step and the GPUs, in TFLOP/s per GPU."""
    return model_flops_per_step(cfg) / (step_seconds * gpus) / 1e12


def _with_fixed(cfg: Config, fixed: set[str]) -> str:
    words = [f"{name} {getattr(cfg.training if name == 'micro_batch_size' else cfg.parallel, name)}"
             for name in SEARCHED if name in fixed and name != "recompute"]
    return f" with {', '.join(words)}" if words else ""
