"""On CUDA the linears' weight gradients go straight into the fp32 main gradients inside one GEMM
(`aten::baddbmm.dtype_out`, bf16 inputs, fp32 accumulation into the fp32 main gradient): no bf16
weight gradient is allocated, the result is the fp32 product's (the unfused path rounds it to bf16
first), and a model's main gradients equal the unfused path's to that rounding. Skipped without CUDA."""

import pytest
import torch

from recompute_bench.backends.main_grad_linear import MainGradLinear, fusable_weights, wgrad_into_main_grad

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")


def test_the_gemm_accumulates_in_fp32_into_the_main_gradient():
    g = torch.Generator(device="cuda").manual_seed(0)
    grad = torch.randn(4096, 1024, device=CUDA, generator=g).bfloat16()
    x = torch.randn(4096, 512, device=CUDA, generator=g).bfloat16()
    start = torch.randn(1024, 512, device=CUDA, generator=g)
    main = start.clone()
    wgrad_into_main_grad(main, grad, x)
    exact = start.double() + grad.double().t() @ x.double()
    unfused = start + (grad.t() @ x).float()  # autograd's bf16 gradient, then the add
    err_fused = (main.double() - exact).abs().max().item()
    err_unfused = (unfused.double() - exact).abs().max().item()
    assert err_fused < 1e-3 and err_fused < err_unfused / 4


def test_no_bf16_weight_gradient_is_allocated():
    lin = MainGradLinear(8192, 8192, bias=False, device=CUDA, dtype=torch.bfloat16)
    lin.weight.main_grad = torch.zeros(8192, 8192, device=CUDA)
    x = torch.randn(512, 8192, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    peaks = {}
    for fused in (True, False):
        lin.weight.fuse_wgrad = fused
        y = lin(x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y.sum().backward()
        torch.cuda.synchronize()
        peaks[fused] = torch.cuda.max_memory_allocated() - base
        lin.weight.grad, x.grad = None, None
    weight_bytes = 8192 * 8192 * 2
    assert peaks[False] - peaks[True] >= weight_bytes  # the unfused path's bf16 gradient of the weight


def test_a_model_fuses_every_linear_on_cuda_and_matches_the_unfused_main_gradients():
    from helpers import config

    from recompute_bench.measure.optimizer import make_optimizer
    from recompute_bench.measure.step import synthetic_batches
    from recompute_bench.models.dense.layers import build_model

    cfg = config("llama3-8b", sets=["model.num_layers=2", "model.hidden_size=256", "model.ffn_hidden_size=512",
                                     "model.num_attention_heads=4", "model.num_query_groups=2",
                                     "training.seq_length=256"])
    grads = {}
    for fused in (True, False):
        model = build_model(cfg.model, 1, CUDA, torch.bfloat16).train()
        optimizer = make_optimizer(model, "bf16", fused_devices=("cuda",) if fused else ())
        assert bool(fusable_weights(model) and fused) == any(p.fuse_wgrad for p in model.parameters())
        tokens = synthetic_batches(cfg, CUDA)[0]
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        grads[fused] = {n: p.main_grad.clone() for n, p in model.named_parameters()}
        del optimizer
    for n in grads[False]:
        ref = grads[False][n]
        torch.testing.assert_close(grads[True][n], ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item() + 1e-6)
