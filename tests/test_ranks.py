"""Many ranks under torchrun, measured on CPU with gloo (2 ranks, the tiny model, seq 32, one
measured step): data parallel gives the single-rank losses, one rank's OOM, error or hang is
recorded with its rank while the other rank's figures are kept, two launchers on localhost
rendezvous into one point, and the launcher's command line and environment."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import LOSS_RTOL, RANK_SETS, config, invoke, launch_ranks, measure, processes_naming
from recompute_bench.launch.process import FAULT_POINTS_ENV, PARENT_PID_ENV, worker_env
from recompute_bench.launch.torchrun import Launch, check_launch, classify_rank, run_ranks, torchrun_command
from recompute_bench.measure.faults import FAULT_DELAY_S
from recompute_bench.measure.record import FAULT_ENV, rank_summary

SLOW = pytest.mark.slow  # launches ranks: `make test-all`; the pure logic below runs in the fast lane


# A global batch of 8: two micro-batches per rank under dp = 2, the first accumulated without being
# reduced (DDP's main gradients, FSDP's unsharded gradients), the second reduced.
ACCUMULATE = ["training.global_batch_size=8"]


@pytest.fixture(scope="module")
def single_rank_losses() -> list[float]:
    return measure(config(sets=[*RANK_SETS, *ACCUMULATE]))["ranks"][0]["losses"]


@SLOW
@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_data_parallel_over_two_ranks_gives_the_single_rank_losses(tmp_path, data_parallel, single_rank_losses):
    record = launch_ranks(tmp_path, data_parallel, sets=ACCUMULATE)
    assert record["status"] == "ok", record["failure"]
    assert record["config"]["parallel"]["data_parallel_size"] == 2
    assert record["launch"]["world_size"] == 2 and record["launch"]["data_parallel"] == data_parallel
    # FSDP shards the optimizer state: the record (and the estimate) say use_distributed_optimizer.
    assert record["config"]["parallel"]["use_distributed_optimizer"] == (data_parallel == "fsdp")
    assert [r["status"] for r in record["ranks"]] == ["ok", "ok"]
    assert len(single_rank_losses) == 2
    for rank in record["ranks"]:
        assert rank["losses"] == pytest.approx(single_rank_losses, rel=LOSS_RTOL)
        assert len(rank["step_times_s"]) == 1
    # Each rank holds one micro-batch of the global two: the single-rank micro-batch's activations.
    single = measure(config(sets=RANK_SETS))["metrics"]["activation_bytes"]
    assert [r["activation_bytes"] for r in record["ranks"]] == [single, single]
    assert record["metrics"]["estimated_activation_bytes"] == pytest.approx(single, rel=0.02)


@SLOW
def test_an_oom_on_one_rank_names_it_and_keeps_the_other_ranks_figures(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "oom:backward:1@1")
    record = launch_ranks(tmp_path, sets=["training.measured_steps=2"])
    assert record["status"] == "oom"
    assert {k: record["failure"][k] for k in ("rank", "step", "phase")} == {"rank": 1, "step": 1, "phase": "backward"}
    assert rank_summary(record) == record["failure"]["summary"] == "OOM rank1; waiting rank0"
    rank0 = record["ranks"][0]
    assert rank0["status"] == "waiting" and rank0["losses"] and rank0["activation_bytes"] > 0  # what it measured stays


@SLOW
def test_a_hang_on_one_rank_is_cut_by_the_collective_watchdog(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "hang:forward:1@1")
    watchdog = 5.0
    started = time.monotonic()
    record = launch_ranks(tmp_path, sets=["training.measured_steps=2"], watchdog_s=watchdog)
    assert time.monotonic() - started < watchdog + 60  # start-up, the watchdog, torchrun's teardown
    assert record["status"] == "timeout"
    assert [r["status"] for r in record["ranks"]] == ["timeout", "waiting"]
    assert record["ranks"][1]["failure"]["step"] == 1  # the hung rank finished step 0 and no more
    assert "Timed out" in record["failure"]["message"] and record["failure"]["rank"] == 0


@SLOW
def test_a_step_takes_as_long_as_its_slowest_rank(tmp_path, monkeypatch):
    # Rank 1's optimizer takes FAULT_DELAY_S longer in the measured step; rank 0 does not wait for
    # it inside the step (no collective follows the optimizer), so rank 0's own time is short.
    monkeypatch.setenv(FAULT_ENV, "delay:optimizer:1@1")
    record = launch_ranks(tmp_path)
    assert record["status"] == "ok", record["failure"]
    [fast], [slow] = (r["step_times_s"] for r in record["ranks"])
    assert slow > FAULT_DELAY_S > fast
    assert record["metrics"]["step_times_s"] == [slow] and record["metrics"]["step_time_s"] == slow
    assert record["metrics"]["step_time_spread_s"] == pytest.approx(slow - fast)
    assert record["metrics"]["tflops_per_gpu"] == pytest.approx(record["metrics"]["model_flops_per_step"] / slow / 2 / 1e12)


@SLOW
def test_a_rank_late_to_a_step_does_not_start_its_peers_clocks(tmp_path, monkeypatch):
    # Rank 1 takes FAULT_DELAY_S to write its piece before the measured step, as a slow disk would.
    # Without the barrier rank 0 would time that as its own step (waiting in the gradient all-reduce).
    monkeypatch.setenv(FAULT_ENV, "delay:write:1@1")
    record = launch_ranks(tmp_path)
    assert record["status"] == "ok", record["failure"]
    assert max(r["step_times_s"][0] for r in record["ranks"]) == record["metrics"]["step_time_s"] < FAULT_DELAY_S / 2


def _rank_pid(pieces: Path, rank: int) -> int | None:
    """The pid of the rank process measuring into `pieces` with torchrun's RANK `rank` (Linux /proc)."""
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"measure" in command and str(pieces).encode() in command and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None


