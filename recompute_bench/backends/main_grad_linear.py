"""The dense linear layer, with Megatron's gradient-accumulation fusion where torch allows it: the
weight-gradient matmul accumulates straight into the weight's fp32 main gradient
(`measure.optimizer.MainGrads`), so no gradient of the weight is ever materialised, in 16 bits or
any other dtype, and no separate add runs.

Megatron (megatron/core/tensor_parallel/layers.py, `LinearWithGradAccumulationAndAsyncCommunication.backward`,
under `gradient_accumulation_fusion`) calls its `fused_weight_gradient_mlp_cuda` extension
(`wgrad_gemm_accum_fp32`, a cuBLAS GEMM with fp32 output and beta = 1 into `weight.main_grad`) and
returns a dummy `grad_weight` so that its DDP's backward hooks still run; the hook sees
`grad_added_to_main_grad` and adds nothing. Here, in pure torch:

- on CUDA with 16-bit weights, `aten::baddbmm.dtype_out` (torch 2.8 and later:
  aten/src/ATen/native/cuda/Blas.cpp `_baddbmm_out_dtype_cuda`, which runs one cuBLAS batched GEMM with
  16-bit inputs, fp32 accumulation and an fp32 output it accumulates into, beta = 1) over a batch of
  one; `addmm.dtype_out` is no use, as it asks its added matrix to be 16-bit;
- with fp32 weights, `Tensor.addmm_` into the main gradient (beta = 1: one GEMM);
- 16-bit weights elsewhere (a CPU, in tests): `addmm_` of fp32 casts of the gradient and the input.

No dummy gradient is returned (torch would allocate it): the weight's gradient is None, and autograd
still runs the weight's accumulation node once per backward, with no gradient, so its
post-accumulate hook (`MainGrads._accumulate`) adds whatever other uses gave (the word embedding's,
for an output layer tied to it) and marks the weight ready, where the data-parallel buckets start
their reduce (`BucketedGrads.ready`), as for any other weight.

Which weights are fused (`fusable_weights`): the weight of a `MainGradLinear` that is a plain tensor
(not a tensor-parallel or FSDP2 DTensor: their gradients go through DTensor's own backward, and FSDP2
keeps no main gradient), on a device where the fusion runs by default (CUDA; the CPU keeps autograd's
gradient and the hook's add, whose results are exact across runs and recompute settings). The
pipeline's stages keep the unfused path (a zero-bubble schedule computes weight gradients in a pass
of their own). A fused module falls back to `F.linear` under torch.compile (a side effect in a
backward would break the graph there) and where grad is off.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

FUSED_DEVICES = ("cuda",)
"""Where `make_optimizer` fuses by default (tests fuse on a CPU by passing devices=("cpu",))."""


def wgrad_into_main_grad(main_grad: torch.Tensor, grad: torch.Tensor, x: torch.Tensor) -> None:
    """main_grad [out, in] (fp32) += grad[T, out]^T @ x[T, in], inside one GEMM where torch has one."""
    if main_grad.is_cuda and grad.dtype in (torch.bfloat16, torch.float16):
        out = main_grad.unsqueeze(0)
        torch.ops.aten.baddbmm.dtype_out(out, grad.t().unsqueeze(0), x.unsqueeze(0), torch.float32, out=out)
    elif grad.dtype == main_grad.dtype:
        main_grad.addmm_(grad.t(), x)
    else:
        main_grad.addmm_(grad.t().float(), x.float())


class _LinearIntoMainGrad(torch.autograd.Function):
    """y = x W^T + b, saving what `F.linear` saves (x and W); backward: the input's gradient and the
    bias's as autograd's linear computes them, the weight's accumulated into `W.main_grad`."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad2d = grad.reshape(-1, grad.shape[-1])
        wgrad_into_main_grad(weight.main_grad, grad2d, x.reshape(-1, x.shape[-1]))
        grad_bias = grad2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias


class MainGradLinear(nn.Linear):
    """`nn.Linear`, whose weight gradient goes straight into the fp32 main gradient where
    `MainGrads` has set the weight up for it (`fuse_wgrad`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if getattr(w, "fuse_wgrad", False) and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            return _LinearIntoMainGrad.apply(x, w, self.bias)
        return F.linear(x, w, self.bias)


@functools.cache
def cuda_gemm_accumulates_into_fp32(device_index: int) -> bool:
    """Whether this torch runs `aten::baddbmm.dtype_out` on this CUDA device (torch 2.8 and later),
    tried once on a 2 x 2 product: where it cannot, the weights keep the unfused path."""
    try:
        out = torch.ones(2, 2, device=f"cuda:{device_index}")
        one = torch.ones(2, 2, device=out.device, dtype=torch.bfloat16)
        wgrad_into_main_grad(out, one, one)
        return bool((out == 3).all())
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


def fusable_weights(model: nn.Module, devices: tuple[str, ...] = FUSED_DEVICES) -> set[int]:
    """Ids of the weights whose gradient the weight-gradient matmul can accumulate into the main
    gradient: a `MainGradLinear`'s plain-tensor weight on one of `devices` (on CUDA with 16-bit
    weights, where this torch has the GEMM that does it)."""
    from torch.distributed.tensor import DTensor

    def fits(w: torch.Tensor) -> bool:
        if isinstance(w, DTensor) or not w.requires_grad or w.device.type not in devices:
            return False
        if w.is_cuda and w.dtype in (torch.bfloat16, torch.float16):
            return cuda_gemm_accumulates_into_fp32(w.device.index or 0)
        return True

    return {id(m.weight) for m in model.modules() if isinstance(m, MainGradLinear) and fits(m.weight)}
