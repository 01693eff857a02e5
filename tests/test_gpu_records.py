"""The first GPU run's records (one H200, 2026-11-28, copied into tests/data/gpu-runs/h200/ from the
shared run folder) against the estimate and the gate: the estimate counts what every CUDA rank
allocates besides the model (torch's two cuBLAS workspaces, the RoPE tables), and the h200 golden
rows committed in results/golden/h200.csv are those runs' own, with their provenance, and gate them."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest
from helpers import invoke

from recompute_bench.analysis.cuda_workspaces import cublas_workspace_bytes, torch_cublas_workspaces_bytes
from recompute_bench.analysis.harness.rank import CUBLAS_WORKSPACES, ROPE_TABLES, rank_memory, record_estimate
from recompute_bench.analysis.megatron import COMPUTE_CAPABILITY
from recompute_bench.config.presets import gpu_type
from recompute_bench.config.schema import RecomputeConfig
from recompute_bench.gate import golden as gold
from recompute_bench.gate import verdicts
from recompute_bench.models import DeviceKernels
from recompute_bench.results.rows import record_row
from recompute_bench.workload import config_from_dict

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "tests" / "data" / "gpu-runs" / "h200"
GOLDEN = ROOT / "results" / "golden" / "h200.csv"
MiB = 2**20


def records(name: str) -> list[dict]:
    return [json.loads(line) for line in (RUNS / name).read_text().splitlines() if line.strip()]


def config_of(record: dict):
    recompute = {**dataclasses.asdict(RecomputeConfig()), **record["recompute"]}
    return config_from_dict({"workload": record["workload"], **record["config"], "recompute": recompute})


def device_of(record: dict) -> DeviceKernels:
    """The device the record ran on, as `run` hands it to the estimate: its attention kernel and the
    compute capability of its GPU kind (torch's default cuBLAS workspace: CUBLAS_WORKSPACE_CONFIG unset)."""
    env = record["env"]
    return DeviceKernels("cuda", env.get("attention_kernel"), COMPUTE_CAPABILITY[gpu_type(env["device_name"])])


def test_torchs_cublas_workspace_follows_the_compute_capability_and_the_variable():
    # CublasHandlePool.cpp getChosenWorkspaceSize: 32 MiB on majors 9, 10 and 12, :4096:2:16:8 before
    assert cublas_workspace_bytes(90) == cublas_workspace_bytes(100) == cublas_workspace_bytes(120) == 32 * MiB
    assert cublas_workspace_bytes(80) == cublas_workspace_bytes(110) == 8 * MiB + 128 * 1024
    assert cublas_workspace_bytes(90, ":4096:8") == 32 * MiB
    assert cublas_workspace_bytes(90, ":4096:2:16:8") == 8 * MiB + 128 * 1024
    assert cublas_workspace_bytes(80, ":16:8") == 128 * 1024
    assert cublas_workspace_bytes(90, "garbage") == 32 * MiB  # no pair: torch warns and takes the default
    assert torch_cublas_workspaces_bytes(90) == 64 * MiB


@pytest.fixture
def the_records_loss(monkeypatch):
    """These runs ran the harness's cross-entropy as it was then, Megatron's whole-logits one (its
    fp32 softmax of every logit kept, with each token's target id and mask, and the 16-bit logits
    beside it in its forward), not today's chunked one (docs/speed.md): the estimate of those runs
    counts that loss's terms in place of today's."""
    from recompute_bench.analysis.harness import rank, stage
    from recompute_bench.models import ELEMENT_BYTES
    from recompute_bench.models.context_parallel import rank_seq_length

    today = stage.loss_saved_bytes

    def saved(cfg, device="cuda"):
        out = dict(today(cfg, device))
        logits = out.pop("loss.logits_gradient") / ELEMENT_BYTES[cfg.training.precision]
        tokens = rank_seq_length(cfg) * cfg.training.micro_batch_size
        return {**out, "loss.softmax": 4 * logits, "loss.masked_target": 8 * tokens, "loss.target_mask": tokens}

    def workspace(cfg):
        e = ELEMENT_BYTES[cfg.training.precision]
        return 0.0 if e >= 4 else e * saved(cfg)["loss.softmax"] / 4

    for module in (rank, stage):
        monkeypatch.setattr(module, "loss_saved_bytes", saved)
    monkeypatch.setattr(rank, "loss_workspace_bytes", workspace)


@pytest.mark.parametrize("name, within", [("tiny.jsonl", 0.05), ("tiny-moe.jsonl", 0.05), ("tiny-mla.jsonl", 0.05),
                                          ("llama3-8b-slice.jsonl", 0.0005)])
def test_the_estimate_meets_the_h200s_measured_peaks(name, within, the_records_loss):
    # Before the workspaces and RoPE tables were counted tiny's estimate was 7.1 MiB against 72.2 MiB
    # measured (-90%) and the llama slice's 66 MiB short.
    for record in records(name):
        assert record["status"] == "ok"
        measured = record["metrics"]["peak_allocated_bytes"]
        estimated = record_estimate(config_of(record), device_of(record))["estimated_peak_allocated_bytes"]
        assert abs(estimated - measured) <= within * measured, (name, record["recompute"], estimated, measured)


def test_the_llama_slice_is_left_with_a_fraction_of_a_mib(the_records_loss):
    for record in records("llama3-8b-slice.jsonl"):
        measured = record["metrics"]["peak_allocated_bytes"]
        estimated = record_estimate(config_of(record), device_of(record))["estimated_peak_allocated_bytes"]
        assert 0 <= measured - estimated < 0.25 * MiB


def test_the_workspaces_count_on_cuda_only_and_the_rope_tables_where_rope_is():
    llama = config_of(records("llama3-8b-slice.jsonl")[0])
    on_cuda = rank_memory(llama, 0, device_of(records("llama3-8b-slice.jsonl")[0])).items
    assert on_cuda[CUBLAS_WORKSPACES] == 64 * MiB
    assert on_cuda[ROPE_TABLES] == 2 * 8192 * 64 * 2  # cos and sin, [8192, 128 / 2] in bf16
    on_cpu = rank_memory(llama, 0, "cpu").items
    assert CUBLAS_WORKSPACES not in on_cpu and on_cpu[ROPE_TABLES] == on_cuda[ROPE_TABLES]
    on_a100 = rank_memory(llama, 0, DeviceKernels("cuda", compute_capability=80)).items
    assert on_a100[CUBLAS_WORKSPACES] == 2 * (8 * MiB + 128 * 1024)
    tiny = config_of(records("tiny.jsonl")[0])  # learned absolute positions: no tables
    assert ROPE_TABLES not in rank_memory(tiny, 0, "cuda").items


def test_the_h200_golden_holds_the_recorded_runs_with_their_provenance():
    rows = gold.read_golden(GOLDEN)
    assert {r["workload"] for r in rows} == {"tiny", "llama3-8b"} and len(rows) == 8
    for row in rows:
        assert (row["device_name"], row["torch_version"]) == ("NVIDIA H200", "2.11.0+cu130")
        assert row["measured_at"].startswith("2026-11-28T") and row["run_id"] in ("golden-source", "llama")
    # tiny's rows are the ones `golden update` wrote from the real sweep, TFLOP/s not gated (a tiny
    # step is launch overhead); the llama rows are the slice's records as measured
    with (RUNS / "golden-h200-tiny.csv").open() as f:
        written = {r["setting"]: r for r in csv.DictReader(f)}
    tiny = [r for r in rows if r["workload"] == "tiny"]
    assert {r["setting"]: r["peak_allocated_bytes"] for r in tiny} == {k: int(v["peak_allocated_bytes"]) for k, v in written.items()}
    assert all(r["tolerance"] == "tflops_per_gpu:off" for r in tiny)
    llama = {r["setting"]: r for r in rows if r["workload"] == "llama3-8b"}
    for record in records("llama3-8b-slice.jsonl"):
        row = llama[record_row(record)["setting"]]
        assert row["peak_allocated_bytes"] == record["metrics"]["peak_allocated_bytes"]
        assert row["tflops_per_gpu"] == pytest.approx(record["metrics"]["tflops_per_gpu"])


def test_compare_passes_the_recorded_llama_sweep_and_fails_a_grown_peak():
    # as `sweep` gates a sweep: the golden rows of the points it ran
    golden = gold.read_golden(GOLDEN)
    rows = [record_row(r) for r in records("llama3-8b-slice.jsonl")]
    keys = {verdicts.row_key(r) for r in rows}
    comparison = verdicts.compare(rows, golden, only_keys=keys)
    assert comparison.passed and [r.verdict for r in comparison.rows] == [verdicts.PASS] * 5
    grown = json.loads(json.dumps(records("llama3-8b-slice.jsonl")[0]))
    grown["metrics"]["peak_allocated_bytes"] = int(1.1 * grown["metrics"]["peak_allocated_bytes"])
    worse = verdicts.compare([record_row(grown)], golden, only_keys={verdicts.row_key(record_row(grown))})
    assert not worse.passed


def test_compare_gates_the_recorded_llama_sweep_against_its_workloads_golden_rows(tmp_path):
    results = tmp_path / "llama.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in records("llama3-8b-slice.jsonl")))
    whole = invoke("compare", str(results), "--golden", str(GOLDEN))
    assert whole.exit_code == 1 and "missing" in whole.output  # tiny's rows, which this sweep did not run
    ran = invoke("compare", str(results), "--golden", str(GOLDEN), "--workload", "llama3-8b")
    assert ran.exit_code == 0, ran.output
    assert "missing" not in ran.output and "5" in ran.output
    wrong = invoke("compare", str(results), "--golden", str(GOLDEN), "-w", "llama3-70b")
    assert wrong.exit_code == 2 and "has no golden row of workload llama3-70b: it holds llama3-8b, tiny" in " ".join(wrong.output.split())
    assert "Traceback" not in wrong.output


def test_the_cuda_peak_tests_shape_puts_the_settings_tens_of_mib_apart():
    # tests/gpu/test_cuda.py asserts the measured order of the settings equals the estimate's, at a
    # shape where the estimate puts them tens of MiB apart (here, on the CPU: the estimate's side)
    import importlib.util

    from helpers import config

    spec = importlib.util.spec_from_file_location("gpu_test_cuda", ROOT / "tests" / "gpu" / "test_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    peaks = {name: record_estimate(config(sets=module.FAST + ["model.max_position_embeddings=1024"], **module.SHAPE,
                                          **overrides), DeviceKernels("cuda", compute_capability=90))
             ["estimated_peak_allocated_bytes"] for name, overrides in module.SETTINGS.items()}
    assert peaks["none"] - peaks["selective"] > 40 * MiB and peaks["selective"] - peaks["full"] > 40 * MiB
