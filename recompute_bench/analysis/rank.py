"""The whole rank: parameters times the layout's bytes per parameter and what FSDP unshards, the
activations of the micro-batches a pipeline stage holds in flight, the backward transient, the
optimizer step's peak, the allocator allowance on top, and the estimate `run` stores beside each
measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recompute_bench.analysis import flops
from recompute_bench.analysis.layer import kind_config, layer_parameters, layer_workspace_bytes
from recompute_bench.analysis.schedule import chunk_forwards_in_flight, schedule_peak
from recompute_bench.analysis.stage import (StageActivations, activation_bytes, embedding_saved_bytes,
                                            loss_saved_bytes, loss_workspace_bytes, outside_parameters,
                                            stage_activations, stage_parameters, token_bytes)
from recompute_bench.models import ELEMENT_BYTES, FP32_BYTES
from recompute_bench.spec.config import Config


ALLOWANCE_FRACTION = 0.10
"""Allocator allowance: reserved minus allocated (fragmentation of the caching allocator), as a
fraction of the estimated allocated peak."""
ALLOWANCE_BYTES = 2**30
"""Fixed allowance: CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers, which
`torch.cuda.max_memory_allocated` does not show but the device must hold."""


@dataclass(frozen=True)
class Held:
    """One buffer a rank holds for each of its parameters, as `estimate` names it."""

    name: str
    per_parameter: float
    """Bytes per parameter of the rank (its tensor-parallel shard of the model)."""
    backward: bool = True
    """Held at the backward peak."""
    step: bool = True
    """Held during the optimizer step."""
    state: bool = False
    """Optimizer state that host memory could hold instead (the planner's offload line)."""


def is_fsdp(cfg: Config) -> bool:
    """Whether cfg's data-parallel ranks run FSDP2: `run` records `--data-parallel fsdp` as
    `use_distributed_optimizer` (and refuses it with DDP), so in this harness a distributed optimizer
    is FSDP's; under framework megatron it is Megatron's."""
    par = cfg.parallel
    return cfg.training.framework == "recompute-bench" and par.data_parallel_size > 1 and par.use_distributed_optimizer


def optimizer_bytes_per_parameter(cfg: Config) -> tuple[Held, ...]:
    """The buffers `measure`'s layout of cfg holds per parameter, only those it has (the tests read
    them back from the live objects of every layout on gloo ranks: tests/test_optimizer_bytes.py).

    One rank, DDP (expert parallel included) and tensor parallel alone run Megatron's scheme
    (`measure.point.MainGradAdam`): weights in the training precision, an fp32 main gradient each
    gradient is added into and freed, which DDP all-reduces in place (no bucket copy); under
    bf16/fp16 fp32 master weights; Adam's two fp32 moments: 2 + 4 + 4 + 8 = 18 bytes, 16 in fp32.
    Megatron's own distributed optimizer (framework megatron) shards the master weights and moments
    over dp and keeps the whole gradient buffer: 6 + 12/dp.

    FSDP2 (`measure.distributed`) shards fp32 weights, fp32 gradients (from the reduce-scatter to the
    step) and the moments over dp: 16/dp. With more than one micro-batch per rank it reduce-scatters
    only in the last one; until then it keeps every layer's unsharded gradient in the fp32 reduce
    dtype (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, `to_accumulated_grad_if_needed`): 4
    bytes per parameter, unsharded, through the backward. What FSDP unshards for compute is
    `fsdp_unsharded_bytes`."""
    dp = cfg.parallel.data_parallel_size
    if is_fsdp(cfg):
        held = [Held("weights (fp32 shards)", 4 / dp, state=True),
                Held("gradients (fp32 shards, reduce-scattered)", 4 / dp, backward=False, state=True),
                Held("Adam moments (fp32 shards)", 8 / dp, state=True)]
        if cfg.num_microbatches > 1:
            held.append(Held("gradients (fp32, unsharded, accumulated over micro-batches)", FP32_BYTES, step=False))
        return tuple(held)
    precision = cfg.training.precision
    sharded = dp > 1 and cfg.parallel.use_distributed_optimizer  # Megatron's distributed optimizer
    shards, where = (dp, " shards") if sharded else (1, "")
    held = [Held(f"weights ({precision})", ELEMENT_BYTES[precision]), Held("main gradients (fp32)", FP32_BYTES)]
    if precision != "fp32":
        held.append(Held(f"master weights (fp32{where})", FP32_BYTES / shards, state=True))
    return (*held, Held(f"Adam moments (fp32{where})", 2 * FP32_BYTES / shards, state=True))


OUTSIDE_WEIGHTS = "FSDP: all-gathered weights outside the layers"
OUTSIDE_GRADS = "FSDP: unsharded gradients outside the layers"
LAYER_WEIGHTS = "FSDP: all-gathered weights of two layers (in backward, prefetched)"
LAYER_GRADS = "FSDP: a layer's unsharded gradients and fp32 reduce-scatter input"


def fsdp_unsharded_bytes(cfg: Config, stage: int = 0) -> dict[str, float]:
    """What FSDP2 holds unsharded in a backward, beyond `optimizer_bytes_per_parameter`, in the
    training precision (`MixedPrecisionPolicy.param_dtype`); nothing for other layouts. Throughout:
    the root's all-gathered weights (everything outside the layers: the root does not reshard after
    forward, torch/distributed/fsdp/_fully_shard/_fsdp_state.py `FSDPState._lazy_init`) and their
    unsharded gradients (from the output layer's backward to the root's reduce-scatter at the end).
    In a layer's backward, for the largest layer: its all-gathered weights and the previous layer's,
    prefetched (`_fsdp_param_group.py`, `FSDPParamGroup._backward_prefetch`), and its unsharded
    gradients with the fp32 reduce-scatter input they are copied into (`_fsdp_collectives.py`,
    `foreach_reduce`)."""
    if not is_fsdp(cfg):
        return {}
    e = ELEMENT_BYTES[cfg.training.precision]
    kinds = ("dense", "moe") if cfg.model.num_moe_experts else ("dense",)
    layer = max(sum(layer_parameters(kind_config(cfg, kind)).values()) for kind in kinds)
    outside = outside_parameters(cfg, stage)
    return {OUTSIDE_WEIGHTS: e * outside, OUTSIDE_GRADS: e * outside,
            LAYER_WEIGHTS: 2 * e * layer, LAYER_GRADS: (e + FP32_BYTES) * layer}


def microbatches_in_flight(cfg: Config, stage: int = 0) -> float:
    """Micro-batches' worth of a stage's layers it holds at once: the model-chunk forwards waiting
    for their backward (`schedule.chunk_forwards_in_flight`, Megatron's schedules) over the chunks
    per rank. 1F1B: stage i holds min(n, p - i). Interleaved with m chunks per rank, the first stage
    holds p + (p - 1)/m (the paper's p (1 + (p - 1)/(p m))) and the last ((m - 1) p + 1)/m, not 1."""
    return chunk_forwards_in_flight(cfg, stage) / (cfg.parallel.virtual_pipeline_model_parallel_size or 1)


@dataclass


class RankMemory:
    """The estimated peak of one pipeline stage's rank, item by item (bytes)."""

    stage: int
    parameters: float
    items: dict[str, float] = field(default_factory=dict)
    """Held at the backward peak, in print order."""
    optimizer_step_bytes: float = 0.0
    """Peak during the optimizer step (no activations then)."""

    @property
    def backward_peak_bytes(self) -> float:
        return sum(self.items.values())

    @property
    def peak_allocated_bytes(self) -> float:
        """What torch.cuda.max_memory_allocated should show."""
        return max(self.backward_peak_bytes, self.optimizer_step_bytes)

    @property
    def phase(self) -> str:
        return "backward" if self.backward_peak_bytes >= self.optimizer_step_bytes else "optimizer step"


def rank_memory(cfg: Config, stage: int = 0, device: str = "cuda", acts: StageActivations | None = None) -> RankMemory:
    """Peak allocated bytes of one rank of pipeline stage `stage` under cfg (the layout's weights,
    gradients and optimizer state, what FSDP unshards, in-flight activations, embedding/loss buffers,
    transient workspaces); `acts` replaces the stage's activations under cfg.recompute (the
    planner's candidate policies). Only the items the layout has are listed. The activations follow
    the stage's schedule (`schedule.schedule_peak`): each model chunk's forward holds its share of the
    stage's activations (the first chunk of the first stage its embedding's, the last chunk of the
    last stage its loss's) until its backward."""
    par = cfg.parallel
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    params = stage_parameters(cfg, stage)
    held = optimizer_bytes_per_parameter(cfg)
    unsharded = fsdp_unsharded_bytes(cfg, stage)
    acts = acts or stage_activations(cfg, device)
    first, last = stage == 0, stage == p - 1
    emb = sum(embedding_saved_bytes(cfg).values())
    loss = sum(loss_saved_bytes(cfg, device).values())
    tokens = token_bytes(cfg) if first or last else 0.0
    chunk = acts.stored_bytes / vp
    rebuilt = acts.peak_bytes - acts.stored_bytes  # what a chunk's backward rebuilds over what it keeps
    layer_window = unsharded.get(LAYER_WEIGHTS, 0.0) + unsharded.get(LAYER_GRADS, 0.0)

    def embeds(c: int) -> bool:
        return first and c == 0

    def loses(c: int) -> bool:
        return last and c == vp - 1

    def stored(c: int) -> float:
        return chunk + (emb if embeds(c) else 0.0) + (loss if loses(c) else 0.0)

    # The micro-batch in backward: first the loss's backward (all its layers still stored), then the
    # layers' backward, where full recompute rebuilds a chunk (and FSDP unshards a layer).
    def at_loss(c: int) -> float:
        return loss_workspace_bytes(cfg) if loses(c) else 0.0

    def in_layers(c: int) -> float:
        return rebuilt + layer_workspace_bytes(cfg, device) - (loss if loses(c) else 0.0)

    peak = schedule_peak(cfg, stage, stored, lambda c: max(at_loss(c), in_layers(c) + layer_window))
    items = {h.name: h.per_parameter * params for h in held if h.backward}
    items.update({name: unsharded[name] for name in (OUTSIDE_WEIGHTS, OUTSIDE_GRADS) if name in unsharded})
    items.update({
        "token ids (all micro-batches of the step)": tokens,
        "activations of the other in-flight micro-batches": peak.others,
        "activations of the micro-batch in backward (stored)": peak.own,
    })
    if peak.kind == "F":  # no backward beyond the stored activations has peaked yet
        items["backward transient (recompute, loss, gradients)"] = 0.0
    elif in_layers(peak.chunk) + layer_window >= at_loss(peak.chunk):
        items["backward transient (recompute, loss, gradients)"] = in_layers(peak.chunk)
        items.update({name: unsharded[name] for name in (LAYER_WEIGHTS, LAYER_GRADS) if name in unsharded})
    else:
        items["backward transient (recompute, loss, gradients)"] = at_loss(peak.chunk)
    items = {name: value for name, value in items.items() if value}
    step = sum(h.per_parameter for h in held if h.step) * params + tokens
    return RankMemory(stage=stage, parameters=params, items=items, optimizer_step_bytes=step)


def stage_memories(cfg: Config, device: str = "cuda", acts: StageActivations | None = None) -> list[RankMemory]:
    """`rank_memory` of every pipeline stage, first to last."""
    return [rank_memory(cfg, r, device, acts) for r in range(cfg.parallel.pipeline_model_parallel_size)]


def peak_rank_memory(cfg: Config, device: str = "cuda", acts: StageActivations | None = None) -> RankMemory:
    """The most loaded rank of all the pipeline stages (the first holds the most micro-batches in
    flight and the embedding; the last the loss and, interleaved, (m - 1) p + 1 chunks)."""
    return max(stage_memories(cfg, device, acts), key=lambda r: r.peak_allocated_bytes)


def device_bytes_needed(peak_allocated: float, allowance_fraction: float = ALLOWANCE_FRACTION,
                        allowance_bytes: float = ALLOWANCE_BYTES) -> float:
    """Device memory a rank needs: the allocated peak plus the stated allocator allowance."""
    return peak_allocated * (1 + allowance_fraction) + allowance_bytes


def record_estimate(cfg: Config, device: str) -> dict[str, float]:
    """The estimate `run` stores next to each measurement (single rank, no model parallelism)."""
    acts = activation_bytes(cfg, device)
    return {
        "estimated_activation_bytes": acts["activation_bytes"],
        "estimated_activation_bytes_per_layer": acts["activation_bytes_per_layer"],
        "estimated_hardware_flops_per_step": flops.hardware_flops_per_step(cfg, device),
        "estimated_peak_allocated_bytes": peak_rank_memory(cfg, device).peak_allocated_bytes,
    }
