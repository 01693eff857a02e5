"""Collectives priced by message size (analysis/gpu_rates.py `GpuRates.collective_seconds`) from nccl-tests'
own published sweeps in the GPU table (config/gpus.py `NcclTable`): the busbw nccl-tests prints is the bytes
one rank sends (`time_ops.ring_bytes`) per second, the priced time at a measured size is the measured time,
small collectives are latency-bound, big ones run at the plateau, a smaller group runs at the busbw of the same
shard, and the kinds with no published sweep keep the flat link rate."""

import pytest
from helpers import config

from recompute_bench.analysis import gpu_rates
from recompute_bench.analysis.megatron import MegatronRun
from recompute_bench.analysis.megatron import time_model as tm
from recompute_bench.analysis.megatron.time_ops import ring_bytes
from recompute_bench.config.gpus import KINDS

B200 = gpu_rates.achieved_rates("b200")
TABLE = KINDS["b200"].nccl
GiB = 2**30
MEASURED = ["b200", "h100", "a100"]
KINDS_COLLECTIVES = [(kind, c) for kind in MEASURED for c in KINDS[kind].nccl.rows]


def seconds(kind, size, group=8, rates=B200):
    """The priced time of nccl-tests' `kind` of a whole buffer of `size` bytes over `group` ranks."""
    return rates.comm_seconds(ring_bytes(kind, size, group), group, 1, "ring", kind)


def busbw(kind, size, group=8, rates=B200):
    return ring_bytes(kind, size, group) / seconds(kind, size, group, rates)


@pytest.mark.parametrize("gpu, rows_at_1_gb_s", [("b200", 21 + 20 + 20), ("h100", 3 * 14), ("a100", 17)])
def test_the_printed_busbw_is_the_bytes_one_rank_sends_per_second(gpu, rows_at_1_gb_s):
    # nccl-tests' doc/PERFORMANCE.md: busbw = S / t x 2 (n - 1) / n for all-reduce, x (n - 1) / n for the others
    checked = 0
    table = KINDS[gpu].nccl
    for kind, rows in table.rows.items():
        for size, micros, printed in rows:
            if printed >= 1.0:  # the printed columns have two decimals
                assert ring_bytes(kind, size, table.ranks) / (micros * 1e-6) / 1e9 == pytest.approx(printed, rel=0.01)
                algbw = size / (micros * 1e-6) / 1e9
                assert abs(algbw / printed - 1) > 0.12  # the size / time (algbw) is not it
                checked += 1
    assert checked == rows_at_1_gb_s  # every row of 1 GB/s and up (B200: all-reduce from 16 KiB, the others 32 KiB)


@pytest.mark.parametrize("gpu, kind", KINDS_COLLECTIVES)
def test_each_measured_size_is_priced_at_its_measured_time(gpu, kind):
    rates, rows = gpu_rates.achieved_rates(gpu), KINDS[gpu].nccl.rows[kind]
    for size, micros, _ in rows:
        assert seconds(kind, size, rates=rates) == pytest.approx(micros * 1e-6, rel=1e-9)
    # between two sizes: on the line through them in log size and log time
    (s0, t0, _), (s1, t1, _) = rows[-4:-2]
    assert seconds(kind, (s0 * s1) ** 0.5, rates=rates) == pytest.approx((t0 * t1) ** 0.5 * 1e-6, rel=1e-9)


@pytest.mark.parametrize("gpu, kind", KINDS_COLLECTIVES)
def test_small_collectives_are_latency_bound(gpu, kind):
    rates, rows = gpu_rates.achieved_rates(gpu), KINDS[gpu].nccl.rows[kind]
    floor = rows[0][1] * 1e-6
    assert seconds(kind, 8, rates=rates) == pytest.approx(floor) and floor > 15e-6  # does not go to 0 with the size
    assert seconds(kind, 2 * rows[0][0], rates=rates) < 1.2 * floor  # twice the smallest size: hardly longer
    nbytes = ring_bytes(kind, 64 * 2**10, 8)
    assert seconds(kind, 64 * 2**10, rates=rates) > 50 * nbytes / rates.link_bytes_per_s  # flat: 50x too cheap


@pytest.mark.parametrize("gpu, kind", KINDS_COLLECTIVES)
def test_big_collectives_approach_the_plateau(gpu, kind):
    rates, rows = gpu_rates.achieved_rates(gpu), KINDS[gpu].nccl.rows[kind]
    plateau = rows[-1][2] * 1e9
    assert busbw(kind, 64 * GiB, rates=rates) == pytest.approx(plateau, rel=0.01)  # past the table: its last busbw
    sizes = (2**20, 16 * 2**20, GiB, 8 * GiB)
    assert sorted(busbw(kind, size, rates=rates) for size in sizes) == [busbw(kind, size, rates=rates) for size in sizes]
    assert busbw(kind, GiB, rates=rates) > 0.85 * plateau


