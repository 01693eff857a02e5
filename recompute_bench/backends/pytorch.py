"""The pure-PyTorch backend: the modules a layer is built from and the recompute primitives.

A backend owns two things, so that another one (Transformer Engine, whose `LayerNormLinear`
fuses the norm into the next linear) is one new file:

- module factories: `linear`, `norm`, `dropout`, `core_attention` (the fused or the explicit
  attention core), `grouped_linear` (a mixture-of-experts layer's experts);
- recompute primitives: `checkpoint` (save the inputs, re-run the function in backward) and
  `discard_output` (free a function's output once its consumer has saved it, refill it from a
  gradient hook), which `recompute.apply` installs on the modules a policy names.

Checkpoints are re-entrant (`use_reentrant=True`), as Megatron's are: the forward runs under
no_grad and only the inputs are saved through `save_for_backward`, which the saved-tensor probe
sees. CPU and CUDA RNG states are restored on recompute, so dropout masks match.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

NAME = "torch"


# ----- module factories -----------------------------------------------------------------------

def linear(in_features: int, out_features: int, bias: bool) -> nn.Module:
    """A dense linear layer: `nn.Linear`, whose weight gradient the main-gradient buffer may take
    straight from the matmul (`backends.main_grad_linear`, Megatron's gradient-accumulation fusion)."""
    from recompute_bench.backends.main_grad_linear import MainGradLinear

    return MainGradLinear(in_features, out_features, bias=bias)


class _RMSNormFunction(torch.autograd.Function):
    """y = x * rsqrt(mean(x^2) + eps) * w as one autograd node (statistics in fp32), saving x and rstd."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        acc = torch.promote_types(x.dtype, torch.float32)
        rstd = torch.rsqrt(x.to(acc).pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return (x.to(acc) * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        x_hat = x.to(rstd.dtype) * rstd
        g = grad.to(rstd.dtype) * weight.to(rstd.dtype)
        grad_x = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
        grad_w = (grad.to(rstd.dtype) * x_hat).reshape(-1, x.shape[-1]).sum(0)
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


class RMSNorm(nn.Module):
    """RMSNorm as one node in the graph, as fused kernels (Apex, Transformer Engine) run it.

    On CUDA it is torch's fused kernel: `F.rms_norm` dispatches CUDA tensors to `aten::_fused_rms_norm`
    (aten/src/ATen/native/layer_norm.cpp `rms_norm_composite`), one forward kernel saving the input,
    the fp32 rstd and the weight, as `_RMSNormFunction` does, and one backward kernel
    (`_fused_rms_norm_backward`) with no atomics, so `verify`'s bitwise checks run on it there.
    Elsewhere `rms_norm` decomposes into several ops (on CPU the layer input's gradient would be a sum
    of three contributions whose order changes when the norm is recomputed, breaking bitwise
    equality), so the CPU runs `_RMSNormFunction`, its hand-written twin."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return _RMSNormFunction.apply(x, self.weight, self.eps)


def norm(kind: str, hidden_size: int, eps: float) -> nn.Module:
    """LayerNorm (with bias) or RMSNorm."""
    if kind == "RMSNorm":
        return RMSNorm(hidden_size, eps)
    return nn.LayerNorm(hidden_size, eps=eps)


class Dropout(nn.Module):
    """Dropout that saves a 1-byte mask on every device, as the paper counts it. (`F.dropout` on a
    CPU saves a mask of the activation's own dtype; `native_dropout` saves a bool mask everywhere.)"""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.native_dropout(x, self.p, True)[0] if self.training else x


def dropout(p: float) -> nn.Module:
    """Dropout with probability p; no module at all when p == 0, so no mask is ever saved."""
    return Dropout(p) if p > 0 else nn.Identity()


# torch.nn.attention.SDPBackend's members, by the names the analysis gives the kernels.
SDPA_KERNELS = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient", "CUDNN_ATTENTION": "cudnn",
                "MATH": "sdpa_math", "OVERRIDEABLE": "overrideable"}


