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

import dataclasses
from typing import Iterable

from recompute_bench.models import ELEMENT_BYTES, spec_for
from recompute_bench.models.context_parallel import rank_seq_length
from recompute_bench.config.schema import Config


def attention_kernel(cfg: Config, device: str = "cuda") -> str:
    """What the core attention runs on `device`: "math", "sdpa_math", or a fused kernel, "flash",
    "efficient" or "cudnn": the one measured where `device` carries it (`models.DeviceKernels`),
    else the spec's prediction (see `DenseSpec.attention_kernel`)."""
    return spec_for(cfg.model).attention_kernel(cfg, device)


def layer_saved_bytes(cfg: Config, modules: Iterable[str] = (), device: str = "cuda") -> dict[str, float]:
    """Bytes one transformer layer keeps for backward for one micro-batch on one tensor-parallel
    rank, storage by storage, when the layer is not inside a full-recompute checkpoint and
    `modules` are recomputed selectively."""
    return spec_for(cfg.model).layer_saved_bytes(cfg, modules, device)


def layer_activation_bytes(cfg: Config, modules: Iterable[str] = (), device: str = "cuda") -> float:
    """Sum of `layer_saved_bytes`: one layer, one micro-batch, one tensor-parallel rank."""
    return sum(layer_saved_bytes(cfg, modules, device).values())


def checkpoint_input_bytes(cfg: Config) -> float:
    """What full recompute keeps per checkpoint: the chunk's [s, b, h] input, sharded over the
    tensor-parallel group with sequence parallelism or `distribute_saved_activations`; under
    context parallel a rank's s/cp tokens (`models.context_parallel.local_seq_length`)."""
    tr, par = cfg.training, cfg.parallel
    nbytes = ELEMENT_BYTES[tr.precision] * rank_seq_length(cfg) * tr.micro_batch_size * cfg.model.hidden_size
    if par.sequence_parallel or cfg.recompute.distribute_saved_activations:
        nbytes /= par.tensor_model_parallel_size
    return nbytes


def kind_config(cfg: Config, kind: str) -> Config:
    """cfg as a model whose every layer is of `kind` ("dense" or "moe", `policy.layer_kind`), so that
    the spec's per-layer answers (a mean over the model's layers) are that kind's exactly."""
    m = cfg.model
    if not m.num_moe_experts or (kind == "moe" and m.moe_layers == m.num_layers):
        return cfg
    model = dataclasses.replace(m, moe_layer_freq=1) if kind == "moe" else dataclasses.replace(m, num_moe_experts=None)
    return dataclasses.replace(cfg, model=model)


def layer_workspace_bytes(cfg: Config, device: str = "cuda") -> float:
    """Transient in one layer's backward: two gradients the size of the layer's largest saved
    tensor (e.g. of the attention probabilities and scores, or of the MLP's wide activations)."""
    return 2 * max(layer_saved_bytes(cfg, (), device).values())


def layer_parameters(cfg: Config) -> dict[str, float]:
    """Parameters of one layer on one tensor-parallel rank: "sharded" (QKV, projections, MLP
    weights and column-parallel biases) and "replicated" (norms, row-parallel biases)."""
    return spec_for(cfg.model).layer_parameters(cfg)
