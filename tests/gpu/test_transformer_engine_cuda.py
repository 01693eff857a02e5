"""Transformer Engine on a GPU: the TE modules `backends/transformer_engine.py` maps the harness's
layer onto exist and run (bf16, forward and backward), TE's checkpoint (Megatron's `te_checkpoint`)
re-runs a LayerNormLinear, and the harness's GPT built from them (`backends/te_layers.py`) takes one
bf16 step under every recompute setting, with the saved bytes each setting should give. Skipped where transformer_engine does not import (these machines);
`bench/gpu_check.py`'s "Transformer Engine tests" step runs this file where it does."""

import pytest
import torch

from helpers import SETTINGS, SMALL_LLAMA, config, saved_step
from recompute_bench.backends.transformer_engine import TE_MODULES, te_problem

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


def test_the_harness_gpt_built_from_te_takes_a_step_under_every_recompute_setting():
    sets = [*(f"{k}={v}" for k, v in SMALL_LLAMA.items()), "model.transformer_impl=transformer_engine",
            "model.hidden_dropout=0.0", "model.attention_dropout=0.0"]
    assert te_problem() is None
    steps = {}
    for name, extra in SETTINGS.items():
        loss, saved, grads, model = saved_step(config("tiny", [*sets, *extra]), "cuda")
        assert type(model.layers[0].self_attention.linear_qkv) is te.LayerNormLinear, name
        assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), name
        steps[name] = loss, saved
    losses = [loss for loss, _ in steps.values()]
    assert max(losses) - min(losses) < 1e-2 * abs(losses[0])  # recompute changes no result beyond bf16 noise
    saved = {name: b for name, (_, b) in steps.items()}
    assert saved["layernorm"] == saved["none"]  # both norms fused into LayerNormLinear: nothing recomputed
    assert saved["full"] < saved["mlp"] < saved["none"] and saved["core_attn"] < saved["none"]