def test_a_smaller_group_runs_at_the_busbw_of_the_same_shard():
    # tp 4 on an 8-GPU board: 64 MiB over 4 ranks moves 16 MiB shards, as 128 MiB does over 8
    s128 = next(row for row in TABLE.rows["all_gather"] if row[0] == 128 * 2**20)
    assert seconds("all_gather", 64 * 2**20, group=4) == pytest.approx(s128[1] * 1e-6 * 3 / 7)
    assert busbw("all_gather", 64 * 2**20, group=4) == pytest.approx(busbw("all_gather", 128 * 2**20))
    # all-reduce over 2 ranks: one shard out and one back, 2 steps of the table's 14
    s8m = next(row for row in TABLE.rows["all_reduce"] if row[0] == 8 * 2**20)
    assert seconds("all_reduce", 2 * 2**20, group=2) == pytest.approx(s8m[1] * 1e-6 * 2 / 14)
    # a smaller group's latency is fewer steps of the table's
    assert seconds("reduce_scatter", 64, group=4) == pytest.approx(TABLE.rows["reduce_scatter"][0][1] * 1e-6 * 3 / 7)


def test_collectives_without_a_published_sweep_keep_the_flat_link():
    a100 = gpu_rates.achieved_rates("a100")
    assert a100.comm_seconds(1e6, 8, 1, "ring", "all_gather") == pytest.approx(1e6 / a100.link_bytes_per_s)
    # A100: a published sweep of all-reduce only; its all-gather and reduce-scatter keep the plateau
    assert set(a100.nccl.rows) == {"all_reduce"} and a100.link_bytes_per_s == 200e9  # nccl-tests issue #149's plateau
    assert busbw("all_reduce", 16 * 2**20, rates=a100) == pytest.approx(119.81e9, rel=1e-3)  # the printed row, not 200
    # GB200's NVL72 has B200's NVLink 5 and NVSwitch generation: B200's sweep and plateau
    gb200 = gpu_rates.achieved_rates("gb200")
    assert gb200.nccl is B200.nccl and gb200.link_bytes_per_s == B200.link_bytes_per_s
    # the HGX H200 board has the HGX H100's NVLink and NVSwitch: H100's sweep
    h200, h100 = gpu_rates.achieved_rates("h200"), gpu_rates.achieved_rates("h100")
    assert h200.nccl is h100.nccl and h200.link_bytes_per_s == h100.link_bytes_per_s
    # on B200 what has no sweep (point-to-point, all-to-all, no collective named) runs at its plateau
    assert B200.comm_seconds(1e6, 8, 1, "ring") == pytest.approx(1e6 / 672.38e9)
    assert B200.comm_seconds(1e6, 8, 1, "all_to_all", "all_gather") == pytest.approx(1e6 / 672.38e9)
    assert gpu_rates.datasheet_rates("b200").nccl is None  # the roofline stays the roofline
    # past the NVLink domain the network prices it, as before
    assert B200.comm_seconds(1e6, 4, 4, "ring", "all_gather") == pytest.approx(1e6 / B200.network_bytes_per_s)


def test_megatron_s_tensor_parallel_collectives_are_priced_by_their_size():
    cfg = config("llama3-8b", training__framework="megatron", parallel__tensor_model_parallel_size=4,
                 parallel__sequence_parallel=True, training__micro_batch_size=1, training__seq_length=1024)
    layer = tm.layer_ops(cfg, MegatronRun("b200"), 0)
    comms = [op for op in layer.forward + layer.backward if op.kind == "comm"]
    assert {op.collective for op in comms} == {"all_gather", "reduce_scatter"}
    for op in comms:
        assert op.seconds(B200) == pytest.approx(B200.collective_seconds(op.bytes, 4, op.collective))
        assert op.seconds(B200) > op.bytes / B200.link_bytes_per_s  # 8 MiB buffers: below the plateau
    # TE's userbuffers (--tp-comm-overlap) are not NCCL: the flat rate
    overlapped = config("llama3-8b", training__framework="megatron", parallel__tensor_model_parallel_size=4,
                        parallel__sequence_parallel=True, parallel__tp_comm_overlap=True, training__seq_length=1024)
    ub = next(op for op in tm.layer_ops(overlapped, MegatronRun("b200"), 0).forward if op.name == "linear_fc1.all_gather")
    assert ub.seconds(B200) == pytest.approx(ub.bytes / B200.link_bytes_per_s)


def test_the_context_parallel_gather_and_a_distributed_checkpoint_s_gather_are_nccl_all_gathers_by_size():
    cfg = config("llama3-8b", training__framework="megatron", parallel__tensor_model_parallel_size=2,
                 parallel__context_parallel_size=4, parallel__cp_comm_type="all_gather", training__seq_length=4096)
    layer = tm.layer_ops(cfg, MegatronRun("b200"), 0)
    gathers = [op for op in layer.forward if op.kind == "comm" and op.name.endswith("_all_gather")]
    assert gathers and all(op.collective == "all_gather" and op.nccl and op.group == 4 for op in gathers)
    for op in gathers:
        assert op.seconds(B200) == pytest.approx(B200.collective_seconds(op.bytes, 4, "all_gather"))
    full = config("llama3-8b", training__framework="megatron", parallel__tensor_model_parallel_size=4,
                  recompute__granularity="full", recompute__method="uniform", recompute__num_layers=1,
                  recompute__distribute_saved_activations=True, training__seq_length=1024)
    checkpoint = next(op for op in tm.checkpoint_ops(full, [tm.LayerPolicy(chunk=0)]) if op.kind == "comm")
    assert checkpoint.seconds(B200) == pytest.approx(B200.collective_seconds(checkpoint.bytes, 4, "all_gather"))
    assert checkpoint.seconds(B200) > checkpoint.bytes / B200.link_bytes_per_s  # 8 MiB: below the plateau
