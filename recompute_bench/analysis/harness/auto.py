"""`plan --auto`: the per-layer recompute policy with the least recompute work that fits a budget.

Each layer of a pipeline stage takes one choice: keep everything (none), recompute any selective
subset of the targets its kind has (a dense layer: core_attn, mlp, layernorm; a mixture-of-experts
layer: core_attn, layernorm, moe, moe_act, shared_experts), be checkpointed whole as part of a
full-recompute chunk of consecutive layers, or (CUDA, with measured costs) offload its activations
to host memory. Dense and MoE layers (`moe_layer_freq` > 1) keep different bytes and cost
different time, so every figure is the layer's kind's (`layer.kind_config`), never a mean.

Costs (`FlopCosts`, `profile.ProfileCosts`): saved bytes always come from the analytical model
(`stage.policy_activations`, exact to the byte on CPU); the recompute cost of a choice is either
the forward FLOPs it runs again (one rate for every op, so time scales with FLOPs) or, with a
measured profile (`--profile`), the median measured forward time of the modules it re-runs. At
equal cost the policy that recomputes fewer modules wins (`layernorm` adds no FLOPs but costs
memory-bound time). Offload costs host-link time, which FLOPs cannot price, so it is a choice only
with a profile measured on CUDA (see `profile.offload_seconds` for the model).

With pipeline stages each stage is solved on its own (its layers, its in-flight micro-batches).
The constraint is the stage's whole-rank peak (`rank.rank_memory` with the candidate's activations:
in-flight micro-batches, the loss, the recompute working set), which grows with both the stage's
stored bytes and its backward peak. So the solver is an exact dynamic programme over layers whose
state is (stored bytes so far, largest backward peak so far, largest offloaded layer so far): a
choice for layer i (or a chunk starting at i) adds to the stored bytes and may raise the peak;
states another state beats on every coordinate and cost are dropped, and states that already
cannot fit are cut. Byte values are kept exactly (no buckets), so the result is optimal for the
model, with no gap to report; layers with the same choice have the same bytes, which keeps the
frontier small (a few thousand states for 32 layers). Pure Python.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from recompute_bench.analysis import flops
from recompute_bench.analysis.allowance import ALLOWANCE_BYTES, ALLOWANCE_FRACTION, device_bytes_needed
from recompute_bench.analysis.checkpoint import checkpoint_input_bytes
from recompute_bench.analysis.harness.layer import layer_activation_bytes
from recompute_bench.analysis.harness.planner import plan, setting_estimate
from recompute_bench.analysis.harness.rank import microbatches_in_flight, rank_memory
from recompute_bench.analysis.harness.stage import StageActivations
from recompute_bench.config.schema import BadInput, Config, RecomputeConfig
from recompute_bench.models import device_kind, kind_config
from recompute_bench.recompute.policy import (LayerPolicy, kind_targets, layer_kind, layer_policies, megatron_flags,
                                              megatron_setting)

AUTO_SCHEMA = "recompute-bench/plan-auto/v3"  # v3: `stages`, `megatron`; costs summed over the stages
Cost = tuple[float, int]
"""(recompute cost per micro-batch in the costs' unit, selective modules recomputed): compared in order."""


class Costs(Protocol):
    """What re-running part of a layer of one kind costs, in one unit (`unit`)."""

    unit: str
    offload_note: str
    """Why offload is or is not a choice, in one line for the output."""

    def selective(self, kind: str, modules: frozenset[str]) -> float: ...
    def full(self, kind: str) -> float: ...
    def offload(self, kind: str, nbytes: float) -> float | None:
        """The added time of offloading `nbytes` of a layer of `kind`, or None: not a choice."""


class FlopCosts:
    """Analytical costs: the forward FLOPs a choice runs again (`flops.policy_recompute_flops`)."""

    unit = "recomputed FLOPs"

    def __init__(self, cfg: Config, device: str = "cuda"):
        self.cfg, self.device = cfg, device
        self.offload_note = ("offload is not a choice on a CPU (CUDA only)" if device_kind(device) == "cpu" else
                             "offload is not a choice with analytical costs (its cost is host-link time, which FLOPs "
                             "do not price); pass --profile on the CUDA device to weigh it")

    def _flops(self, kind: str, policy: LayerPolicy) -> float:
        index = next(i for i in range(self.cfg.model.num_layers) if layer_kind(self.cfg.model, i) == kind)
        return flops.policy_recompute_flops(self.cfg, [policy], None, self.device, first=index)

    def selective(self, kind: str, modules: frozenset[str]) -> float:
        return self._flops(kind, LayerPolicy(modules=modules))

    def full(self, kind: str) -> float:
        return self._flops(kind, LayerPolicy(chunk=0))

    def offload(self, kind: str, nbytes: float) -> float | None:
        return None


@dataclass(frozen=True)
class Choice:
    """One way to run a single layer that is not checkpointed whole."""

    policy: LayerPolicy
    stored_bytes: float
    cost: Cost
    brought_bytes: float = 0.0
    """Offload: the layer's activations, brought back to the device in backward."""


def choices(cfg: Config, kind: str, costs: Costs, device: str = "cuda") -> list[Choice]:
    """For a layer of `kind`: none, every selective subset of the targets it has and (where the
    costs price it and there is one pipeline stage, Megatron's rule) offload, without those another
    choice beats on bytes and cost (they can never be part of a best policy)."""
    targets = kind_targets(cfg.spec.recompute_targets, kind)
    c = kind_config(cfg, kind)
    out = []
    for modules in (frozenset(x) for n in range(len(targets) + 1) for x in itertools.combinations(targets, n)):
        out.append(Choice(LayerPolicy(modules=modules), layer_activation_bytes(c, modules, device),
                          (costs.selective(kind, modules) if modules else 0.0, len(modules))))
    full = layer_activation_bytes(c, (), device)
    offload = costs.offload(kind, full) if cfg.parallel.pipeline_model_parallel_size == 1 else None
    if offload is not None:
        out.append(Choice(LayerPolicy(offload=True), 0.0, (offload, 0), full))
    return [x for x in out if not any(_beats(y, x) for y in out)]


def _beats(a: Choice, b: Choice) -> bool:
    mine, theirs = (a.stored_bytes, a.brought_bytes, a.cost), (b.stored_bytes, b.brought_bytes, b.cost)
    return mine != theirs and all(x <= y for x, y in zip(mine, theirs))


def _add(a: Cost, b: Cost) -> Cost:
    return a[0] + b[0], a[1] + b[1]


def solve(cfg: Config, layers: int, fits: Callable[[StageActivations], bool],
          device: str = "cuda", costs: Costs | None = None, first: int = 0) -> list[LayerPolicy] | None:
    """The cheapest policy list for the `layers` layers from model layer `first` (a pipeline
    stage's) whose stage activations `fits` accepts, or None. `fits` must be monotone: if it accepts
    (stored, peak) it accepts anything no larger. `costs`: FlopCosts(cfg, device) unless given."""
    costs = costs or FlopCosts(cfg, device)
    kinds = [layer_kind(cfg.model, first + i) for i in range(layers)]
    options = {k: choices(cfg, k, costs, device) for k in set(kinds)}
    full_bytes = {k: layer_activation_bytes(kind_config(cfg, k), (), device) for k in set(kinds)}
    full_cost = {k: (costs.full(k), len(cfg.spec.recompute_targets) + 1) for k in set(kinds)}
    ckpt = checkpoint_input_bytes(cfg)
    # frontier[i]: (stored, peak, brought) -> (cost, previous state key, previous i, step taken) after i layers
    frontier: list[dict[tuple[float, float, float], tuple]] = [dict() for _ in range(layers + 1)]
    frontier[0][(0.0, 0.0, 0.0)] = ((0.0, 0), None, None, None)

    fitting: dict[tuple[float, float, float], bool] = {}

    def offer(i: int, key: tuple[float, float, float], entry: tuple) -> None:
        if key not in fitting:
            fitting[key] = fits(StageActivations(layers, key[0], max(key[1], key[0] + key[2])))
        if not fitting[key]:
            return
        old = frontier[i].get(key)
        if old is None or entry[0] < old[0]:
            frontier[i][key] = entry

    for i in range(layers):
        for key, (cost, *_rest) in _pareto(frontier[i]).items():
            stored, peak, brought = key
            for c in options[kinds[i]]:
                offer(i + 1, (stored + c.stored_bytes, peak, max(brought, c.brought_bytes)),
                      (_add(cost, c.cost), key, i, c.policy))
            chunk_bytes, step = 0.0, (0.0, 0)
            for k in range(1, layers - i + 1):
                chunk_bytes += full_bytes[kinds[i + k - 1]]
                step = _add(step, full_cost[kinds[i + k - 1]])
                offer(i + k, (stored + ckpt, max(peak, stored + chunk_bytes), brought), (_add(cost, step), key, i, k))
    final = frontier[layers]
    if not final:
        return None
    key = min(final, key=lambda k: (final[k][0], max(k[1], k[0] + k[2]), k[0]))
    return _walk_back(frontier, layers, key)


def _pareto(states: dict[tuple[float, float, float], tuple]) -> dict[tuple[float, float, float], tuple]:
    """The states no other state with the same brought-back bytes beats on stored bytes, peak and
    cost at once (brought-back bytes take a few values: none, or one layer kind's)."""
    kept: dict[tuple[float, float, float], tuple] = {}
    for brought in {k[2] for k in states}:
        kept |= _pareto2({k: v for k, v in states.items() if k[2] == brought})
    return kept


def _pareto2(states: dict[tuple, tuple]) -> dict[tuple, tuple]:
    """The states no other state beats on stored bytes, peak and cost at once. Taken in order of
    stored bytes, a state is beaten when one kept before it has no higher peak and no higher cost:
    a Fenwick tree over the peaks answers the least cost kept at or below a peak."""
    peaks = sorted({k[1] for k in states})
    rank = {p: i + 1 for i, p in enumerate(peaks)}
    tree: list[Any] = [None] * (len(peaks) + 1)
    kept = {}
    for key, entry in sorted(states.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[1][0])):
        i, best = rank[key[1]], None
        while i:
            if tree[i] is not None and (best is None or tree[i] < best):
                best = tree[i]
            i -= i & -i
        if best is not None and best <= entry[0]:
            continue
        kept[key] = entry
        i = rank[key[1]]
        while i <= len(peaks):
            if tree[i] is None or entry[0] < tree[i]:
                tree[i] = entry[0]
            i += i & -i
    return kept


