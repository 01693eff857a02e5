"""A rank's memory: the CUDA allocator's figures (`cuda_memory`), the whole GPU's use as NVML samples it
(`NvmlSampler`), the measured window over them (`reset_peaks`, `open_window`, `close_window`), and the
allocator's cap (`limit_memory`).

A point's memory figures are the measured window's: the peaks, and the allocator's retry and OOM
counts, from the reset at the window's start; the run's peaks (`run_peak_*`) also cover the build,
the probe step and the warm-up. On a machine without CUDA every figure is None ("not measured"),
never zero.
"""

from __future__ import annotations

import threading

import torch


def cuda_memory(device: torch.device) -> dict:
    """Allocator peaks, retries and OOMs since the last reset of each (`reset_peak_memory_stats`,
    `reset_accumulated_memory_stats`: `open_window` resets both when the measured window starts);
    all None on CPU."""
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


def reset_peaks(device: torch.device) -> None:
    """Count the allocator's peaks from here (the point's start, before its model is built)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def current(device: torch.device) -> dict:
    """The allocator's figures so far, those this device has (none on a CPU): what a rank's entry
    is updated with after every step, and when a point fails."""
    return {k: v for k, v in cuda_memory(device).items() if v is not None}


def open_window(device: torch.device) -> dict:
    """Start the measured window: returns the run's figures so far (the build, probe and warm-up),
    then restarts the peaks and the allocator's retry and OOM counts, which accumulate from the
    process's start until reset."""
    run_peak = cuda_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)
    return run_peak


def close_window(device: torch.device, run_peak: dict) -> dict:
    """The measured window's figures, and on CUDA the run's peaks (`run_peak_*`): the larger of the
    peak before the window (`open_window`'s) and the window's own."""
    window = cuda_memory(device)
    if device.type != "cuda":
        return window
    return {**window,
            "run_peak_allocated_bytes": max(run_peak["peak_allocated_bytes"], window["peak_allocated_bytes"]),
            "run_peak_reserved_bytes": max(run_peak["peak_reserved_bytes"], window["peak_reserved_bytes"])}


def limit_memory(device: torch.device, memory_limit_gb: float | None) -> None:
    """Cap this process's CUDA allocator at `memory_limit_gb` GiB (`set_per_process_memory_fraction`),
    so a card's OOM can be produced on a larger one. Refused earlier on a CPU."""
    if memory_limit_gb:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, memory_limit_gb * 2**30 / total), device)
