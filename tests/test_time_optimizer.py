"""The optimizer step as Megatron runs it (analysis/megatron/time_optimizer.py): each pass's bytes for a
hand-counted rank, the kernel each runs at, and fused Adam priced at the share of the copy our H200 measured."""

import pytest
from helpers import config

from recompute_bench.analysis import gpu_rates
from recompute_bench.analysis.megatron import time_model as tm
from recompute_bench.analysis.megatron.time_optimizer import shard_parameters
from recompute_bench.config import gpus

H100 = gpu_rates.datasheet_rates("h100")
N = 1_000_000
"""Parameters on the rank; with the distributed optimizer over dp 4 its shard is S = 250,000."""
S = N / 4


def megatron(**overrides):
    return config("llama3-70b", training__framework="megatron", **overrides)


def passes(cfg, parameters=N):
    return {op.name: (op.bytes, op.kernel) for op in tm.optimizer_ops(cfg, parameters)}


def bf16_distributed(**overrides):
    return megatron(**{"training__precision": "bf16", "parallel__use_distributed_optimizer": True,
                       "parallel__data_parallel_size": 4, **overrides})


def test_bf16_with_the_distributed_optimizer_makes_five_passes():
    # fp32 grad buffer (the shard's main grads are views of it: no copy), no loss scaler
    assert passes(bf16_distributed()) == {
        "optimizer.zero_grad_buffer": (4 * N, None),  # the whole, unsharded fp32 grad buffer
        "optimizer.grad_norm": (4 * S, "multi_tensor"),  # multi_tensor_l2norm reads the shard's grads
        "optimizer.clip_grad": (8 * S, "multi_tensor"),  # multi_tensor_scale_tensor reads and writes them
        "optimizer.adam": (28 * S, "adam"),  # reads grad, master, m, v; writes master, m, v
        "optimizer.main_params_to_model_params": (6 * S, None),  # per-tensor copy_: fp32 in, bf16 out
    }
    assert [op.name for op in tm.optimizer_ops(bf16_distributed(), N)][0] == "optimizer.zero_grad_buffer"


def test_a_bf16_grad_buffer_halves_the_zeroing_and_adds_the_fp32_copy_of_the_shard():
    got = passes(bf16_distributed(training__grad_reduce_in_bf16=True))
    assert got["optimizer.zero_grad_buffer"] == (2 * N, None)
    assert got["optimizer.main_grads_to_fp32"] == (6 * S, None)  # `.float()` of a bf16 view: read 2, write 4


def test_fp16_adds_the_unscale_pass_and_copies_out_with_a_multi_tensor_kernel_without_the_distributed_optimizer():
    got = passes(megatron(training__precision="fp16"))
    assert got == {
        "optimizer.zero_grad_buffer": (2 * N, None),  # fp16 runs reduce in fp16
        "optimizer.main_grads_to_fp32": (6 * N, None),
        "optimizer.unscale_main_grads": (8 * N, "multi_tensor"),  # _amp_foreach_non_finite_check_and_unscale_
        "optimizer.grad_norm": (4 * N, "multi_tensor"),
        "optimizer.clip_grad": (8 * N, "multi_tensor"),
        "optimizer.adam": (28 * N, "adam"),
        "optimizer.main_params_to_model_params": (6 * N, "multi_tensor"),  # multi_tensor_scale by 1.0
    }
    # bf16 has no overflow buffer: Float16OptimizerWithFloat16Params copies tensor by tensor
    assert passes(megatron(training__precision="bf16"))["optimizer.main_params_to_model_params"] == (6 * N, None)


@pytest.mark.parametrize("recipe, amax, written", [("tensorwise", True, 1), ("blockwise", True, 1), ("mxfp8", True, 2),
                                                   ("delayed", False, 1)])
