"""Checks that need a CUDA device: real allocator peaks and a real OOM. Skipped without one."""

import json

import pytest
import torch

from helpers import config, invoke
from recompute_bench.measure.point import run_point

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
FAST = ["training.warmup_steps=1", "training.measured_steps=2"]


# tiny widened so the settings' estimated peaks lie tens of MiB apart (none 247, selective
# [core_attn, mlp] 183, full uniform 1 138 MiB): at seq 128 they were 1 MiB apart and recompute's
# own transient buffers decided the measured order (none 75,658,240 B < selective 77,094,400 B).
SHAPE = dict(training__seq_length=1024, training__micro_batch_size=8, training__global_batch_size=8,
             model__hidden_size=128, model__ffn_hidden_size=512)
SETTINGS = {"none": {}, "selective": dict(recompute__granularity="selective", recompute__modules=["core_attn", "mlp"]),
            "full": dict(recompute__granularity="full", recompute__method="uniform", recompute__num_layers=1)}


def _peak(**overrides):
    record = run_point(config(sets=FAST + ["model.max_position_embeddings=1024"], **SHAPE, **overrides),
                       device=torch.device("cuda"))
    assert record["status"] == "ok", record["failure"]
    return record


def test_cuda_peaks_follow_the_estimates_order_and_are_measured():
    records = {name: _peak(**overrides) for name, overrides in SETTINGS.items()}
    for r in records.values():
        rank = r["ranks"][0]
        assert rank["peak_allocated_bytes"] > 0 and rank["peak_reserved_bytes"] >= rank["peak_allocated_bytes"]
        assert rank["run_peak_allocated_bytes"] >= rank["peak_allocated_bytes"] and rank["num_ooms"] == 0
    estimated = {name: r["metrics"]["estimated_peak_allocated_bytes"] for name, r in records.items()}
    measured = {name: r["metrics"]["peak_allocated_bytes"] for name, r in records.items()}
    order = sorted(estimated, key=estimated.get, reverse=True)
    assert order == ["none", "selective", "full"]
    assert min(estimated[a] - estimated[b] for a, b in zip(order, order[1:])) > 20 * 2**20  # tens of MiB apart
    assert sorted(measured, key=measured.get, reverse=True) == order
    none = records["none"]["metrics"]
    assert none["mfu"] is None or 0 < none["mfu"] < 1


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
