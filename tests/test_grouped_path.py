"""The experts' grouped matmuls: torch._grouped_mm, the padded torch.bmm path where its fast kernel
is unavailable, and the per-expert reference agree in output and gradients; the path recorded is
the one torch's dispatch takes."""

import pytest
import torch

from recompute_bench.backends import pytorch as backend


def run(layer, x, offsets):
    x = x.clone().requires_grad_(True)
    layer.weight.grad = None
    y = layer(x, offsets)
    y.backward(torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape).sin())
    return y.detach(), x.grad, layer.weight.grad.clone()


@pytest.mark.parametrize("counts", [[3, 0, 7, 2], [0, 0, 5, 0]])
def test_padded_bmm_equals_grouped_mm_and_the_per_expert_reference(monkeypatch, counts):
    torch.manual_seed(0)
    grouped = backend.grouped_linear(4, 16, 24, True)
    torch.nn.init.normal_(grouped.weight)
    loop = backend.grouped_linear(4, 16, 24, False)
    loop.weight = grouped.weight
    x = torch.randn(sum(counts), 16)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    reference = run(loop, x, offsets)
    assert backend.grouped_gemm_path(True, "cpu") == "grouped_mm_fallback"
    fused = run(grouped, x, offsets)
    assert grouped.path == "grouped_mm_fallback"
    monkeypatch.delattr(torch, "_grouped_mm")
    assert backend.grouped_gemm_path(True, "cpu") == "padded_bmm" and backend.grouped_gemm_path(False) == "per_expert"
    padded = run(grouped, x, offsets)
    assert grouped.path == "padded_bmm"
    for got, want, other in zip(padded, reference, fused):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, other, rtol=1e-5, atol=1e-5)


def test_padded_bmm_keeps_what_grouped_mm_keeps(monkeypatch):
    layer = backend.grouped_linear(4, 16, 24, True)
    x, offsets = torch.randn(12, 16, requires_grad=True), torch.tensor([3, 3, 10, 12], dtype=torch.int32)
    monkeypatch.delattr(torch, "_grouped_mm")
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        layer(x, offsets)
    assert sorted(t.numel() for t in kept) == sorted([x.numel(), layer.weight.numel(), offsets.numel()])


@pytest.mark.parametrize("capability,dtype,path", [
    ((9, 0), torch.bfloat16, "grouped_mm"),    # H100 / H200
    ((10, 0), torch.bfloat16, "grouped_mm"),   # B200 / GB200
    ((10, 3), torch.bfloat16, "grouped_mm"),
    ((9, 0), torch.float16, "padded_bmm"),     # the fast kernel is bf16 only: torch would loop, syncing
    ((9, 0), torch.float32, "padded_bmm"),
    ((9, 0), None, "padded_bmm"),              # operands of two dtypes
    ((8, 0), torch.bfloat16, "padded_bmm"),    # A100
    ((8, 9), torch.bfloat16, "padded_bmm"),    # L40S
    ((12, 0), torch.bfloat16, "padded_bmm"),   # RTX 50xx: not sm100
])
def test_the_fast_grouped_kernel_is_bf16_on_sm90_or_sm100_only(monkeypatch, capability, dtype, path):
    # torch 2.13's `_grouped_mm_cuda` (ATen/native/cuda/GroupedBlas.cpp) takes its fast path when
    # `scaled_mm_arch_allowed(/*sm90_only=*/true, /*sm100_only=*/true)` (major 9 or major 10) and
    # a, b and the output are bf16; anything else runs `_grouped_mm_fallback`, a loop that copies
    # the offsets to the host on every call. Where the fast path is out, the padded bmm runs.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert backend.grouped_gemm_path(True, torch.device("cuda", 0), dtype) == path
    assert backend.grouped_gemm_path(False, torch.device("cuda", 0), dtype) == "per_expert"


def test_the_cpu_runs_grouped_mm_through_torchs_fallback_loop():
    # On a CPU `_grouped_mm` is its composite fallback in any dtype: one mm per group (the host read
    # of the offsets waits for nothing there), exactly what the per-expert loop computes.
    x, w = torch.randn(12, 16), torch.randn(4, 16, 24)
    offsets = torch.tensor([3, 3, 10, 12], dtype=torch.int32)
    bounds = [0, *offsets.tolist()]
    reference = torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(zip(bounds, bounds[1:]))])
    assert torch.equal(torch._grouped_mm(x, w, offs=offsets), reference)
    assert backend.grouped_gemm_path(True, "cpu", torch.float32) == "grouped_mm_fallback"
