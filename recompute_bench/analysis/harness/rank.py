"""The whole rank: parameters times the layout's bytes per parameter and what FSDP unshards, the
activations of the micro-batches a pipeline stage holds in flight (its model chunks, walked through
its schedule's order), the backward transient, the optimizer step's peak, the allocator allowance on
top, and the estimate `run` stores beside each measurement (per pipeline stage too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from recompute_bench.analysis import flops
from recompute_bench.analysis.cuda_workspaces import DEFAULT_COMPUTE_CAPABILITY, torch_cublas_workspaces_bytes
from recompute_bench.analysis.harness.layer import layer_parameters, layer_workspace_bytes
from recompute_bench.analysis.harness.stage import (StageActivations, activation_bytes, embedding_saved_bytes,
                                                    loss_saved_bytes, loss_workspace_bytes, outside_parameters,
                                                    stage_activations, stage_parameters, token_bytes)
from recompute_bench.analysis.megatron_schedule import chunk_forwards_in_flight
from recompute_bench.analysis.pipelining_schedule import (Walk, bubble_fraction, peak_chunks, rank_actions,
                                                          rank_stages, walk)
from recompute_bench.config.schema import Config
from recompute_bench.models import ELEMENT_BYTES, FP32_BYTES, device_kind, kind_config
from recompute_bench.models.context_parallel import rank_seq_length


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
    return (cfg.training.framework == "recompute-bench" and par.data_parallel_size * par.context_parallel_size > 1
            and par.use_distributed_optimizer)


def optimizer_bytes_per_parameter(cfg: Config) -> tuple[Held, ...]:
    """The buffers `measure`'s layout of cfg holds per parameter, only those it has (the tests read
    them back from the live objects of every layout on gloo ranks: tests/test_optimizer_bytes.py).

    One rank, DDP (expert parallel included) and tensor parallel alone run Megatron's scheme
    (`measure.optimizer.MainGradAdam`): weights in the training precision, an fp32 main gradient each
    gradient is added into and freed, which DDP all-reduces in place (no bucket copy); under
    bf16/fp16 fp32 master weights; Adam's two fp32 moments: 2 + 4 + 4 + 8 = 18 bytes, 16 in fp32.
    Megatron's own distributed optimizer (framework megatron) shards the master weights and moments
    over dp and keeps the whole gradient buffer: 6 + 12/dp.

    FSDP2 (`measure.data_parallel`) shards fp32 weights, fp32 gradients (from the reduce-scatter to the
    step) and the moments over dp: 16/dp. With more than one micro-batch per rank it reduce-scatters
    only in the last one; until then it keeps every layer's unsharded gradient in the fp32 reduce
    dtype (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, `to_accumulated_grad_if_needed`): 4
    bytes per parameter, unsharded, through the backward. What FSDP unshards for compute is
    `fsdp_unsharded_bytes`."""
    dp = cfg.parallel.data_parallel_size
    if is_fsdp(cfg):
        dp *= cfg.parallel.context_parallel_size  # FSDP shards over dp x cp (`measure.context_parallel`)
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
STAGE_WEIGHTS = "FSDP: all-gathered weights of every layer (pipeline: not resharded after forward)"


def fsdp_unsharded_bytes(cfg: Config, stage: int = 0) -> dict[str, float]:
    """What FSDP2 holds unsharded in a backward, beyond `optimizer_bytes_per_parameter`, in the
    training precision (`MixedPrecisionPolicy.param_dtype`); nothing for other layouts. Throughout:
    the root's all-gathered weights (everything outside the layers: the root does not reshard after
    forward, torch/distributed/fsdp/_fully_shard/_fsdp_state.py `FSDPState._lazy_init`) and their
    unsharded gradients (from the output layer's backward to the root's reduce-scatter at the end).
    In a layer's backward, for the largest layer: its all-gathered weights and the previous layer's,
    prefetched (`_fsdp_param_group.py`, `FSDPParamGroup._backward_prefetch`), and its unsharded
    gradients with the fp32 reduce-scatter input they are copied into (`_fsdp_collectives.py`,
    `foreach_reduce`). Under pipeline parallelism no layer reshards after its forward
    (`measure.pipeline`, as torchtitan runs FSDP with pp): every layer's weights stay all-gathered
    from the step's first forward to its end, in place of the two-layer window."""
    if not is_fsdp(cfg):
        return {}
    e = ELEMENT_BYTES[cfg.training.precision]
    kinds = ("dense", "moe") if cfg.model.num_moe_experts else ("dense",)
    layer = max(sum(layer_parameters(kind_config(cfg, kind)).values()) for kind in kinds)
    outside = outside_parameters(cfg, stage)
    out = {OUTSIDE_WEIGHTS: e * outside, OUTSIDE_GRADS: e * outside}
    if cfg.parallel.pipeline_model_parallel_size > 1:
        out[STAGE_WEIGHTS] = e * (stage_parameters(cfg, stage) - outside)
    else:
        out[LAYER_WEIGHTS] = 2 * e * layer
    out[LAYER_GRADS] = (e + FP32_BYTES) * layer
    return out


