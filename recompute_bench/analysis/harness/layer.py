"""One transformer layer: the bytes it keeps for backward for one micro-batch on one
tensor-parallel rank, storage by storage, for every selective setting; what a full-recompute
checkpoint keeps instead; its backward transient; its parameters. Pure Python: the model's spec
(`recompute_bench.models`) names the storages of the layer `models/*/layers.py` builds, found with the
saved-tensor probe and checked against it in the tests (a storage several saved tensors share counts
once, as the probe counts it).

Under tensor parallelism t the terms are split the paper's way: what lies inside the
column/row-parallel region (q, k, v, the attention scores, the MLP's wide activations) divides by t;
what lies outside (norm inputs and outputs, dropout masks, norm statistics) divides by t only with
sequence parallelism. Bytes everywhere; a "token" is one of the s x b positions of a micro-batch,
of which a context-parallel rank holds s / cp x b (`models.context_parallel.rank_seq_length`).
"""

from __future__ import annotations

from typing import Iterable

from recompute_bench.config.schema import Config


def attention_kernel(cfg: Config, device: str = "cuda") -> str:
    """What the core attention runs on `device`: "math", "sdpa_math", or a fused kernel, "flash",
    "efficient" or "cudnn": the one measured where `device` carries it (`models.DeviceKernels`),
    else the spec's prediction (see `DenseSpec.attention_kernel`)."""
    return cfg.spec.attention_kernel(cfg, device)


def layer_saved_bytes(cfg: Config, modules: Iterable[str] = (), device: str = "cuda") -> dict[str, float]:
    """Bytes one transformer layer keeps for backward for one micro-batch on one tensor-parallel
    rank, storage by storage, when the layer is not inside a full-recompute checkpoint and
    `modules` are recomputed selectively."""
    return cfg.spec.layer_saved_bytes(cfg, modules, device)


def layer_activation_bytes(cfg: Config, modules: Iterable[str] = (), device: str = "cuda") -> float:
    """Sum of `layer_saved_bytes`: one layer, one micro-batch, one tensor-parallel rank."""
    return sum(layer_saved_bytes(cfg, modules, device).values())


def layer_workspace_bytes(cfg: Config, device: str = "cuda") -> float:
    """Transient in one layer's backward: two gradients the size of the layer's largest saved
    tensor (e.g. of the attention probabilities and scores, or of the MLP's wide activations)."""
    return 2 * max(layer_saved_bytes(cfg, (), device).values())


def layer_parameters(cfg: Config) -> dict[str, float]:
    """Parameters of one layer on one tensor-parallel rank: "sharded" (QKV, projections, MLP
    weights and column-parallel biases) and "replicated" (norms, row-parallel biases)."""
    return cfg.spec.layer_parameters(cfg)
