"""The Transformer Engine backend (`--transformer-impl transformer_engine`): each dense layer of the
harness's GPT built from TE's modules as Megatron builds it (`transformer_engine.TE_MODULES`), under
the harness's own module names, so `recompute.apply` installs every recompute setting unchanged.

    input_layernorm    IdentityOp (nn.Identity): the norm runs inside linear_qkv
    linear_qkv         te.LayerNormLinear(normalization = the model's RMSNorm or LayerNorm)
    core_attention     te.DotProductAttention(causal, bshd, num_gqa_groups = the query groups)
    linear_proj        te.Linear
    pre_mlp_layernorm  IdentityOp: the norm runs inside linear_fc1
    linear_fc1         te.LayerNormLinear (2f wide under SwiGLU), then the activation in torch
    linear_fc2         te.Linear

TE's signatures (NVIDIA/TransformerEngine d0067d0): `module/layernorm_linear.py` `LayerNormLinear(in_features,
out_features, eps, ..., bias, normalization, ..., params_dtype, ..., device)`, registering
`layer_norm_weight` (and `layer_norm_bias` under LayerNorm) before `weight` and `bias`, and deferring
its initialisation where `device == "meta"`; `module/linear.py` `Linear(in_features, out_features, ...,
bias, ..., params_dtype, ..., device)`; `attention/dot_product_attention/dot_product_attention.py`
`DotProductAttention(num_attention_heads, kv_channels, num_gqa_groups, attention_dropout, qkv_format,
attn_mask_type, ...)`, whose forward takes q, k, v laid out [b, s, heads, d] under qkv_format "bshd" and
gives [b, s, heads * d], the harness's core-attention contract (q, k, v views of the fused QKV output
in a layout TE does not read are made contiguous by `utils.py` `get_qkv_layout`). The layers are built on the meta device
like the harness's own and materialised by `layers.materialize`: the norm weights fill with ones and
the matrices take the same draws, in the same order, as the harness's layer (no norm weight is drawn).

Everything outside the layers (embedding, final norm, output layer, loss, dropout, the recompute
primitives) is the pure-PyTorch backend's: Megatron's output layer is not a TE module either. Selective
`layernorm` recompute finds IdentityOp norms and installs nothing, as Megatron's transformer_layer.py
does; `core_attn`, `mlp` and full recompute checkpoint the same modules as in the harness's layer.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

import torch
from torch import nn

from recompute_bench.backends import pytorch
from recompute_bench.config.schema import ModelConfig

NAME = "transformer_engine"
TE_NORMS = {"RMSNorm": "RMSNorm", "LayerNorm": "LayerNorm"}
"""The model's normalization -> LayerNormLinear's `normalization` (the same names)."""


def __getattr__(name: str):
    """Everything this backend does not build itself is the pure-PyTorch backend's."""
    return getattr(pytorch, name)


def te_pytorch() -> ModuleType:
    """`transformer_engine.pytorch` (imported when a layer is built, never at import)."""
    return importlib.import_module("transformer_engine.pytorch")


def _device() -> str | torch.device:
    """Where a new tensor lands now: "meta" inside the build's meta-device context (TE defers its
    initialisation only for the string "meta")."""
    device = torch.empty(0).device
    return "meta" if device.type == "meta" else device


def transformer_layer(cfg: ModelConfig, backend: ModuleType, mlp: Optional[nn.Module] = None,
                      attention=None) -> nn.Module:
    """One dense pre-norm layer of the harness (`layers.TransformerLayer`) with TE's modules in place
    of the norms, linears and attention core (see the module docstring)."""
    from recompute_bench.models.dense.layers import TransformerLayer

    if mlp is not None or attention is not None:
        raise ValueError("Transformer Engine's layers are built for dense attention and MLP only")
    te = te_pytorch()
    device, dtype = _device(), torch.get_default_dtype()
    h, eps, bias = cfg.hidden_size, cfg.layernorm_epsilon, cfg.add_bias_linear
    norm = TE_NORMS[cfg.normalization]
    layer = TransformerLayer(cfg, pytorch)  # the harness's layer: its names, its forward
    attn, block = layer.self_attention, layer.mlp
    # Re-assigning a registered name keeps its place, so parameters keep the harness's order.
    layer.input_layernorm, layer.pre_mlp_layernorm = nn.Identity(), nn.Identity()
    attn.linear_qkv = te.LayerNormLinear(h, attn.linear_qkv.out_features, eps=eps, bias=bias, normalization=norm,
                                         params_dtype=dtype, device=device)
    attn.core_attention = te.DotProductAttention(cfg.num_attention_heads, cfg.head_dim, num_gqa_groups=cfg.groups,
                                                 attention_dropout=cfg.attention_dropout, qkv_format="bshd",
                                                 attn_mask_type="causal")
    attn.linear_proj = te.Linear(attn.linear_proj.in_features, h, bias=bias, params_dtype=dtype, device=device)
    block.linear_fc1 = te.LayerNormLinear(h, block.linear_fc1.out_features, eps=eps, bias=bias, normalization=norm,
                                          params_dtype=dtype, device=device)
    block.linear_fc2 = te.Linear(block.linear_fc2.in_features, h, bias=bias, params_dtype=dtype, device=device)
    return layer


def implementation(model: nn.Module) -> dict[str, str]:
    """The record's `env` entry of a model whose layers are TE's: `transformer_impl`; nothing otherwise."""
    return {"transformer_impl": NAME} if getattr(model, "backend", None) == NAME else {}