def _walk_back(frontier: list[dict], i: int, key: tuple[float, float, float]) -> list[LayerPolicy]:
    steps = []
    while i:
        _cost, prev_key, prev_i, step = frontier[i][key]
        steps.append(step)
        key, i = prev_key, prev_i
    out: list[LayerPolicy] = []
    chunk = 0
    for step in reversed(steps):
        if isinstance(step, int):
            out += [LayerPolicy(chunk=chunk)] * step
            chunk += 1
        else:
            out.append(step)
    return out


def stage_policy_config(cfg: Config, stages: list[list[LayerPolicy]]) -> Config:
    """cfg running `stages[s]`'s policy in pipeline stage s (chunk numbers kept apart per stage)."""
    entries, offset = [], 0
    for stage in stages:
        entries += [dataclasses.replace(x, chunk=None if x.chunk is None else x.chunk + offset).entry for x in stage]
        offset += 1 + max((x.chunk for x in stage if x.chunk is not None), default=-1)
    return dataclasses.replace(cfg, recompute=RecomputeConfig(layer_policy=entries))


def stage_peaks(cfg: Config, device: str = "cuda") -> list[Callable[[StageActivations], float]]:
    """Per pipeline stage s, `rank.rank_memory(cfg, s, device, acts).peak_allocated_bytes` as a
    function of the stage's activations, read off the rank model once. It is (f - 1) S + max(S + a,
    P + b) in the backward (f micro-batches in flight on stage s, S stored, P the backward peak, a
    and b what the loss and the layers' workspaces add), or the optimizer step's peak, which
    activations do not touch."""
    far = 2.0**40  # a stored or peak size that dominates its max(), exact in float arithmetic
    out = []
    for stage in range(cfg.parallel.pipeline_model_parallel_size):
        def backward(stored: float, peak: float, stage: int = stage) -> float:
            return rank_memory(cfg, stage, device, StageActivations(1, stored, peak)).backward_peak_bytes
        f = microbatches_in_flight(cfg, stage)
        step = rank_memory(cfg, stage, device).optimizer_step_bytes
        a, b = backward(far, 0.0) - f * far, backward(0.0, far) - far

        def peak(acts: StageActivations, f: float = f, a: float = a, b: float = b, step: float = step) -> float:
            s, q = acts.stored_bytes, acts.peak_bytes
            return max((f - 1) * s + max(s + a, q + b), step)
        out.append(peak)
    return out


