"""What the process runs on: the environment block of a record, CUDA allocator figures and NVML.

On a machine without CUDA every memory figure is None ("not measured"), never zero.
"""

from __future__ import annotations

import datetime
import platform
import socket
import subprocess
import threading
from importlib import metadata
from pathlib import Path

import torch


def device_name(device: torch.device) -> str:
    """Marketing name of the GPU, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def package_version() -> str:
    try:
        return metadata.version("recompute-bench")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def git_sha() -> str | None:
    """Commit of the checkout the package runs from, if it is one."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment(device: torch.device) -> dict:
    """The record's `env` block."""
    return {
        "device": device.type,
        "device_name": device_name(device),
        "cpu": platform.processor() or platform.machine(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda if device.type == "cuda" else None,
        "package_version": package_version(),
        "git_sha": git_sha(),
        "hostname": socket.gethostname(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def cuda_memory(device: torch.device) -> dict:
    """Allocator peaks since the last reset, retries and OOMs; all None on CPU."""
    if device.type != "cuda":
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None, "alloc_retries": None, "num_ooms": None}
    stats = torch.cuda.memory_stats(device)
    return {
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "num_ooms": stats.get("num_ooms", 0),
    }


class NvmlSampler:
    """Samples device memory used (NVML, the whole GPU) in a thread; `peak` is None where NVML is absent."""

    def __init__(self, device: torch.device, interval_s: float = 0.05):
        self.peak: int | None = None
        self.total: int | None = None
        self._handle = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.interval_s = interval_s
        if device.type != "cuda":
            return
        try:
            import pynvml
            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            handle = None
            for i in range(pynvml.nvmlDeviceGetCount()):  # NVML ignores CUDA_VISIBLE_DEVICES: match by UUID
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                nv_uuid = pynvml.nvmlDeviceGetUUID(h)
                nv_uuid = nv_uuid.decode() if isinstance(nv_uuid, bytes) else nv_uuid
                if nv_uuid.replace("GPU-", "") == uuid.replace("GPU-", ""):
                    handle = h
            self._handle = handle or pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self._pynvml = pynvml
            self.total = pynvml.nvmlDeviceGetMemoryInfo(self._handle).total
        except Exception:  # no driver library, no permission: telemetry degrades to "not measured"
            self._handle = None

    def _sample(self) -> None:
        used = self._pynvml.nvmlDeviceGetMemoryInfo(self._handle).used
        self.peak = used if self.peak is None else max(self.peak, used)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "NvmlSampler":
        if self._handle is not None:
            self._sample()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()
