"""Device memory beyond the allocated bytes: what the allowance on top of the allocated peak is made
of, whether a setting fits a budget with it, only within it ("tight"), or not at all, and what
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` changes. Pure Python.

The allowance stays the flat one (`ALLOWANCE_FRACTION` of the allocated peak plus
`ALLOWANCE_BYTES`), and here is why no better one follows from torch's caching allocator's
rules (c10/cuda/CUDACachingAllocator.cpp). The rules bound the waste of a single block: a request
is rounded up to 512 bytes (`kMinBlockSize`); requests up to 1 MiB share 2 MiB segments
(`kSmallBuffer`), requests up to 10 MiB carve 20 MiB ones (`kLargeBuffer`), larger ones get a
segment of their own rounded up to 2 MiB (`kRoundLarge`); a cached large block is split only when
more than 1 MiB would remain (`should_split`). What makes reserved memory exceed allocated memory at
a peak is not that per-block waste but free blocks between live ones that are each too small for
the next request (a freed [s, b, h] hole where an [s, b, f] tensor is wanted), and which holes exist
depends on the order and sizes of every allocation and free before the peak, which the allocated-
bytes model does not carry. So the fraction stays a stated allowance, not a derived one, and the
plan marks settings that fit only inside it as "tight".

With `expandable_segments:True` the allocator keeps one segment per stream and grows it by mapping
pages (2 MiB for small requests, 20 MiB for large ones) at the lowest free address, splits any block
with 512 bytes to spare, and on an out-of-memory unmaps the free pages and maps them where the
request fits: free memory stranded between live blocks can be returned and reused, so reserved
memory stays within about a page per live region of the allocated bytes. It is the setting Megatron
Bridge's performance recipes run with (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`), adopted
after the seeds' Llama 3 70B run went out of memory above its logged allocated peak.
"""

from __future__ import annotations

from typing import Any

ALLOWANCE_FRACTION = 0.10
"""Allocator allowance: reserved minus allocated (fragmentation of the caching allocator), as a
fraction of the estimated allocated peak."""
ALLOWANCE_BYTES = 2**30
"""Fixed allowance: what the device must hold but `torch.cuda.max_memory_allocated` does not show: the
CUDA context with its loaded kernels, the cuBLAS and cuDNN handles' own state and NCCL's buffers, all
allocated outside torch's caching allocator. torch's cuBLAS workspaces are not part of it: they are
allocated through the caching allocator (CublasHandlePool.cpp `getNewWorkspace`), so they are in the
allocated peak, and the estimate counts them there (`harness.rank.run_buffer_bytes`,
`megatron.buffers.buffer_bytes`, both through `analysis.cuda_workspaces`)."""


def device_bytes_needed(peak_allocated: float, allowance_fraction: float = ALLOWANCE_FRACTION,
                        allowance_bytes: float = ALLOWANCE_BYTES) -> float:
    """Device memory a rank needs: the allocated peak plus the stated allocator allowance."""
    return peak_allocated * (1 + allowance_fraction) + allowance_bytes

def gib_of(needed: float, budget: float) -> str:
    """"needs" against "budget" in GiB, as a plan says it ("1.07 GiB of 1.00 GiB"), with the fewest
    digits (two at least, six at most) that tell the two apart: a need just above the budget never
    reads as equal to it."""
    digits = 2
    while digits < 6 and f"{needed / 2**30:.{digits}f}" == f"{budget / 2**30:.{digits}f}":
        digits += 1
    return f"{needed / 2**30:.{digits}f} GiB of {budget / 2**30:.{digits}f} GiB"


FITS, TIGHT, OVER = "fits", "tight", "over"

EXPANDABLE_SEGMENTS = ("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets the caching allocator grow one segment "
                       "per stream page by page and remap free pages where a request fits, so free memory between "
                       "live blocks is not stranded: the fragmentation part of the allowance shrinks toward a page "
                       "per live region")


def allowance_parts(peak_allocated: float, fraction: float, fixed: float) -> dict[str, float]:
    """The allowance on top of `peak_allocated`, by part (bytes)."""
    return {f"caching allocator: reserved above allocated ({100 * fraction:g}% of the allocated peak)": fraction * peak_allocated,
            "CUDA context, NCCL buffers, cuDNN/cuBLAS handles (fixed)": fixed}


def fit(peak_allocated: float, budget: float, fraction: float, fixed: float) -> str:
    """FITS: the peak plus the whole allowance fits the budget; TIGHT: only the peak plus the fixed
    part does (it fits if the allocator's fragmentation stays below what is left); OVER: not even that."""
    if device_bytes_needed(peak_allocated, fraction, fixed) <= budget:
        return FITS
    if peak_allocated + fixed <= budget:
        return TIGHT
    return OVER


def allowance_row(fraction: float, fixed: float) -> dict[str, Any]:
    """The allowance as `plan --json` carries it."""
    return {"fraction": fraction, "bytes": fixed,
            "parts": ["caching allocator: reserved above allocated, as a fraction of the allocated peak",
                      "CUDA context, NCCL buffers, cuDNN/cuBLAS handles (fixed)"],
            "derived": False,
            "why_not_derived": "the allocator's rules bound each block's rounding (512 B, 2/20 MiB segments, 2 MiB "
                               "rounding, no split under 1 MiB of remainder), but fragmentation depends on the order "
                               "and sizes of every allocation before the peak, which the model does not carry",
            "expandable_segments": EXPANDABLE_SEGMENTS}
