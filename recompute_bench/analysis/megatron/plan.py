"""`plan --framework megatron`: every recompute setting Megatron can run for a Config, each with
the peak of every pipeline stage (`stage_peaks`), whether it fits a budget with the allocator
allowance, and its step time relative to no recompute (`analysis.megatron.time_model`); the settings that
fit, fastest first, with the flags to paste; what would fit when nothing does; and (`--auto`) what
a per-stage or per-layer choice would gain over the best uniform setting, which Megatron cannot run.

The plan takes any Config the Megatron memory model accepts: a setting is a candidate when
`config.rules.validate` accepts it (Megatron's rules as the product enforces them) and both
`stage_peaks` and the time model price it; the others are listed with the reason. A Config from
any source (presets and flags today, a Bridge config or a Megatron log through `--from`) plans the
same way: `megatron_plan(cfg, run, rates, budget)`. Pure Python.
"""

from __future__ import annotations

import dataclasses
from itertools import combinations
from typing import Any, Callable

from recompute_bench.analysis.allowance import (FITS, OVER, TIGHT, allowance_parts, allowance_row,
                                                device_bytes_needed, fit)
from recompute_bench.analysis.gpu_rates import GpuRates, rates_row
from recompute_bench.analysis.megatron.flags import pasteable
from recompute_bench.analysis.megatron.gpu import MegatronRun
from recompute_bench.analysis.megatron.parameters import stage_parameter_groups
from recompute_bench.analysis.megatron.stage import stage_peak, stage_peaks
from recompute_bench.analysis.megatron.time_model import StepTime, step_time
from recompute_bench.config.rules import layers_per_model_chunk, validate
from recompute_bench.config.choices import OFFLOAD_MODULES
from recompute_bench.config.schema import BadInput, Config, RecomputeConfig, data_parallel_size, with_setting
from recompute_bench.recompute.policy import LayerPolicy, megatron_flags, megatron_setting
from recompute_bench.recompute.settings import selective_settings

PLAN_SCHEMA = "recompute-bench/plan-megatron/v1"


def offload_groups(cfg: Config, run: MegatronRun) -> tuple[list[str], list[str]]:
    """(the fine-grained offload modules that move bytes of cfg's layers in the Megatron memory
    model, those Megatron offers that move none there), in Megatron's order. A module moves bytes
    when some layer kind keeps a storage of its group (`offload.fine_grained_offloaded` with that
    module alone, attn_proj beside core_attn as Megatron requires)."""
    from recompute_bench.analysis.megatron.layer import layer_saved_bytes
    from recompute_bench.analysis.megatron.offload import fine_grained_offloaded, offload_group

    kinds = {cfg.model.is_moe_layer(i): i for i in range(cfg.model.num_layers)}
    moving, inert = [], []
    for module in OFFLOAD_MODULES:
        listed = [module, "core_attn"] if module == "attn_proj" else [module]
        probe = with_setting(cfg, RecomputeConfig(fine_grained_activation_offloading=True, offload_modules=listed))
        moved = any(offload_group(name) == module
                    for i in kinds.values() for name in fine_grained_offloaded(probe, layer_saved_bytes(probe, run, (), i)))
        (moving if moved else inert).append(module)
    return moving, inert


def candidate_settings(cfg: Config, run: MegatronRun | None = None) -> list[RecomputeConfig]:
    """Every setting worth asking Megatron about for cfg's model: none; selective with every
    non-empty subset of the model's modules (dense, MoE and MLA: `cfg.spec.recompute_targets`);
    full uniform and block with every recompute_num_layers of a model chunk, each also with
    distribute_saved_activations; CPU offloading of every layer count; and, given the run, fine-grained
    offloading of every subset of the offload modules that move bytes (`offload_groups`) beside none
    and every selective setting. Megatron's rules (`validate`) then drop what it refuses."""
    n = layers_per_model_chunk(cfg)
    selective = [RecomputeConfig(), *selective_settings(cfg.spec.recompute_targets)]
    out = list(selective)
    for method in ("uniform", "block"):
        for k in range(1, n + 1):
            out.append(RecomputeConfig("full", [], method, k))
            out.append(RecomputeConfig("full", [], method, k, distribute_saved_activations=True))
    out += [RecomputeConfig(activation_offload_layers=k) for k in range(1, cfg.model.num_layers)]
    if run is not None:
        moving, _ = offload_groups(cfg, run)
        for k in range(1, len(moving) + 1):
            for listed in combinations(moving, k):
                out += [dataclasses.replace(r, fine_grained_activation_offloading=True, offload_modules=list(listed))
                        for r in selective]
    return out