def chunks_in_flight(cfg: Config, stage: int = 0) -> int:
    """Model-chunk forwards whose activations pipeline rank `stage` holds at once. For Megatron's
    schedules, its warm-up plus the steady state's one forward before its backward
    (megatron/core/pipeline_parallel/schedules.py, `get_pp_rank_microbatches`): without virtual
    stages (1F1B) p - r - 1 warm-up forwards, so p - r micro-batches; interleaved with vp model
    chunks per rank, 2 (p - r - 1) + (vp - 1) p warm-up chunk-forwards (the micro-batch group per
    virtual stage is p, Megatron's default), so 2 (p - r - 1) + (vp - 1) p + 1 chunks. Either is
    capped by the step's chunk-forwards, the micro-batches times vp (all of them in warm-up). Other
    schedules (GPipe: all of them; the zero-bubble ones) by their order (`schedules.peak_chunks`)."""
    par = cfg.parallel
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    if p == 1:
        return vp  # no pipeline: one micro-batch through every layer
    if par.schedule in ("1F1B", "Interleaved1F1B"):  # Megatron's order (`schedule.chunk_forwards_in_flight`)
        return chunk_forwards_in_flight(cfg, stage)
    return sum(peak_chunks(rank_actions(par.schedule, p, vp, cfg.num_microbatches, stage)).values())


def microbatches_in_flight(cfg: Config, stage: int = 0) -> float:
    """Micro-batches' worth of its layers that pipeline rank `stage` holds at once: `chunks_in_flight`
    over the model chunks per rank. 1F1B: stage r holds p - r; interleaved, the first stage
    2 (p - 1) + (vp - 1) p + 1 chunks, p (1 + (p - 1)/(p vp)) micro-batches (the paper's factor),
    the last (vp - 1) p + 1 chunks, not one micro-batch."""
    return chunks_in_flight(cfg, stage) / (cfg.parallel.virtual_pipeline_model_parallel_size or 1)


@dataclass(frozen=True)
class ModelChunk:
    """One model chunk a pipeline rank holds (a virtual stage: the whole stage without virtual
    stages) and what one micro-batch saves in it."""

    virtual_stage: int
    first_layer: int
    layers: StageActivations
    embedding_bytes: float = 0.0
    """Saved by the embedding (the first virtual stage only)."""
    loss_bytes: float = 0.0
    """Saved by the final norm, the output layer and the loss (the last virtual stage only)."""
    loss_function_bytes: float = 0.0
    """Of `loss_bytes`, what the loss function itself saves (below the logits)."""
    at_loss_bytes: float = 0.0
    """Held in the loss's backward (the last virtual stage): all its layers' activations still stored."""
    in_layers_bytes: float = 0.0
    """Held at worst in its layers' backward (full recompute rebuilds a chunk there)."""
    window_bytes: float = 0.0
    """What FSDP unshards on top while a layer runs its backward."""

    @property
    def stored_bytes(self) -> float:
        """Kept from this chunk's forward of a micro-batch until its backward."""
        return self.layers.stored_bytes + self.embedding_bytes + self.loss_bytes

    @property
    def transient_bytes(self) -> float:
        """Held on top of `stored_bytes` while this chunk runs a micro-batch's backward."""
        return max(self.at_loss_bytes, self.in_layers_bytes + self.window_bytes) - self.stored_bytes


