"""The whole rank: parameters times the optimizer's bytes per parameter, the activations of the
micro-batches a pipeline stage holds in flight, the backward transient, the optimizer step's peak,
the allocator allowance on top, and the estimate `run` stores beside each measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recompute_bench.analysis import flops
from recompute_bench.analysis.layer import layer_workspace_bytes
from recompute_bench.analysis.stage import (StageActivations, activation_bytes, embedding_saved_bytes,
                                            loss_saved_bytes, loss_workspace_bytes, stage_activations,
                                            stage_parameters, token_bytes)
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


def microbatches_in_flight(cfg: Config, stage: int = 0) -> float:
    """Micro-batches whose activations a pipeline stage holds at once. 1F1B: stage i holds p - i
    (at most the number of micro-batches). Interleaved with m chunks per rank, the first stage holds
    p (1 + (p - 1)/(p m)) micro-batches' worth of its layers (the paper's factor)."""
    par = cfg.parallel
    p, m = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    n = cfg.num_microbatches
    if p == 1:
        return 1.0
    if m > 1 and stage == 0:
        return min(float(n), p * (1 + (p - 1) / (p * m)))
    return float(min(p - stage, n))


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
    replaces the stage's activations under cfg.recompute (the planner's candidate policies)."""
    p = cfg.parallel.pipeline_model_parallel_size
    params = stage_parameters(cfg, stage)
    per = optimizer_bytes_per_parameter(cfg)
    acts = acts or stage_activations(cfg, device)
    in_flight = microbatches_in_flight(cfg, stage)
    first, last = stage == 0, stage == p - 1
    emb = sum(embedding_saved_bytes(cfg).values()) if first else 0.0
    loss = sum(loss_saved_bytes(cfg, device).values()) if last else 0.0
    # The micro-batch in backward: first the loss's backward (all its layers still stored), then
    # the layers' backward, where full recompute rebuilds a chunk.
    at_loss = acts.stored_bytes + emb + (loss + loss_workspace_bytes(cfg) if last else 0.0)
    in_layers = acts.peak_bytes + emb + layer_workspace_bytes(cfg, device)
    items = {
        "weights": per["weights"] * params,
        "gradients (16-bit, until the step)": per["grads16"] * params,
        "main gradients (fp32)": per["main_grads"] * params,
        "master weights (fp32)": per["master_weights"] * params,
        "Adam moments (fp32)": per["adam_moments"] * params,
        "token ids (all micro-batches of the step)": token_bytes(cfg) if first or last else 0.0,
        "activations of the other in-flight micro-batches": (in_flight - 1) * (acts.stored_bytes + emb + loss),
        "activations of the micro-batch in backward (stored)": acts.stored_bytes + emb + loss,
        "backward transient (recompute, loss, gradients)": max(at_loss, in_layers) - (acts.stored_bytes + emb + loss),
    }
    step = sum(per[k] for k in ("weights", "main_grads", "master_weights", "adam_moments", "step_temporaries")) * params
    step += items["token ids (all micro-batches of the step)"]
    return RankMemory(stage=stage, parameters=params, items=items, optimizer_step_bytes=step)


def peak_rank_memory(cfg: Config, device: str = "cuda", acts: StageActivations | None = None) -> RankMemory:
    """The most loaded rank: the first or the last pipeline stage (middle ones hold less than the
    first: the same layers, fewer micro-batches in flight, no embedding)."""
    p = cfg.parallel.pipeline_model_parallel_size
    ranks = [rank_memory(cfg, 0, device, acts)] + ([rank_memory(cfg, p - 1, device, acts)] if p > 1 else [])
    return max(ranks, key=lambda r: r.peak_allocated_bytes)


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