def _family(r: RecomputeConfig) -> tuple:
    """Settings that differ only in how many layers they recompute or offload (the plan lists the
    fastest of each family that fits)."""
    if r.granularity == "full":
        return ("full", r.method, r.distribute_saved_activations)
    if r.activation_offload_layers:
        return ("offload",)
    return (r.granularity, tuple(r.modules), tuple(r.offload_modules))


class Planner:
    """Prices settings of one Config on one GPU kind against one budget."""

    def __init__(self, cfg: Config, run: MegatronRun, rates: GpuRates, budget: float, fraction: float, fixed: float):
        self.cfg, self.run, self.rates = cfg, run, rates
        self.budget, self.fraction, self.fixed = budget, fraction, fixed
        self.parameters = [stage_parameter_groups(cfg, s) for s in range(cfg.parallel.pipeline_model_parallel_size)]
        self.times: dict[str, StepTime] = {}
        """Each setting's step time, by its label: priced once however often the plan asks."""
        self.searched: tuple[list[dict[str, Any]], list[dict[str, str]]] | None = None
        self.none_step = self.time(RecomputeConfig()).step_seconds

    def time(self, r: RecomputeConfig) -> StepTime:
        key = r.label
        if key not in self.times:
            self.times[key] = step_time(with_setting(self.cfg, r), self.run, self.rates, self.parameters)
        return self.times[key]

    def row(self, r: RecomputeConfig) -> dict[str, Any]:
        """One setting priced: BadInput where Megatron refuses it or a model cannot price it."""
        cfg = with_setting(self.cfg, r)
        validate(cfg)
        stages = stage_peaks(cfg, self.run)
        st = self.time(r)
        peak = max(stages, key=lambda s: s.peak_allocated_bytes)
        need = device_bytes_needed(peak.peak_allocated_bytes, self.fraction, self.fixed)
        return {
            "label": r.label, "recompute": dataclasses.asdict(r),
            "stages": [{"stage": s.stage, "peak_allocated_bytes": s.peak_allocated_bytes, "phase": s.phase,
                        "device_bytes_needed": device_bytes_needed(s.peak_allocated_bytes, self.fraction, self.fixed)}
                       for s in stages],
            "peak_allocated_bytes": peak.peak_allocated_bytes, "peak_stage": peak.stage, "device_bytes_needed": need,
            "fit": fit(peak.peak_allocated_bytes, self.budget, self.fraction, self.fixed),
            "step_seconds": st.step_seconds, "recompute_seconds": st.recompute_seconds,
            "relative_throughput": self.none_step / st.step_seconds, **throughput(cfg, self.rates, st),
            "flags": pasteable(r),
        }

    def search(self) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
        """Every candidate priced, and those left out with the reason (one line per reason); searched
        once, the same rows handed to every later caller."""
        if self.searched is None:
            rows, excluded = [], {}
            for r in candidate_settings(self.cfg, self.run):
                try:
                    rows.append(self.row(r))
                except BadInput as e:
                    reason = str(e).split(";")[0]
                    excluded.setdefault(reason, []).append(r.label)
            self.searched = rows, [{"reason": reason, "settings": _span(labels)} for reason, labels in excluded.items()]
        return self.searched


