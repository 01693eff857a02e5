"""Device facts for the sweep parent, read through NVML: no torch, no CUDA context.

A process that initialises CUDA keeps a context (hundreds of MiB) on the GPU for as long as it
lives. The sweep parent lives for the whole sweep while its workers measure, so it must learn what
it runs on without torch: the NVIDIA management library answers from the driver alone. Where NVML
or a GPU is absent, the answer is "cpu", as the workers will then measure on the CPU.

NVML numbers every GPU of the machine and ignores CUDA_VISIBLE_DEVICES; a worker's `cuda:0` is the
first visible one, so its CUDA_VISIBLE_DEVICES entry (an index, or a GPU-/MIG- UUID) is looked up.
"""

from __future__ import annotations

import os

from recompute_bench.measure.telemetry import torch_build

CPU = "cpu"

TORCH_FLOOR = (2, 9)
"""The oldest torch the harness measures with, as pyproject.toml declares it: torch 2.9 is the first
release with `torch.distributed.pipelining.ScheduleDualPipeV` (pytorch/pytorch PR #159591, August
2025; torchtitan issue #1679: not in 2.8), and with the other APIs the measurement calls:
`fully_shard` in `torch.distributed.fsdp` (public from 2.6), `distribute_tensor(src_data_rank=)`,
the schedules' `scale_grads` and `step(return_outputs=)`. Tested on 2.13 (CPU) and meant for the
lent GPU machines' 2.11."""


def check_torch() -> None:
    """BadInput (one line, the fix) when the installed torch is older than TORCH_FLOOR; read from
    torch's files, so this process does not import it. Nothing to say where torch is absent (the
    import that needs it says so) or its version cannot be read."""
    from recompute_bench.config.schema import BadInput

    version, _ = torch_build()
    numbers = [int(x) for x in version.split("+")[0].split(".")[:2] if x.isdigit()] if version else []
    if len(numbers) == 2 and tuple(numbers) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise BadInput(f"torch {version} is older than {floor}, the oldest this harness measures with (its pipeline "
                       f"schedules and FSDP2); pip install 'torch>={floor},<3'")


def _visible(index: int) -> str | None:
    """The NVML name (an index or a GPU-/MIG- UUID) of what CUDA calls device `index`; None when
    CUDA_VISIBLE_DEVICES shows fewer devices."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return str(index)
    entries = []
    for entry in (e.strip() for e in value.split(",")):
        # CUDA stops at the first entry it cannot parse ("", "-1", "NoDevFiles"): none after it is visible.
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    return entries[index] if index < len(entries) else None


def _decode(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def visible_gpu_name(index: int = 0) -> str:
    """Name of the GPU a worker's `cuda:<index>` would be (e.g. "NVIDIA H100 80GB HBM3"), or "cpu"
    where NVML, its driver library or that GPU is missing."""
    name = _ask_nvml(index, lambda nvml, handle: _decode(nvml.nvmlDeviceGetName(handle)))
    return CPU if name is None else name


def visible_gpu_capability(index: int = 0) -> tuple[int, int] | None:
    """(major, minor) CUDA compute capability of the GPU a worker's `cuda:<index>` would be, from
    NVML; None where NVML, its driver library or that GPU is missing."""
    return _ask_nvml(index, lambda nvml, handle: tuple(nvml.nvmlDeviceGetCudaComputeCapability(handle)))


def _ask_nvml(index: int, ask):
    """`ask(pynvml, handle)` of the GPU a worker's `cuda:<index>` would be, or None where NVML, its
    driver library or that GPU is missing."""
    entry = _visible(index)
    if entry is None:
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver library (NVMLError_LibraryNotFound) or no driver loaded: no GPU here
        return None
    try:
        if entry.isdigit():
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(entry))
        else:
            handle = pynvml.nvmlDeviceGetHandleByUUID(entry)
        return ask(pynvml, handle)
    except Exception:  # an index past the last GPU, an unknown UUID, no permission
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def visible_gpu_count() -> int | None:
    """How many GPUs a process started here sees as cuda:0, cuda:1, ... (CUDA_VISIBLE_DEVICES
    applied: CUDA stops at its first entry that names no GPU), from NVML; None where NVML cannot
    tell (no pynvml, no driver library)."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # ImportError, or no driver library / driver loaded
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        n = 0
        while count and (entry := _visible(n)) is not None:
            try:
                if entry.isdigit():
                    pynvml.nvmlDeviceGetHandleByIndex(int(entry))
                else:
                    pynvml.nvmlDeviceGetHandleByUUID(entry)
            except Exception:  # an index past the last GPU, an unknown UUID
                break
            n += 1
        return n
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def default_device_type() -> str:
    """What a worker without --device measures on: "cuda" when a GPU is visible and torch was built
    with CUDA, else "cpu" (the same choice as `measure.point.pick_device`, made without torch)."""
    _, cuda = torch_build()
    return "cuda" if cuda and visible_gpu_name() != CPU else CPU