@SLOW
def test_a_rank_killed_by_a_signal_is_killed_and_its_peer_waiting(tmp_path):
    # What the host's OOM killer does: SIGKILL to one rank in the middle of the run.
    launch = Launch(nproc_per_node=2)
    cfg = check_launch(config(sets=[*RANK_SETS, "training.measured_steps=5000"]), launch, "cpu")
    pieces, result = tmp_path / "pieces", {}
    run = threading.Thread(target=lambda: result.update(run_ranks(cfg, launch, name="t", pieces=pieces,
                                                                  log_path=tmp_path / "t.log", timeout_s=180)))
    run.start()
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        try:
            if json.loads((pieces / "rank1.json").read_text())["rank_entry"]["step"] >= 2:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    os.kill(_rank_pid(pieces, 1), signal.SIGKILL)
    run.join()
    assert [r["status"] for r in result["ranks"]] == ["waiting", "killed"]
    assert result["status"] == "killed" and result["failure"]["rank"] == 1 and result["failure"]["signal"] == "SIGKILL"
    assert "killed by SIGKILL while running step" in result["failure"]["message"]
    assert result["failure"]["summary"] == "killed rank1; waiting rank0"
    assert result["ranks"][1]["losses"]  # what the killed rank measured before stays


@SLOW
def test_the_nccl_watchdogs_verdict_reaches_the_record(tmp_path, monkeypatch):
    # Rank 1 ends as ProcessGroupNCCL's watchdog ends a rank: its verdict on stderr, then SIGABRT.
    monkeypatch.setenv(FAULT_ENV, "watchdog:backward:1@1")
    record = launch_ranks(tmp_path, sets=["training.measured_steps=2"])
    assert [r["status"] for r in record["ranks"]] == ["waiting", "timeout"]
    assert record["status"] == "timeout" and record["failure"]["rank"] == 1
    assert record["failure"]["collective"] == "ALLREDUCE" and "300.042 s" in record["failure"]["message"]


@SLOW
def test_a_gloo_timeout_names_the_collective_and_the_rank(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "hang:write:1@1")  # rank 1 never reaches the next step's barrier
    record = launch_ranks(tmp_path, sets=["training.measured_steps=2"], watchdog_s=5.0)
    assert record["status"] == "timeout" and record["failure"]["rank"] == 0
    assert record["failure"]["collective"] == "barrier"
    assert [r["status"] for r in record["ranks"]] == ["timeout", "waiting"]


