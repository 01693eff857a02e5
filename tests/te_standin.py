"""A stand-in for `transformer_engine.pytorch` in plain torch, for the CPU tests of `backends/te_layers.py`:
the classes the harness builds from, with Transformer Engine's constructor signatures (NVIDIA/TransformerEngine
d0067d0: module/layernorm_linear.py `LayerNormLinear`, module/linear.py `Linear`,
attention/dot_product_attention/dot_product_attention.py `DotProductAttention`, distributed.py `checkpoint`)
and their parameter names, computing what TE's kernels compute (no FP8, no tensor parallel). `install`
puts it in `sys.modules` for one test. Each class counts its forward calls (`calls`), so a test sees which
modules a recompute setting re-runs."""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types
from collections import Counter
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

calls: Counter = Counter()
"""Forward calls per class name since `install`."""


def _norm(x, weight, bias, normalization, eps):
    if normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class LayerNormLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1, get_rng_state_tracker=None,
                 init_method=None, bias: bool = True, normalization: str = "LayerNorm", return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 return_layernorm_output: bool = False, return_layernorm_output_gathered: bool = False,
                 parameters_split=None, zero_centered_gamma: bool = False, device="cuda", ub_overlap_ag: bool = False,
                 ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 ub_bulk_dgrad: bool = False, ub_name=None, delay_wgrad_compute: bool = False,
                 symmetric_ar_type=None, name=None):
        super().__init__()
        assert normalization in ("LayerNorm", "RMSNorm")
        dtype = params_dtype or torch.get_default_dtype()
        self.in_features, self.out_features, self.eps, self.normalization = in_features, out_features, eps, normalization
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features, device=device, dtype=dtype))
        self.layer_norm_bias = (nn.Parameter(torch.zeros(in_features, device=device, dtype=dtype))
                                if normalization != "RMSNorm" else None)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
        calls[type(self).__name__] += 1
        return F.linear(_norm(inp, self.layer_norm_weight, self.layer_norm_bias, self.normalization, self.eps),
                        self.weight, self.bias)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1, get_rng_state_tracker=None,
                 rng_tracker_name=None, init_method=None, bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 parameters_split=None, device="cuda", ub_overlap_ag: bool = False, ub_overlap_rs: bool = False,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 ub_name=None, delay_wgrad_compute: bool = False, symmetric_ar_type=None,
                 save_original_input: bool = False, name=None):
        super().__init__()
        dtype = params_dtype or torch.get_default_dtype()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
        calls[type(self).__name__] += 1
        return F.linear(inp, self.weight, self.bias)


class DotProductAttention(nn.Module):
    def __init__(self, num_attention_heads: int, kv_channels, num_gqa_groups: Optional[int] = None,
                 attention_dropout: float = 0.0, qkv_format: str = "sbhd", attn_mask_type: str = "causal",
                 window_size=None, bottom_right_diagonal=None, sequence_parallel: bool = False, tp_size: int = 1,
                 get_rng_state_tracker=None, tp_group=None, layer_number=None, attention_type: str = "self",
                 cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p",
                 softmax_scale: Optional[float] = None, softmax_type: str = "vanilla",
                 return_max_logit: bool = False, name=None):
        super().__init__()
        assert qkv_format == "bshd" and attn_mask_type == "causal", "the stand-in runs what the harness builds"
        self.heads, self.groups = num_attention_heads, num_gqa_groups or num_attention_heads
        self.scale = softmax_scale or 1.0 / math.sqrt(kv_channels)
        self.attention_dropout = attention_dropout

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None, **kwargs):
        calls[type(self).__name__] += 1
        assert key_layer.shape[2] == self.groups and query_layer.shape[2] == self.heads
        b, s = query_layer.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in (query_layer, key_layer, value_layer))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attention_dropout if self.training else 0.0,
                                             is_causal=True, scale=self.scale, enable_gqa=self.groups != self.heads)
        return out.transpose(1, 2).reshape(b, s, -1)


def checkpoint(function, *args, **kwargs):
    """distributed.py `checkpoint(function, *args, **kwargs)`: torch's re-entrant checkpoint here."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=kwargs.get("use_reentrant", True))


def install(monkeypatch) -> types.ModuleType:
    """Put the stand-in in `sys.modules` as `transformer_engine.pytorch` for one test; returns it."""
    calls.clear()
    package = types.ModuleType("transformer_engine")
    package.__path__ = []  # a package, so importlib takes its submodule from sys.modules
    te = types.ModuleType("transformer_engine.pytorch")
    te.LayerNormLinear, te.Linear, te.DotProductAttention = LayerNormLinear, Linear, DotProductAttention
    distributed = types.ModuleType("transformer_engine.pytorch.distributed")
    distributed.checkpoint = checkpoint
    te.distributed, package.pytorch = distributed, te
    for module, is_package in [(package, True), (te, True), (distributed, False)]:
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None, is_package=is_package)
    for name, module in [("transformer_engine", package), ("transformer_engine.pytorch", te),
                         ("transformer_engine.pytorch.distributed", distributed)]:
        monkeypatch.setitem(sys.modules, name, module)
    return te
