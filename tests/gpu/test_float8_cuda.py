"""`--precision fp8` on a GPU (torchao's float8 training, `measure.float8`; docs/speed.md). Skipped
without a CUDA device or without torchao; `bench/gpu_check.py`'s "torchao FP8" step brings torchao."""

import importlib.util

import pytest
import torch

from recompute_bench.measure.float8 import float8_problem
from test_float8 import SETTINGS, _step  # noqa: F401  (the CPU test's model and settings)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                 reason="torchao not importable (pip install 'recompute-bench[fp8]')")]


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


fp8_units = pytest.mark.skipif(_capability() < (8, 9), reason="needs compute capability 8.9 or later (FP8 tensor cores)")


@fp8_units
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_on_cuda_runs_fp8_gemms_and_saves_what_bf16_saves_in_every_setting(recipe):
    for name, sets in SETTINGS.items():
        loss16, saved16, _, _, _ = _step(sets, "bf16", device="cuda")
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            loss8, saved8, _, grads, _ = _step(sets, "fp8", recipe, device="cuda")
        assert saved8 == saved16, name  # torchao keeps the bf16 input, as a bf16 linear does
        assert loss8 == pytest.approx(loss16, rel=0.02), name
        assert all(torch.isfinite(g).all() for g in grads.values()), name
        assert any("_scaled_mm" in e.key for e in prof.key_averages()), name  # torchao's FP8 GEMMs ran


def test_below_compute_capability_8_9_fp8_is_refused():
    if _capability() >= (8, 9):
        pytest.skip("this GPU has FP8 tensor cores (compute capability 8.9 or later)")
    assert "compute capability 8.9 or later" in float8_problem("cuda", _capability())
