"""Checks that need a CUDA device: real allocator peaks and a real OOM. Skipped without one."""

import json

import pytest
import torch

from helpers import config, invoke
from recompute_bench.measure.point import run_point

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
FAST = ["training.warmup_steps=1", "training.measured_steps=2"]


def _peak(**overrides):
    record = run_point(config(sets=FAST, training__seq_length=128, **overrides), device=torch.device("cuda"))
    assert record["status"] == "ok", record["failure"]
    return record


def test_cuda_peaks_fall_with_recompute_and_are_measured():
    none = _peak()
    selective = _peak(recompute__granularity="selective", recompute__modules=["core_attn", "mlp"])
    full = _peak(recompute__granularity="full", recompute__method="uniform", recompute__num_layers=1)
    for r in (none, selective, full):
        rank = r["ranks"][0]
        assert rank["peak_allocated_bytes"] > 0 and rank["peak_reserved_bytes"] >= rank["peak_allocated_bytes"]
        assert rank["run_peak_allocated_bytes"] >= rank["peak_allocated_bytes"] and rank["num_ooms"] == 0
    peaks = [r["metrics"]["peak_allocated_bytes"] for r in (none, selective, full)]
    assert peaks[0] > peaks[1] > peaks[2]
    assert none["metrics"]["mfu"] is None or 0 < none["metrics"]["mfu"] < 1


def test_a_real_oom_is_a_recorded_result():
    free, _ = torch.cuda.mem_get_info()
    s, h = 2048, 1024
    # a micro-batch whose layer activations (tens of bytes per token and hidden unit) cannot fit
    b = int(free / (s * h * 20)) + 1
    record = run_point(config(sets=FAST + [f"model.max_position_embeddings={s}"], model__hidden_size=h,
                              model__num_attention_heads=16, model__ffn_hidden_size=4 * h, training__seq_length=s,
                              training__micro_batch_size=b, training__global_batch_size=b),
                       device=torch.device("cuda"))
    assert record["status"] == "oom"
    assert record["failure"]["phase"] in ("forward", "backward")
    assert record["ranks"][0]["num_ooms"] >= 1 and record["ranks"][0]["peak_allocated_bytes"] > 0


def test_a_memory_limit_produces_a_real_oom(tmp_path):
    # `run` caps the allocator of the process it measures in: here pytest's, so the cap is lifted
    # again before the next test (conftest.py checks that every GPU test does so).
    try:
        result = invoke("run", "--results", str(tmp_path / "r.jsonl"), "--memory-limit-gb", "0.001", "--json",
                        "--no-save", "--set", "model.hidden_dropout=0", "--set", "model.attention_dropout=0")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
    record = json.loads(result.stdout)
    assert result.exit_code == 1 and record["status"] == "oom" and record["launch"]["memory_limit_gb"] == 0.001
