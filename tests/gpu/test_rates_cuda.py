"""`plan --framework megatron --profile`: the rates measured on this GPU, cached, and priced with.
Skipped without CUDA."""

import pytest
import torch

from recompute_bench.analysis.gpu_rates import DATASHEET, read_rates_profile, with_profile
from recompute_bench.measure.rates import cached_rates
from recompute_bench.config.presets import gpu_type

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_measured_rates_stay_under_the_datasheet_peak_and_are_cached(tmp_path):
    profile, path, cached = cached_rates(tmp_path)
    assert not cached and read_rates_profile(path) == profile
    measured = profile["measured"]
    assert measured["bf16_flops"] > 0 and measured["hbm_bytes_per_s"] > 0
    kind = gpu_type(profile["device_name"])
    if kind in DATASHEET:  # a measurement cannot beat the dense peak (5% for clock boost)
        sheet = DATASHEET[kind]
        assert measured["bf16_flops"] <= 1.05 * sheet.matrix_flops["bf16"]
        assert measured["hbm_bytes_per_s"] <= 1.05 * sheet.hbm_bytes_per_s
        if measured["fp8_flops"]:
            assert measured["fp8_flops"] <= 1.05 * sheet.matrix_flops["fp8"]
        assert with_profile(sheet, profile).matrix_flops["bf16"] == measured["bf16_flops"]
    again, _, cached = cached_rates(tmp_path)
    assert cached and again == profile


def test_the_run_s_own_gemm_shapes_are_measured_cached_apart_and_priced_with(tmp_path):
    from recompute_bench.analysis.gpu_rates import ACHIEVED
    from recompute_bench.analysis.megatron.time_ops import Op

    shapes = [(4096, 2560, 8192, "bf16"), (4096, 8192, 2048, "bf16")]
    profile, path, cached = cached_rates(tmp_path, shapes=shapes)
    assert not cached and path != cached_rates(tmp_path)[1]  # another set of shapes, another file
    measured = {(g["m"], g["n"], g["k"], g["precision"]): g["flops_per_s"] for g in profile["gemms"]}
    assert set(measured) == set(shapes) and all(0 < f <= 1.05 * 989.5e12 * 2.6 for f in measured.values())
    kind = gpu_type(profile["device_name"])
    if kind in ACHIEVED:
        rates = with_profile(ACHIEVED[kind], profile)
        op = Op("g", "matrix", flops=2 * 4096 * 2560 * 8192, shape=(4096, 2560, 8192))
        assert op.seconds(rates) == op.flops / measured[(4096, 2560, 8192, "bf16")]
