"""`plan --framework megatron --profile`: measure the rates the time model prices work at on this
machine's GPU, and cache them (the format and how they override the datasheet:
`analysis/gpu_rates.py`).

- bf16 matrix FLOP/s: a square 8192 bf16 matmul (2 x 8192^3 FLOPs), the median of `steps` timed runs;
- fp8 matrix FLOP/s: the same shape through `torch._scaled_mm` in float8_e4m3fn with a bf16 output
  (what Transformer Engine's FP8 GEMMs run on Hopper and newer), where this GPU and torch run it;
- HBM bytes/s: a device-to-device copy of 1 GiB (it reads and writes 1 GiB each);
- each GEMM of the run's own shapes (`time_model.gemm_shapes`: m x k by k x n in bf16, or FP8 through
  `torch._scaled_mm` where it runs), FLOP/s, which the model then prices those GEMMs at.

Each run is timed with CUDA events on the device's stream (`measure.timing.timed`). NVLink needs two
GPUs and is not measured.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Callable

import torch

from recompute_bench.analysis.cache import read_or_measure
from recompute_bench.analysis.gpu_rates import PROFILE_MATMUL_SIZE, RATES_SCHEMA, rates_cache_path, read_rates_profile
from recompute_bench.config.schema import BadInput
from recompute_bench.measure.telemetry import device_name
from recompute_bench.measure.timing import timed

MATMUL_SIZE = PROFILE_MATMUL_SIZE
COPY_BYTES = 2**30


def _median_seconds(device: torch.device, fn: Callable[[], Any], warmup: int, steps: int) -> float:
    """The median of `steps` runs of `fn` on `device`, each timed by `measure.timing.timed`, after `warmup` runs."""
    for _ in range(warmup):
        fn()
    return statistics.median([timed(device, fn) for _ in range(steps)])


def _fp8_flops(device: torch.device, warmup: int, steps: int) -> float | None:
    """FP8 GEMM FLOP/s, or None where torch or the GPU has no FP8 GEMM."""
    n = MATMUL_SIZE
    if not hasattr(torch, "_scaled_mm") or torch.cuda.get_device_capability(device) < (8, 9):
        return None
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS LT wants it
    one = torch.ones((), device=device)
    try:
        seconds = _median_seconds(device, lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                                  warmup, steps)
    except (RuntimeError, TypeError):
        return None
    return 2 * n**3 / seconds


def _gemm_flops(device: torch.device, m: int, n: int, k: int, precision: str, warmup: int, steps: int) -> float | None:
    """FLOP/s of one [m, k] x [k, n] GEMM in `precision` (bf16/fp16, or fp8 by `torch._scaled_mm`); None where it cannot run."""
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    if precision == "fp8":
        if not hasattr(torch, "_scaled_mm") or torch.cuda.get_device_capability(device) < (8, 9):
            return None
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        fn = lambda: a @ b  # noqa: E731
    try:
        return 2 * m * n * k / _median_seconds(device, fn, warmup, steps)
    except (RuntimeError, TypeError):
        return None


def measure_rates(device: torch.device, warmup: int = 3, steps: int = 10,
                  shapes: list[tuple[float, float, float, str]] | tuple = ()) -> dict[str, Any]:
    """The rates of the GPU `device`, measured now, with the GEMMs of `shapes` ((m, n, k, precision))."""
    n = MATMUL_SIZE
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    bf16 = 2 * n**3 / _median_seconds(device, lambda: a @ b, warmup, steps)
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    hbm = 2 * COPY_BYTES / _median_seconds(device, lambda: dst.copy_(src), warmup, steps)
    src = dst = None  # free the 2 GiB before the GEMMs
    gemms = []
    for m, n, k, precision in shapes:
        if precision in ("bf16", "fp16", "fp8"):
            flops = _gemm_flops(device, int(m), int(n), int(k), precision, warmup, steps)
            if flops:
                gemms.append({"m": m, "n": n, "k": k, "precision": precision, "flops_per_s": flops})
    return {"schema": RATES_SCHEMA, "device_name": device_name(device), "torch": torch.__version__,
            "steps": steps, "measured": {"bf16_flops": bf16, "fp8_flops": _fp8_flops(device, warmup, steps),
                                         "hbm_bytes_per_s": hbm}, "gemms": gemms}


def cached_rates(folder: Path = Path("results/profiles"), shapes: list[tuple[float, float, float, str]] | tuple = ()
                 ) -> tuple[dict[str, Any], Path, bool]:
    """This machine's GPU's rates (with the GEMMs of `shapes`): read from the cache (one file per
    device and set of shapes), or measured and cached; BadInput without a GPU."""
    if not torch.cuda.is_available():
        raise BadInput("--profile measures this machine's GPU, and there is none here; drop --profile (the datasheet "
                       "rates of --gpu price the plan)")
    device = torch.device("cuda", torch.cuda.current_device())
    return read_or_measure(rates_cache_path(device_name(device), folder, shapes), read_rates_profile,
                           lambda: measure_rates(device, shapes=shapes))