def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, enable_gqa: bool) -> str:
    """The kernel `F.scaled_dot_product_attention(q, k, v, dropout_p, is_causal=True, enable_gqa)`
    runs here: torch's own choice for these tensors (`torch._fused_sdp_choice`, which the sdpa
    dispatch calls: the backends enabled, their order, the device, dtypes, shapes and strides)."""
    from torch.nn.attention import SDPBackend

    choice = torch._fused_sdp_choice(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=enable_gqa)
    return SDPA_KERNELS.get(SDPBackend(choice).name, SDPBackend(choice).name.lower())


class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d) + causal mask) -> dropout -> times V: the part selective `core_attn`
    recompute re-runs. Inputs [b, s, heads, d] (k and v with `groups` heads); output [b, s, heads * d].

    `sdpa` calls torch's fused kernel; `math` is the explicit path the paper's memory formula
    describes (QK^T, mask, softmax, dropout, times V, each saving what autograd needs).
    `attention_kernel` names what ran in the first forward that built a graph (the one whose saved
    tensors backward reads): "math", or the kernel sdpa chose (`sdpa_kernel`)."""

    def __init__(self, attention_backend: str, heads: int, groups: int, head_dim: int, attention_dropout: float):
        super().__init__()
        self.attention_backend = attention_backend
        self.heads, self.groups = heads, groups
        self.scale = 1.0 / math.sqrt(head_dim)
        self.attention_dropout = attention_dropout
        self.dropout = dropout(attention_dropout)
        self.attention_kernel: str | None = "math" if attention_backend == "math" else None
        self.context_parallel = None
        """Under context parallel, this rank's part of the sequence (`models.cp_attention.SequenceSplit`):
        its queries then attend to every rank's keys through it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s = q.shape[:2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, s, d]
        if self.context_parallel is not None:
            out = self._across_split(q, k, v)
        elif self.attention_backend == "sdpa":
            p = self.attention_dropout if self.training else 0.0
            gqa = self.groups != self.heads
            if self.attention_kernel is None and torch.is_grad_enabled():  # asked once: a host-side check
                self.attention_kernel = sdpa_kernel(q, k, v, p, gqa)
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=gqa)
        else:
            if self.groups != self.heads:
                k = k.repeat_interleave(self.heads // self.groups, dim=1)
                v = v.repeat_interleave(self.heads // self.groups, dim=1)
            # An additive -inf mask, built for this length: the add saves nothing for backward.
            mask = torch.full((s, s), float("-inf"), device=q.device, dtype=q.dtype).triu(1)
            scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale + mask
            probs = self.dropout(torch.softmax(scores, dim=-1))
            out = torch.matmul(probs, v)
        return out.transpose(1, 2).reshape(b, s, -1)

    def _across_split(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.attention_dropout if self.training else 0.0
        kernel = split_attention_kernel(self.attention_backend, q.device, q.dtype, p, q.shape[-1])
        if torch.is_grad_enabled():
            self.attention_kernel = kernel
        return self.context_parallel.attention(q, k, v, kernel, self.scale, p)


def split_attention_kernel(attention_backend: str, device: torch.device, dtype: torch.dtype, dropout_p: float,
                     head_dim: int) -> str:
    """The block kernel the attention over a context-parallel split runs (`models.cp_attention`): torch's fused flash kernel where it takes
    the block (sdpa; no dropout; on CUDA 16-bit and a head dimension up to 256, as `sdpa` would pick
    flash for one rank), else the fp32 formulas (`sdpa_math`)."""
    if attention_backend != "sdpa" or dropout_p > 0:
        return "sdpa_math"
    if device.type == "cuda":
        return "flash" if dtype in (torch.float16, torch.bfloat16) and head_dim <= 256 else "sdpa_math"
    return "flash"


def core_attention(attention_backend: str, heads: int, groups: int, head_dim: int,
                   attention_dropout: float) -> nn.Module:
    """The attention core (fused `sdpa` or explicit `math`). It calls no submodule on its inputs'
    views: under a re-entrant checkpoint those views require grad without a grad_fn, which torch's
    module tracker (used by FlopCounterMode) cannot hook."""
    return CoreAttention(attention_backend, heads, groups, head_dim, attention_dropout)


class GroupedLinear(nn.Module):
    """`num_experts` bias-free linears, weight [experts, out, in], applied to consecutive row groups of
    one [rows, in] input: expert e takes the rows up to `offsets[e]` (int32 cumulative counts).

    `grouped`: `torch._grouped_mm` for all experts where its fast kernel takes the operands (no host
    read of the counts) or on a CPU (its fallback loop), else the padded batched path (`_PaddedBmm`);
    otherwise one matmul per expert, the CPU reference, which reads the counts on the host to slice
    the rows. `grouped_gemm_path` names the path; `path` is the one the last forward ran."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, grouped: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.grouped = grouped
        self.path: str | None = None

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        w = self.weight.transpose(-2, -1)  # [experts, in, out], column-major as the CUDA kernel wants it
        self.path = grouped_gemm_path(self.grouped, x.device, x.dtype if x.dtype == w.dtype else None)
        if self.path in ("grouped_mm", "grouped_mm_fallback"):
            if w.requires_grad and self.path == "grouped_mm" and leaves_empty_expert_grads(x.device):
                w.register_hook(_zero_empty_experts(offsets))
            y = torch._grouped_mm(x, w, offs=offsets)
            if y.requires_grad:  # not under a checkpoint's no-grad forward
                y.register_hook(_contiguous)
            return y
        if self.path == "padded_bmm":
            return _PaddedBmm.apply(x, w, offsets)
        bounds = [0, *offsets.tolist()]
        return torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(zip(bounds, bounds[1:]))])


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    """A gradient hook: `torch._grouped_mm`'s backward refuses the expanded, zero-stride gradient of a
    `.sum()` on CUDA ("Invalid strides/sizes, got [0, 0] for strides", the first H200 run), and a
    reduction downstream of the experts may hand it one."""
    return grad.contiguous()


def _zero_empty_experts(offsets: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient hook on the experts' weights [experts, in, out] that zeroes the gradient of every
    expert that received no row: where torch's grouped matmul is reported to leave an empty group's
    output unwritten (compute capability 10.x), that gradient would be whatever the allocator's block
    held. `where` also clears a NaN, and runs on the device: no host read of the counts."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
        return torch.where((counts > 0)[:, None, None], grad, grad.new_zeros(()))
    return hook


def leaves_empty_expert_grads(device: torch.device) -> bool:
    """Whether `_grouped_mm` on `device` may leave the weight gradient of an expert without rows
    unwritten: reported for its CUDA kernel on compute capability 10.x (Blackwell), so guarded there
    (`_zero_empty_experts`); a CPU's fallback loop and Hopper's kernel write zeros."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10


def kernels_that_ran(model: nn.Module) -> dict[str, str]:
    """What the model's kernels ran in its last training step, as the record's `env` names it:
    `attention_kernel` (see `CoreAttention`), with experts `grouped_gemm_path` (see
    `grouped_gemm_path`), under context parallel `context_parallel_attention` (which attention over
    the split ran: "p2p", "all_gather" or "torch_ring", `models.cp_attention`); kernels that differ
    between layers are joined with "+"."""
    ran = {"attention_kernel": {m.attention_kernel for m in model.modules() if isinstance(m, CoreAttention)},
           "grouped_gemm_path": {m.path for m in model.modules() if isinstance(m, GroupedLinear)},
           "context_parallel_attention": {m.context_parallel.path for m in model.modules()
                                          if isinstance(m, CoreAttention) and m.context_parallel is not None}}
    return {key: "+".join(sorted(names)) for key, names in ran.items() if names and None not in names}


def grouped_linear(num_experts: int, in_features: int, out_features: int, grouped: bool) -> nn.Module:
    """The experts' fc1 or fc2: grouped matmuls, or one matmul per expert (see GroupedLinear)."""
    return GroupedLinear(num_experts, in_features, out_features, grouped)


def grouped_mm_available() -> bool:
    """Whether the torch in use has `torch._grouped_mm`."""
    return hasattr(torch, "_grouped_mm")


def grouped_gemm_path(grouped: bool, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> str:
    """The experts' matmul path for operands of `dtype` (None: of two dtypes) on `device`:

    - "grouped_mm": torch's fast grouped kernel, which needs bf16 operands and output on a GPU of
      compute capability 9.x or 10.x (`_grouped_mm_cuda` in ATen/native/cuda/GroupedBlas.cpp, torch
      2.13: `scaled_mm_arch_allowed(sm90_only, sm100_only) && a_b_and_out_are_bf16`); it reads no
      count on the host;
    - "grouped_mm_fallback": `_grouped_mm` on a CPU, where torch runs `_grouped_mm_fallback`, one mm
      per group after reading the offsets on the host, which costs nothing there;
    - "padded_bmm": on CUDA where the fast kernel does not take the operands (fp32, fp16, another
      GPU), and wherever torch lacks `_grouped_mm`: on CUDA `_grouped_mm` would fall back to its loop,
      which copies the offsets to the host, waiting for the device, on every call; `_PaddedBmm`
      reads the counts once per call too, but runs one batched matmul instead of one per expert;
    - "per_expert": `moe_grouped_gemm` false.
    """
    if not grouped:
        return "per_expert"
    device = torch.device(device)
    if not grouped_mm_available():
        return "padded_bmm"
    if device.type != "cuda":
        return "grouped_mm_fallback"
    fast = torch.cuda.get_device_capability(device)[0] in (9, 10) and dtype == torch.bfloat16
    return "grouped_mm" if fast else "padded_bmm"


class _PaddedBmm(torch.autograd.Function):
    """Grouped matmuls as one `torch.bmm` over [experts, most rows, in]: every expert's rows padded
    with zeros to the busiest expert's count (one host read of the counts). It saves what
    `_grouped_mm` saves (the rows, the weights, the offsets), never the padded copy, and pads again
    in backward; the zero rows add nothing to the weight gradient. The matmuls run E x max rows."""

    @staticmethod
    def _layout(offsets: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).long()
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=offsets.device), counts, output_size=rows)
        position = torch.arange(rows, device=offsets.device) - (offsets.long() - counts).index_select(0, expert)
        return expert, position, int(counts.max()) if counts.numel() else 0

    @staticmethod
    def _pad(a: torch.Tensor, expert: torch.Tensor, position: torch.Tensor, experts: int, most: int) -> torch.Tensor:
        return a.new_zeros(experts, most, a.shape[-1]).index_put_((expert, position), a)

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, offsets)
        expert, position, most = _PaddedBmm._layout(offsets, x.shape[0])
        return torch.bmm(_PaddedBmm._pad(x, expert, position, w.shape[0], most), w)[expert, position]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, offsets = ctx.saved_tensors
        expert, position, most = _PaddedBmm._layout(offsets, x.shape[0])
        g = _PaddedBmm._pad(grad, expert, position, w.shape[0], most)
        grad_x = torch.bmm(g, w.transpose(-2, -1))[expert, position]
        grad_w = torch.bmm(_PaddedBmm._pad(x, expert, position, w.shape[0], most).transpose(-2, -1), g)
        return grad_x, grad_w, None


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of `aten._grouped_mm`, which FlopCounterMode has no formula for: 2 per multiply-add.
    2-D x 2-D (a weight gradient, groups along the contracted rows) makes a [groups, m, n] output
    from one [m, rows] x [rows, n] product; otherwise every output element sums over a's last dim."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


def _register_grouped_mm_flops() -> None:
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    if grouped_mm_available() and torch.ops.aten._grouped_mm not in flop_registry:
        register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flops)