def model_chunks(cfg: Config, stage: int = 0, device: str = "cuda", acts: StageActivations | None = None) -> list[ModelChunk]:
    """The model chunks pipeline rank `stage` holds, in order (rank r: virtual stages r, r + p, ...;
    under a V schedule r and 2p - 1 - r), each with its layers' activations under cfg.recompute
    (`acts` in their place: the planner's candidate, for a rank of one chunk), the embedding's and
    the loss's, and what its backward holds: first the loss's backward (all its layers still
    stored), then the layers', where full recompute rebuilds a chunk (and FSDP unshards a layer)."""
    par = cfg.parallel
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    per = cfg.model.num_layers // (p * vp)
    stages = rank_stages(par.schedule, p, vp, stage) if p > 1 else list(range(vp))
    if acts is not None and len(stages) > 1:
        raise ValueError("a candidate's activations replace one model chunk's; this rank holds several")
    unsharded = fsdp_unsharded_bytes(cfg, stage)
    window = unsharded.get(LAYER_WEIGHTS, 0.0) + unsharded.get(LAYER_GRADS, 0.0)
    out = []
    for v in stages:
        layers = acts or stage_activations(cfg, device, per, v * per)
        first, last = v == 0, v == p * vp - 1
        emb = sum(embedding_saved_bytes(cfg).values()) if first else 0.0
        saved = loss_saved_bytes(cfg, device) if last else {}
        loss = sum(saved.values())
        at_loss = layers.stored_bytes + emb + loss + (loss_workspace_bytes(cfg) if last else 0.0)
        in_layers = layers.peak_bytes + emb + layer_workspace_bytes(cfg, device)
        below_logits = sum(b for name, b in saved.items() if name.startswith("loss."))
        out.append(ModelChunk(v, v * per, layers, emb, loss, below_logits, at_loss, in_layers, window))
    return out


def saved_token_bytes(cfg: Config, stage: int = 0) -> float:
    """The step's token tensor as the saved tensors of pipeline rank `stage` hold it: the embedding
    keeps a view of it (token ids), on the rank of the first virtual stage only. The loss keeps no
    view of it: it keeps only the gradient of its logits (`loss_saved_bytes`), whatever the micro-batch size (measured: a last stage alone at micro-batch 1 holds no token ids)."""
    par = cfg.parallel
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    stages = rank_stages(par.schedule, p, vp, stage) if p > 1 else [0]
    if par.context_parallel_size > 1:
        return 0.0  # the embedding keeps its own copy of this rank's ids (`embedding_saved_bytes`)
    return token_bytes(cfg) if 0 in stages else 0.0


def schedule_walk(cfg: Config, stage: int = 0, device: str = "cuda", acts: StageActivations | None = None) -> tuple[list[ModelChunk], Walk]:
    """The model chunks of pipeline rank `stage` and what its schedule holds of them (`schedules.walk`)."""
    par = cfg.parallel
    chunks = model_chunks(cfg, stage, device, acts)
    by_stage = {c.virtual_stage: c for c in chunks}
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    if p == 1:  # one micro-batch at a time, through every chunk
        stored = sum(c.stored_bytes for c in chunks)
        worst = max(chunks, key=lambda c: c.transient_bytes)
        return chunks, Walk(stored, {c.virtual_stage: 1 for c in chunks}, stored + worst.transient_bytes, worst.virtual_stage)
    actions = rank_actions(par.schedule, p, vp, cfg.num_microbatches, stage)
    return chunks, walk(actions, lambda v: by_stage[v].stored_bytes, lambda v: by_stage[v].transient_bytes,
                        lambda v: by_stage[v].loss_function_bytes)


