"""The attention kernel a run records is torch's own choice for its tensors, and the estimate's bytes
and FLOPs follow it; torch's GQA-blind sdpa FLOP formulas (before 2026-03) are replaced where the
torch in use has them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import FAST, config, meta_step_flops, shrunk
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, flop_registry, shape_wrapper

from recompute_bench.analysis import flops
from recompute_bench.analysis.harness.layer import attention_kernel
from recompute_bench.analysis.harness.stage import activation_bytes
from recompute_bench.backends import pytorch as backend
from recompute_bench.measure.point import run_point
from recompute_bench.models import DeviceKernels

CPU = torch.device("cpu")


@pytest.mark.parametrize("dropout,gqa,v_dim,kernel", [
    (0.0, False, 16, "flash"), (0.1, False, 16, "sdpa_math"), (0.0, True, 16, "flash"), (0.0, False, 8, "sdpa_math"),
])
def test_the_kernel_named_is_the_one_torch_picks_for_these_tensors(dropout, gqa, v_dim, kernel):
    # torch's CPU flash kernel has no dropout and one head dimension for q, k and v.
    q = torch.randn(2, 4, 64, 16, requires_grad=True)
    k = torch.randn(2, 2 if gqa else 4, 64, 16)
    v = torch.randn(2, 2 if gqa else 4, 64, v_dim)
    assert backend.sdpa_kernel(q, k, v, dropout, gqa) == kernel
    with sdpa_kernel([SDPBackend.MATH]):  # what the user (or a context) enables is what torch picks
        assert backend.sdpa_kernel(q, k, v, dropout, gqa) == "sdpa_math"


@pytest.mark.parametrize("sets,kernel", [
    ([], "sdpa_math"),                                                        # tiny: attention dropout
    (["model.attention_dropout=0"], "flash"),
    (["model.attention_backend=math"], "math"),
])
def test_run_records_the_attention_kernel_that_ran(sets, kernel):
    cfg = config(sets=[*FAST, "training.seq_length=32", *sets])
    record = run_point(cfg, device=CPU)
    assert record["status"] == "ok", record["failure"]
    assert record["env"]["attention_kernel"] == kernel
    assert record["metrics"]["estimated_activation_bytes"] == record["metrics"]["activation_bytes"]


def test_the_estimate_follows_the_kernel_that_ran_not_the_table():
    # No dropout on a CPU: the table predicts torch's flash kernel. With only the math backend enabled,
    # torch runs its math fallback (s² scores, fp32 upcasts): the record says so, and its estimate of
    # the bytes saved and of the hardware FLOPs is that kernel's, equal to what the probe and
    # FlopCounterMode measured (the flash prediction is off by the scores, and its FLOPs uncounted).
    cfg = config(sets=[*FAST, "training.seq_length=32", "model.attention_dropout=0"])
    assert attention_kernel(cfg, "cpu") == "flash"
    with sdpa_kernel([SDPBackend.MATH]):
        record = run_point(cfg, device=CPU)
    m = record["metrics"]
    assert record["env"]["attention_kernel"] == "sdpa_math"
    assert m["estimated_activation_bytes"] == m["activation_bytes"]
    assert m["hardware_flops_per_step"] == m["estimated_hardware_flops_per_step"] == m["measured_flops_per_step"]
    predicted = activation_bytes(cfg, "cpu")["activation_bytes"]
    assert predicted < m["activation_bytes"]
    assert activation_bytes(cfg, DeviceKernels("cpu", "sdpa_math"))["activation_bytes"] == m["activation_bytes"]


def test_a_measured_kernel_replaces_the_tables_prediction_in_the_analysis():
    cfg = config("llama3-8b", sets=["model.num_layers=2"])
    assert attention_kernel(cfg, "cuda") == "flash"
    for kernel in ("efficient", "cudnn", "sdpa_math"):
        assert attention_kernel(cfg, DeviceKernels("cuda", kernel)) == kernel
    assert attention_kernel(cfg, DeviceKernels("cuda", "overrideable")) == "flash"  # not modelled: predicted
    # cuDNN and flash save the same tensors; the math fallback keeps the s² scores in fp32.
    same = activation_bytes(cfg, DeviceKernels("cuda", "cudnn"))
    assert same == activation_bytes(cfg, "cuda")
    assert activation_bytes(cfg, DeviceKernels("cuda", "sdpa_math"))["activation_bytes"] > 3 * same["activation_bytes"]
    # The math fallback runs the whole s x s square: about twice the fused kernels' attention FLOPs.
    assert flops.hardware_flops_per_step(cfg, DeviceKernels("cuda", "sdpa_math")) > flops.hardware_flops_per_step(cfg)


# ----- GQA FLOP formulas (torch before 2026-03) -----------------------------------------------------

def _equal_heads_only(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    """The pre-2026-03 formula's contract: q, k and v with one head count, else an AssertionError."""
    assert query_shape[1] == key_shape[1] == value_shape[1]
    return 0


