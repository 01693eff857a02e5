"""Tensor parallelism (DTensor) over 2 ranks under torchrun, CPU and gloo (test_ranks.py's settings):
tp=2 with and without sequence parallelism gives the single-rank losses, FLOPs and (per rank) the
estimated activation bytes; distribute_saved_activations halves the checkpointed inputs; verify
gathers every gradient and compares it; bad combinations are one line, exit 2."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from helpers import LOSS_RTOL, RANK_SETS, SMALL_LLAMA, config, invoke, measure, rank_script

from recompute_bench.analysis.harness.stage import activation_bytes as estimated_activation_bytes
from recompute_bench.measure.record import layout_label

SLOW = pytest.mark.slow  # launches ranks: `make test-all`; the pure logic here runs in the fast lane

TP2 = ["parallel.tensor_model_parallel_size=2"]
MATH = ["model.attention_backend=math"]  # its matmuls have FLOP formulas on a CPU (the flash kernel's have none)
FULL_1 = ["recompute.granularity=full", "recompute.method=uniform", "recompute.num_layers=1"]


# Llama's layer (RMSNorm, SwiGLU, 8 heads in 2 query groups, RoPE, untied output layer), small.
LLAMA = [f"{k}={v}" for k, v in SMALL_LLAMA.items()] + ["model.num_layers=2"]


def _alone(sets, workload: str = "tiny") -> dict:
    return measure(config(workload, sets=[*RANK_SETS, *sets]))


POINTS = {
    "sp": ("tiny", [*RANK_SETS, *TP2, "parallel.sequence_parallel=true", *MATH]),
    "distributed": ("tiny", [*RANK_SETS, *TP2, *FULL_1, "recompute.distribute_saved_activations=true"]),
    "llama": ("llama3-8b", [*RANK_SETS, *LLAMA, *TP2, "parallel.sequence_parallel=true", *MATH]),
}
GATHERED = {  # one micro-batch's gradients, gathered (full_tensor) and compared with one rank's
    "grads tp": ("llama3-8b", [*RANK_SETS, *LLAMA, *TP2, *MATH]),
    "grads tp+sp": ("llama3-8b", [*RANK_SETS, *LLAMA, *TP2, "parallel.sequence_parallel=true", *MATH]),
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Both points measured on 2 ranks in one torchrun launch (tensor_parallel_ranks.py): each rank's results."""
    return rank_script("tensor_parallel_ranks.py", tmp_path_factory.mktemp("tp"), json.dumps(POINTS), json.dumps(GATHERED))


@SLOW
def test_tp2_with_sequence_parallel_matches_one_rank_and_the_estimate(two_ranks):
    ranks = [r["sp"] for r in two_ranks]
    assert [r["status"] for r in ranks] == ["ok", "ok"], ranks[0]["failure"]
    alone = _alone(MATH)
    for rank in ranks:
        # fp32: the row-parallel all-reduce, the reduce-scatter and the vocabulary-parallel softmax
        # add the same numbers in another order, a few ulps of a loss near 6.
        assert rank["losses"] == pytest.approx(alone["ranks"][0]["losses"], rel=LOSS_RTOL)
    m = ranks[0]["metrics"]
    # Each rank keeps its shards: 1/2 of everything but the tokens, what the estimate says (here: exactly).
    assert ranks[1]["metrics"]["activation_bytes"] == m["activation_bytes"]
    assert m["activation_bytes"] == pytest.approx(m["estimated_activation_bytes"], rel=0.02)
    assert m["activation_bytes"] < 0.55 * alone["metrics"]["activation_bytes"]
    # FLOPs of DTensor ops are counted on local shards: 2 ranks x this rank's = one rank's step.
    assert m["measured_flops_per_step"] == alone["metrics"]["measured_flops_per_step"] == m["hardware_flops_per_step"]
    assert m["num_parameters"] == alone["metrics"]["num_parameters"]


@SLOW
def test_tp2_with_sequence_parallel_on_a_llama_layer(two_ranks):
    """Whole query groups per rank, SwiGLU's gate and up columns paired per rank, RMSNorm on shards."""
    ranks = [r["llama"] for r in two_ranks]
    assert [r["status"] for r in ranks] == ["ok", "ok"], ranks[0]["failure"]
    alone = _alone([*LLAMA, *MATH], "llama3-8b")
    assert ranks[0]["losses"] == pytest.approx(alone["ranks"][0]["losses"], rel=LOSS_RTOL)
    m = ranks[0]["metrics"]
    assert m["activation_bytes"] == pytest.approx(m["estimated_activation_bytes"], rel=0.02)
    assert m["measured_flops_per_step"] == alone["metrics"]["measured_flops_per_step"]


