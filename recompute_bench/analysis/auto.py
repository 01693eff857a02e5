"""`plan --auto`: the per-layer recompute policy with the least recompute work that fits a budget.

Each layer of a pipeline stage takes one choice: keep everything (none), recompute any selective
subset of the model's `recompute_targets`, or be checkpointed whole as part of a full-recompute
chunk of consecutive layers. Costs are the analytical model's: saved bytes from
`memory.policy_activations`, recompute work from `flops.policy_recompute_flops` (forward FLOPs run
again in backward; one rate for every op, so time scales with FLOPs). At equal FLOPs the policy that
recomputes fewer modules wins (`layernorm` adds no FLOPs but costs memory-bound time). Activation
offload is not a choice: its cost is host-link time, which FLOPs do not measure.

The constraint is the whole-rank peak (`memory.peak_rank_memory` with the candidate's activations:
in-flight micro-batches, the loss, the recompute working set), which grows with both the stage's
stored bytes and its backward peak. So the solver is an exact dynamic programme over layers whose
state is the pair (stored bytes so far, largest backward peak so far): a choice for layer i (or a
chunk starting at i) adds to the stored bytes and may raise the peak; states another state beats on
stored bytes, peak and cost are dropped, and states that already cannot fit are cut. Byte values
are kept exactly (no buckets), so the result is optimal for the model, with no gap to report;
layers with the same choice have the same bytes, which keeps the frontier small (a few thousand
states for 32 layers). Pure Python.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Callable

from recompute_bench.analysis import flops
from recompute_bench.analysis import memory as model
from recompute_bench.models import spec_for
from recompute_bench.recompute.policy import LayerPolicy
from recompute_bench.spec.config import Config, ConfigError, RecomputeConfig

AUTO_SCHEMA = "recompute-bench/plan-auto/v1"
Cost = tuple[float, int]
"""(forward FLOPs recomputed per micro-batch, selective modules recomputed): compared in order."""


@dataclass(frozen=True)
class Choice:
    """One way to run a single layer that is not checkpointed whole."""

    policy: LayerPolicy
    stored_bytes: float
    cost: Cost


def choices(cfg: Config, device: str = "cuda") -> list[Choice]:
    """none and every selective subset of the model's targets, without those another choice beats
    on both bytes and cost (they can never be part of a best policy)."""
    targets = spec_for(cfg.model).recompute_targets
    subsets = [frozenset(c) for n in range(len(targets) + 1) for c in itertools.combinations(targets, n)]
    out = []
    for modules in subsets:
        p = LayerPolicy(modules=modules)
        out.append(Choice(p, model.layer_activation_bytes(cfg, modules, device),
                          (flops.policy_recompute_flops(cfg, [p], None, device), len(modules))))
    return [c for c in out if not any(d.stored_bytes <= c.stored_bytes and d.cost <= c.cost
                                      and (d.stored_bytes, d.cost) != (c.stored_bytes, c.cost) for d in out)]


def _add(a: Cost, b: Cost) -> Cost:
    return a[0] + b[0], a[1] + b[1]


def solve(cfg: Config, layers: int, fits: Callable[[model.StageActivations], bool],
          device: str = "cuda") -> list[LayerPolicy] | None:
    """The cheapest policy list for `layers` layers whose stage activations `fits` accepts, or None.
    `fits` must be monotone: if it accepts (stored, peak) it accepts anything no larger."""
    options = choices(cfg, device)
    full = model.layer_activation_bytes(cfg, (), device)
    ckpt = model.checkpoint_input_bytes(cfg)
    layer_fwd = flops.policy_recompute_flops(cfg, [LayerPolicy(chunk=0)], None, device)
    full_work = len(spec_for(cfg.model).recompute_targets) + 1  # a whole layer: more than any subset
    # frontier[i]: (stored, peak) -> (cost, previous state key, previous i, step taken) after i layers
    frontier: list[dict[tuple[float, float], tuple]] = [dict() for _ in range(layers + 1)]
    frontier[0][(0.0, 0.0)] = ((0.0, 0), None, None, None)

    fitting: dict[tuple[float, float], bool] = {}

    def offer(i: int, key: tuple[float, float], entry: tuple) -> None:
        if key not in fitting:
            fitting[key] = fits(model.StageActivations(layers, key[0], max(key)))
        if not fitting[key]:
            return
        old = frontier[i].get(key)
        if old is None or entry[0] < old[0]:
            frontier[i][key] = entry

    for i in range(layers):
        for key, (cost, *_rest) in _pareto(frontier[i]).items():
            stored, peak = key
            for c in options:
                offer(i + 1, (stored + c.stored_bytes, peak), (_add(cost, c.cost), key, i, c.policy))
            for k in range(1, layers - i + 1):
                step = (k * layer_fwd, k * full_work)
                offer(i + k, (stored + ckpt, max(peak, stored + k * full)), (_add(cost, step), key, i, k))
    final = frontier[layers]
    if not final:
        return None
    key = min(final, key=lambda k: (final[k][0], max(k), k[0]))
    return _walk_back(frontier, layers, key)


def _pareto(states: dict[tuple[float, float], tuple]) -> dict[tuple[float, float], tuple]:
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


def _walk_back(frontier: list[dict], i: int, key: tuple[float, float]) -> list[LayerPolicy]:
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


def stage_policy_config(cfg: Config, stage: list[LayerPolicy]) -> Config:
    """cfg running `stage`'s policy in every pipeline stage (chunk numbers kept apart per stage)."""
    p = cfg.parallel.pipeline_model_parallel_size
    span = 1 + max((x.chunk for x in stage if x.chunk is not None), default=0)
    entries = [dataclasses.replace(x, chunk=None if x.chunk is None else x.chunk + s * span).entry
               for s in range(p) for x in stage]
    return dataclasses.replace(cfg, recompute=RecomputeConfig(layer_policy=entries))


