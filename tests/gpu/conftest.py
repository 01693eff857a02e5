"""Every GPU test leaves the process as it found it: the CUDA allocator's memory fraction, the sync
debug mode, the current device, the matmul and determinism settings are read before each test and
after it; a test that changed one fails, naming it, and the value is put back, so no later test
runs under another test's cap or mode (`run --memory-limit-gb` in-process once left a ~1 MiB
allocator cap on the whole pytest process)."""

from __future__ import annotations

import pytest
import torch


def _fraction(device: int) -> float:
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch 2.13 has it
    return get(device) if get is not None else 1.0


def process_state() -> dict[str, object]:
    """The process-wide settings a GPU test could change, by name."""
    state: dict[str, object] = {f"memory fraction of cuda:{d}": _fraction(d) for d in range(torch.cuda.device_count())}
    state.update({"sync debug mode": torch.cuda.get_sync_debug_mode(), "current device": torch.cuda.current_device(),
                  "float32 matmul precision": torch.get_float32_matmul_precision(),
                  "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
                  "cudnn deterministic": torch.backends.cudnn.deterministic,
                  "cudnn benchmark": torch.backends.cudnn.benchmark, "default dtype": torch.get_default_dtype()})
    return state


def restore(name: str, value: object) -> None:
    """Put one setting of `process_state` back."""
    if name.startswith("memory fraction of cuda:"):
        torch.cuda.set_per_process_memory_fraction(value, int(name.rsplit(":", 1)[1]))
    elif name == "sync debug mode":
        torch.cuda.set_sync_debug_mode(value)
    elif name == "current device":
        torch.cuda.set_device(value)
    elif name == "float32 matmul precision":
        torch.set_float32_matmul_precision(value)
    elif name == "deterministic algorithms":
        torch.use_deterministic_algorithms(value)
    elif name == "cudnn deterministic":
        torch.backends.cudnn.deterministic = value
    elif name == "cudnn benchmark":
        torch.backends.cudnn.benchmark = value
    elif name == "default dtype":
        torch.set_default_dtype(value)


@pytest.fixture(autouse=True)
def leaves_the_process_as_found():
    if not torch.cuda.is_available():
        yield
        return
    before = process_state()
    yield
    after = process_state()
    changed = {name: (before[name], after[name]) for name in before if after.get(name) != before[name]}
    for name, (value, _) in changed.items():
        restore(name, value)
    assert not changed, f"the test left process-wide state changed (now restored): {changed}"
