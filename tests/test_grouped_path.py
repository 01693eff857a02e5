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


def test_the_fast_path_takes_a_zero_stride_gradient_and_zeroes_empty_experts_on_sm100(monkeypatch):
    # torch._grouped_mm's CUDA backward refuses the expanded gradient of a `.sum()` ("Invalid
    # strides/sizes, got [0, 0] for strides", the first H200 run), and on compute capability 10.x it
    # is reported to leave an expert without rows its weight gradient unwritten. A stand-in with both
    # habits replaces it here: the layer hands it a contiguous gradient and zeroes the empty experts'.
    real = torch._grouped_mm

    class Strict(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, offs):
            ctx.save_for_backward(x, w, offs)
            return real(x, w, offs=offs)

        @staticmethod
        def backward(ctx, grad):
            if 0 in grad.stride():
                raise RuntimeError(f"Invalid strides/sizes, got {list(grad.stride())} for strides")
            x, w, offs = ctx.saved_tensors
            with torch.enable_grad():
                xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
                grad_x, grad_w = torch.autograd.grad(real(xx, ww, offs=offs), (xx, ww), grad)
            grad_w[torch.diff(offs, prepend=offs.new_zeros(1)) == 0] = float("nan")  # unwritten
            return grad_x, grad_w, None

    torch.manual_seed(0)
    layer = backend.grouped_linear(4, 16, 24, True)
    torch.nn.init.normal_(layer.weight)
    reference = backend.grouped_linear(4, 16, 24, False)
    reference.weight = torch.nn.Parameter(layer.weight.detach().clone())
    x, offsets = torch.randn(12, 16), torch.tensor([3, 3, 10, 12], dtype=torch.int32)  # expert 1 has no rows
    reference(x, offsets).sum().backward()
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, offs: Strict.apply(a, b, offs))
    monkeypatch.setattr(backend, "grouped_gemm_path", lambda grouped, device, dtype=None: "grouped_mm")
    monkeypatch.setattr(backend, "leaves_empty_expert_grads", lambda device: True)
    layer(x, offsets).sum().backward()
    assert layer.path == "grouped_mm"
    assert torch.equal(layer.weight.grad[1], torch.zeros(24, 16))
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)
    # where the guard is off (Hopper) the stand-in's unwritten gradient shows: the guard is what cleared it
    layer.weight.grad = None
    monkeypatch.setattr(backend, "leaves_empty_expert_grads", lambda device: False)
    layer(x, offsets).sum().backward()
    assert layer.weight.grad[1].isnan().all() and not layer.weight.grad[[0, 2, 3]].isnan().any()


def test_empty_experts_are_guarded_on_compute_capability_10_only(monkeypatch):
    for capability, guarded in (((9, 0), False), ((10, 0), True), ((10, 3), True), ((12, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert backend.leaves_empty_expert_grads(torch.device("cuda", 0)) is guarded
    assert not backend.leaves_empty_expert_grads(torch.device("cpu"))