def rank_peak(cfg: Config, device: str = "cuda") -> Callable[[model.StageActivations], float]:
    """`memory.peak_rank_memory(cfg, device, acts).peak_allocated_bytes` as a function of the
    stage's activations, read off the rank model once. Per stage it is (f - 1) S + max(S + a, P + b)
    in the backward (f micro-batches in flight, S stored, P the backward peak, a and b what the loss
    and the layers' workspaces add), or the optimizer step's peak, which activations do not touch."""
    p = cfg.parallel.pipeline_model_parallel_size
    far = 2.0**40  # a stored or peak size that dominates its max(), exact in float arithmetic
    terms = []
    for stage in sorted({0, p - 1}):
        def backward(stored: float, peak: float) -> float:
            acts = model.StageActivations(1, stored, peak)
            return model.rank_memory(cfg, stage, device, acts).backward_peak_bytes
        f = model.microbatches_in_flight(cfg, stage)
        step = model.rank_memory(cfg, stage, device).optimizer_step_bytes
        terms.append((f, backward(far, 0.0) - f * far, backward(0.0, far) - far, step))

    def peak(acts: model.StageActivations) -> float:
        s, q = acts.stored_bytes, acts.peak_bytes
        return max(max((f - 1) * s + max(s + a, q + b), step) for f, a, b, step in terms)

    return peak


def auto_plan(cfg: Config, budget_bytes: float, device: str = "cuda",
              allowance_fraction: float = model.ALLOWANCE_FRACTION,
              allowance_bytes: float = model.ALLOWANCE_BYTES) -> dict[str, Any]:
    """The cheapest per-layer policy whose whole-rank need (allocated peak plus the allowance) fits
    `budget_bytes`, its predicted figures, and beside it `memory.plan`'s best uniform setting."""
    if cfg.parallel.virtual_pipeline_model_parallel_size:
        raise ConfigError("plan --auto plans one model chunk per pipeline stage; drop "
                          "--set parallel.virtual_pipeline_model_parallel_size")
    layers = cfg.model.num_layers // cfg.parallel.pipeline_model_parallel_size
    base = dataclasses.replace(cfg, recompute=RecomputeConfig())

    peak = rank_peak(base, device)
    stage = solve(cfg, layers, lambda acts: model.device_bytes_needed(peak(acts), allowance_fraction,
                                                                      allowance_bytes) <= budget_bytes, device)
    uniform = model.plan(cfg, budget_bytes, device, allowance_fraction, allowance_bytes)
    out: dict[str, Any] = {"schema": AUTO_SCHEMA, "workload": cfg.workload, "config": cfg.to_dict(),
                           "device": model.device_kind(device), "budget_bytes": budget_bytes,
                           "allowance": {"fraction": allowance_fraction, "bytes": allowance_bytes},
                           "solver": "exact dynamic programme over layers x (stored, peak) bytes",
                           "policy": None, "predicted": None,
                           "uniform": uniform["fits"][0] if uniform["fits"] else None,
                           "reason": uniform["reason"], "would_fit": uniform["would_fit"]}
    if stage is None:
        return out
    chosen = stage_policy_config(cfg, stage)
    row = model.setting_estimate(chosen, device)
    row["device_bytes_needed"] = model.device_bytes_needed(row["peak_allocated_bytes"], allowance_fraction, allowance_bytes)
    out["policy"] = chosen.recompute.layer_policy
    out["predicted"] = row
    return out
