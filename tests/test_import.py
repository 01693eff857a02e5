"""`recompute-bench import`: every format's reader against excerpts written from the source's own
format strings (tests/data/ingest/README.md), the steps each source's convention chooses, the record
it becomes, bad input (exit 2, one line naming the file, other files still written), and the seeds'
experiment table replayed from Bridge logs through import, compare and report."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from helpers import invoke
from recompute_bench.gate import golden as gold
from recompute_bench.ingest import formats
from recompute_bench.ingest.timing import bridge_window, megatron_window
from recompute_bench.results.rows import load_result_records, record_row

DATA = Path(__file__).parent / "data" / "ingest"
MEGATRON_LOG = DATA / "megatron-lm" / "gpt-tp2-pp2.log"
MEGATRON_OOM = DATA / "megatron-lm" / "gpt-tp2-pp2-oom.log"
GOLDEN_CASE = DATA / "megatron-golden" / "gpt3_mcore_te_tp1_pp1_resume_torch_dist_uniform_full_recompute"
MEGATRON_GOLDEN = GOLDEN_CASE / "golden_values_dev_dgx_h100.json"
SEED = DATA / "bridge-seed"
BRIDGE_GOLDEN = DATA / "bridge-golden" / "llama3_70b_sft_h100_bf16.json"
TORCHTITAN = DATA / "torchtitan" / "llama3-8b.log"
H100 = "NVIDIA H100 80GB HBM3"
# The seeds' runs: Llama 3 70B on 32 H100s, TP 4, PP 4, VP 5 (Bridge's summary states those); the
# preset gives the model's vocabulary and embeddings, --dp the data-parallel size.
SEED_ARGS = ["-w", "llama3-70b", "--dp", "2", "--device-name", H100]
BRIDGE_GOLDEN_ARGS = [*SEED_ARGS, "--tp", "4", "--pp", "4", "--set", "parallel.virtual_pipeline_model_parallel_size=5",
                      "--sequence-parallel", "--use-distributed-optimizer", "-gb", "32", "-sl", "4096",
                      "--recompute-modules", "core_attn"]
TORCHTITAN_ARGS = ["-w", "llama3-8b", "-gb", "8", "-sl", "8192", "--dp", "8"]


def _import(tmp_path, *args, results="cluster.jsonl"):
    out = tmp_path / results
    return invoke("import", *map(str, args), "--results", str(out)), out


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ----- readers --------------------------------------------------------------------------------------

def test_megatron_log_reads_the_dump_the_steps_and_every_ranks_memory():
    run = formats.read(MEGATRON_LOG)
    assert run.format == "megatron-lm" and run.complete
    assert run.arguments["tensor_model_parallel_size"] == 2 and run.arguments["recompute_modules"] == ["core_attn"]
    assert run.arguments["padded_vocab_size"] == 50688  # from " > padded vocab ... (new size: 50688)"
    assert [s.step for s in run.steps] == list(range(1, 21))
    assert run.steps[0].step_time_s == pytest.approx(3.07097, abs=1e-4)
    assert sorted(run.ranks) == [0, 1, 4, 5]  # the data-parallel rank 0 of each (tp, pp)
    assert run.ranks[4].peak_allocated_bytes == pytest.approx(2561.30 * 2**20)  # MB are 2**20 bytes
    assert run.ranks[4].after_step == 2  # the last report wins


def test_megatron_window_is_the_median_of_steps_5_to_20():
    run = formats.read(MEGATRON_LOG)
    w = megatron_window(run.steps)
    assert [s.step for s in w.steps] == list(range(5, 21))
    assert w.value("step_time_s") == statistics.median(s.step_time_s for s in run.steps[4:20])


def test_megatron_oom_names_its_rank_step_and_the_gpus_capacity():
    run = formats.read(MEGATRON_OOM)
    assert run.failure.rank == 5 and run.failure.device_total_bytes == pytest.approx(79.11 * 2**30)
    assert "CUDA out of memory" in run.failure.message


def test_bridge_log_reads_the_summary_steps_and_memory_in_decimal_gigabytes():
    run = formats.read(SEED / "Exp 1.log")
    assert run.format == "megatron-bridge" and not run.complete
    a = run.arguments
    assert (a["tensor_model_parallel_size"], a["pipeline_model_parallel_size"], a["virtual_pipeline_model_parallel_size"]) == (4, 4, 5)
    assert (a["recompute_granularity"], a["recompute_modules"], a["seq_length"], a["padded_vocab_size"]) == \
        ("selective", ["mlp"], 4096, 128256)
    assert [s.step for s in run.steps] == list(range(50))  # Bridge counts steps from 0 (iteration - 1)
    assert len(run.ranks) == 16 and run.ranks[0].peak_allocated_bytes == 55.6e9
    w = bridge_window(run.steps)
    assert [s.step for s in w.steps] == list(range(35, 50))  # max(1, int(50 * 0.70)) onwards
    assert w.value("tflops_per_gpu") == pytest.approx(593.6)


def test_megatron_golden_reads_the_real_file_and_its_model_config():
    run = formats.read(MEGATRON_GOLDEN)
    assert run.format == "megatron-golden" and run.device_name == "dgx_h100"
    assert run.arguments["recompute_granularity"] == "full" and run.arguments["num_layers"] == 12
    assert run.ranks[-1].peak_allocated_bytes == 2561334272.0  # step 100, the last rank's peak
    w = megatron_window(run.steps)
    assert [s.step for s in w.steps] == list(range(30, 46))


def test_bridge_golden_and_torchtitan_are_detected_and_read():
    bg = formats.read(BRIDGE_GOLDEN)
    assert bg.format == "bridge-golden" and len(bg.steps) == 10 and bg.peaks["peak_allocated_bytes"] == 57.2e9
    tt = formats.read(TORCHTITAN)
    assert tt.format == "torchtitan" and tt.device_name == H100
    assert [s.step for s in tt.steps] == [1, 10, 15, 20] and tt.steps[-1].tokens_per_s_per_gpu == 6245
    assert tt.ranks[0].peak_reserved_bytes == pytest.approx(58.87 * 2**30) and tt.ranks[0].peak_allocated_bytes is None


# ----- records ------------------------------------------------------------------------------------

def test_megatron_log_record_keeps_the_source_figures_with_the_estimate_per_rank(tmp_path):
    result, out = _import(tmp_path, MEGATRON_LOG)
    assert result.exit_code == 0, result.output
    (r,) = _records(out)
    assert r["schema"] == "recompute-bench/result/v1" and r["config"]["training"]["framework"] == "megatron"
    assert r["config"]["parallel"]["data_parallel_size"] == 2 and r["config"]["model"]["vocab_size"] == 50688
    run = formats.read(MEGATRON_LOG)
    w = megatron_window(run.steps)
    assert r["metrics"]["step_time_s"] == w.value("step_time_s")
    assert r["metrics"]["tflops_per_gpu"] == w.value("tflops_per_gpu")  # the log's own throughput
    assert r["source"]["steps"] == list(range(5, 21)) and "median" in r["source"]["timing"]
    assert r["metrics"]["peak_allocated_bytes"] == pytest.approx(2561.30 * 2**20)
    assert r["env"]["torch_version"] is None and r["metrics"]["activation_bytes"] is None  # not measured, not guessed
    stages = {e["rank"]: e["stage"] for e in r["ranks"]}
    assert stages == {0: 0, 1: 0, 4: 1, 5: 1}  # order tp-cp-ep-dp-pp: rank // (tp x dp)
    assert all(e["estimated_peak_allocated_bytes"] > 0 for e in r["ranks"])


def test_oom_record_names_rank_and_step(tmp_path):
    result, out = _import(tmp_path, MEGATRON_OOM)
    assert result.exit_code == 0, result.output
    (r,) = _records(out)
    assert r["status"] == "oom" and r["failure"]["rank"] == 5 and r["failure"]["step"] == 4
    assert r["failure"]["summary"] == "OOM rank5"
    assert r["metrics"]["step_time_s"] is None  # three steps, none after Megatron's warm-up window


def test_torchtitan_record_uses_megatrons_flops_over_the_measured_tokens_per_second(tmp_path):
    result, out = _import(tmp_path, TORCHTITAN, *TORCHTITAN_ARGS)
    assert result.exit_code == 0, result.output
    (r,) = _records(out)
    m = r["metrics"]
    assert m["step_time_s"] == pytest.approx(8 * 8192 / (6245 * 8))
    assert m["tflops_per_gpu"] == pytest.approx(m["model_flops_per_step"] / m["step_time_s"] / 8 / 1e12)
    assert r["source"]["reported"] == {"tflops_per_gpu": 361.76, "tokens_per_s_per_gpu": 6245.0}
    assert m["peak_allocated_bytes"] is None and r["config"]["training"]["framework"] == "recompute-bench"


# ----- bad input ----------------------------------------------------------------------------------

def _one_error_line(result):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output
    return lines[0]


def test_a_file_in_no_known_format(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello\n")
    assert "notes.txt: is in no known format" in _one_error_line(_import(tmp_path, bad)[0])


def test_a_log_without_iteration_lines(tmp_path):
    text = MEGATRON_LOG.read_text().splitlines()
    log = tmp_path / "started.log"
    log.write_text("\n".join(line for line in text if " iteration " not in line) + "\n")
    assert "started.log: has no iteration line" in _one_error_line(_import(tmp_path, log)[0])


def test_a_truncated_last_line_is_named(tmp_path):
    text = MEGATRON_LOG.read_text()
    log = tmp_path / "cut.log"
    log.write_text(text[:text.rindex(" lm loss:")])  # the last iteration line, cut mid-write
    line = _one_error_line(_import(tmp_path, log)[0])
    assert f"cut.log:{len(log.read_text().splitlines())}: the last line is cut short" in line


def test_an_argument_the_estimate_cannot_express_names_its_line(tmp_path):
    text = MEGATRON_LOG.read_text().replace("  fp8 " + "." * 45 + " None", "  fp8 " + "." * 45 + " hybrid")
    assert "hybrid" in text
    log = tmp_path / "fp8.log"
    log.write_text(text)
    n = next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith("  fp8 "))
    line = _one_error_line(_import(tmp_path, log)[0])
    assert f"fp8.log:{n}:" in line and "--fp8-format hybrid cannot be expressed" in line  # the dump names it fp8


def test_a_bridge_log_without_a_preset_says_what_to_pass(tmp_path):
    line = _one_error_line(_import(tmp_path, SEED / "Exp 1.log")[0])
    assert "Exp 1.log" in line and "--workload" in line


def test_a_flag_for_what_the_log_states_is_refused(tmp_path):
    line = _one_error_line(_import(tmp_path, SEED / "Exp 1.log", *SEED_ARGS, "-gb", "64")[0])
    assert "Exp 1.log" in line and "training.global_batch_size" in line


def test_what_other_files_gave_is_still_written(tmp_path):
    bad = tmp_path / "empty.json"
    bad.write_text("{}\n")
    result, out = _import(tmp_path, MEGATRON_LOG, bad, MEGATRON_OOM)
    assert "empty.json" in _one_error_line(result)
    assert [r["status"] for r in _records(out)] == ["ok", "oom"]


# ----- every format imports, compares and reports ----------------------------------------------------

@pytest.mark.parametrize("path,args", [
    (MEGATRON_LOG, []), (MEGATRON_GOLDEN, ["--world-size", "8"]), (SEED / "Exp 1.log", SEED_ARGS),
    (BRIDGE_GOLDEN, BRIDGE_GOLDEN_ARGS), (TORCHTITAN, TORCHTITAN_ARGS),
], ids=["megatron-lm", "megatron-golden", "megatron-bridge", "bridge-golden", "torchtitan"])
def test_every_format_imports_compares_and_reports(tmp_path, path, args):
    result, out = _import(tmp_path, path, *args)
    assert result.exit_code == 0, result.output
    golden = tmp_path / "golden.csv"
    assert invoke("golden", "update", str(out), "--golden", str(golden)).exit_code == 0
    compared = invoke("compare", str(out), "--golden", str(golden), "--json")
    assert compared.exit_code == 0, compared.output
    assert [r["verdict"] for r in json.loads(compared.stdout)["rows"]] == ["pass"]
    reported = invoke("report", str(out), "--out", str(tmp_path / "report"))
    assert reported.exit_code == 0, reported.output
    md = (tmp_path / "report" / "report.md").read_text()
    assert "Memory per rank: measured and estimated" in md or path == BRIDGE_GOLDEN  # a Bridge golden names no rank


# ----- the seeds' experiment table --------------------------------------------------------------------

def seed_golden(tmp_path) -> Path:
    """The golden of the seeds' table: the preset's known-good run (Golden.log: selective[core_attn],
    709.8 TFLOP/s/GPU over Bridge's window, fits at 57.2 GB) promoted with `golden update`, and the same
    figures required of every setting the experiments try (each row keyed by that setting), so a
    setting is judged against what the preset delivers: within 5% of its TFLOP/s and it fits."""
    result, known_good = _import(tmp_path, SEED / "Golden.log", *SEED_ARGS, results="golden-run.jsonl")
    assert result.exit_code == 0, result.output
    path = tmp_path / "h100.csv"
    assert invoke("golden", "update", str(known_good), "--golden", str(path)).exit_code == 0
    (reference,) = gold.read_golden(path)
    figures = {k: reference[k] for k in ("status", "tflops_per_gpu", "step_time_s", "peak_allocated_bytes",
                                         "peak_reserved_bytes", "loss")}
    experiments = [record_row(r) for r in load_result_records(tmp_path / "cluster.jsonl")]
    rows = [reference] + [{**gold.golden_row(r), **figures} for r in experiments
                          if r["setting"] != reference["setting"]]
    gold.write_golden(path, rows)
    return path


def test_the_seeds_experiment_table_replays_with_its_verdicts(tmp_path):
    logs = [SEED / f"{name}.log" for name in ("Baseline", "Exp 1", "Exp 2", "Exp 3")]
    result, out = _import(tmp_path, *logs, *SEED_ARGS)
    assert result.exit_code == 0, result.output
    golden = seed_golden(tmp_path)
    compared = invoke("compare", str(out), "--golden", str(golden), "--json")
    assert compared.exit_code == 1  # the gate fails, as the seeds' table does
    rows = {r["experiment"]: r for r in json.loads(compared.stdout)["rows"]}
    assert {name: r["verdict"] for name, r in rows.items()} == {
        "Baseline": "unexpected OOM", "Exp 1": "perf regression", "Exp 2": "perf regression", "Exp 3": "unexpected OOM"}
    vs_golden = {name: next(m["rel_diff"] for m in r["metrics"] if m["name"] == "tflops_per_gpu")
                 for name, r in rows.items()}
    assert {name: f"{100 * d:+.1f}%" for name, d in vs_golden.items()} == {
        "Baseline": "-0.8%", "Exp 1": "-16.4%", "Exp 2": "-17.3%", "Exp 3": "-1.1%"}  # the seeds' "vs Golden"
    table = compared.stderr
    assert "Unexpected OOM rank0" in table and "Perf regression" in table
    peaks = {r["point"]["name"]: r["metrics"]["peak_allocated_bytes"] for r in _records(out)}
    assert peaks == {"Baseline": 58.8e9, "Exp 1": 55.6e9, "Exp 2": 55.6e9, "Exp 3": 59.6e9}  # the seeds' Peak Mem (GB)
    reported = invoke("report", str(out), "--out", str(tmp_path / "report"))
    assert reported.exit_code == 0, reported.output
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| Baseline | `selective[core_attn]` | OOM rank0 | 704.0 |" in md
    assert "| Exp 3 | `selective[core_attn,layernorm]` | 0 | 0 | OOM |" in md  # rank 0, stage 0, beside its estimate