def _equal_heads_only_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    assert query_shape[1] == key_shape[1] == value_shape[1]
    return 0


def _gqa_flash_flops():
    """FlopCounterMode over a GQA flash attention forward and backward on meta tensors (8 query
    heads, 2 key/value heads, b 2, s 64, d 32)."""
    aten = torch.ops.aten
    q = torch.empty(2, 8, 64, 32, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(2, 2, 64, 32, device="meta", dtype=torch.bfloat16)
    with FlopCounterMode(display=False) as counter:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(q, kv, kv, 0.0, True)
        aten._scaled_dot_product_flash_attention_backward(out, q, kv, kv, out, lse, cum_q, cum_k, max_q, max_k, 0.0,
                                                          True, seed, offset)
    return counter.get_total_flops()


def test_gqa_formulas_replace_torchs_where_it_refuses_grouped_heads(monkeypatch):
    aten = torch.ops.aten
    expected = 2 * 2 * 8 * 64 * 64 * (32 + 32) + 2 * 2 * 8 * 64 * 64 * (3 * 32 + 2 * 32)
    assert _gqa_flash_flops() == expected  # torch 2.13's own formulas count every query head
    for kernel in backend.SDPA_FLOP_OPS:  # an older torch's formulas, as registered there
        monkeypatch.setitem(flop_registry, getattr(aten, f"_scaled_dot_product_{kernel}_attention"),
                            shape_wrapper(_equal_heads_only))
        monkeypatch.setitem(flop_registry, getattr(aten, f"_scaled_dot_product_{kernel}_attention_backward"),
                            shape_wrapper(_equal_heads_only_backward))
    with pytest.raises(AssertionError):
        _gqa_flash_flops()  # the probe of every GQA model died here
    backend._register_gqa_sdpa_flops()
    assert _gqa_flash_flops() == expected


def test_torchs_own_gqa_aware_formulas_are_kept():
    aten = torch.ops.aten
    before = {k: flop_registry[getattr(aten, f"_scaled_dot_product_{k}_attention")] for k in backend.SDPA_FLOP_OPS}
    backend._register_gqa_sdpa_flops()
    assert {k: flop_registry[getattr(aten, f"_scaled_dot_product_{k}_attention")] for k in backend.SDPA_FLOP_OPS} == before


def test_a_gqa_model_is_counted_by_the_fused_kernels_formulas():
    # llama3's shrunken layer on meta tensors with flash attention: FlopCounterMode's count matches
    # the GQA formula (k and v heads serve 4 query heads each) and the estimate counts the same square.
    cfg = shrunk("llama3-8b")
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, precision="bf16"))
    assert cfg.model.groups != cfg.model.num_attention_heads
    assert meta_step_flops(cfg, "flash") == flops.hardware_flops_per_step(cfg, DeviceKernels("cuda", "flash"))