def test_fp8_weights_change_the_copy_out_into_an_amax_pass_and_a_cast(recipe, amax, written):
    cfg = bf16_distributed(training__precision="fp8", training__fp8_recipe=recipe, training__fp8_param_gather=True,
                           model__transformer_impl="transformer_engine")
    got = passes(cfg)
    assert got["optimizer.main_params_to_model_params"] == ((4 + written) * S, None)
    assert got.get("optimizer.main_params_amax") == ((4 * S, None) if amax else None)
    assert "optimizer.main_params_amax" not in passes(bf16_distributed(training__precision="fp8",
                                                                       training__fp8_recipe=recipe))


def test_te_fused_adam_with_master_weights_writes_the_weight_itself():
    cfg = bf16_distributed(training__use_precision_aware_optimizer=True, training__grad_reduce_in_bf16=True)
    got = passes(cfg)
    # decoupled bf16 grad read in place (2), fp32 moments read + written (16), bf16 weight and int16 remainder
    # read + written (8); no grad copy, no copy-out
    assert got["optimizer.adam"] == ((2 + 16 + 8) * S, "adam")
    assert "optimizer.main_grads_to_fp32" not in got and "optimizer.main_params_to_model_params" not in got


def test_the_experts_shard_over_the_expert_data_parallel_group():
    cfg = bf16_distributed(parallel__context_parallel_size=2)
    # dense over dp x cp = 8 ranks; experts over tp x cp x dp / (etp x ep) = 8 as well, here
    assert shard_parameters(cfg, {"dense": N, "expert": 2 * N}) == (3 * N, N / 8 + 2 * N / 8)
    assert shard_parameters(megatron(), N) == (N, N)  # no distributed optimizer: every parameter


def test_adam_runs_at_the_share_of_the_copy_our_h200_measured():
    h200 = gpu_rates.achieved_rates("h200")
    params = 1_923_125_248  # our run's slice: aten::_fused_adam_ took 223.266 ms over 13 steps
    adam = next(op for op in tm.optimizer_ops(megatron(training__precision="bf16"), params) if op.name == "optimizer.adam")
    assert adam.seconds(h200) == pytest.approx(223.266e-3 / 13)
    assert gpus.MULTI_TENSOR_SHARE["adam"] == pytest.approx(0.741, abs=1e-3)
    assert gpus.MULTI_TENSOR_SHARE["multi_tensor"] == pytest.approx(0.858, abs=1e-3)
    # a kind with no measurement takes the same shares of its own copy rate; the datasheet's roofline takes none
    h100 = gpu_rates.achieved_rates("h100")
    assert h100.memory_rate("adam") == pytest.approx(gpus.COPY_SHARE * 3.35e12 * gpus.MULTI_TENSOR_SHARE["adam"])
    assert h100.memory_rate() == h100.hbm_bytes_per_s == H100.memory_rate("adam") * gpus.COPY_SHARE
    assert "fused Adam 74% and the other multi-tensor kernels 86% of the copy" in h100.source


def test_the_step_grows_by_the_passes_it_had_left_out():
    cfg = bf16_distributed()
    # before: zeroing 4 N, the norm 4 S and Adam 30 S, all at the copy rate; now the clip (8 S) and the
    # copy-out (6 S) apart from Adam (28 S): 4 N + 46 S on the roofline
    assert tm.pass_seconds(tm.optimizer_ops(cfg, N), H100) == pytest.approx((4 * N + 46 * S) / 3.35e12)
    h100 = gpu_rates.achieved_rates("h100")
    copy, share = h100.hbm_bytes_per_s, gpus.MULTI_TENSOR_SHARE
    expected = (4 * N + 6 * S) / copy + 12 * S / (share["multi_tensor"] * copy) + 28 * S / (share["adam"] * copy)
    assert tm.pass_seconds(tm.optimizer_ops(cfg, N), h100) == pytest.approx(expected)
    # 4 N with 4 S of shard: 5.5 N at the copy, 3 N at 0.86 of it, 7 N at 0.74: 1.48x the 12.5 N the old pricing moved
    assert expected / ((4 * N + 34 * S) / copy) == pytest.approx((5.5 + 3 / 0.858 + 7 / 0.741) / 12.5, rel=1e-3)
    assert expected / ((4 * N + 34 * S) / copy) == pytest.approx(1.475, abs=0.005)
