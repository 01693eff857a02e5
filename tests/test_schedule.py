"""Megatron's pipeline schedules (analysis/megatron_schedule.py), which both frameworks' estimates follow:
the passes each stage runs, how many chunk forwards wait for their backward, every stage's peak."""

import json

import pytest
from helpers import config, invoke

from recompute_bench.analysis.harness.rank import microbatches_in_flight, rank_memory, stage_memories
from recompute_bench.analysis.harness.stage import stage_activations
from recompute_bench.analysis.megatron_schedule import chunk_forwards_in_flight, schedule


def _cfg(p, vp=None, n=8, workload="gpt3-175b"):
    return config(workload, parallel__pipeline_model_parallel_size=p, parallel__virtual_pipeline_model_parallel_size=vp,
                  training__global_batch_size=n, training__micro_batch_size=1)


def test_interleaved_passes_in_megatrons_order():
    # p 2, vp 2, 4 micro-batches: get_schedule_table takes groups of p micro-batches through chunk 0,
    # then chunk 1; warm-up (p - r - 1) x 2 + (vp - 1) x p: 4 chunk forwards on stage 0, 2 on stage 1.
    cfg = _cfg(2, 2, n=4)
    last = schedule(cfg, 1)
    assert last[:4] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("B", 0, 1)]  # backward runs the chunks in reverse
    assert [e for e in schedule(cfg, 0) if e[0] == "F"][:5] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 0)]
    for stage in (0, 1):
        events = schedule(cfg, stage)
        forwards = [e[1:] for e in events if e[0] == "F"]
        backwards = [e[1:] for e in events if e[0] == "B"]
        assert sorted(forwards) == sorted(backwards) == sorted((mb, c) for mb in range(4) for c in range(2))
        assert all(events.index(("F", *x)) < events.index(("B", *x)) for x in forwards)
    assert [chunk_forwards_in_flight(cfg, r) for r in (0, 1)] == [5, 3]


@pytest.mark.parametrize("p,vp,n", [(4, None, 8), (4, None, 2), (8, 3, 64), (4, 8, 4), (4, 2, 8)])
def test_chunks_in_flight_per_stage(p, vp, n):
    cfg = _cfg(p, vp, n, workload="gpt3-1t" if vp == 8 else "gpt3-175b")
    m = vp or 1
    for r in range(p):
        warmup = min(n, p - r - 1) if m == 1 else min(n * m, (p - r - 1) * 2 + (m - 1) * p)
        assert chunk_forwards_in_flight(cfg, r) == min(n * m, warmup + 1)
    if m > 1:  # the last stage of an interleaved pipeline holds (vp - 1) p + 1 chunks, not one micro-batch
        assert chunk_forwards_in_flight(cfg, p - 1) == min(n * m, (m - 1) * p + 1)


def test_the_last_interleaved_stage_holds_its_warm_up_in_both_frameworks():
    # p 8, vp 3, 64 micro-batches: the last stage holds 2 x 8 = 16 chunks beside the one in backward
    # (the old estimate counted it one micro-batch in flight, nothing beside it).
    cfg = _cfg(8, 3, n=64)
    chunk = stage_activations(cfg).stored_bytes / 3
    last = rank_memory(cfg, 7)
    assert last.items["activations of the other in-flight micro-batches"] == pytest.approx(16 * chunk)
    assert microbatches_in_flight(cfg, 7) == pytest.approx(17 / 3)
    assert microbatches_in_flight(cfg, 0) == pytest.approx(8 * (1 + 7 / 24))  # the paper's interleave factor


def test_estimate_json_carries_every_stage():
    result = invoke("estimate", "-w", "gpt3-175b", "--pp", "8", "--set", "parallel.virtual_pipeline_model_parallel_size=3",
                    "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    stages = report["stages"]
    assert [s["stage"] for s in stages] == list(range(8))
    assert report["setting"]["peak_allocated_bytes"] == max(s["peak_allocated_bytes"] for s in stages)
    for s, mem in zip(stages, stage_memories(_cfg(8, 3, n=64))):
        assert s["peak_allocated_bytes"] == mem.peak_allocated_bytes
        assert s["breakdown"]["backward peak"] == pytest.approx(sum(v for k, v in s["breakdown"].items()
                                                                     if k not in ("backward peak", "optimizer step peak")))