def throughput(cfg: Config, rates: GpuRates, st: StepTime) -> dict[str, Any]:
    """A priced step as users read it: model TFLOP/s per GPU (the model FLOPs of the global batch,
    `analysis.flops.model_flops_per_step`, over the step and the GPUs), tokens per second per GPU,
    MFU (against the GPU's dense 16-bit datasheet peak, as Korthikanti et al. and Megatron's logs
    count it, FP8 runs included) and the step's seconds by class (`StepTime.by_class`)."""
    from recompute_bench.analysis.flops import model_flops_per_step

    world = cfg.parallel.world_size
    flops = model_flops_per_step(cfg) / world / st.step_seconds
    tokens = cfg.training.global_batch_size * cfg.training.seq_length / world / st.step_seconds
    return {"tflops_per_gpu": flops / 1e12, "tokens_per_s_per_gpu": tokens, "mfu": flops / rates.peak("bf16"),
            "step_parts": st.by_class()}


def _span(labels: list[str]) -> str:
    return labels[0] if len(labels) == 1 else f"{labels[0]} ... {labels[-1]} ({len(labels)} settings)"


def _amount(row: dict[str, Any]) -> int:
    """How much a setting asks to recompute or offload (modules, layers, offload modules)."""
    r = row["recompute"]
    return len(r["modules"]) + (r["num_layers"] or 0) + r["activation_offload_layers"] + len(r["offload_modules"])


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two rows have the same step time and peak (to the byte and nanosecond)."""
    return round(a["step_seconds"], 9) == round(b["step_seconds"], 9) and \
        round(a["peak_allocated_bytes"]) == round(b["peak_allocated_bytes"])


def speed_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fastest first; at equal predicted time the one that asks for less (offload the model finds
    hidden still takes host memory and the host link), then the lower peak."""
    return sorted(rows, key=lambda r: (round(r["step_seconds"], 9), _amount(r), r["peak_allocated_bytes"], r["label"]))


def shown(rows: list[dict[str, Any]], current: str | None = None) -> tuple[list[dict[str, Any]], list[dict[str, str]],
                                                                           list[str]]:
    """The rows that fit: those that fit with the allowance fastest first (the one to use on top),
    then the tight ones faster than every one of those, fastest first; only the fastest of each
    family and fit class (more layers recomputed or offloaded is never faster), and only a row that
    needs less memory than every faster row shown (a slower setting that also peaks higher is no
    choice). Apart from them: the settings that only repeat a shown one's time and peak while asking
    for more (a module with nothing to recompute, such as `layernorm` where Transformer Engine fuses
    the norms), and the labels of the dominated ones (`--all` lists them). The run's own setting
    (`current`) is listed wherever it fits, dominated or not, to compare with."""
    seen, out, same, dominated, kept = set(), [], [], [], []
    for row in speed_order(rows):  # at equal step and peak, the one that asks for less comes first
        twin = next((x for x in kept if _same(x, row)), None)
        if twin is None:
            kept.append(row)
        elif row["fit"] != OVER:
            same.append({"setting": row["label"], "same_as": twin["label"]})
    fitting = [r for r in kept if r["fit"] == FITS]
    fastest = fitting[0]["step_seconds"] if fitting else float("inf")
    tight = [r for r in kept if r["fit"] == TIGHT and r["step_seconds"] < fastest]
    for row in fitting + tight:
        key = (_family(RecomputeConfig(**row["recompute"])), row["fit"])
        if key in seen:
            continue
        faster = [x for x in out if x["fit"] == row["fit"]]
        if faster and min(x["peak_allocated_bytes"] for x in faster) <= row["peak_allocated_bytes"] \
                and row["label"] != current:
            dominated.append(row["label"])
            continue
        seen.add(key)
        out.append(row)
    return out, same, dominated


