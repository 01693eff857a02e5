"""Proving a context-parallel attention kernel on the device it runs on, before a point is measured.

A context-parallel rank's attention is its blocks (`models.cp_attention`) merged by their
log-sum-exps. `split_blocks` runs every rank's blocks of one sequence on one process, K and V of the
whole sequence at hand, and returns the output and the gradients of q, k and v as the ranks together
compute them: no collective, no autograd graph, only the block kernel's own forward and backward.

`check_kernel` compares that with attention over the whole sequence written out in fp32 (the
`sdpa_math` formulas on one causal block) on small random inputs of the run's heads, head size and
dtype, on the run's device. A kernel that is exact on a CPU can still be wrong on a GPU (CUDA's flash
backward reads its log-sum-exp by pointer, as one contiguous [b, heads, s] array, where the CPU
kernel honours strides), so a record names what was checked where, and a point whose kernel fails
the check is not measured (`measure.point`).
"""

from __future__ import annotations

import functools

import torch

from recompute_bench.models.context_parallel import Block, attention_blocks, chunk_length, rank_chunks, rank_positions
from recompute_bench.models.cp_attention import BlockKernel, merge

CHECK_CHUNK = 32
"""Positions per chunk of the checked sequence (2 x cp chunks)."""

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}
"""Largest |error| / max |value| of each tensor; 16-bit dtypes `HALF_TOLERANCE` (the block outputs
and gradients are rounded to 8 or 11 bits before they are summed)."""
HALF_TOLERANCE = 3e-2


def split_blocks(kernel_name: str, comm: str, cp: int, q, k, v, grad) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) of causal attention over [b, heads, s, d] q and [b, groups, s, d] k, v given
    the output's gradient `grad`, computed as `cp` ranks of comm type `comm` compute them with block
    kernel `kernel_name` (dropout off), each tensor in q's dtype."""
    b, heads, s, d = q.shape
    n = chunk_length(s, cp)
    out_all = torch.zeros_like(q)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for r in range(cp):
        mine = rank_chunks(r, cp)
        pos = torch.tensor(rank_positions(s, r, cp), device=q.device)
        kernel = BlockKernel(kernel_name, d ** -0.5, 0.0, n)
        blocks = kernel.blocks(attention_blocks(r, cp, comm))
        out = torch.zeros(b, heads, len(mine) * n, d, device=q.device)
        lse = torch.full((b, heads, len(mine) * n), float("-inf"), device=q.device)
        q_r, grad_r = q[:, :, pos], grad[:, :, pos].contiguous()
        runs = []
        for i, block in enumerate(blocks):
            keys = torch.tensor([c * n + j for c in block.k_chunks for j in range(n)], device=q.device)
            first = mine.index(block.q_chunks[0])
            rows = slice(first * n, (first + len(block.q_chunks)) * n)
            runs.append((i, block, keys, rows))
            merge(out[:, :, rows], lse[:, :, rows], *kernel.forward(q_r[:, :, rows], k[:, :, keys], v[:, :, keys], block, i, 0))
        out_r = out.to(q.dtype)
        out_all[:, :, pos] = out_r
        for i, block, keys, rows in runs:  # the merged output and log-sum-exp, sliced as a rank slices them
            g = kernel.backward(grad_r[:, :, rows], q_r[:, :, rows], k[:, :, keys], v[:, :, keys], out_r[:, :, rows],
                                lse[:, :, rows], block, i, 0)
            dq[:, :, pos[rows]] += g[0].to(q.dtype)
            dk[:, :, keys] += g[1].to(k.dtype)
            dv[:, :, keys] += g[2].to(v.dtype)
    return out_all, dq, dk, dv


def whole_attention(q, k, v, grad) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) of causal attention over the whole sequence, the formulas in fp32."""
    s, d = q.shape[2], q.shape[3]
    kernel = BlockKernel("sdpa_math", d ** -0.5, 0.0, s)
    block = Block((0,), (0,))
    q, k, v, grad = (t.float() for t in (q, k, v, grad))
    out, lse = kernel.forward(q, k, v, block, 0, 0)
    return (out, *kernel.backward(grad, q, k, v, out, lse, block, 0, 0))


@functools.lru_cache(maxsize=None)
def check_kernel(kernel_name: str, comm: str, cp: int, heads: int, groups: int, head_dim: int, dtype: torch.dtype,
                 device: str) -> dict:
    """How far `split_blocks` is from `whole_attention` on this device, per tensor: {"out", "dq", "dk",
    "dv": max |error| / max |value|}, "tolerance" and "passed". Inputs from a private generator (the
    run's random streams are untouched); once per process and kind of split."""
    s = 2 * cp * CHECK_CHUNK
    g = torch.Generator(device=device).manual_seed(1234)

    def draw(h: int) -> torch.Tensor:
        return torch.randn(1, h, s, head_dim, generator=g, device=device).to(dtype)

    q, k, v, grad = draw(heads), draw(groups), draw(groups), draw(heads)
    with torch.no_grad():
        got = split_blocks(kernel_name, comm, cp, q, k, v, grad)
        want = whole_attention(q, k, v, grad)
    errors = {name: ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
              for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
    tolerance = TOLERANCE.get(dtype, HALF_TOLERANCE)
    return {**errors, "tolerance": tolerance, "passed": all(e <= tolerance for e in errors.values())}


class KernelCheckFailed(RuntimeError):
    """A context-parallel attention kernel disagrees with whole-sequence attention on this device."""


def checked_splits(model: torch.nn.Module) -> dict[str, str]:
    """Check the kernel each context-parallel split of `model` ran in its last forward with a graph
    (`SequenceSplit.ran`), on its device: the record's `context_parallel_check`, or nothing without
    context parallel. torch's own ring is named as unchecked here. Raises KernelCheckFailed where a
    kernel fails, so the point is an error, not a measurement."""
    seen: dict[str, str] = {}
    for split in {id(s): s for s in _splits(model)}.values():
        if split.path == "torch_ring":
            seen[split.path] = "torch_ring: torch's own ring attention, not checked here"
            continue
        if split.ran is None:  # no forward with a graph ran
            continue
        kernel, heads, groups, head_dim, dtype, device = split.ran
        cp = split.peers.size
        result = check_kernel(kernel, split.comm_type, cp, heads, groups, head_dim, dtype, device)
        worst = max(result[k] for k in ("out", "dq", "dk", "dv"))
        text = (f"{split.comm_type} {kernel} cp{cp} {str(dtype).removeprefix('torch.')} on {device}: output and "
                f"q/k/v gradients within {worst:.1e} of whole-sequence fp32 attention (tolerance {result['tolerance']:.0e})")
        if not result["passed"]:
            detail = ", ".join(f"{k} {result[k]:.2e}" for k in ("out", "dq", "dk", "dv"))
            raise KernelCheckFailed(f"context-parallel attention ({split.comm_type}, {kernel} kernel) is wrong on "
                                    f"{device}: relative errors {detail} against whole-sequence attention "
                                    f"(tolerance {result['tolerance']:.0e}); this point is not measured")
        seen[text] = text
    return {"context_parallel_check": "; ".join(sorted(seen.values()))} if seen else {}


def _splits(model: torch.nn.Module):
    for module in model.modules():
        split = getattr(module, "context_parallel", None)
        if split is not None and hasattr(split, "ran"):
            yield split
