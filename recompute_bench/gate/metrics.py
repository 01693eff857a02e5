"""The metrics a golden row carries and how each is compared: kind, direction, default tolerance,
whether it is wall-clock (not gated on CPU rows) or deterministic (any change fails)."""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class Metric:
    """How one metric is compared: kind, direction and default relative tolerance."""

    name: str
    kind: str
    """perf, memory or exact (no better direction)."""
    higher_is_better: bool | None
    tolerance: float | None
    """Relative tolerance; 0 is exact; None reports the difference without gating it."""
    wall_clock: bool = False
    """A wall-clock metric: reported but not gated on golden rows measured on a CPU."""
    deterministic: bool = False
    """The same program on the same config gives the same value, so a difference in either direction
    means the program changed: worse is a regression, better is "changed" (it fails too)."""


# Wall-clock numbers on a CPU swing with whatever else runs there: on the shared 2-core machine the
# CPU golden was made on, the same `tiny` point ran from 0.0002 to 0.0038 TFLOP/s (18x) depending
# on a concurrent test run. No tolerance short of ~99% would stay quiet, so CPU rows report
# TFLOP/s with its signed difference and the deterministic metrics (FLOPs, bytes, parameters,
# loss) carry the gate. A row's `tolerance` column or --tolerance still gates it on purpose.
METRICS = {m.name: m for m in (
    Metric("tflops_per_gpu", "perf", True, 0.05, wall_clock=True),
    Metric("step_time_s", "perf", False, None, wall_clock=True),  # same information as TFLOP/s: reported only
    Metric("peak_allocated_bytes", "memory", False, 0.05),
    Metric("peak_reserved_bytes", "memory", False, 0.05),
    Metric("activation_bytes", "memory", False, 0.0, deterministic=True),
    Metric("measured_flops_per_step", "perf", False, 0.0, deterministic=True),
    Metric("hardware_flops_per_step", "perf", False, 0.0, deterministic=True),
    Metric("model_flops_per_step", "exact", None, 0.0, deterministic=True),
    Metric("num_parameters", "exact", None, 0.0, deterministic=True),
    Metric("loss", "exact", None, 0.01),  # kernels differ slightly between CPUs in bf16
)}
