"""Transformer Engine on a GPU: the TE modules `backends/transformer_engine.py` maps the harness's
layer onto exist and run (bf16, forward and backward), and TE's checkpoint (Megatron's `te_checkpoint`)
re-runs a LayerNormLinear. Skipped where transformer_engine does not import (these machines);
`bench/gpu_check.py`'s "Transformer Engine tests" step runs this file where it does."""

import pytest
import torch

from recompute_bench.backends.transformer_engine import TE_MODULES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
te = pytest.importorskip("transformer_engine.pytorch", reason="transformer_engine not importable")


def test_the_mapped_te_modules_exist_and_run_forward_and_backward():
    for name, (_, te_name) in TE_MODULES.items():
        assert hasattr(te, te_name), (name, te_name)
    h, heads, s, b = 256, 4, 128, 2
    qkv = te.LayerNormLinear(h, 3 * h, normalization="RMSNorm", bias=False, params_dtype=torch.bfloat16).cuda()
    attn = te.DotProductAttention(heads, h // heads, attn_mask_type="causal", qkv_format="bshd")
    x = torch.randn(b, s, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv(x).view(b, s, 3, heads, h // heads).unbind(2)
    out = attn(q, k, v)
    out.float().pow(2).mean().backward()
    assert out.shape == (b, s, h) and torch.isfinite(x.grad).all()


def test_te_checkpoint_recomputes_a_layernorm_linear_and_gives_the_same_gradient():
    from transformer_engine.pytorch.distributed import checkpoint

    torch.manual_seed(0)
    layer = te.LayerNormLinear(256, 512, normalization="RMSNorm", params_dtype=torch.bfloat16).cuda()
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().sum().backward()
    plain = x.grad.clone()
    x.grad = None
    checkpoint(layer, x, use_reentrant=True).float().sum().backward()
    torch.testing.assert_close(x.grad, plain)
