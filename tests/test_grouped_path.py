"""The experts' grouped matmuls: torch._grouped_mm, the padded torch.bmm path where torch lacks it,
and the per-expert reference agree in output and gradients."""

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
    assert backend.grouped_gemm_path(True, "cpu") == "grouped_mm"
    fused = run(grouped, x, offsets)
    monkeypatch.delattr(torch, "_grouped_mm")
    assert backend.grouped_gemm_path(True, "cpu") == "padded_bmm" and backend.grouped_gemm_path(False) == "per_expert"
    padded = run(grouped, x, offsets)
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
