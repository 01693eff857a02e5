"""Every test not marked `gpu` runs on the CPU, on any machine (`on_the_cpu`): its 1e-6 and bitwise
comparisons hold in fp32 on a CPU, not under CUDA's TF32, atomics or NCCL. Helpers that measure in
this process pass `helpers.CPU`; the processes a test starts (workers, torchrun ranks) see no GPU.
Shared helpers live in `helpers.py`."""

import pytest


@pytest.fixture(autouse=True)
def on_the_cpu(request, monkeypatch):
    """Hide every GPU from a test not marked gpu: CUDA_VISIBLE_DEVICES="" reaches the processes it
    starts (a worker's or torchrun rank's torch then sees no CUDA device and takes gloo) and the
    NVML lookups of this process (`launch.devices`), which the CLI's default device follows. CUDA
    may already be initialised in this process by a GPU test, so in-process helpers pass `CPU`."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
