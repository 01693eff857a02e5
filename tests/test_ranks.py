"""Many ranks under torchrun, measured on CPU with gloo (2 ranks, the tiny model, seq 32, one
measured step): data parallel gives the single-rank losses, one rank's OOM, error or hang is
recorded with its rank while the other rank's figures are kept, two launchers on localhost
rendezvous into one point, and the launcher's command line and environment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import config, invoke
from recompute_bench.launch.process import FAULT_POINTS_ENV, PARENT_PID_ENV, worker_env
from recompute_bench.launch.torchrun import Launch, check_launch, run_ranks, torchrun_command
from recompute_bench.measure.point import run_point
from recompute_bench.measure.record import FAULT_ENV, rank_summary

# No dropout (each rank draws its own masks), fp32 (no 16-bit rounding of the all-reduce), the
# step's global batch of 4 samples split into 2 micro-batches of 2: one per rank under dp = 2.
SETS = ["model.hidden_dropout=0", "model.attention_dropout=0", "training.precision=fp32",
        "training.seq_length=32", "training.warmup_steps=0", "training.measured_steps=1"]
# The losses of the first step (same weights, same tokens) and of the second (after one update
# from the all-reduced gradients) agree to fp32 rounding: only the order in which the micro-batch
# losses and gradients are summed differs, a few ulps of a value near 6.
LOSS_RTOL = 1e-6


def _two_ranks(tmp_path: Path, data_parallel: str = "ddp", sets=(), watchdog_s: float = 60.0,
               timeout_s: float = 180.0) -> dict:
    launch = Launch(nproc_per_node=2, data_parallel=data_parallel, watchdog_s=watchdog_s)
    cfg = check_launch(config(sets=[*SETS, *sets]), launch, "cpu")
    return run_ranks(cfg, launch, name="t", pieces=tmp_path / "pieces", log_path=tmp_path / "t.log", timeout_s=timeout_s)


# A global batch of 8: two micro-batches per rank under dp = 2, the first accumulated without being
# reduced (DDP's main gradients, FSDP's unsharded gradients), the second reduced.
ACCUMULATE = ["training.global_batch_size=8"]


@pytest.fixture(scope="module")
def single_rank_losses() -> list[float]:
    return run_point(config(sets=[*SETS, *ACCUMULATE]))["ranks"][0]["losses"]


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_data_parallel_over_two_ranks_gives_the_single_rank_losses(tmp_path, data_parallel, single_rank_losses):
    record = _two_ranks(tmp_path, data_parallel, sets=ACCUMULATE)
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
    single = run_point(config(sets=SETS))["metrics"]["activation_bytes"]
    assert [r["activation_bytes"] for r in record["ranks"]] == [single, single]
    assert record["metrics"]["estimated_activation_bytes"] == pytest.approx(single, rel=0.02)


def test_an_oom_on_one_rank_names_it_and_keeps_the_other_ranks_figures(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "oom:backward:1@1")
    record = _two_ranks(tmp_path, sets=["training.measured_steps=2"])
    assert record["status"] == "oom"
    assert {k: record["failure"][k] for k in ("rank", "step", "phase")} == {"rank": 1, "step": 1, "phase": "backward"}
    assert rank_summary(record) == record["failure"]["summary"] == "OOM rank1; waiting rank0"
    rank0 = record["ranks"][0]
    assert rank0["status"] == "waiting" and rank0["losses"] and rank0["activation_bytes"] > 0  # what it measured stays


def test_a_hang_on_one_rank_is_cut_by_the_collective_watchdog(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "hang:forward:1@1")
    watchdog = 5.0
    started = time.monotonic()
    record = _two_ranks(tmp_path, sets=["training.measured_steps=2"], watchdog_s=watchdog)
    assert time.monotonic() - started < watchdog + 60  # start-up, the watchdog, torchrun's teardown
    assert record["status"] == "timeout"
    assert [r["status"] for r in record["ranks"]] == ["timeout", "waiting"]
    assert record["ranks"][1]["failure"]["step"] == 1  # the hung rank finished step 0 and no more
    assert "Timed out" in record["failure"]["message"] and record["failure"]["rank"] == 0


def test_two_launchers_on_localhost_rendezvous_into_one_point(tmp_path):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    results = tmp_path / "runs.jsonl"
    args = [sys.executable, "-c", "from recompute_bench.cli import main; main()", "run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "two-nodes", "--results", str(results),
            *[a for s in SETS for a in ("--set", s)]]
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
    (["--pp", "2", "--nproc-per-node", "2"], "pipeline parallelism is not measured yet"),
    (["--dp", "2"], "pass --nproc-per-node 2"),
    (["--nnodes", "2"], "pass --rdzv-endpoint"),
    (["--nproc-per-node", "2", "--data-parallel", "zero"], "is not one of ddp, fsdp"),
    (["--nproc-per-node", "2", "--set", "parallel.use_distributed_optimizer=true"], "pass --data-parallel fsdp"),
])
def test_bad_launches_are_one_line_exit_2(tmp_path, args, words):
    result = invoke("run", "--device", "cpu", "--results", str(tmp_path / "r.jsonl"), *args)
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real OOM under --memory-limit-gb needs a CUDA device")
def test_a_memory_limit_produces_a_real_oom_on_cuda(tmp_path):
    result = invoke("run", "--results", str(tmp_path / "r.jsonl"), "--memory-limit-gb", "0.001", "--json",
                    "--no-save", *[a for s in SETS[:2] for a in ("--set", s)])
    record = json.loads(result.stdout)
    assert result.exit_code == 1 and record["status"] == "oom" and record["launch"]["memory_limit_gb"] == 0.001


def test_a_sweep_over_two_ranks_records_one_ranks_oom_and_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_POINTS_ENV, "Baseline=oom:forward:0@1")
    result = invoke("sweep", "--baseline", "--modules", "core_attn", "--nproc-per-node", "2", "--run-id", "two",
                    "--results-dir", str(tmp_path), "--no-golden", *[a for s in SETS for a in ("--set", s)])
    assert result.exit_code == 1, result.output
    records = [json.loads(line) for line in (tmp_path / "two" / "results.jsonl").read_text().splitlines()]
    assert [(r["point"]["name"], r["status"]) for r in records] == [("Baseline", "oom"), ("Exp 1", "ok")]
    assert records[0]["failure"]["summary"] == "OOM rank1; waiting rank0"
    assert [len(r["ranks"]) for r in records] == [2, 2] and "OOM rank1" in " ".join(result.stderr.split())


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
