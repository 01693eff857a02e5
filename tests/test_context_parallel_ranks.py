"""Context parallel over ranks under torchrun, CPU and gloo (test_ranks.py's settings, fp32, seq 32):
cp 2 on 2 ranks with each attention path (p2p, all_gather) and kernel (flash; the written-out one
with dropout), every recompute kind, a Llama layer; cp 2 x tp 2 (sequence parallel), dp 2 x cp 2
(FSDP2) and cp 2 x pp 2 on 4 ranks. Every rank's saved bytes equal the estimate exactly (per pipeline
stage too), the losses and gathered gradients equal one rank's to fp32 rounding, verify is bitwise
under each layout, and a hung or OOMing context-parallel rank is named."""

from __future__ import annotations

import json
import re

import pytest

from helpers import LOSS_RTOL, RANK_SETS, SMALL_LLAMA, config, invoke, measure, rank_script
from recompute_bench.measure.record import FAULT_ENV, rank_summary

pytestmark = pytest.mark.slow  # launches ranks: `make test-all`

CP2 = ["parallel.context_parallel_size=2"]
DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]  # the written-out kernel, whose matmuls are counted
LLAMA = [f"{k}={v}" for k, v in SMALL_LLAMA.items()] + ["model.num_layers=2"]

TWO = {  # name -> (workload, data parallel, --set items), measured on 2 ranks
    "p2p": ("tiny", "ddp", [*RANK_SETS, *CP2]),
    "all_gather": ("tiny", "ddp", [*RANK_SETS, *CP2, "parallel.cp_comm_type=all_gather"]),
    "p2p dropout": ("tiny", "ddp", [*RANK_SETS, *CP2, *DROPOUT]),
    "all_gather dropout": ("tiny", "ddp", [*RANK_SETS, *CP2, *DROPOUT, "parallel.cp_comm_type=all_gather"]),
    "core_attn": ("tiny", "ddp", [*RANK_SETS, *CP2, *DROPOUT, "recompute.granularity=selective",
                                  'recompute.modules=["core_attn", "layernorm"]']),
    "core_attn all_gather": ("tiny", "ddp", [*RANK_SETS, *CP2, *DROPOUT, "parallel.cp_comm_type=all_gather",
                                             "recompute.granularity=selective", 'recompute.modules=["core_attn"]']),
    "full": ("tiny", "ddp", [*RANK_SETS, *CP2, "recompute.granularity=full", "recompute.method=block",
                             "recompute.num_layers=2"]),
    "llama": ("llama3-8b", "ddp", [*RANK_SETS, *LLAMA, *CP2]),
}
TWO_GATHERED = {
    "grads p2p": ("tiny", "ddp", [*RANK_SETS, *CP2]),
    "grads all_gather": ("tiny", "ddp", [*RANK_SETS, *CP2, "parallel.cp_comm_type=all_gather"]),
    "grads llama": ("llama3-8b", "ddp", [*RANK_SETS, *LLAMA, *CP2]),
}
FOUR = {
    "cp x tp": ("llama3-8b", "ddp", [*RANK_SETS, *LLAMA, *CP2, "parallel.tensor_model_parallel_size=2",
                                     "parallel.sequence_parallel=true"]),
    "dp x cp fsdp": ("tiny", "fsdp", [*RANK_SETS, *CP2, "training.global_batch_size=4"]),
    "cp x pp": ("tiny", "ddp", [*RANK_SETS, *CP2, "parallel.pipeline_model_parallel_size=2",
                                "training.global_batch_size=4", "recompute.granularity=selective",
                                'recompute.modules=["core_attn"]']),
}
FOUR_GATHERED = {
    "grads cp x tp": ("llama3-8b", "ddp", [*RANK_SETS, *LLAMA, *CP2, "parallel.tensor_model_parallel_size=2",
                                           "parallel.sequence_parallel=true"]),
    "grads dp x cp fsdp": ("tiny", "fsdp", [*RANK_SETS, *CP2]),
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return rank_script("context_parallel_ranks.py", tmp_path_factory.mktemp("cp2"), json.dumps(TWO), json.dumps(TWO_GATHERED))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    return rank_script("context_parallel_ranks.py", tmp_path_factory.mktemp("cp4"), json.dumps(FOUR),
                       json.dumps(FOUR_GATHERED), nproc=4, timeout=600)


def _alone(workload: str, sets: list[str]) -> dict:
    """The same point on one rank: cp 1, every other setting as given."""
    return measure(config(workload, sets=[s for s in sets if not s.startswith("parallel.")]))


@pytest.mark.parametrize("point", TWO)
def test_cp2_measures_the_estimated_bytes_on_every_rank_and_one_ranks_losses(two_ranks, point):
    ranks = [r[point] for r in two_ranks]
    assert [r["status"] for r in ranks] == ["ok", "ok"], ranks[0]["failure"]
    assert [r["rank_entry"]["context_parallel_rank"] for r in ranks] == [0, 1]
    for rank in ranks:
        # exactly: every storage the split's attention, the embedding's copy of the ids and the rest keep
        assert rank["metrics"]["activation_bytes"] == rank["metrics"]["estimated_activation_bytes"]
        assert rank["metrics"]["activation_bytes_per_layer"] == rank["metrics"]["estimated_activation_bytes_per_layer"]
    env = ranks[0]["env"]
    assert env["context_parallel_attention"] == ("all_gather" if "all_gather" in point else "p2p")
    dropout = "dropout" in point or point.startswith("core_attn")
    assert env["attention_kernel"] == ("sdpa_math" if dropout else "flash")
    m = ranks[0]["metrics"]
    if dropout:  # the written-out kernel's matmuls are counted: what each rank's blocks run, summed
        assert m["measured_flops_per_step"] == m["hardware_flops_per_step"]
    else:  # FlopCounterMode has no formula for torch's CPU flash kernel: the rest of the step
        assert m["measured_flops_per_step"] < m["hardware_flops_per_step"]
    workload, _, sets = TWO[point]
    if not dropout:  # dropout: each rank draws its own masks
        alone = _alone(workload, sets)
        # fp32: the softmax merged from blocks, dK and dV summed over ranks, gradients averaged over
        # cp: the same sums in another order, a few ulps of a loss near 6 (two steps: the second
        # after the optimizer applied the all-reduced gradients).
        assert ranks[0]["losses"] == pytest.approx(alone["ranks"][0]["losses"], rel=LOSS_RTOL)
        assert m["model_flops_per_step"] == alone["metrics"]["model_flops_per_step"]


@pytest.mark.parametrize("point", TWO_GATHERED)
def test_cp2_gathered_gradients_equal_one_ranks(two_ranks, point):
    got = two_ranks[0][point]
    # fp32, another order of the same sums: within 1e-6 of the loss and of the largest gradient, and
    # every parameter under its single-rank name (a missing or renamed one is inf).
    assert got["loss_diff"] <= 1e-6 * got["loss"]
    assert got["max_grad_diff"] <= 1e-6 * got["max_grad"], got["worst_parameter"]


@pytest.mark.parametrize("point", FOUR)
def test_cp2_with_tp_fsdp_or_pp_on_four_ranks(four_ranks, point):
    ranks = [r[point] for r in four_ranks]
    assert [r["status"] for r in ranks] == ["ok"] * 4, ranks[0]["failure"]
    workload, kind, sets = FOUR[point]
    alone = _alone(workload, sets)
    for rank in ranks:
        assert rank["losses"] == pytest.approx(alone["ranks"][0]["losses"], rel=LOSS_RTOL)
        entry, m = rank["rank_entry"], rank["metrics"]
        if "pipeline_stage" in entry:  # each stage against its own estimate, its peak through the schedule too
            est = m["estimated_stages"][entry["pipeline_stage"]]
            assert entry["activation_bytes"] == est["activation_bytes"]
            assert entry["activation_peak_bytes"] == est["activation_peak_bytes"]
        else:
            assert m["activation_bytes"] == m["estimated_activation_bytes"]
    if point == "cp x pp":
        assert {r["rank_entry"]["pipeline_stage"] for r in ranks} == {0, 1}
        assert ranks[0]["rank_entry"]["activation_bytes"] != ranks[2]["rank_entry"]["activation_bytes"]
    if point == "cp x tp":  # the cp rank is the second coordinate: ranks 0, 1 hold cp rank 0
        assert [r["rank_entry"]["context_parallel_rank"] for r in ranks] == [0, 0, 1, 1]


@pytest.mark.parametrize("point", FOUR_GATHERED)
def test_cp2_with_tp_or_fsdp_gathered_gradients_equal_one_ranks(four_ranks, point):
    got = four_ranks[0][point]
    assert got["loss_diff"] <= 1e-6 * got["loss"]
    assert got["max_grad_diff"] <= 1e-6 * got["max_grad"], got["worst_parameter"]


# ----- the CLI ----------------------------------------------------------------------------------

SEQ32 = ["--seq-length", "32"]


def test_run_cp2_records_every_rank_and_its_estimate(tmp_path):
    result = invoke("run", "-w", "tiny", "--nproc-per-node", "2", "--cp", "2", *SEQ32, "--device", "cpu",
                    "--results", str(tmp_path / "r.jsonl"))
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "r.jsonl").read_text())
    assert record["status"] == "ok" and record["config"]["parallel"]["context_parallel_size"] == 2
    assert [r["activation_bytes"] for r in record["ranks"]] == [record["metrics"]["estimated_activation_bytes"]] * 2
    assert record["env"]["context_parallel_attention"] == "p2p"
    assert record["env"]["context_parallel_check"].startswith("p2p sdpa_math cp2 bfloat16 on cpu: output and q/k/v gradients within")
    assert "(cp 2)" in " ".join(result.output.split())