def test_a_failed_rank_leaves_through_destroy_process_group(tmp_path, monkeypatch):
    from recompute_bench.launch import rank as rank_program
    from recompute_bench.measure import distributed

    (tmp_path / "config.json").write_text(json.dumps(config(sets=RANK_SETS).to_dict()))
    monkeypatch.setenv("RANK", "1")
    left = []
    monkeypatch.setattr(distributed, "measure_rank", lambda cfg, **kw: {"rank_entry": {"status": "oom"}})
    monkeypatch.setattr(distributed, "leave_group", lambda: left.append("destroyed") or True)
    monkeypatch.setattr(rank_program, "_die_with_agent", lambda: None)  # this process is pytest, not a rank
    assert rank_program.measure(["--pieces", str(tmp_path)]) == 1  # torchrun then stops the peers
    assert left == ["destroyed"]


def test_leaving_the_group_is_bounded_in_time(monkeypatch):
    import torch.distributed as dist
    from recompute_bench.measure.distributed import leave_group

    release = threading.Event()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: release.wait(60))  # a destroy that blocks
    started = time.monotonic()
    try:
        assert leave_group(0.2) is False and time.monotonic() - started < 5
    finally:
        release.set()
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    assert leave_group(0.2) is True


def test_a_hung_ranks_stack_is_read_through_torchruns_line_prefix():
    from recompute_bench.launch.process import innermost_frame

    dump = ("[default1]:Current thread 0x00007f (most recent call first):\n"
            '[default1]:  File "/x/recompute_bench/measure/point.py", line 245 in _fault\n'
            '[default1]:  File "/x/recompute_bench/measure/point.py", line 280 in step\n')
    assert innermost_frame(dump) == "point.py:245 in _fault"


# Lines as torch writes them (`WorkNCCL::checkTimeout`): the prefix of torch 2.5+, and of torch 2.1.
NCCL_TIMEOUTS = [
    "[rank1]:[E1123 20:27:21.433063423 ProcessGroupNCCL.cpp:632] [PG ID 0 PG GUID 0(default_pg) Rank 1] Watchdog caught "
    "collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) "
    "ran for 600088 milliseconds before timing out.",
    "[E ProcessGroupNCCL.cpp:475] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, "
    "OpType=BROADCAST, NumelIn=131072000, NumelOut=131072000, Timeout(ms)=600000) ran for 600081 milliseconds before timing out.",
]


@pytest.mark.parametrize("line, collective", list(zip(NCCL_TIMEOUTS, ["ALLREDUCE", "BROADCAST"])))
def test_classifying_ranks_from_torchruns_exits_and_the_watchdog(line, collective):
    running = {"rank_entry": {"rank": 1, "status": "running", "step": 4, "failure": None}}
    aborted = {"first": 1, "ranks": {"1": {"local_rank": 1, "exitcode": -6, "signal": "SIGABRT"}}}
    entry = classify_rank(1, running, exits=aborted, stderr="noise\n" + line + "\nterminate called\n")
    assert entry["status"] == "timeout" and entry["failure"]["collective"] == collective
    assert classify_rank(1, running, exits=aborted)["status"] == "killed"  # SIGABRT without a verdict: a crash
    # torchrun stops the other ranks with SIGTERM: they waited, unless one was the first to fail
    stopped = {"first": 0, "ranks": {"0": {"local_rank": 0, "exitcode": -9, "signal": "SIGKILL"},
                                     "1": {"local_rank": 1, "exitcode": -15, "signal": "SIGTERM"}}}
    assert classify_rank(1, running, exits=stopped)["status"] == "waiting"
    assert classify_rank(0, None, exits=stopped)["status"] == "killed"  # killed before its first piece
    assert classify_rank(1, running, exits={**stopped, "first": 1})["status"] == "killed"
    assert classify_rank(1, running, exits={})["status"] == "waiting"


