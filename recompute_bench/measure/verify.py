"""Proof that a recompute setting changes memory and time, never the math.

Every setting runs one micro-batch forward and backward against the no-recompute baseline, with
the same seed, inputs and dropout masks, in fp32. The loss and every gradient must be bitwise
equal; the largest absolute difference is reported per setting. Recompute keeps parameter names,
so gradients are matched by name (a renamed or missing parameter is itself a failure).

A CPU's fp32 kernels give the same bits every run. On CUDA some do not: `index_add_` (the MoE
combine) and the fused attention backward (flash's dQ, the efficient kernel's) accumulate with
atomics in whatever order the threads arrive. There verify runs under
`torch.use_deterministic_algorithms(True)` (not warn-only: that is what makes torch pass
`deterministic=true` to flash's backward, aten/src/ATen/native/transformers/cuda/attention_backward.cu)
with `CUBLAS_WORKSPACE_CONFIG=:4096:8` (cuBLAS's reproducible workspace), so bitwise equality still
means "the math is unchanged"; an op with no deterministic CUDA kernel raises instead of differing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from recompute_bench.recompute.apply import apply_recompute
from recompute_bench.config.schema import Config, RecomputeConfig
from recompute_bench.workload import resolved

VERIFY_DROPOUT = 0.1

CUBLAS_WORKSPACE = ":4096:8"
__all__ = ["Outcome", "deterministic", "determinism", "fp32_with_dropout", "loss_and_grads", "verify"]


def determinism(device_type: str) -> str:
    """How verify makes two runs on `device_type` give the same bits, in words for its output."""
    if device_type != "cuda":
        return f"{device_type}: its fp32 kernels are deterministic"
    return f"cuda: torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE}"


@contextlib.contextmanager
def deterministic(device: torch.device) -> Iterator[str]:
    """Run the block with deterministic kernels on a CUDA `device` (see the module docstring),
    restoring torch's setting afterwards; yields `determinism(device.type)`. cuBLAS reads
    CUBLAS_WORKSPACE_CONFIG when it creates a handle, so a value the user set is kept, and a
    process that already ran a matmul on the device keeps its handle's workspace."""
    if device.type != "cuda":
        yield determinism(device.type)
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield determinism(device.type)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@dataclass
class Outcome:
    setting: str
    attention_backend: str
    loss_diff: float
    max_grad_diff: float
    worst_parameter: str

    @property
    def exact(self) -> bool:
        return self.loss_diff == 0.0 and self.max_grad_diff == 0.0


def loss_and_grads(cfg: Config, recompute: RecomputeConfig, tokens: torch.Tensor,
                   device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """Loss and gradients by parameter name of one micro-batch (seeded weights and dropout)."""
    model = apply_recompute(cfg.spec.build(cfg, device, torch.float32), recompute)
    model.train()
    tokens = tokens.to(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.training.seed)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def fp32_with_dropout(cfg: Config, attention_backend: str) -> Config:
    """The workload in fp32 with dropout on (0.1 where the preset has none), so RNG restore is tested."""
    model = dataclasses.replace(
        cfg.model, attention_backend=attention_backend,
        hidden_dropout=cfg.model.hidden_dropout or VERIFY_DROPOUT,
        attention_dropout=cfg.model.attention_dropout or VERIFY_DROPOUT)
    return resolved(dataclasses.replace(cfg, model=model, training=dataclasses.replace(cfg.training, precision="fp32")))


def max_grad_diff(base: dict[str, torch.Tensor | None], other: dict[str, torch.Tensor | None]) -> tuple[float, str]:
    """The largest |difference| of any gradient, and its parameter; inf where names or presence differ."""
    worst, worst_name = -1.0, ""
    for name in base.keys() | other.keys():
        g0, g1 = base.get(name), other.get(name)
        if g0 is None or g1 is None:
            diff = 0.0 if g0 is None and g1 is None else float("inf")
        else:
            diff = (g0 - g1).abs().max().item()
        if diff > worst:
            worst, worst_name = diff, name
    return worst, worst_name


def verify(cfg: Config, settings: list[RecomputeConfig], backends: list[str], device: torch.device) -> list[Outcome]:
    """Compare each setting with no recompute, for each attention backend (under `deterministic`)."""
    outcomes = []
    with deterministic(device):
        for backend in backends:
            run_cfg = fp32_with_dropout(cfg, backend)
            g = torch.Generator().manual_seed(run_cfg.training.seed)
            tokens = torch.randint(0, cfg.model.vocab_size,
                                   (cfg.training.micro_batch_size, cfg.training.seq_length + 1), generator=g)
            base_loss, base_grads = loss_and_grads(run_cfg, RecomputeConfig(), tokens, device)
            for setting in settings:
                loss, grads = loss_and_grads(run_cfg, setting, tokens, device)
                worst, worst_name = max_grad_diff(base_grads, grads)
                outcomes.append(Outcome(setting.label, backend, (loss - base_loss).abs().item(), worst, worst_name))
    return outcomes
