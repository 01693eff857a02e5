"""What torch's attention kernels execute under the causal mask: the (query, key) pairs of every tile
they run, for the hardware FLOPs (no torch).

A fused kernel (flash, memory-efficient, cuDNN on CUDA; torch's flash kernel on a CPU) walks the
s x s score matrix in tiles of `rows` queries by `cols` keys and skips a tile only when the causal
mask hides all of it: a tile on the diagonal runs whole, masked half included. So it runs about half
the square plus half a tile's width along the diagonal, where `FlopCounterMode` (whose formulas
ignore the mask) counts the whole square, and Megatron's model FLOPs count exactly half. The math
paths (`--attention-backend math`, sdpa's math fallback) compute the whole square and then mask it.

Tile sizes, forward and backward, (queries, keys), as torch 2.13 launches them on sm90 (H100/H200):

- flash (FlashAttention-2 vendored in ATen, `transformers/cuda/flash_attn`): the head dimension is
  rounded up to 32, 64, 96, 128, 160, 192, 224 or 256 (`HEADDIM_SWITCH`); the forward's tiles are
  `run_mha_fwd_hdim*` in `flash_fwd_launch_template.h` for a GPU that is not sm86/sm89 (with dropout
  where they differ), the backward's `run_mha_bwd_hdim*` in `flash_bwd_launch_template.h` for 227 KB
  of shared memory per block. Not modelled: the split-KV forward (64 x 128 tiles at head dim 128)
  that `set_params_splitkv` picks without dropout when batch x heads x ceil(s / 64) is below 80% of
  twice the SM count, i.e. short sequences on few heads;
- efficient (CUTLASS memory-efficient attention, `mem_eff_attention`): forward 64 x 64 up to head
  dimension 64, 64 x 128 up to 128, 32 x 128 above (`dispatch_cutlassF_*_sm80`, first kernel whose
  kMaxK covers the head dimension); backward assumed 64 x 64 (its dispatcher, `dispatch_cutlassB`,
  also weighs shared memory and alignment, which the analysis does not see);
- cudnn: assumed 128 x 128 both ways (cuDNN's kernels are not open source);
- flash on a CPU (`cpu_flash_attention`, `ATen/native/cpu/FlashAttentionKernel.cpp`): 256 queries
  for s >= 768, 64 for s >= 192, else 32, by 512 keys (fewer when the sequence is shorter), both
  ways.

Tile sizes matter little for long sequences: on CUDA at s = 8192 every tile above runs 50.4% to
50.8% of the square.
"""

from __future__ import annotations

import functools

FUSED_KERNELS = ("flash", "efficient", "cudnn")
"""torch's fused attention kernels (`torch.nn.attention.SDPBackend`'s names): they keep no s x s
tensor, and their backward recomputes QK^T."""
ATTENTION_KERNELS = ("math", "sdpa_math", *FUSED_KERNELS)
"""Every kernel the analysis models (`DenseSpec.attention_kernel`)."""

_FLASH_SM90 = {  # rounded head dim: (forward, forward with dropout, backward) tiles
    32: ((128, 128), (128, 128), (128, 128)),
    64: ((128, 128), (128, 64), (128, 128)),
    96: ((128, 64), (128, 64), (64, 128)),
    128: ((128, 64), (128, 32), (64, 128)),
    160: ((128, 32), (128, 32), (64, 64)),
    192: ((128, 64), (64, 64), (64, 64)),
    224: ((128, 64), (128, 64), (64, 64)),
    256: ((64, 64), (64, 64), (64, 64)),
}


def attention_tiles(kernel: str, device: str, head_dim: int, seq_length: int,
                    dropout: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """(forward, backward) tiles, each (queries, keys), of fused `kernel` on `device` ("cuda" or
    "cpu") for one head dimension (q and k's), as the module docstring lists them."""
    if device == "cpu":  # torch's CPU flash kernel is the only fused one there
        rows = 256 if seq_length >= 768 else 64 if seq_length >= 192 else 32
        return (rows, 512), (rows, 512)
    if kernel == "flash":
        bucket = next(d for d in _FLASH_SM90 if head_dim <= d)
        forward, with_dropout, backward = _FLASH_SM90[bucket]
        return (with_dropout if dropout else forward), backward
    if kernel == "efficient":
        forward = (64, 64) if head_dim <= 64 else (64, 128) if head_dim <= 128 else (32, 128)
        return forward, (64, 64)
    return (128, 128), (128, 128)


@functools.lru_cache(maxsize=None)
def causal_pairs(seq_length: int, rows: int, cols: int) -> int:
    """(query, key) pairs a causal kernel with `rows` x `cols` tiles evaluates over an s x s score
    matrix: every tile holding at least one pair the mask keeps (key <= query), whole, clipped to
    the matrix. Query block i reaches key blocks 0 .. (its last query) // cols."""
    s = seq_length
    total = 0
    for start in range(0, s, rows):
        height = min(rows, s - start)
        last_query = start + height - 1
        total += height * min(s, (last_query // cols + 1) * cols)
    return total