@pytest.mark.parametrize("args", [["--nproc-per-node", "2", "--cp", "2"],
                                  ["--nproc-per-node", "4", "--cp", "2", "--tp", "2", "--sequence-parallel"],
                                  ["--nproc-per-node", "4", "--cp", "2", "--pp", "2"]])
def test_verify_over_context_parallel_ranks_is_exact_and_matches_one_rank(tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    result = invoke("verify", *args, *SEQ32, "--recompute-granularity", "full", "--recompute-method", "uniform",
                    "--recompute-num-layers", "1", "--json")
    assert result.exit_code == 0, result.output
    [outcome] = json.loads(result.stdout)
    assert outcome["setting"] == "full uniform 1" and outcome["attention_backend"] == "sdpa" and outcome["exact"]
    found = re.search(r"one rank running every micro-batch \(sdpa\): \|loss diff\| (\S+), max \|grad diff\| (\S+)",
                      result.stderr)
    assert found, result.stderr
    assert float(found.group(1).rstrip(",")) <= 1e-6 * 7 and float(found.group(2)) <= 1e-6  # a loss near 6


def _faulted(tmp_path, monkeypatch, fault: str, *args: str) -> dict:
    monkeypatch.setenv(FAULT_ENV, fault)
    invoke("run", "-w", "tiny", "--nproc-per-node", "2", "--cp", "2", *SEQ32, "--device", "cpu", "--set",
           "training.measured_steps=2", "--results", str(tmp_path / "r.jsonl"), *args)
    return json.loads((tmp_path / "r.jsonl").read_text())


def test_an_oom_on_a_context_parallel_rank_names_it(tmp_path, monkeypatch):
    record = _faulted(tmp_path, monkeypatch, "oom:backward:1@1")
    assert record["status"] == "oom"
    assert {k: record["failure"][k] for k in ("rank", "step", "phase")} == {"rank": 1, "step": 1, "phase": "backward"}
    assert rank_summary(record) == "OOM rank1; waiting rank0"
    assert [r.get("context_parallel_rank") for r in record["ranks"]] == [0, 1]


def test_a_hung_context_parallel_rank_is_cut_by_the_watchdog(tmp_path, monkeypatch):
    record = _faulted(tmp_path, monkeypatch, "hang:forward:1@1", "--watchdog-s", "5")
    assert record["status"] == "timeout"
    # rank 0 timed out waiting in the ring's exchange for the hung rank 1, which finished step 0 only
    assert [r["status"] for r in record["ranks"]] == ["timeout", "waiting"]
    assert record["ranks"][1]["failure"]["step"] == 1 and record["failure"]["rank"] == 0