@SLOW
def test_two_launchers_on_localhost_rendezvous_into_one_point(tmp_path):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    results = tmp_path / "runs.jsonl"
    args = [sys.executable, "-c", "from recompute_bench.cli import main; main()", "run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "two-nodes", "--results", str(results),
            *[a for s in RANK_SETS for a in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    nodes = [subprocess.Popen([*args, "--node-rank", str(n)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    codes = [node.wait(timeout=240) for node in nodes]
    assert codes == [0, 0], [node.stderr.read()[-2000:] for node in nodes]
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(records) == 2  # each node's launcher appends the point it merged
    for record in records:
        assert record["status"] == "ok" and record["launch"]["nnodes"] == 2
        assert [r["rank"] for r in record["ranks"]] == [0, 1]
        assert record["ranks"][0]["losses"] == pytest.approx(record["ranks"][1]["losses"], rel=0)


def test_the_launcher_command_line_and_environment(tmp_path, monkeypatch):
    one = torchrun_command(Launch(nproc_per_node=2), tmp_path)
    assert one[1:4] == ["-m", "recompute_bench.launch.rank", "agent"]
    text = " ".join(one)
    assert "--nproc-per-node 2 --nnodes 1 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint localhost:0" in text
    assert "--max-restarts 0" in text and f"-m recompute_bench.launch.rank measure --pieces {tmp_path}" in text
    many = " ".join(torchrun_command(Launch(nproc_per_node=8, nnodes=2, node_rank=1, rdzv_endpoint="head:29500",
                                            rdzv_id="job7", data_parallel="fsdp"), tmp_path))
    assert "--nproc-per-node 8 --nnodes 2 --node-rank 1 --rdzv-backend c10d --rdzv-endpoint head:29500 --rdzv-id job7" in many
    assert "--data-parallel fsdp" in many
    monkeypatch.setenv(FAULT_ENV, "error:forward:0@1")
    env = worker_env("p")
    assert env[PARENT_PID_ENV] == str(os.getpid()) and env[FAULT_ENV] == "error:forward:0@1"
    assert str(Path(__file__).resolve().parents[1]) in env["PYTHONPATH"].split(os.pathsep)


def test_rank_summaries():
    ranks = [{"rank": r, "status": s} for r, s in enumerate(["ok", "ok", "oom", "waiting", "ok", "oom"])]
    assert rank_summary({"ranks": ranks}) == "OOM ranks 2,5; waiting rank3"
    assert rank_summary({"ranks": ranks[:2]}) == ""


@pytest.mark.parametrize("args, words", [
    (["--memory-limit-gb", "40"], "no CUDA device here; drop --memory-limit-gb"),
    (["--pp", "2"], "tensor_model_parallel_size 1 x pipeline_model_parallel_size 2 does not divide the 1 rank(s)"),
    (["--pp", "4", "--nproc-per-node", "4"], "torch's 1F1B schedule needs at least as many micro-batches as stages (4), "
                                             "got 2; pass --global-batch-size 8 or more, or --pp-schedule GPipe"),
    (["--dp", "2"], "pass --nproc-per-node 2"),
    (["--nnodes", "2"], "pass --rdzv-endpoint"),
    (["--nproc-per-node", "2", "--data-parallel", "zero"], "is not one of ddp, fsdp"),
    (["--nproc-per-node", "2", "--set", "parallel.use_distributed_optimizer=true"], "pass --data-parallel fsdp"),
])
def test_bad_launches_are_one_line_exit_2(tmp_path, args, words):
    result = invoke("run", "--device", "cpu", "--results", str(tmp_path / "r.jsonl"), *args)
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output
    assert not (tmp_path / "r.jsonl").exists()


@SLOW
def test_a_sweep_over_two_ranks_records_one_ranks_oom_and_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_POINTS_ENV, "Baseline=oom:forward:0@1")
    result = invoke("sweep", "--baseline", "--modules", "core_attn", "--nproc-per-node", "2", "--run-id", "two",
                    "--results-dir", str(tmp_path), "--no-golden", *[a for s in RANK_SETS for a in ("--set", s)])
    assert result.exit_code == 1, result.output
    records = [json.loads(line) for line in (tmp_path / "two" / "results.jsonl").read_text().splitlines()]
    assert [(r["point"]["name"], r["status"]) for r in records] == [("Baseline", "oom"), ("Exp 1", "ok")]
    assert records[0]["failure"]["summary"] == "OOM rank1; waiting rank0"
    assert [len(r["ranks"]) for r in records] == [2, 2] and "OOM rank1" in " ".join(result.stderr.split())


@SLOW
def test_verify_over_two_fsdp_ranks_is_exact_and_matches_one_rank(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("verify", "--nproc-per-node", "2", "--data-parallel", "fsdp", "--attention-backend", "sdpa",
                    "--seq-length", "32", "--recompute-granularity", "full", "--recompute-method", "uniform",
                    "--recompute-num-layers", "1", "--json")
    assert result.exit_code == 0, result.output
    [outcome] = json.loads(result.stdout)
    assert outcome["setting"] == "full uniform 1" and outcome["exact"]  # recompute under FSDP2: bitwise
    # FSDP's gathered gradients against one rank running both micro-batches (each seeded alike for
    # dropout) and averaging: fp32 rounding at most (the mean of two values is summed once either way).
    line = next(line for line in result.stderr.splitlines() if "ranks vs one rank" in line)
    loss_diff, grad_diff = (float(line.split(key)[1].split()[0].rstrip(",")) for key in ("|loss diff|", "max |grad diff|"))
    assert loss_diff <= 1e-6 and grad_diff <= 1e-6


def _end(pids: list[int]) -> None:
    """SIGKILL what a failing test left running (each by its id), so the machine is not left with it."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _gone_within(path: Path, seconds: float) -> list[int]:
    """The processes still naming `path` once `seconds` have passed (none: as soon as there are none)."""
    deadline = time.monotonic() + seconds
    while (left := processes_naming(path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@SLOW
def test_a_sweep_killed_during_a_two_rank_point_leaves_no_rank_and_resumes_alone(tmp_path):
    # Both ranks of the first point hang in step 1; the sweep is SIGKILLed then (a crash, `kill -9`).
    # torchrun starts each rank in a session of its own: they must die with the agent, which dies
    # with the sweep. Then `--resume RUN` alone (the plan keeps its ranks) completes the sweep.
    run = tmp_path / "killed"
    sets = [a for s in RANK_SETS for a in ("--set", s)]
    command = [sys.executable, "-c", "from recompute_bench.cli import main; main()", "sweep", "--baseline", "--modules",
               "core_attn", "--nproc-per-node", "2", "--run-id", "killed", "--results-dir", str(tmp_path),
               "--no-golden", *sets]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), FAULT_POINTS_ENV: "Baseline=hang:forward:1"}
    sweep = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pieces = run / "work" / "Baseline"
    try:
        deadline = time.monotonic() + 150
        while True:  # both ranks finished step 0: they hang in step 1's forward
            try:
                if all(json.loads((pieces / f"rank{r}.json").read_text())["rank_entry"]["step"] >= 1 for r in (0, 1)):
                    break
            except (OSError, ValueError):
                pass
            assert sweep.poll() is None and time.monotonic() < deadline, "the ranks never reached step 1"
            time.sleep(0.2)
        assert len(processes_naming(pieces)) >= 3  # the agent and both ranks
        sweep.kill()
        sweep.wait()
        assert _gone_within(pieces, 10) == []
    finally:
        sweep.kill()
        _end(processes_naming(pieces))
    result = invoke("sweep", "--resume", "killed", "--results-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    assert [(r["point"]["name"], r["status"], r["launch"]["world_size"]) for r in records] == [
        ("Baseline", "ok", 2), ("Exp 1", "ok", 2)]


@SLOW
def test_a_point_cut_by_its_time_limit_leaves_no_rank_behind(tmp_path, monkeypatch):
    # Rank 1 of the first point hangs; its collective limit (--watchdog-s) is longer than the
    # point's time limit, which kills the agent's process group: both ranks go with it, and the
    # next point runs on a machine they left.
    monkeypatch.setenv(FAULT_POINTS_ENV, "Baseline=hang:forward:1@1")
    pieces = tmp_path / "cut" / "work" / "Baseline"
    try:
        result = invoke("sweep", "--baseline", "--modules", "core_attn", "--nproc-per-node", "2", "--timeout", "40",
                        "--watchdog-s", "300", "--run-id", "cut", "--results-dir", str(tmp_path), "--no-golden",
                        *[a for s in RANK_SETS for a in ("--set", s)])
        assert result.exit_code == 1, result.output
        records = [json.loads(line) for line in (tmp_path / "cut" / "results.jsonl").read_text().splitlines()]
        assert [(r["point"]["name"], r["status"]) for r in records] == [("Baseline", "timeout"), ("Exp 1", "ok")]
        assert _gone_within(pieces, 5) == []
    finally:
        _end(processes_naming(pieces))