_register_grouped_mm_flops()


def _gqa_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """A fused sdpa kernel's forward, QK^T and times V over every query head: with grouped query
    attention each k and v head serves several query heads, so the work is the query heads'."""
    b, heads, s_q, d_qk = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return 2 * b * heads * s_q * s_k * (d_qk + d_v)


def _gqa_sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                             **kwargs) -> int:
    """Its backward: QK^T again, then the gradients of the scores, of V, of Q and of K (three
    products over the q/k head dimension, two over v's), every query head."""
    b, heads, s_q, d_qk = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return 2 * b * heads * s_q * s_k * (3 * d_qk + 2 * d_v)


SDPA_FLOP_OPS = ("flash", "efficient", "cudnn")


def _register_gqa_sdpa_flops() -> None:
    """torch's sdpa FLOP formulas asserted equal query and key/value heads until 2026-03
    (pytorch/pytorch#177169, "Fix sdpa_flop_count to support GQA"), so `FlopCounterMode` raised on
    every grouped-query model's fused attention (llama3, mixtral, qwen3, tiny-moe on CUDA). Where the
    torch in use still refuses a grouped-query shape, its formulas for the fused kernels are
    replaced by these, which count what torch's own count as since (every query head)."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    q, kv = (1, 4, 8, 16), (1, 2, 8, 16)
    for kernel in SDPA_FLOP_OPS:
        forward = getattr(torch.ops.aten, f"_scaled_dot_product_{kernel}_attention", None)
        backward = getattr(torch.ops.aten, f"_scaled_dot_product_{kernel}_attention_backward", None)
        for op, formula, shapes in ((forward, _gqa_sdpa_flops, (q, kv, kv)),
                                    (backward, _gqa_sdpa_backward_flops, (q, q, kv, kv))):
            if op is None or op not in flop_registry:
                continue
            try:
                flop_registry[op](*shapes)
            except AssertionError:  # an older torch's formula: equal heads only
                del flop_registry[op]
                register_flop_formula(op)(formula)


_register_gqa_sdpa_flops()


# ----- the loss ------------------------------------------------------------------------------

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split over the vocabulary (one rank's columns, `start` the
    first id it holds; `group` None: the whole vocabulary), chunked over tokens. Megatron's
    `_VocabParallelCrossEntropy` (megatron/core/tensor_parallel/cross_entropy.py) works one fp32 copy
    of all the logits into the softmax and keeps it for backward; here, as Liger's cross-entropy does
    (linkedin/Liger-Kernel src/liger_kernel/ops/cross_entropy.py `cross_entropy_forward`: the
    gradient written into the input in the forward, scaled by the output's gradient in backward),
    each chunk of `rows` tokens is cast to fp32 and worked with Megatron's steps (subtract the
    all-reduced max, exp, divide by the all-reduced sum, subtract 1 at the target) into the
    gradient of the token's loss, which is written back into the logits' own storage, in their dtype.
    That buffer is all it keeps; backward multiplies it by each token's gradient in place. The fp32
    working set is one chunk (`models.loss_chunk_rows`); 16-bit logits hold 2 bytes per logit plus
    that chunk at the peak (Megatron's 2 + 4). fp32 logits are worked in place, chunk by chunk: pass
    logits nothing else reads (the output layer's). The chunks follow from the shapes alone, so the
    result is the same run after run and under every recompute setting."""

    @staticmethod
    def forward(ctx, logits, target, start, group, rows):
        buffer = logits.detach()  # overwritten with the gradient; nothing else reads the output layer's logits
        top = buffer.amax(dim=-1).float()
        if group is not None:
            torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
        outside = (target < start) | (target >= start + buffer.shape[-1])
        local = target - start
        local[outside] = 0
        picked = buffer.gather(-1, local.unsqueeze(-1)).squeeze(-1).float() - top
        picked[outside] = 0.0
        if group is not None:
            torch.distributed.all_reduce(picked, group=group)
        total = torch.empty_like(top)
        in_place = buffer.dtype == torch.float32
        space = None if in_place else torch.empty(min(rows, buffer.shape[0]), buffer.shape[-1], device=buffer.device)
        for r in range(0, buffer.shape[0], rows):
            chunk = buffer[r:r + rows]
            work = chunk if in_place else space[:chunk.shape[0]].copy_(chunk)  # one fp32 chunk at a time
            work -= top[r:r + rows].unsqueeze(-1)
            torch.exp(work, out=work)
            s = work.sum(dim=-1)
            if group is not None:
                torch.distributed.all_reduce(s, group=group)
            total[r:r + rows] = s
            work.div_(s.unsqueeze(-1))  # the softmax
            work.scatter_add_(-1, local[r:r + rows].unsqueeze(-1), (outside[r:r + rows].float() - 1.0).unsqueeze(-1))
            if not in_place:
                chunk.copy_(work)
        ctx.rows = rows
        ctx.save_for_backward(buffer)
        return torch.log(total) - picked

    @staticmethod
    def backward(ctx, grad):
        (gradient,) = ctx.saved_tensors
        # chunk by chunk: a CPU kernel multiplying 16-bit values by fp32 ones computes into an fp32
        # temporary the size of its output (CUDA's casts in the kernel)
        for r in range(0, gradient.shape[0], ctx.rows):
            gradient[r:r + ctx.rows].mul_(grad[r:r + ctx.rows].unsqueeze(-1))
        return gradient, None, None, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of [..., vocab] logits, vocabulary-parallel when the logits
    are a DTensor sharded over the vocabulary (each rank works on its local columns; max, target
    logit and sum of exponentials are all-reduced over the tensor-parallel group). `rows`: tokens
    per fp32 chunk (default `models.loss_chunk_rows`, which the estimate follows)."""
    from torch.distributed.tensor import DTensor

    from recompute_bench.models import loss_chunk_rows

    group, start = None, 0
    if isinstance(logits, DTensor):
        mesh = logits.device_mesh
        logits = logits.to_local()
        group = mesh.get_group()
        start = mesh.get_local_rank() * logits.shape[-1]
    flat = logits.reshape(-1, logits.shape[-1])
    rows = rows or loss_chunk_rows(flat.shape[0], flat.shape[-1])
    return _VocabParallelCrossEntropy.apply(flat, labels.reshape(-1), start, group, rows).mean()


# ----- recompute primitives -------------------------------------------------------------------

def checkpoint(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """Run fn saving only its tensor inputs; re-run it (same RNG state) when backward needs it."""
    return _torch_checkpoint(fn, *args, use_reentrant=True, preserve_rng_state=True)


class _ShardedCheckpoint(torch.autograd.Function):
    """A re-entrant checkpoint whose saved input is split over a process group, as Megatron's
    `distribute_saved_activations` does under tensor parallelism: forward runs `fn` without a graph
    and keeps only this rank's 1/n of the (replicated) input x; backward all-gathers x, restores the
    RNG state and re-runs `fn` with a graph. Every other input is saved as it is."""

    @staticmethod
    def forward(ctx, fn, group, x, *rest):
        ctx.fn, ctx.group, ctx.shape, ctx.numel = fn, group, x.shape, x.numel()
        ctx.rng = torch.get_rng_state(), torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        with torch.no_grad():
            out = fn(x, *rest)
        size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        part = -(-x.numel() // size)
        flat = F.pad(x.detach().reshape(-1), (0, part * size - x.numel()))
        ctx.save_for_backward(flat[rank * part:(rank + 1) * part].clone(), *rest)  # a copy: x itself is not kept
        return out

    @staticmethod
    def backward(ctx, grad):
        shard, *rest = ctx.saved_tensors
        parts = [torch.empty_like(shard) for _ in range(torch.distributed.get_world_size(ctx.group))]
        torch.distributed.all_gather(parts, shard, group=ctx.group)
        x = torch.cat(parts)[:ctx.numel].view(ctx.shape).requires_grad_(True)
        rest = [r.detach().requires_grad_(r.requires_grad) for r in rest]
        cpu_rng, cuda_rng = ctx.rng
        with torch.random.fork_rng(devices=[x.device] if cuda_rng is not None else []):
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng, x.device)
            with torch.enable_grad():
                out = ctx.fn(x, *rest)
        torch.autograd.backward(out, grad)
        return None, None, x.grad, *(r.grad for r in rest)


def checkpoint_sharded(group, fn: Callable[..., torch.Tensor], x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    """`checkpoint(fn, x, *rest)` keeping only this rank's 1/n of x, all-gathered over `group` in backward."""
    return _ShardedCheckpoint.apply(fn, group, x, *rest)