def policy_cost(cfg: Config, policies: list[LayerPolicy], costs: Costs, device: str = "cuda", first: int = 0) -> float:
    """What `policies` (layers from model layer `first`) cost in `costs`' unit per micro-batch: the
    solver's objective."""
    total = 0.0
    for i, p in enumerate(policies):
        kind = layer_kind(cfg.model, first + i)
        if p.chunk is not None:
            total += costs.full(kind)
        elif p.offload:
            total += costs.offload(kind, layer_activation_bytes(kind_config(cfg, kind), (), device)) or 0.0
        elif p.modules:
            total += costs.selective(kind, p.modules)
    return total


def auto_plan(cfg: Config, budget_bytes: float, device: str = "cuda",
              allowance_fraction: float = ALLOWANCE_FRACTION,
              allowance_bytes: float = ALLOWANCE_BYTES, costs: Costs | None = None) -> dict[str, Any]:
    """The cheapest per-layer policy of each pipeline stage whose whole-rank need (allocated peak
    plus the allowance) fits `budget_bytes` against that stage's own in-flight micro-batches, its
    predicted figures stage by stage, how Megatron can run it (`megatron`), and beside it
    `memory.plan`'s best uniform setting (one for every stage, its peak the most loaded stage's),
    both priced by `costs` (analytical FLOPs unless given) summed over the model's layers. Each
    stage at its own least cost also makes the costliest stage, which paces the pipeline, least."""
    if cfg.parallel.virtual_pipeline_model_parallel_size:
        raise BadInput("plan --auto plans one model chunk per pipeline stage; drop "
                          "--set parallel.virtual_pipeline_model_parallel_size")
    costs = costs or FlopCosts(cfg, device)
    p = cfg.parallel.pipeline_model_parallel_size
    layers = cfg.model.num_layers // p
    targets = cfg.spec.recompute_targets
    base = dataclasses.replace(cfg, recompute=RecomputeConfig())

    def fitting(peak: Callable[[StageActivations], float]) -> Callable[[StageActivations], bool]:
        return lambda acts: device_bytes_needed(peak(acts), allowance_fraction, allowance_bytes) <= budget_bytes

    stages = [solve(cfg, layers, fitting(peak), device, costs, s * layers) for s, peak in enumerate(stage_peaks(base, device))]
    uniform = plan(cfg, budget_bytes, device, allowance_fraction, allowance_bytes)
    for row in uniform["fits"]:
        r = RecomputeConfig(**row["recompute"])
        row["recompute_cost"] = sum(policy_cost(cfg, layer_policies(r, layers), costs, device, s * layers) for s in range(p))
    # the cheapest fitting uniform setting by the same costs (measured ones may order them otherwise)
    best = min(uniform["fits"], key=lambda row: row["recompute_cost"]) if uniform["fits"] else None
    out: dict[str, Any] = {"schema": AUTO_SCHEMA, "workload": cfg.workload, "config": cfg.to_dict(),
                           "device": device_kind(device), "budget_bytes": budget_bytes,
                           "allowance": {"fraction": allowance_fraction, "bytes": allowance_bytes},
                           "solver": "exact dynamic programme over layers x (stored, peak, brought-back) bytes"
                                     + (", per pipeline stage" if p > 1 else ""),
                           "costs": costs.unit, "offload": costs.offload_note if p == 1
                           else "offload is not a choice with pipeline parallelism (Megatron's rule)",
                           "layer_kinds": [layer_kind(cfg.model, i) for i in range(cfg.model.num_layers)],
                           "policy": None, "predicted": None, "stages": None, "megatron": None, "uniform": best,
                           "unfit_stages": [s for s, stage in enumerate(stages) if stage is None],
                           "reason": uniform["reason"], "would_fit": uniform["would_fit"]}
    if out["unfit_stages"]:
        return out
    chosen = stage_policy_config(cfg, stages)
    row = setting_estimate(chosen, device)
    row["device_bytes_needed"] = device_bytes_needed(row["peak_allocated_bytes"], allowance_fraction, allowance_bytes)
    row["recompute_cost"] = sum(policy_cost(cfg, stage, costs, device, s * layers) for s, stage in enumerate(stages))
    settings = [megatron_setting(cfg.model, stage, targets, s * layers) for s, stage in enumerate(stages)]
    out["policy"] = chosen.recompute.layer_policy
    out["predicted"] = row
    out["stages"] = []
    for s, stage in enumerate(stages):
        peak = rank_memory(chosen, s, device).peak_allocated_bytes
        out["stages"].append({"stage": s, "layers": [s * layers, (s + 1) * layers - 1],
                              "microbatches_in_flight": microbatches_in_flight(cfg, s),
                              "policy": [x.entry for x in stage], "label": RecomputeConfig(layer_policy=[x.entry for x in stage]).label,
                              "megatron_setting": None if settings[s] is None else settings[s].label,
                              "peak_allocated_bytes": peak,
                              "device_bytes_needed": device_bytes_needed(peak, allowance_fraction, allowance_bytes),
                              "recompute_cost": policy_cost(cfg, stage, costs, device, s * layers)})
    out["megatron"] = megatron_run(settings, best)
    return out


