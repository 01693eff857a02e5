"""Merging the ranks' pieces into one record (`launch.torchrun.merge_pieces`), from hand-made pieces:
no process is launched, so every verdict here is the merge's own logic."""

from helpers import config
from recompute_bench.launch.torchrun import Launch, merge_pieces
from recompute_bench.measure.record import unmeasured_rank

GiB = 2**30


def piece(rank: int, status: str = "ok", *, peak_gib: float | None = None, reserved_gib: float | None = None,
          step: int = 3, failure: dict | None = None, env: bool = True) -> dict:
    """What a rank leaves: its entry, and (as every rank writes them) the env and metrics it measured."""
    entry = {**unmeasured_rank(rank, "cpu", status, failure), "step": step}
    if peak_gib is not None:
        entry["peak_allocated_bytes"] = int(peak_gib * GiB)
    if reserved_gib is not None:
        entry["peak_reserved_bytes"] = int(reserved_gib * GiB)
    out = {"rank_entry": entry, "metrics": {"step_time_s": 0.5 + rank, "loss": 6.0}}
    if env:
        out["env"] = {"device": "cpu", "rank_that_wrote_it": rank}
    return out


def test_ok_ranks_merge_to_the_largest_peak_and_its_spread_and_the_lowest_ranks_metrics():
    pieces = {0: piece(0, peak_gib=10, reserved_gib=12), 1: piece(1, peak_gib=14, reserved_gib=13),
              2: piece(2, peak_gib=11), 3: piece(3, peak_gib=12.5, reserved_gib=16)}
    record = merge_pieces(config(), Launch(nproc_per_node=4), pieces)
    assert record["status"] == "ok" and record["failure"] is None
    assert [e["rank"] for e in record["ranks"]] == [0, 1, 2, 3]
    assert record["metrics"]["peak_allocated_bytes"] == 14 * GiB
    assert record["metrics"]["peak_allocated_spread_bytes"] == 4 * GiB  # 14 - 10
    assert record["metrics"]["peak_reserved_bytes"] == 16 * GiB  # rank 2 measured none: not a zero
    assert record["metrics"]["step_time_s"] == 0.5 and record["env"]["rank_that_wrote_it"] == 0
    assert record["launch"]["nproc_per_node"] == 4


def test_metrics_come_from_the_lowest_rank_that_measured_them():
    pieces = {0: piece(0, env=False), 1: piece(1, peak_gib=3)}
    record = merge_pieces(config(), Launch(nproc_per_node=2), pieces)
    assert record["env"]["rank_that_wrote_it"] == 1 and record["metrics"]["step_time_s"] == 1.5


def test_an_oom_on_one_rank_is_the_points_status_and_the_ranks_inside_a_step_were_waiting():
    oom = {"step": 2, "phase": "backward", "message": "CUDA out of memory"}
    pieces = {0: piece(0, "running", step=2), 1: piece(1, "oom", failure=oom, step=2), 2: piece(2, peak_gib=1)}
    record = merge_pieces(config(), Launch(nproc_per_node=3), pieces)
    assert record["status"] == "oom"
    assert record["failure"]["rank"] == 1 and record["failure"]["phase"] == "backward"
    assert [e["status"] for e in record["ranks"]] == ["waiting", "oom", "ok"]
    assert "still running step 2" in record["ranks"][0]["failure"]["message"]
    assert "OOM rank1" in record["failure"]["summary"] and "waiting rank0" in record["failure"]["summary"]


def test_oom_outranks_error_whatever_the_rank_order():
    error = {"step": 1, "phase": "forward", "message": "boom"}
    oom = {"step": 1, "phase": "forward", "message": "out of memory"}
    pieces = {0: piece(0, "error", failure=error), 1: piece(1, "oom", failure=oom)}
    record = merge_pieces(config(), Launch(nproc_per_node=2), pieces)
    assert record["status"] == "oom" and record["failure"]["rank"] == 1


def test_a_group_stopped_by_the_points_time_limit_is_a_timeout_and_a_missing_piece_says_so():
    limit = "the point ran past --timeout 30 s"
    record = merge_pieces(config(), Launch(nproc_per_node=2), {0: piece(0, "running", step=4)}, timeout=limit,
                          log_tail="loading\nstarting rank 1")
    assert record["status"] == "timeout"
    assert [e["status"] for e in record["ranks"]] == ["timeout", "timeout"]
    assert limit in record["ranks"][0]["failure"]["message"]
    assert record["ranks"][1]["failure"]["message"] == limit


def test_a_rank_that_left_nothing_without_a_time_limit_is_an_error_naming_its_last_line():
    record = merge_pieces(config(), Launch(nproc_per_node=2), {0: piece(0)}, log_tail="loading\nSegmentation fault")
    assert record["status"] == "error" and record["failure"]["rank"] == 1
    assert record["failure"]["message"] == "the rank left no result: Segmentation fault"