class _WithoutOutput(torch.autograd.Function):
    """Run `fn(*xs)` without a graph, save only xs; backward uses what `_refill` recomputed. `fn`
    returns one tensor or a tuple of them (MLA's q, k, v)."""

    @staticmethod
    def forward(ctx, fn, *xs):
        with torch.no_grad():
            y = fn(*xs)
        ctx.fn = fn
        ctx.recomputed = None
        ctx.save_for_backward(*xs)
        return y

    @staticmethod
    def backward(ctx, *grads):
        if ctx.recomputed is None:  # the output was never discarded
            _refill(ctx, None)
        xs, ys = ctx.recomputed
        ctx.recomputed = None
        torch.autograd.backward(ys, grads)
        return None, *(x.grad if x.requires_grad else None for x in xs)


def _tensors(y: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return y if isinstance(y, tuple) else (y,)


def _refill(ctx, output: torch.Tensor | tuple[torch.Tensor, ...] | None) -> None:
    """Re-run the function with a graph and, if its output was discarded, refill those storages."""
    xs = tuple(x.detach().requires_grad_(needs) for x, needs in zip(ctx.saved_tensors, ctx.needs_input_grad[1:]))
    with torch.enable_grad():
        ys = _tensors(ctx.fn(*xs))
    for old, new in zip(_tensors(output) if output is not None else (), ys):
        storage = local(old).untyped_storage()
        storage.resize_(local(new).untyped_storage().nbytes())
        with torch.no_grad():
            storage.copy_(local(new).untyped_storage())
    ctx.recomputed = (xs, ys)


def without_output(fn: Callable[..., torch.Tensor], *xs: torch.Tensor):
    """fn(*xs) (a tensor or a tuple of them) whose output may later be freed with `discard`: only
    xs are saved for backward."""
    return _WithoutOutput.apply(fn, *xs)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a tensor-parallel or FSDP shard, or a replica: its storage is
    what is allocated, freed, refilled and counted); any other tensor as it is."""
    return getattr(t, "_local_tensor", t)


def discard(output: torch.Tensor | tuple[torch.Tensor, ...], hook_tensor: torch.Tensor) -> None:
    """Free the storage of `output` (made by `without_output`, already saved by its consumer) and
    recompute it when the gradient reaches `hook_tensor`, the consumer's output: just before the
    consumer's backward reads it (Megatron's CheckpointWithoutOutput)."""
    if not hook_tensor.requires_grad:
        return
    for y in _tensors(output):
        local(y).untyped_storage().resize_(0)
    hook_tensor.register_hook(lambda _grad: _refill(_tensors(output)[0].grad_fn, output))