def megatron_run(settings: list[RecomputeConfig | None], uniform: dict[str, Any] | None) -> dict[str, Any]:
    """How Megatron-LM runs a plan whose stages run `settings` (each stage's policy as one Megatron
    setting, None where it is a mix no setting expresses): Megatron reads one recompute setting for
    every pipeline stage (`TransformerConfig.recompute_*`, applied per model chunk in
    `TransformerBlock._checkpointed_forward`), so only a plan whose stages all run the same setting
    has flags; otherwise why not, and the uniform setting `uniform` to run there instead."""
    instead = (f"; run the best uniform setting there instead ({uniform['label']}"
               + (": " + " ".join(uniform["megatron_flags"]) if uniform["megatron_flags"] else ", no recompute flags")
               + ")" if uniform else "; no uniform setting fits")
    mixed = [s for s, r in enumerate(settings) if r is None]
    if mixed:
        return {"runs": False, "setting": None, "flags": None,
                "note": f"Megatron cannot run this plan: {'it' if len(settings) == 1 else f'stage {mixed[0]}'} mixes "
                        f"choices layer by layer, which no Megatron setting expresses{instead}"}
    if all(r == settings[0] for r in settings):
        r = settings[0]
        return {"runs": True, "setting": r.label, "flags": megatron_flags(r),
                "note": f"Megatron runs this plan as {r.label}" + (" on every stage" if len(settings) > 1 else "")
                        + (": " + " ".join(megatron_flags(r)) if megatron_flags(r) else " (no recompute flags)")}
    per = ", ".join(f"stage {s} {r.label}" for s, r in enumerate(settings) if r is not None)
    return {"runs": False, "setting": None, "flags": None,
            "note": f"Megatron cannot run this plan: it applies one recompute setting to every pipeline stage, and "
                    f"this plan runs {per}{instead}"}
