"""The pipeline schedules the analysis writes out (`analysis/pipelining_schedule.py`) against torch's own
(torch.distributed.pipelining builds each rank's order without a process group when its stages are
stand-ins), the in-flight counts they imply against Megatron's warm-up formulas, and the theoretical
bubble against (p - 1)/(n vp + p - 1)."""

from __future__ import annotations

import pytest
from helpers import config
from torch import nn
from torch.distributed.pipelining import schedules as torch_schedules

from recompute_bench.analysis.harness.rank import chunks_in_flight
from recompute_bench.analysis.pipelining_schedule import (Action, bubble_fraction, peak_chunks, rank_actions,
                                                          rank_stages, walk)

KIND = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
CASES = [("1F1B", 1, p, n) for p in (2, 3, 4) for n in (4, 8, 12)] + \
        [("GPipe", 1, p, n) for p in (2, 4) for n in (3, 8)] + \
        [(s, vp, p, n) for s in ("Interleaved1F1B", "InterleavedZeroBubble") for vp in (2, 3) for p in (2, 4) for n in (p, 2 * p, 4 * p)] + \
        [("ZBVZeroBubble", 2, p, n) for p in (2, 3, 4) for n in (2, 5, 8, 16)] + \
        [("DualPipeV", 2, p, n) for p in (2, 3, 4) for n in (2 * p, 2 * p + 1, 16)]


class Recorder:
    """A stand-in pipeline stage that records what torch's schedule runs on it: no process group,
    no communication (every send and receive is an empty list), no model."""

    def __init__(self, index: int, num_stages: int, p: int, rank: int, log: list[Action]):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, p, rank
        self.submod, self.device, self.log = nn.Identity(), "cpu", log
        self.is_first, self.is_last = index == 0, index == num_stages - 1  # (no loss function: no loss computed)
        self.args_recv_info, self.act_send_info = {0: ()}, {}  # nothing received or sent

    def forward_one_chunk(self, i, *_, **__):
        self.log.append(Action("F", self.stage_index, i))

    def backward_one_chunk(self, i, loss=None, full_backward=True, last_backward=False):
        self.log.append(Action("B" if full_backward else "I", self.stage_index, i))

    def backward_weight_one_chunk(self, i, last_backward=False):
        self.log.append(Action("W", self.stage_index, i))

    def __getattr__(self, name):  # communication, set-up and gradient reduction: nothing to do
        return lambda *_, **__: []


def torch_order(schedule: str, vp: int, p: int, n: int, rank: int) -> list[Action]:
    """The work torch's schedule runs on `rank`'s stages in one step, in order."""
    log: list[Action] = []
    index = rank_stages(schedule, p, vp, rank)
    stages = [Recorder(i, p * vp, p, rank, log) for i in index]
    built = torch_schedules.get_schedule_class(schedule)(stages[0] if vp == 1 else stages, n)
    built._step_microbatches()
    return log


@pytest.mark.parametrize("schedule, vp, p, n", CASES)
def test_each_ranks_order_is_torchs(schedule, vp, p, n):
    for rank in range(p):
        assert rank_actions(schedule, p, vp, n, rank) == torch_order(schedule, vp, p, n, rank), rank
        assert {a.stage for a in rank_actions(schedule, p, vp, n, rank)} == set(rank_stages(schedule, p, vp, rank))


@pytest.mark.parametrize("vp", [1, 2, 3])
def test_1f1b_and_interleaved_hold_megatrons_warm_up_plus_one(vp):
    schedule = "Interleaved1F1B" if vp > 1 else "1F1B"
    for p, n in ((2, 4), (4, 8), (4, 16), (8, 8)):
        cfg = config("gpt3-175b", parallel__pipeline_model_parallel_size=p, training__global_batch_size=n,
                     parallel__virtual_pipeline_model_parallel_size=vp if vp > 1 else None)
        for rank in range(p):
            held = peak_chunks(rank_actions(schedule, p, vp, n, rank))
            assert sum(held.values()) == chunks_in_flight(cfg, rank), (p, n, rank)


def test_gpipe_holds_every_microbatch_and_zero_bubble_frees_at_w():
    assert peak_chunks(rank_actions("GPipe", 4, 1, 8, 3)) == {3: 8}
    # I frees nothing (torch retains the graph for W): a chunk weighs until its W.
    order = [Action("F", 0, 0), Action("F", 0, 1), Action("I", 0, 0), Action("F", 0, 2), Action("W", 0, 0), Action("F", 0, 3)]
    held = walk(order, lambda stage: 10.0, lambda stage: 5.0)
    assert (held.saved_peak, held.held, held.backward_peak) == (30, {0: 3}, 25)


@pytest.mark.parametrize("schedule, vp", [("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2), ("Interleaved1F1B", 4)])
def test_the_theoretical_bubble_is_the_textbook_one(schedule, vp):
    for p, n in ((2, 4), (4, 8), (4, 32), (8, 16)):
        assert bubble_fraction(schedule, p, vp, n) == pytest.approx((p - 1) / (n * vp + p - 1))


def test_zero_bubble_schedules_idle_less_than_1f1b():
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        assert bubble_fraction(schedule, 4, 2, 16) < bubble_fraction("Interleaved1F1B", 4, 2, 16)
