"""torch's cuBLAS workspaces: device memory every CUDA rank allocates through the caching allocator
(so `torch.cuda.max_memory_allocated` shows it) as soon as it runs a matrix product, whatever the
framework above torch. Shared by the harness's estimate (`harness/rank.py`) and Megatron's
(`megatron/buffers.py`). Pure Python.

Source: aten/src/ATen/cuda/CublasHandlePool.cpp (torch 2.11 to 2.13). `getChosenWorkspaceSize`
returns `parseChosenWorkspaceSize()`: with CUBLAS_WORKSPACE_CONFIG set, the sum of SIZE KiB x COUNT
over its ":SIZE:COUNT" pairs (regex ":([0-9]+):([0-9]+)"; a value with no pair falls back to the
default, with a warning); unset, 32 MiB (":4096:8") where the device's compute capability major is 9,
10 or 12 (Hopper, Blackwell) and ":4096:2:16:8" (8.125 MiB) on the others. `setWorkspaceForHandle`
allocates one such workspace per (cuBLAS handle, stream) through `CUDACachingAllocator` and keeps it
in `cublas_handle_stream_to_workspace()` for the rest of the process; cuBLASLt shares it by default
(`unified_cublas_and_lt_workspaces`, TORCH_CUBLASLT_UNIFIED_WORKSPACE unset).
"""

from __future__ import annotations

import re

KiB = 1024

DEFAULT_COMPUTE_CAPABILITY = 90
"""The compute capability (major x 10 + minor) assumed where none is known: an H100's, as framework
megatron's default GPU kind (`megatron.gpu.DEFAULT_GPU`)."""

TORCH_CUBLAS_HANDLES = 2
"""Workspaces a training step allocates: torch keeps one per (cuBLAS handle, stream), handles are per
thread (CublasHandlePool.cpp `getCurrentCUDABlasHandle`, a thread-local pool window), and the autograd
engine runs a CUDA device's backward on a thread of its own (torch/csrc/autograd/engine.cpp
`Engine::start_device_threads`): the forward's matrix products take the main thread's handle, the
backward's a second one."""


def cublas_workspace_bytes(compute_capability: int = DEFAULT_COMPUTE_CAPABILITY,
                           cublas_workspace_config: str | None = None) -> float:
    """One of torch's cuBLAS workspaces (`getChosenWorkspaceSize`) on a device of
    `compute_capability` (major x 10 + minor: 90 for sm_90) under CUBLAS_WORKSPACE_CONFIG
    `cublas_workspace_config` (None: unset)."""
    pairs = re.findall(r":(\d+):(\d+)", cublas_workspace_config or "")
    if pairs:
        return float(sum(int(size) * KiB * int(count) for size, count in pairs))
    if compute_capability // 10 in (9, 10, 12):
        return float(4096 * KiB * 8)
    return float(4096 * KiB * 2 + 16 * KiB * 8)


def torch_cublas_workspaces_bytes(compute_capability: int = DEFAULT_COMPUTE_CAPABILITY,
                                  cublas_workspace_config: str | None = None) -> float:
    """What a training step's cuBLAS workspaces hold: one per handle (`TORCH_CUBLAS_HANDLES`)."""
    return TORCH_CUBLAS_HANDLES * cublas_workspace_bytes(compute_capability, cublas_workspace_config)
