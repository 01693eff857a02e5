"""The whole rank: parameters times the optimizer's bytes per parameter, the activations of the
micro-batches a pipeline stage holds in flight, the backward transient, the optimizer step's peak,
the allocator allowance on top, and the estimate `run` stores beside each measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from recompute_bench.analysis import flops
from recompute_bench.analysis.schedules import Walk, bubble_fraction, peak_chunks, rank_actions, rank_stages, walk
from recompute_bench.analysis.layer import layer_workspace_bytes
from recompute_bench.analysis.stage import (StageActivations, activation_bytes, embedding_saved_bytes,
                                            loss_saved_bytes, loss_workspace_bytes, stage_activations,
                                            stage_parameters, token_bytes)
from recompute_bench.models import ELEMENT_BYTES, vocab_rows
from recompute_bench.spec.config import Config


ALLOWANCE_FRACTION = 0.10
"""Allocator allowance: reserved minus allocated (fragmentation of the caching allocator), as a
fraction of the estimated allocated peak."""
ALLOWANCE_BYTES = 2**30
"""Fixed allowance: CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers, which
`torch.cuda.max_memory_allocated` does not show but the device must hold."""


def optimizer_bytes_per_parameter(cfg: Config) -> dict[str, float]:
    """Bytes per parameter as `measure.point`'s optimizers hold them (tests/test_measure.py measures
    them). 16-bit (Megatron's layout): weights 2; no 16-bit gradient is kept (a hook adds each one
    into the fp32 main gradient as soon as autograd produced it and frees it, so only one
    parameter's exists at a time: a transient, not a per-parameter cost); fp32 main gradients 4,
    fp32 master weights 4, Adam moments 8: 18 held. fp32: plain Adam, weights 4, gradients 4,
    moments 8: 16. Step temporaries 0: Adam runs fused (torch's fused kernel on CUDA and CPU)
    and allocates nothing the size of the parameters. A distributed optimizer (Megatron's:
    6 + 12/dp held) shards master weights and moments over dp."""
    par = cfg.parallel
    shards = par.data_parallel_size if par.use_distributed_optimizer else 1
    if cfg.training.precision == "fp32":
        return {"weights": 4, "grads16": 0, "main_grads": 4, "master_weights": 0,
                "adam_moments": 8 / shards, "step_temporaries": 0}
    return {"weights": 2, "grads16": 0, "main_grads": 4, "master_weights": 4 / shards,
            "adam_moments": 8 / shards, "step_temporaries": 0}


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
    total = cfg.num_microbatches * vp
    if p == 1:
        return vp  # no pipeline: one micro-batch through every layer
    if par.schedule == "1F1B":
        return min(p - stage, total)
    if par.schedule == "Interleaved1F1B":
        return min(2 * (p - stage - 1) + (vp - 1) * p + 1, total)
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
    transient_bytes: float = 0.0
    """Held on top of `stored_bytes` while this chunk runs a micro-batch's backward."""

    @property
    def stored_bytes(self) -> float:
        """Kept from this chunk's forward of a micro-batch until its backward."""
        return self.layers.stored_bytes + self.embedding_bytes + self.loss_bytes


def model_chunks(cfg: Config, stage: int = 0, device: str = "cuda", acts: StageActivations | None = None) -> list[ModelChunk]:
    """The model chunks pipeline rank `stage` holds, in order (rank r: virtual stages r, r + p, ...;
    under a V schedule r and 2p - 1 - r), each with its layers' activations under cfg.recompute
    (`acts` in their place: the planner's candidate, for a rank of one chunk), the embedding's and
    the loss's, and its backward transient: first the loss's backward (all its layers still
    stored), then the layers', where full recompute rebuilds a chunk."""
    par = cfg.parallel
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    per = cfg.model.num_layers // (p * vp)
    stages = rank_stages(par.schedule, p, vp, stage) if p > 1 else list(range(vp))
    if acts is not None and len(stages) > 1:
        raise ValueError("a candidate's activations replace one model chunk's; this rank holds several")
    out = []
    for v in stages:
        layers = acts or stage_activations(cfg, device, per, v * per)
        first, last = v == 0, v == p * vp - 1
        emb = sum(embedding_saved_bytes(cfg).values()) if first else 0.0
        saved = loss_saved_bytes(cfg, device) if last else {}
        loss = sum(saved.values())
        stored = layers.stored_bytes + emb + loss
        at_loss = stored + (loss_workspace_bytes(cfg) if last else 0.0)
        in_layers = layers.peak_bytes + emb + layer_workspace_bytes(cfg, device)
        below_logits = sum(b for name, b in saved.items() if name.startswith("loss."))
        out.append(ModelChunk(v, v * per, layers, emb, loss, below_logits, max(at_loss, in_layers) - stored))
    return out


def saved_token_bytes(cfg: Config, stage: int = 0) -> float:
    """The step's token tensor as the saved tensors of pipeline rank `stage` hold it: the embedding
    keeps a view of it (token ids); the loss keeps a view of it (labels) when a micro-batch is one
    sequence, a copy otherwise (`loss_saved_bytes`' labels)."""
    par = cfg.parallel
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    stages = rank_stages(par.schedule, p, vp, stage) if p > 1 else [0]
    if 0 in stages or (p * vp - 1 in stages and cfg.training.micro_batch_size == 1):
        return token_bytes(cfg)
    return 0.0


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
    """Peak allocated bytes of one rank of pipeline stage `stage` under cfg (parameters, gradients,
    optimizer state, in-flight activations, embedding/loss buffers, transient workspaces); `acts`
    replaces the stage's activations under cfg.recompute (the planner's candidate policies). The
    backward peak is the most its schedule holds while one chunk-forward runs its backward
    (`schedule_walk`), plus what torch's pipeline runtime keeps beside the saved tensors."""
    par = cfg.parallel
    p = par.pipeline_model_parallel_size
    params = stage_parameters(cfg, stage)
    per = optimizer_bytes_per_parameter(cfg)
    chunks, held = schedule_walk(cfg, stage, device, acts)
    backward = next(c for c in chunks if c.virtual_stage == held.in_backward)
    ends = {0, p * (par.virtual_pipeline_model_parallel_size or 1) - 1}
    items = {
        "weights": per["weights"] * params,
        "gradients (16-bit, until the step)": per["grads16"] * params,
        "main gradients (fp32)": per["main_grads"] * params,
        "master weights (fp32)": per["master_weights"] * params,
        "Adam moments (fp32)": per["adam_moments"] * params,
        "token ids (all micro-batches of the step)": token_bytes(cfg) if ends & {c.virtual_stage for c in chunks} else 0.0,
        "activations of the other in-flight micro-batches": held.backward_peak - backward.transient_bytes - backward.stored_bytes,
        "activations of the micro-batch in backward (stored)": backward.stored_bytes,
        "backward transient (recompute, loss, gradients)": backward.transient_bytes,
    }
    if p > 1 and cfg.training.framework != "megatron":  # Megatron receives into fresh tensors and frees sent outputs
        items["pipeline buffers (received activations and gradients, outputs held for backward)"] = pipeline_buffer_bytes(cfg, stage)
    step = sum(per[k] for k in ("weights", "main_grads", "master_weights", "adam_moments", "step_temporaries")) * params
    step += items["token ids (all micro-batches of the step)"]
    return RankMemory(stage=stage, parameters=params, items=items, optimizer_step_bytes=step)


def pipeline_buffer_bytes(cfg: Config, stage: int) -> float:
    """What torch.distributed.pipelining's stage keeps beside autograd's saved tensors (stage.py,
    torch 2.13): for each chunk whose input comes from another rank, one receive buffer per
    micro-batch of the step (`_setup_forward_recv_info`; those of the held micro-batches are the
    first layer's saved input, counted there), and for each chunk whose output goes to another rank
    one gradient buffer per micro-batch (`_setup_backward_recv_info`); and each held chunk-forward's
    output until its backward (`fwd_cache`: the hidden states, or the last chunk's logits), which no
    saved tensor of this rank holds; the held ones are those of the moment the most chunk-forwards
    are held. GPU accounting: the CPU probe counts saved tensors only."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    held = peak_chunks(rank_actions(par.schedule, p, vp, cfg.num_microbatches, stage))
    e, t = ELEMENT_BYTES[tr.precision], par.tensor_model_parallel_size
    hidden = e * tr.micro_batch_size * tr.seq_length * m.hidden_size / (t if par.sequence_parallel else 1)
    logits = e * tr.micro_batch_size * tr.seq_length * vocab_rows(cfg) / t
    mine = set(rank_stages(par.schedule, p, vp, stage))
    n, total = cfg.num_microbatches, 0.0
    for v in sorted(mine):
        kept = held.get(v, 0)
        if v > 0 and v - 1 not in mine:
            total += (n - kept) * hidden
        if v < p * vp - 1 and v + 1 not in mine:
            total += n * hidden
        total += kept * (logits if v == p * vp - 1 else hidden)
    return total


def peak_rank_memory(cfg: Config, device: str = "cuda", acts: StageActivations | None = None) -> RankMemory:
    """The most loaded pipeline rank (every stage is weighed: with virtual stages or a V schedule
    the first and the last are not always the ones)."""
    ranks = [rank_memory(cfg, stage, device, acts) for stage in range(cfg.parallel.pipeline_model_parallel_size)]
    return max(ranks, key=lambda r: r.peak_allocated_bytes)


def device_bytes_needed(peak_allocated: float, allowance_fraction: float = ALLOWANCE_FRACTION,
                        allowance_bytes: float = ALLOWANCE_BYTES) -> float:
    """Device memory a rank needs: the allocated peak plus the stated allocator allowance."""
    return peak_allocated * (1 + allowance_fraction) + allowance_bytes


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