@SLOW
@pytest.mark.parametrize("point", GATHERED)
def test_tp2_gathered_gradients_equal_one_ranks(two_ranks, point):
    got = two_ranks[0][point]
    # fp32, the same sums in another order (the row-parallel all-reduce, the reduce-scatter, the
    # vocabulary-parallel softmax): within 1e-6 of the largest gradient, and every parameter present
    # under its single-rank name (a missing or renamed one is inf).
    assert got["loss_diff"] <= 1e-6
    assert got["max_grad_diff"] <= 1e-6 * got["max_grad"], got["worst_parameter"]


@SLOW
def test_tp2_distribute_saved_activations_halves_the_checkpointed_inputs(two_ranks):
    ranks = [r["distributed"] for r in two_ranks]
    assert [r["status"] for r in ranks] == ["ok", "ok"], ranks[0]["failure"]
    alone = _alone(FULL_1)  # one rank keeps each layer's whole [b, s, h] input, as tp=2 without it would
    for rank in ranks:
        assert rank["losses"] == pytest.approx(alone["ranks"][0]["losses"], rel=LOSS_RTOL)
    m = ranks[0]["metrics"]
    assert m["activation_bytes_per_layer"] * 2 == alone["metrics"]["activation_bytes_per_layer"]
    assert m["activation_bytes_per_layer"] == m["estimated_activation_bytes_per_layer"]
    kept = config(sets=[*RANK_SETS, *TP2, *FULL_1])  # the same tp=2 point keeping whole inputs, estimated
    assert alone["metrics"]["activation_bytes_per_layer"] == estimated_activation_bytes(kept, "cpu")[
        "activation_bytes_per_layer"]
    # Its tables and golden rows (a record's `recompute` object) name it apart from the same setting
    # keeping whole inputs.
    from recompute_bench.results.rows import setting_label
    distributed = config(sets=[*RANK_SETS, *TP2, *FULL_1, "recompute.distribute_saved_activations=true"])
    assert distributed.recompute.label == "full uniform 1 +distribute" and kept.recompute.label == "full uniform 1"
    assert setting_label({"recompute": dataclasses.asdict(distributed.recompute)}) == "full uniform 1 +distribute"


@SLOW
def test_verify_over_two_tensor_parallel_ranks_gathers_every_gradient(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("verify", "--nproc-per-node", "2", "--tp", "2", "--sequence-parallel", "--attention-backend", "math",
                    "--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp", "layernorm",
                    "--set", "training.seq_length=32")
    assert result.exit_code == 0, result.output
    assert "all 1 settings leave the loss and every gradient bitwise equal" in result.output
    # Against one rank (dropout off): every gathered gradient within fp32 rounding of another sum order.
    found = re.search(r"one rank running every micro-batch \(math\): \|loss diff\| (\S+), max \|grad diff\| (\S+)",
                      result.output)
    assert found, result.output
    assert float(found.group(1)) < 1e-6 and float(found.group(2)) < 1e-6


@pytest.mark.parametrize("args, words", [
    (["--nproc-per-node", "3", "--tp", "3"], "tensor_model_parallel_size 3 must divide num_attention_heads 4"),
    (["--nproc-per-node", "2", "--tp", "2", "--sequence-parallel", "--recompute-granularity", "full",
      "--recompute-method", "uniform", "--recompute-num-layers", "1", "--set", "recompute.distribute_saved_activations=true"],
     "distribute_saved_activations must be false when sequence parallelism is enabled"),
    (["--nproc-per-node", "2", "--tp", "2", "--set", "recompute.distribute_saved_activations=true"],
     "distribute_saved_activations applies to full recompute only"),
    (["--nproc-per-node", "3", "--tp", "2"], "does not divide the 3 rank(s) launched"),
    (["--tp", "2"], "does not divide the 1 rank(s) launched"),
    (["--nproc-per-node", "4", "--tp", "2"], "pass --data-parallel fsdp to combine data and tensor parallelism"),
    (["--nproc-per-node", "2", "--tp", "2", "--sequence-parallel", "--seq-length", "33"], "pass --seq-length as a multiple of 2"),
    (["--nproc-per-node", "2", "--tp", "2", "-w", "tiny-moe"], "expert tensor parallel) is not modelled yet"),
])
def test_bad_tensor_parallel_combinations_are_one_line_exit_2(tmp_path, args, words):
    result = invoke("run", "--device", "cpu", "--results", str(tmp_path / "r.jsonl"), *args)
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "r.jsonl").exists()


def test_layout_labels():
    assert layout_label(2, "ddp") == "ddp"
    assert layout_label(2, "ddp", 2, True) == "tp 2, sequence parallel"
    assert layout_label(4, "fsdp", 2) == "fsdp 2 x tp 2"
    assert layout_label(2, "ddp", pp=2) == "pp 2" and layout_label(8, "fsdp", 2, True, 2) == "fsdp 2 x tp 2 x pp 2, sequence parallel"
