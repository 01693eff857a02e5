"""Every test not marked `gpu` runs on the CPU, on any machine (`on_the_cpu`): its 1e-6 and bitwise
comparisons hold in fp32 on a CPU, not under CUDA's TF32, atomics or NCCL. Helpers that measure in
this process pass `helpers.CPU`; the processes a test starts (workers, torchrun ranks) see no GPU.
Shared helpers live in `helpers.py`.

Under pytest-xdist (`make test-all`: two workers) the machine's cores are shared out among the
workers (`pytest_configure`): torch's intra-op threads, and OMP_NUM_THREADS for the processes a test
starts. Two workers of two threads each on CI's two cores spin-wait for each other's threads, which
made the small CPU steps of the slow tests several times slower."""

import os

import pytest


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:  # one process (`make test`): torch's default, every core
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // int(workers))))  # a set value is kept
    import torch
    torch.set_num_threads(int(threads))


@pytest.fixture(autouse=True)
def on_the_cpu(request, monkeypatch):
    """Hide every GPU from a test not marked gpu: CUDA_VISIBLE_DEVICES="" reaches the processes it
    starts (a worker's or torchrun rank's torch then sees no CUDA device and takes gloo) and the
    NVML lookups of this process (`launch.devices`), which the CLI's default device follows. CUDA
    may already be initialised in this process by a GPU test, so in-process helpers pass `CPU`."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