def megatron_plan(cfg: Config, run: MegatronRun, rates: GpuRates, budget: float, fraction: float, fixed: float,
                  gpus: int | None = None, mark_current: bool = False, auto: bool = False) -> dict[str, Any]:
    """The plan: every setting priced (`settings`), those that fit fastest first (`fits`), the one
    to use (`recommended`, with its flags and its time's parts), and when nothing fits the layouts
    that would (`would_fit`). `mark_current`: cfg's own recompute setting is the run's (read from
    its file), listed wherever it fits and named in `current`. `auto`: also what a per-stage or
    per-layer choice would gain (`auto`, `auto_plan` over the same priced settings). BadInput when
    the budget is below what a rank holds before any activation (`check_budget`)."""
    check_budget(cfg, run, budget, fixed)
    planner = Planner(cfg, run, rates, budget, fraction, fixed)
    rows, excluded = planner.search()
    if not rows:
        raise BadInput("no recompute setting of this run can be priced: " + "; ".join(e["reason"] for e in excluded))
    current = cfg.recompute.label if mark_current and any(r["label"] == cfg.recompute.label for r in rows) else None
    fits, same, dominated = shown(rows, current)
    smallest = min(rows, key=lambda r: r["peak_allocated_bytes"])
    out: dict[str, Any] = {
        "schema": PLAN_SCHEMA, "framework": "megatron", "workload": cfg.workload, "config": cfg.to_dict(),
        "gpu": run.gpu, "gpus": gpus if gpus is not None else cfg.parallel.world_size, "rates": rates_row(rates),
        "budget_bytes": budget, "allowance": allowance_row(fraction, fixed),
        "num_microbatches": cfg.num_microbatches, "no_recompute_step_seconds": planner.none_step,
        "settings": speed_order(rows), "excluded": excluded, "fits": fits, "same_as_shown": same,
        "dominated": dominated, "time_notes": time_notes(cfg, run), "current": current,
        "recommended": None, "reason": None, "flags": None, "time_parts": None, "would_fit": [],
    }
    best = next((r for r in fits if r["fit"] == FITS), fits[0] if fits else None)
    if best is not None:
        r = RecomputeConfig(**best["recompute"])
        st = planner.time(r)
        out["recommended"] = best["label"]
        out["flags"] = best["flags"]
        out["time_parts"] = {"step_seconds": st.step_seconds, "microbatch_seconds": st.microbatch_seconds,
                             "pacing_stage": st.pacing_stage, "bubble_seconds": st.bubble_seconds,
                             "optimizer_seconds": st.optimizer_seconds, "data_parallel_seconds": st.data_parallel,
                             "num_microbatches": cfg.num_microbatches,
                             "by_class": st.by_class(), "parts": st.parts}
        gib = 2**30
        allowance = allowance_parts(best["peak_allocated_bytes"], fraction, fixed)
        if best["fit"] == FITS:
            out["reason"] = (f"fastest setting that fits: {100 * best['relative_throughput']:.1f}% of no recompute's "
                             f"throughput, needs {best['device_bytes_needed'] / gib:.1f} of {budget / gib:.1f} GiB on "
                             f"stage {best['peak_stage']} ({best['peak_allocated_bytes'] / gib:.1f} GiB allocated + "
                             f"{sum(allowance.values()) / gib:.1f} GiB allowance)")
        else:
            out["reason"] = (f"tight: nothing fits with the allowance; {best['label']} fits only if the caching "
                             f"allocator holds under {(budget - best['peak_allocated_bytes'] - fixed) / gib:.1f} GiB above "
                             f"its {best['peak_allocated_bytes'] / gib:.1f} GiB allocated peak: run with "
                             f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    else:
        out["reason"] = (f"nothing fits: the smallest setting ({smallest['label']}) peaks at "
                         f"{smallest['peak_allocated_bytes'] / 2**30:.1f} GiB allocated on stage {smallest['peak_stage']}, "
                         f"{smallest['device_bytes_needed'] / 2**30:.1f} GiB with the allowance, of {budget / 2**30:.1f} GiB")
        out["would_fit"] = would_fit(cfg, run, rates, budget, fraction, fixed, gpus, planner.none_step)
    if auto:
        out["auto"] = auto_plan(planner, next((r for r in fits if r["fit"] == FITS), None))
    return out


def time_notes(cfg: Config, run: MegatronRun) -> list[str]:
    """What the time model leaves out that this run has, one line each."""
    notes = []
    impl = cfg.training.cuda_graph_impl
    if impl != "none":
        notes.append(f"CUDA graphs ({impl}): the time model prices no kernel launch overhead, with graphs or without, "
                     "so it predicts no speed-up from them; their memory (static buffers, the capture) is in the peaks")
    if cfg.model.num_moe_experts:
        notes.append("MoE: every expert is priced with its share of the tokens (balanced routing), as the memory model "
                     "counts them; an imbalanced router makes the busiest rank slower than predicted")
    _, inert = offload_groups(cfg, run)
    m = cfg.model
    # modules whose layers save something Megatron would offload, which the memory model does not
    # move yet: MoE's groups, the MoE layer's own pre-MLP norm and MLA's input norm (TENorms; a
    # dense TE layer's norms are fused into its linears and save nothing of their own)
    present = [x for x in inert if (x in ("expert_fc1", "moe_act", "fused_group_mlp", "mlp_norm") and m.num_moe_experts)
               or (x == "attn_norm" and m.multi_latent_attention)]
    if present:
        notes.append(f"fine-grained offload of {', '.join(present)} is not planned: the Megatron memory model moves "
                     "none of their bytes yet")
    return notes


def check_budget(cfg: Config, run: MegatronRun, budget: float, fixed: float) -> None:
    """BadInput when the budget is below what a rank holds with no activations at all: its
    parameters, gradients, optimizer state and buffers, plus the fixed allowance."""
    stages = stage_peaks(with_setting(cfg, RecomputeConfig()), run)
    worst = max(stages, key=lambda s: s.static_bytes)
    if worst.static_bytes + fixed > budget:
        raise BadInput(f"--memory-gb {budget / 2**30:g} is below what stage {worst.stage} holds before any activation: "
                       f"{worst.static_bytes / 2**30:.1f} GiB of parameters, gradients, optimizer state and buffers plus "
                       f"the {fixed / 2**30:g} GiB fixed allowance; pass a larger --memory-gb or shard more "
                       f"(--tp, --pp, --set parallel.use_distributed_optimizer=true)")


# ----- what would fit ---------------------------------------------------------------------------


def _layout(cfg: Config, gpus: int | None, **parallel: Any) -> Config:
    par = dataclasses.replace(cfg.parallel, **parallel)
    if gpus is not None:  # the GPU count stays: data parallel takes what tensor and pipeline leave
        parallel["data_parallel_size"] = data_parallel_size(gpus, par.tensor_model_parallel_size,
                                                            par.pipeline_model_parallel_size, par.context_parallel_size)
    return with_setting(cfg, **parallel)


def layout_changes(cfg: Config, gpus: int | None) -> list[tuple[str, Callable[[], Config]]]:
    """The changes of layout the plan tries when nothing fits, each as its flags and the changed Config."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    t, p, vp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    out: list[tuple[str, Callable[[], Config]]] = [
        (f"--tp {2 * t} --sequence-parallel", lambda: _layout(cfg, gpus, tensor_model_parallel_size=2 * t, sequence_parallel=True))]
    if t > 1 and not par.sequence_parallel:
        out.append(("--sequence-parallel", lambda: _layout(cfg, gpus, sequence_parallel=True)))
    out.append((f"--pp {2 * p}", lambda: _layout(cfg, gpus, pipeline_model_parallel_size=2 * p,
                                                 virtual_pipeline_model_parallel_size=vp)))
    if tr.micro_batch_size > 1:
        out.append(("--micro-batch-size 1", lambda: dataclasses.replace(cfg, training=dataclasses.replace(tr, micro_batch_size=1))))
    if p > 1:
        stage = m.num_layers // p
        more = next((v for v in range((vp or 1) + 1, stage + 1) if stage % v == 0), None)
        if more:
            out.append((f"--set parallel.virtual_pipeline_model_parallel_size={more}",
                        lambda: _layout(cfg, gpus, virtual_pipeline_model_parallel_size=more)))
    if par.data_parallel_size > 1 and not par.use_distributed_optimizer:
        out.append(("--set parallel.use_distributed_optimizer=true", lambda: _layout(cfg, gpus, use_distributed_optimizer=True)))
    return out


def would_fit(cfg: Config, run: MegatronRun, rates: GpuRates, budget: float, fraction: float, fixed: float,
              gpus: int | None, none_step: float) -> list[dict[str, Any]]:
    """Each change of layout with the fastest setting that then fits (or why the change is not
    possible), its TFLOP/s per GPU relative to no recompute in today's layout."""
    out = []
    for change, build in layout_changes(cfg, gpus):
        entry: dict[str, Any] = {"change": change, "fits": False, "setting": None, "device_bytes_needed": None,
                                 "relative_throughput": None, "note": None}
        try:
            changed = build()
            validate(changed)
            planner = Planner(changed, run, rates, budget, fraction, fixed)
            rows, _ = planner.search()
        except BadInput as e:
            entry["note"] = str(e).split(";")[0]
            out.append(entry)
            continue
        fitting = [r for r in speed_order(rows) if r["fit"] != OVER]
        best = next((r for r in fitting if r["fit"] == FITS), fitting[0] if fitting else None)
        if best is None:
            best = min(rows, key=lambda r: r["peak_allocated_bytes"])
        # TFLOP/s per GPU against no recompute in today's layout: the same global batch's FLOPs over
        # the step time and the GPU count of each layout.
        per_gpu = none_step * cfg.parallel.world_size / (best["step_seconds"] * changed.parallel.world_size)
        entry.update({"fits": best["fit"] != OVER, "fit": best["fit"], "setting": best["label"],
                      "device_bytes_needed": best["device_bytes_needed"], "relative_throughput": per_gpu})
        if gpus is None and changed.parallel.world_size != cfg.parallel.world_size:
            entry["note"] = f"{changed.parallel.world_size} GPUs"
        out.append(entry)
    return out


# ----- plan --auto: per stage and per layer ------------------------------------------------------


def _choices(cfg: Config, run: MegatronRun, rates: GpuRates) -> list[tuple[str, Callable[[int], LayerPolicy]]]:
    """What one layer may do in a per-layer policy: keep everything, recompute any selective subset
    Megatron accepts for the model (as a uniform setting), or be checkpointed whole on its own;
    less a choice that another beats on every kind of layer the model has (dense, MoE), keeping no
    fewer bytes (`layer_bytes`) for no less recompute time (`time_model.layer_seconds`): a
    dominated choice never makes a faster mix (a MoE model's seven modules offer 127 subsets, most
    of them dominated)."""
    from recompute_bench.analysis.checkpoint import checkpoint_input_bytes
    from recompute_bench.analysis.megatron.layer import layer_bytes
    from recompute_bench.analysis.megatron.time_model import layer_seconds

    out: list[tuple[str, Callable[[int], LayerPolicy]]] = [("none", lambda i: LayerPolicy())]
    targets = cfg.spec.recompute_targets
    for k in range(1, len(targets) + 1):
        for subset in combinations(targets, k):
            try:
                validate(with_setting(cfg, RecomputeConfig("selective", list(subset))))
            except BadInput:
                continue
            out.append((f"selective[{','.join(subset)}]", lambda i, s=frozenset(subset): LayerPolicy(modules=s)))
    out.append(("full", lambda i: LayerPolicy(chunk=i)))
    kinds = list({cfg.model.is_moe_layer(i): i for i in range(cfg.model.num_layers)}.values())

    def cost(policy: LayerPolicy) -> list[tuple[float, float]]:
        return [(layer_seconds(cfg, run, rates, policy, i)["recompute"],
                 checkpoint_input_bytes(cfg) if policy.chunk is not None else layer_bytes(cfg, run, policy.modules, i))
                for i in kinds]

    costs = {name: cost(make(0)) for name, make in out}

    def beaten(name: str) -> bool:
        mine = costs[name]
        return any(other != name and all(t <= mt and b <= mb for (t, b), (mt, mb) in zip(costs[other], mine))
                   and costs[other] != mine for other in costs)

    # of choices that cost the same on every kind, the one listed first (asking for least) stays
    seen: list[list[tuple[float, float]]] = []
    kept = []
    for name, make in out:
        if beaten(name) or costs[name] in seen:
            continue
        seen.append(costs[name])
        kept.append((name, make))
    return kept


def _policy_config(cfg: Config, pattern: list[LayerPolicy], distribute: bool = False) -> Config:
    """cfg running `pattern` in every model chunk (layer j runs pattern[j mod n]; each checkpointed
    layer its own checkpoint), its checkpoints' inputs distributed over tensor parallel or not."""
    n = len(pattern)
    entries = [dataclasses.replace(pattern[j % n], chunk=j).entry if pattern[j % n].chunk is not None
               else pattern[j % n].entry for j in range(cfg.model.num_layers)]
    return with_setting(cfg, RecomputeConfig(layer_policy=entries, distribute_saved_activations=distribute))


def auto_plan(planner: Planner, uniform: dict[str, Any] | None) -> dict[str, Any]:
    """What choosing per pipeline stage, or per layer within each stage's model chunks, would gain
    over the best uniform setting `uniform` (a row of `megatron_plan`, or None when none fits), with
    `planner`'s settings and step times (those `megatron_plan` priced, not priced again).
    Per stage: each stage runs the fastest uniform setting that fits it. Per layer: each stage runs,
    in every model chunk, k layers of one choice and the rest of another (none, a selective subset,
    or a whole-layer checkpoint), the fastest such mix that fits. The pipeline is paced by its
    slowest stage, so the step is (m + (p - 1)/vp) x the slowest stage's micro-batch. Megatron runs
    one setting for every layer of every chunk of every stage (TransformerConfig.recompute_*), so
    only a plan whose stages all run the same Megatron setting can run there.

    A mix's micro-batch is priced without building its step: the time model is additive, a stage's
    micro-batch under no recompute plus what each layer re-runs under its choice (and each
    checkpoint's all-gather with distributed inputs), so the mixes are tried fastest first and the
    memory model is asked only until one fits (its time then taken from `step_time` itself)."""
    from recompute_bench.analysis.megatron.time_model import checkpoint_ops, layer_key, layer_seconds, op_times
    from recompute_bench.config.pipeline_split import model_chunks

    cfg, run, rates = planner.cfg, planner.run, planner.rates
    budget, fraction, fixed = planner.budget, planner.fraction, planner.fixed
    par = cfg.parallel
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    n = layers_per_model_chunk(cfg)

    def fits_stage(c: Config, s: int) -> bool:
        return fit(stage_peak(c, s, run).peak_allocated_bytes, budget, fraction, fixed) == FITS

    def step(stage_micro: list[float]) -> float:
        return (cfg.num_microbatches + (p - 1) / vp) * max(stage_micro) + planner.time(RecomputeConfig()).optimizer_seconds

    rows, _ = planner.search()
    times = planner.times  # every row's, priced by the search
    per_stage: list[dict[str, Any] | None] = []
    for s in range(p):
        best = None
        for row in sorted(speed_order(rows), key=lambda r: round(times[r["label"]].microbatch_seconds[s], 12)):
            if fit(row["stages"][s]["peak_allocated_bytes"], budget, fraction, fixed) == FITS:
                best = {"stage": s, "setting": row["label"], "microbatch_seconds": times[row["label"]].microbatch_seconds[s]}
                break
        per_stage.append(best)

    per_layer: list[dict[str, Any] | None] = []
    choices = _choices(cfg, run, rates)
    distributed = with_setting(cfg, RecomputeConfig("full", [], "block", 1, distribute_saved_activations=True))
    try:  # Megatron's rule: distributed checkpoint inputs need tensor parallel without sequence parallel
        validate(distributed)
        distributions = [False, True]
    except BadInput:
        distributions = [False]
    none_micro = planner.time(RecomputeConfig()).microbatch_seconds
    rerun: dict[tuple, float] = {}

    def rerun_seconds(name: str, policy: LayerPolicy, layer: int) -> float:
        key = (name, layer_key(cfg, layer))
        if key not in rerun:
            rerun[key] = layer_seconds(cfg, run, rates, policy, layer)["recompute"]
        return rerun[key]

    checkpoint_cost = sum(op_times(checkpoint_ops(distributed, [LayerPolicy(chunk=0)]), rates).values()) \
        if True in distributions else 0.0
    pairs = [(x, x) for x in choices] + [(x, y) for x in choices for y in choices if x[0] != y[0]]
    for s in range(p):
        layers = [c.first_layer + i for c in model_chunks(cfg, s) for i in range(c.layers)]
        # what each choice re-runs on the stage's layers at position r of the pattern (layer j runs
        # pattern[j mod n]), and how many of those layers there are (checkpoints, if whole)
        added = {name: [sum(rerun_seconds(name, make(j), j) for j in layers if j % n == r) for r in range(n)]
                 for name, make in choices}
        count = [sum(1 for j in layers if j % n == r) for r in range(n)]
        mixes = []
        for (name_a, a), (name_b, b) in pairs:
            for distribute in distributions if "full" in (name_a, name_b) else [False]:
                for k in range(1, n) if name_a != name_b else [n]:  # mixes: k of a, n - k of b
                    pattern = [a(i) for i in range(k)] + [b(i) for i in range(k, n)]
                    micro = none_micro[s] + sum(added[name_a][:k]) + sum(added[name_b][k:])
                    if distribute:
                        micro += checkpoint_cost * sum(count[r] for r in range(n) if pattern[r].chunk is not None)
                    mixes.append((round(micro, 12), name_a, name_b, k, distribute, pattern))
        mixes.sort(key=lambda x: x[0])
        best = None if per_stage[s] is None else {**per_stage[s], "megatron_setting": per_stage[s]["setting"]}
        for micro, name_a, name_b, k, distribute, pattern in mixes:
            if best is not None and micro >= best["microbatch_seconds"] * (1 - 1e-9):
                break  # every mix left is no faster than the stage's own uniform setting
            c = _policy_config(cfg, pattern, distribute)
            try:
                if not fits_stage(c, s):
                    continue
                micro = step_time(c, run, rates, planner.parameters).microbatch_seconds[s]
            except BadInput:
                continue
            setting = megatron_setting(cfg.model, pattern, cfg.spec.recompute_targets)
            words = name_b if name_a == name_b else f"{k} {name_a} + {n - k} {name_b}"
            words += " +distribute" if distribute else ""
            best = {"stage": s, "setting": words, "microbatch_seconds": micro,
                    "megatron_setting": None if setting is None else dataclasses.replace(
                        setting, distribute_saved_activations=distribute).label}
            break
        per_layer.append(best)

    out: dict[str, Any] = {"uniform": None, "per_stage": None, "per_layer": None}
    if uniform is not None:  # priced by the same formula as the mixes, so that equal plans gain 0
        total = step(planner.time(RecomputeConfig(**uniform["recompute"])).microbatch_seconds)
        out["uniform"] = {"setting": uniform["label"], "step_seconds": total,
                          "relative_throughput": planner.none_step / total}
    for key, stages in (("per_stage", per_stage), ("per_layer", per_layer)):
        if any(x is None for x in stages):
            out[key] = {"stages": stages, "step_seconds": None, "gain": None,
                        "unfit_stages": [s for s, x in enumerate(stages) if x is None]}
            continue
        total = step([x["microbatch_seconds"] for x in stages])
        gain = None if out["uniform"] is None else out["uniform"]["step_seconds"] / total - 1
        out[key] = {"stages": stages, "step_seconds": total, "relative_throughput": planner.none_step / total, "gain": gain}
    out["megatron"] = _megatron_note(out, uniform)
    return out


def _megatron_note(out: dict[str, Any], uniform: dict[str, Any] | None) -> str:
    """Whether Megatron can run the per-layer plan, and what to run instead."""
    layer = out["per_layer"]
    instead = (f"run the best uniform setting instead: {uniform['label']} ("
               + (" ".join(megatron_flags(RecomputeConfig(**uniform["recompute"]))) or "no recompute flags") + ")"
               if uniform else "no uniform setting fits")
    if layer is None or layer["step_seconds"] is None:
        return f"no per-layer policy fits either; {instead}"
    settings = {x.get("megatron_setting") for x in layer["stages"]}
    if len(settings) == 1 and None not in settings:
        return f"Megatron runs this per-layer plan as {settings.pop()} on every stage"
    return ("Megatron cannot run it: it applies one recompute setting to every layer of every model chunk on every "
            f"pipeline stage (TransformerConfig.recompute_*); {instead}")