def stage_estimate(cfg: Config, stage: int, device: str = "cuda") -> dict[str, float | int | list[int]]:
    """What `run` measures on pipeline rank `stage`, estimated: its model chunks (virtual stages),
    the activation bytes one micro-batch saves through them, the most saved at once under the
    schedule (in-flight chunk-forwards times their bytes, the token ids once), how many micro-batches
    that is, and the rank's allocated peak (GPU)."""
    chunks, held = schedule_walk(cfg, stage, device)
    tokens = saved_token_bytes(cfg, stage)
    return {
        "pipeline_stage": stage,
        "model_chunks": [c.virtual_stage for c in chunks],
        "activation_bytes": sum(c.stored_bytes for c in chunks) + tokens,
        "activation_bytes_per_layer": sum(c.layers.stored_bytes for c in chunks) / sum(c.layers.layers for c in chunks),
        "activation_peak_bytes": held.saved_peak + tokens,
        "microbatches_in_flight": sum(held.held.values()) / len(chunks),
        "peak_allocated_bytes": rank_memory(cfg, stage, device).peak_allocated_bytes,
    }


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
    transient workspaces, what torch's pipeline runtime keeps); `acts` replaces the stage's
    activations under cfg.recompute (the planner's candidate policies). The backward peak is the most
    its schedule holds while one chunk-forward runs its backward (`schedule_walk`). Only the items
    the layout has are listed."""
    par = cfg.parallel
    p = par.pipeline_model_parallel_size
    params = stage_parameters(cfg, stage)
    held = optimizer_bytes_per_parameter(cfg)
    unsharded = fsdp_unsharded_bytes(cfg, stage)
    chunks, walked = schedule_walk(cfg, stage, device, acts)
    backward = next(c for c in chunks if c.virtual_stage == walked.in_backward)
    ends = {0, p * (par.virtual_pipeline_model_parallel_size or 1) - 1}
    tokens = token_bytes(cfg) if ends & {c.virtual_stage for c in chunks} else 0.0
    items = {h.name: h.per_parameter * params for h in held if h.backward}
    items.update({name: unsharded[name] for name in (OUTSIDE_WEIGHTS, OUTSIDE_GRADS, STAGE_WEIGHTS) if name in unsharded})
    items.update({
        "token ids (all micro-batches of the step)": tokens,
        "activations of the other in-flight micro-batches": walked.backward_peak - backward.transient_bytes - backward.stored_bytes,
        "activations of the micro-batch in backward (stored)": backward.stored_bytes,
    })
    if backward.in_layers_bytes + backward.window_bytes >= backward.at_loss_bytes:
        items["backward transient (recompute, loss, gradients)"] = backward.in_layers_bytes - backward.stored_bytes
        items.update({name: unsharded[name] for name in (LAYER_WEIGHTS, LAYER_GRADS) if name in unsharded})
    else:
        items["backward transient (recompute, loss, gradients)"] = backward.at_loss_bytes - backward.stored_bytes
    if p > 1 and cfg.training.framework != "megatron":  # Megatron receives into fresh tensors and frees sent outputs
        items["pipeline buffers (received activations and gradients, outputs held for backward)"] = pipeline_buffer_bytes(cfg, stage)
    run_long = run_buffer_bytes(cfg, device)
    items.update(run_long)
    items = {name: value for name, value in items.items() if value}
    step = sum(h.per_parameter for h in held if h.step) * params + tokens + sum(run_long.values())
    return RankMemory(stage=stage, parameters=params, items=items, optimizer_step_bytes=step)


CUBLAS_WORKSPACES = "torch cuBLAS workspaces (the forward's thread and autograd's backward thread)"
ROPE_TABLES = "RoPE tables (cos, sin buffers)"


def run_buffer_bytes(cfg: Config, device: str = "cuda") -> dict[str, float]:
    """What a rank allocates once and holds for the whole run besides parameters and optimizer
    state, by name: on CUDA torch's two cuBLAS workspaces (`analysis.cuda_workspaces`, sized by the
    compute capability and CUBLAS_WORKSPACE_CONFIG that `device` carries, `models.DeviceKernels`;
    an H100's and torch's default where it carries none); and the GPT's RoPE tables
    (models/dense/layers.py `RotaryEmbedding`: cos and sin, [max_position_embeddings, rotary_dim / 2]
    each in the training precision, plus under context parallel this rank's rows of each as buffers
    of their own). Every pipeline rank builds its own tables."""
    out: dict[str, float] = {}
    if device_kind(device) == "cuda":
        capability = getattr(device, "compute_capability", None) or DEFAULT_COMPUTE_CAPABILITY
        out[CUBLAS_WORKSPACES] = torch_cublas_workspaces_bytes(capability, getattr(device, "cublas_workspace_config", None))
    m = cfg.model
    if m.position_embedding_type == "rope":
        rows = m.max_position_embeddings + (rank_seq_length(cfg) if cfg.parallel.context_parallel_size > 1 else 0)
        out[ROPE_TABLES] = 2 * rows * (m.rotary_dim // 2) * ELEMENT_BYTES[cfg.training.precision]
    return out


def pipeline_buffer_bytes(cfg: Config, stage: int) -> float:
    """What torch.distributed.pipelining's stage keeps beside autograd's saved tensors (stage.py,
    torch 2.13): for each chunk whose input comes from another rank, one receive buffer per
    micro-batch of the step (`_setup_forward_recv_info`; those of the held micro-batches are the
    first layer's saved input, counted there), and for each chunk whose output goes to another rank
    one gradient buffer per micro-batch (`_setup_backward_recv_info`); and each held chunk-forward's
    hidden-state output until its backward (`fwd_cache`), which no saved tensor of this rank holds;
    the held ones are those of the moment the most chunk-forwards are held. The last chunk's output,
    the logits, is the storage the loss writes its gradient into and keeps (`loss_saved_bytes`).
    GPU accounting: the CPU probe counts saved tensors only."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    held = peak_chunks(rank_actions(par.schedule, p, vp, cfg.num_microbatches, stage))
    e, t, s = ELEMENT_BYTES[tr.precision], par.tensor_model_parallel_size, rank_seq_length(cfg)
    hidden = e * tr.micro_batch_size * s * m.hidden_size / (t if par.sequence_parallel else 1)
    mine = set(rank_stages(par.schedule, p, vp, stage))
    n, total = cfg.num_microbatches, 0.0
    for v in sorted(mine):
        kept = held.get(v, 0)
        if v > 0 and v - 1 not in mine:
            total += (n - kept) * hidden
        if v < p * vp - 1 and v + 1 not in mine:
            total += n * hidden
        if v < p * vp - 1:
            total += kept * hidden
    return total


def stage_memories(cfg: Config, device: str = "cuda", acts: StageActivations | None = None) -> list[RankMemory]:
    """`rank_memory` of every pipeline stage, first to last."""
    return [rank_memory(cfg, r, device, acts) for r in range(cfg.parallel.pipeline_model_parallel_size)]


def peak_rank_memory(cfg: Config, device: str = "cuda", acts: StageActivations | None = None) -> RankMemory:
    """The most loaded pipeline rank (every stage is weighed: with virtual stages or a V schedule
    the first and the last are not always the ones)."""
    return max(stage_memories(cfg, device, acts), key=lambda r: r.peak_allocated_bytes)


def record_estimate(cfg: Config, device: str) -> dict[str, Any]:
    """The estimate `run` stores next to each measurement: one micro-batch's activations through the
    whole model (with pipeline stages: through the first stage, as rank 0 measures them), FLOPs, the
    most loaded rank's peak, and with pipeline stages each stage's (`stage_estimate`) in
    `estimated_stages` and the schedule's theoretical bubble."""
    acts = activation_bytes(cfg, device)
    out: dict[str, Any] = {
        "estimated_activation_bytes": acts["activation_bytes"],
        "estimated_activation_bytes_per_layer": acts["activation_bytes_per_layer"],
        "estimated_hardware_flops_per_step": flops.hardware_flops_per_step(cfg, device),
        "estimated_peak_allocated_bytes": peak_rank_memory(cfg, device).peak_allocated_bytes,
    }
    par = cfg.parallel
    if par.pipeline_model_parallel_size > 1:
        stages = [stage_estimate(cfg, s, device) for s in range(par.pipeline_model_parallel_size)]
        out["estimated_stages"] = stages
        # What rank 0 (the first stage) measures for one micro-batch, the record's own figure there.
        out["estimated_activation_bytes"] = stages[0]["activation_bytes"]
        out["estimated_activation_bytes_per_layer"] = stages[0]["activation_bytes_per_layer"]
        out["estimated_bubble_fraction"] = bubble_fraction(par.schedule, par.pipeline_model_parallel_size,
                                                           par.virtual_pipeline_model_parallel_size or 1, cfg.num_microbatches)
    return out
