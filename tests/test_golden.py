"""compare and golden update on hand-made golden and result files: every verdict, direction,
tolerance edges, overrides, CI outputs, exit codes and corrupt inputs."""

import json
import shlex
import xml.etree.ElementTree as ET

import pytest

from helpers import invoke
from helpers import CPU_ENV, H100_ENV, record, write_golden_of, write_results
from recompute_bench.gate import golden as gold, metrics, tolerances as tol, verdicts
from recompute_bench.config.schema import BadInput
from recompute_bench.results.rows import KEY_COLUMNS, record_row


def verdict(actual, golden_record, *, tolerances=None, strict=False, tolerance_column=""):
    """Verdict of one result against a golden made of one record."""
    g = gold.golden_row(record_row(golden_record), tolerance_column)
    g["tolerance_parsed"] = tol.parse_tolerances([tolerance_column])
    comparison = verdicts.compare([record_row(actual)], [g], tolerances=tolerances or {}, strict=strict)
    return comparison.rows[0], comparison


@pytest.mark.parametrize("tflops, expected", [
    (100.0, verdicts.PASS), (95.1, verdicts.PASS), (95.0, verdicts.PASS),  # exactly at the 5% edge passes
    (94.9, verdicts.PERF), (105.0, verdicts.PASS), (105.1, verdicts.IMPROVED),
])
def test_tflops_is_higher_is_better_with_a_5_percent_tolerance(tflops, expected):
    row, _ = verdict(record(tflops_per_gpu=tflops), record())
    assert row.verdict == expected
    assert row.metric("tflops_per_gpu").rel_diff == pytest.approx((tflops - 100) / 100)


@pytest.mark.parametrize("factor, expected", [(1.05, verdicts.PASS), (1.051, verdicts.MEMORY), (0.949, verdicts.IMPROVED)])
def test_peak_memory_is_lower_is_better(factor, expected):
    row, _ = verdict(record(peak_allocated_bytes=int(50 * 2**30 * factor)), record())
    assert row.verdict == expected


def test_deterministic_metrics_are_exact():
    assert verdict(record(activation_bytes=10**9 + 1), record())[0].verdict == verdicts.MEMORY
    assert verdict(record(measured_flops_per_step=4 * 10**15 + 2), record())[0].verdict == verdicts.PERF
    assert verdict(record(num_parameters=10**9 + 1), record())[0].verdict == verdicts.CHANGED
    assert verdict(record(loss=6.0 * 1.009), record())[0].verdict == verdicts.PASS
    assert verdict(record(loss=6.0 * 1.011), record())[0].verdict == verdicts.CHANGED


@pytest.mark.parametrize("metric, golden_value", [
    ("activation_bytes", 10**9), ("measured_flops_per_step", 4 * 10**15), ("hardware_flops_per_step", 4 * 10**15),
    ("model_flops_per_step", 3 * 10**15), ("num_parameters", 10**9)])
def test_a_deterministic_metric_that_drops_is_a_changed_program_and_fails(metric, golden_value):
    row, comparison = verdict(record(**{metric: golden_value - 1}), record())
    assert (row.verdict, row.metric(metric).outcome, comparison.passed) == (verdicts.CHANGED, "changed", False)
    percent = f"{-100 / golden_value:+.2g}%"  # -1e-07% for one byte of a gigabyte: never "±0.0%"
    assert row.reasons == [f"{metric} {golden_value - 1} vs golden {golden_value} ({percent}, tolerance 0%): changed "
                           "(the program computes something else; if that is intended, update the golden)"]
    # TFLOP/s and peak memory are not deterministic: beyond tolerance they stay an improvement (strict only).
    assert verdict(record(tflops_per_gpu=200.0), record())[0].verdict == verdicts.IMPROVED


def test_compare_fails_on_fewer_activation_bytes_and_prints_the_update_command(tmp_path):
    g, r = _files(tmp_path, [record(name="Baseline")], [record(name="Baseline", activation_bytes=9 * 10**8)])
    result = invoke("compare", str(r), "--golden", str(g))
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert any(line.split() == ["│", "Baseline", "│", "activation_bytes", "│", "953.67", "MiB", "│", "858.31", "MiB", "│",
                                "-10.0%", "│", "0%", "│", "changed", "│"] for line in lines), result.stderr
    assert "FAIL: 1 of 1 rows failing; 1 changed" in lines
    hint = lines.index("if the change is intended, update the golden (then review the git diff):")
    assert lines[hint + 1] == f"  recompute-bench golden update {r} --golden {g}"


def test_cpu_rows_report_timing_and_gate_the_deterministic_metrics():
    row, _ = verdict(record(device=CPU_ENV, tflops_per_gpu=5.0), record(device=CPU_ENV))
    assert row.verdict == verdicts.PASS
    assert (row.metric("tflops_per_gpu").outcome, row.metric("tflops_per_gpu").rel_diff) == ("info", pytest.approx(-0.95))
    assert verdict(record(device=CPU_ENV, activation_bytes=10**9 + 1), record(device=CPU_ENV))[0].verdict == verdicts.MEMORY
    opted_in, _ = verdict(record(device=CPU_ENV, tflops_per_gpu=40.0), record(device=CPU_ENV), tolerance_column="tflops_per_gpu:50%")
    assert opted_in.verdict == verdicts.PERF
    row, _ = verdict(record(device=CPU_ENV), record(device=CPU_ENV))
    assert row.metric("peak_allocated_bytes").outcome == "n/m"
    assert row.metric("step_time_s").outcome == "info"


def test_the_table_says_cpu_timing_is_not_gated_where_a_gpu_row_shows_its_difference():
    from recompute_bench.render.comparison import CPU_NOT_GATED, CPU_NOTE, cpu_note, table_cells

    cpu, _ = verdict(record(device=CPU_ENV, tflops_per_gpu=5.0), record(device=CPU_ENV))
    assert table_cells(cpu)[3] == CPU_NOT_GATED  # not "-95.0%" beside OK
    gpu, _ = verdict(record(device=H100_ENV, tflops_per_gpu=5.0), record(device=H100_ENV))
    assert table_cells(gpu)[3] == "-95.0%"
    assert cpu_note(verdicts.Comparison([cpu])) == CPU_NOTE and cpu_note(verdicts.Comparison([gpu])) is None


def test_tolerance_overrides_command_line_beats_row_beats_default():
    slower = record(tflops_per_gpu=93.0)
    assert verdict(slower, record())[0].verdict == verdicts.PERF
    assert verdict(slower, record(), tolerances={"tflops_per_gpu": 0.10})[0].verdict == verdicts.PASS
    assert verdict(slower, record(), tolerance_column="tflops_per_gpu:10%")[0].verdict == verdicts.PASS
    assert verdict(record(tflops_per_gpu=98.0), record(), tolerance_column="tflops_per_gpu:1%")[0].verdict == verdicts.PERF
    row, _ = verdict(slower, record(), tolerances={"tflops_per_gpu": 0.01}, tolerance_column="tflops_per_gpu:10%")
    assert row.verdict == verdicts.PERF
    assert verdict(slower, record(), tolerances={"tflops_per_gpu": None})[0].metric("tflops_per_gpu").outcome == "info"


def test_a_row_shows_its_worst_verdict_and_keeps_the_others():
    row, _ = verdict(record(tflops_per_gpu=120.0, activation_bytes=2 * 10**9), record())
    assert row.verdict == verdicts.MEMORY
    assert set(row.verdicts) == {verdicts.MEMORY, verdicts.IMPROVED}


def test_oom_matrix():
    oom = record(status="oom", failure_rank=3)
    assert verdict(oom, record())[0].verdict == verdicts.UNEXPECTED_OOM
    assert verdict(oom, record(status="oom"))[0].verdict == verdicts.EXPECTED_OOM
    fits, comparison = verdict(record(), record(status="oom"))
    assert fits.verdict == verdicts.NOW_FITS and comparison.passed
    assert not verdict(record(), record(status="oom"), strict=True)[1].passed


def test_failed_points_fail_whatever_the_golden():
    from recompute_bench.render.comparison import result_text

    for status, text in (("error", "Error"), ("timeout", "Timeout"), ("killed", "Killed")):
        row, comparison = verdict(record(status=status), record())
        assert row.verdict == verdicts.FAILED and not comparison.passed and result_text(row) == text
        assert verdicts.compare([record_row(record(status=status))], []).rows[0].verdict == verdicts.FAILED


def test_not_comparable_device_software_or_definition():
    assert verdict(record(device=CPU_ENV), record())[0].verdict == verdicts.NOT_COMPARABLE
    assert verdict(record(device=(H100_ENV[0], "2.12.1+cu128")), record())[0].verdict == verdicts.NOT_COMPARABLE
    assert verdict(record(device=(H100_ENV[0], "2.13.1+cu130")), record())[0].verdict == verdicts.PASS
    # A v1 record written before ModelConfig had make_vocab_size_divisible_by: it keeps its key (the
    # field's default) but was measured by another program (the vocabulary was not padded).
    older = record()
    del older["config"]["model"]["make_vocab_size_divisible_by"]
    assert verdicts.row_key(record_row(older)) == verdicts.row_key(record_row(record()))
    row, _ = verdict(older, record())
    assert row.verdict == verdicts.NOT_COMPARABLE and "config_hash" in row.reasons[0]


def test_missing_and_new_rows(tmp_path):
    golden = [record(), record(["core_attn"])]
    results = [record(), record(["mlp"])]
    rows = gold.read_golden(write_golden_of(tmp_path / "g.csv", golden))
    comparison = verdicts.compare([record_row(r) for r in results], rows)
    assert [(r.setting, r.verdict) for r in comparison.rows] == [
        ("none", verdicts.PASS), ("selective[mlp]", verdicts.NEW), ("selective[core_attn]", verdicts.MISSING)]
    assert not comparison.passed and [r.verdict for r in comparison.failing_rows] == [verdicts.MISSING]
    only = verdicts.compare([record_row(r) for r in results], rows, only_keys={verdicts.row_key(record_row(results[0]))})
    assert [r.verdict for r in only.rows] == [verdicts.PASS, verdicts.NEW] and only.passed
    assert not verdicts.compare([record_row(r) for r in results], rows, strict=True,
                            only_keys={verdicts.row_key(record_row(results[0]))}).passed


def test_golden_csv_round_trip_keeps_exact_integers(tmp_path):
    big = record(measured_flops_per_step=1234567890123456789, loss=6.123456789)
    row = gold.read_golden(write_golden_of(tmp_path / "g.csv", [big]))[0]
    assert row["measured_flops_per_step"] == 1234567890123456789
    assert row["peak_allocated_bytes"] == 50 * 2**30 and row["recompute_modules"] == ""
    assert verdicts.compare([record_row(big)], [row]).passed


@pytest.mark.parametrize("spec, expected", [("tflops_per_gpu:5%", 0.05), ("loss:0.02", 0.02), ("activation_bytes:0", 0.0),
                                            ("step_time_s:off", None)])
def test_parse_tolerance(spec, expected):
    assert tol.parse_tolerance(spec)[1] == expected


@pytest.mark.parametrize("spec", ["tflops:5%", "tflops_per_gpu", "tflops_per_gpu:-1%", "loss:abc", "loss:inf"])
def test_bad_tolerance_is_bad_input(spec):
    with pytest.raises(BadInput):
        tol.parse_tolerance(spec)


# ----- the command line -----------------------------------------------------------------------
def _files(tmp_path, golden_records, result_records, tolerance=None):
    g = write_golden_of(tmp_path / "golden" / "h100.csv", golden_records, tolerance)
    r = write_results(tmp_path / "run" / "results.jsonl", result_records)
    return g, r


def test_compare_exit_0_on_pass_and_writes_ci_outputs(tmp_path, monkeypatch):
    g, r = _files(tmp_path, [record(name="Baseline"), record(["mlp"], name="Exp 1")],
                  [record(name="Baseline"), record(["mlp"], name="Exp 1", tflops_per_gpu=102.0)])
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = invoke("compare", str(r.parent), "--golden", str(g), "--junit", str(tmp_path / "out" / "junit.xml"),
                    "--markdown", str(tmp_path / "out" / "compare.md"), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["passed"] and [row["verdict"] for row in doc["rows"]] == ["pass", "pass"]
    tflops = next(m for m in doc["rows"][1]["metrics"] if m["name"] == "tflops_per_gpu")
    assert tflops["rel_diff"] == pytest.approx(0.02)
    suite = ET.parse(tmp_path / "out" / "junit.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) == 2 * len(metrics.METRICS) and suite.get("failures") == "0"
    text = summary.read_text()
    assert text.startswith("earlier step\n") and "**PASS" in text and "+2.0%" in text
    assert (tmp_path / "out" / "compare.md").read_text() in text


def test_compare_exit_1_names_the_regression_and_the_update_command(tmp_path):
    g, r = _files(tmp_path, [record(name="Baseline"), record(["mlp"], name="Exp 1")],
                  [record(name="Baseline"), record(["mlp"], name="Exp 1", tflops_per_gpu=80.0)])
    result = invoke("compare", str(r), "--golden", str(g), "--junit", str(tmp_path / "junit.xml"))
    assert result.exit_code == 1
    out = " ".join(result.stderr.split())
    assert "Perf regression" in out and "-20.0%" in out
    assert f"recompute-bench golden update {r} --golden {g} --select 'Exp 1'" in out
    failures = [c for c in ET.parse(tmp_path / "junit.xml").getroot().iter("testcase") if c.find("failure") is not None]
    assert [c.get("name") for c in failures] == ["selective[mlp] :: tflops_per_gpu"]
    assert "-20.0%" in failures[0].find("failure").get("message")


def test_the_printed_update_command_runs_as_printed(tmp_path):
    """compare RUN --results-dir DIR: the update command it prints names the folder too, stays on one line
    however long the paths, and promotes the rows when run as printed."""
    results_dir = tmp_path / ("a results folder with a name long enough to wrap any console " * 2).strip()
    g = write_golden_of(tmp_path / "golden" / "h100.csv", [record(), record(["mlp"])])
    write_results(results_dir / "nightly 7" / "results.jsonl", [record(name="Baseline"),
                                                                record(["mlp"], name="Exp 1", tflops_per_gpu=80.0)])
    result = invoke("compare", "nightly 7", "--golden", str(g), "--results-dir", str(results_dir))
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    command = lines[lines.index("if the change is intended, update the golden (then review the git diff):") + 1]
    assert shlex.split(command) == ["recompute-bench", "golden", "update", "nightly 7", "--golden", str(g),
                                    "--results-dir", str(results_dir), "--select", "Exp 1"]
    update = invoke(*shlex.split(command)[1:])
    assert update.exit_code == 0 and "0 added, 1 replaced, 1 kept" in update.stderr, update.output
    assert invoke("compare", "nightly 7", "--golden", str(g), "--results-dir", str(results_dir)).exit_code == 0


def test_strict_fails_on_unexpected_improvement(tmp_path):
    g, r = _files(tmp_path, [record()], [record(tflops_per_gpu=130.0)])
    assert invoke("compare", str(r), "--golden", str(g)).exit_code == 0
    assert invoke("compare", str(r), "--golden", str(g), "--strict").exit_code == 1
    assert invoke("compare", str(r), "--golden", str(g), "--tolerance", "tflops_per_gpu:50%", "--strict").exit_code == 0


def test_compare_finds_a_run_id_and_the_device_golden(tmp_path):
    write_golden_of(tmp_path / "golden" / "h100.csv", [record()])
    write_results(tmp_path / "myrun" / "results.jsonl", [record()])
    result = invoke("compare", "myrun", "--results-dir", str(tmp_path))
    assert result.exit_code == 0, result.output


def _corrupt(golden_file, kind):
    """The golden's text with one defect (the baseline row has no comma inside a cell)."""
    text = golden_file.read_text()
    header, row = text.splitlines()[:2]
    columns, cells = header.split(","), row.split(",")

    def with_cell(column, value):
        changed = list(cells)
        changed[columns.index(column)] = value
        return header + "\n" + ",".join(changed) + "\n"

    return {"bad number": with_cell("tflops_per_gpu", "fast"), "bad status": with_cell("status", "fine"),
            "duplicate": text + row + "\n", "bad tolerance": with_cell("tolerance", "speed:fast"),
            "empty": "", "binary": "\x00\xff\xfe garbage", "few columns": "workload,status\ntiny,ok\n"}[kind]


@pytest.mark.parametrize("kind, words", [
    ("missing", "does not exist"), ("empty", "not a readable CSV"), ("binary", "not a readable CSV"),
    ("few columns", "lacks the column"), ("bad number", "not a number"), ("bad status", "is not ok or oom"),
    ("duplicate", "repeats the key"), ("bad tolerance", "tolerance"),
])
def test_corrupt_golden_is_one_line_exit_2_and_writes_nothing(tmp_path, kind, words):
    g, r = _files(tmp_path, [record()], [record()])
    if kind == "missing":
        g.unlink()
    else:
        g.write_bytes(_corrupt(g, kind).encode("latin-1"))
    before = g.read_bytes() if g.exists() else None
    junit = tmp_path / "junit.xml"
    result = invoke("compare", str(r), "--golden", str(g), "--junit", str(junit))
    assert result.exit_code == 2, result.output
    assert words in result.stderr and "Traceback" not in result.output
    assert not junit.exists()
    if before is not None:
        update = invoke("golden", "update", str(r), "--golden", str(g))
        assert update.exit_code == 2 and g.read_bytes() == before


@pytest.mark.parametrize("lines, words", [
    ('{"schema": "recompute-bench/result/v1", "workl', "is not a JSON record"),
    ('{"a": 1}', "not a recompute-bench/result/v1 record"),
    ('{"schema": "recompute-bench/result/v1", "workload": "tiny"}', "lacks"),
])
def test_corrupt_results_are_one_line_exit_2(tmp_path, lines, words):
    g, r = _files(tmp_path, [record()], [record()])
    r.write_text(r.read_text() + lines + "\n")
    result = invoke("compare", str(r), "--golden", str(g))
    assert result.exit_code == 2 and words in result.stderr and "Traceback" not in result.output


def test_unknown_results_are_exit_2(tmp_path):
    result = invoke("compare", "no-such-run", "--results-dir", str(tmp_path))
    assert result.exit_code == 2 and "neither a file, a folder nor a run id" in result.stderr


def test_golden_update_replaces_adds_and_keeps_rows(tmp_path):
    g, _ = _files(tmp_path, [record(), record(["core_attn"]), record(["mlp"])], [], tolerance={1: "tflops_per_gpu:9%"})
    before = {row["setting"]: row for row in gold.read_golden(g)}
    r = write_results(tmp_path / "new" / "results.jsonl",
                      [record(["core_attn"], name="Exp 1", tflops_per_gpu=90.0),
                       record(["layernorm"], name="Exp 2"), record(["mlp"], name="Exp 3", status="error")])
    result = invoke("golden", "update", str(r), "--golden", str(g))
    assert result.exit_code == 0, result.output
    after = {row["setting"]: row for row in gold.read_golden(g)}
    assert list(after) == ["none", "selective[core_attn]", "selective[mlp]", "selective[layernorm]"]
    assert after["selective[core_attn]"]["tflops_per_gpu"] == 90.0
    assert after["selective[core_attn]"]["tolerance"] == "tflops_per_gpu:9%"
    assert after["none"] == before["none"] and after["selective[mlp]"] == before["selective[mlp]"]
    assert "Exp 3 (error)" in result.stderr


def test_golden_update_select_and_refusals(tmp_path):
    g, _ = _files(tmp_path, [record()], [])
    r = write_results(tmp_path / "new" / "results.jsonl",
                      [record(name="Baseline", tflops_per_gpu=50.0), record(["mlp"], name="Exp 1")])
    assert invoke("golden", "update", str(r), "--golden", str(g), "--select", "Exp 1").exit_code == 0
    rows = gold.read_golden(g)
    assert [row["setting"] for row in rows] == ["none", "selective[mlp]"] and rows[0]["tflops_per_gpu"] == 100.0
    bad = invoke("golden", "update", str(r), "--golden", str(g), "--select", "Exp 9")
    assert bad.exit_code == 2 and "matches no result" in bad.stderr
    cpu = write_results(tmp_path / "cpu" / "results.jsonl", [record(device=CPU_ENV)])
    refused = invoke("golden", "update", str(cpu), "--golden", str(g))
    assert refused.exit_code == 2 and "measured on" in refused.stderr
    failed = write_results(tmp_path / "failed" / "results.jsonl", [record(status="timeout")])
    nothing = invoke("golden", "update", str(failed), "--golden", str(g))
    assert nothing.exit_code == 1 and "nothing promoted" in nothing.stderr


def test_golden_update_creates_a_golden_that_then_passes(tmp_path):
    r = write_results(tmp_path / "run" / "results.jsonl", [record(status="oom"), record(["mlp"])])
    g = tmp_path / "golden" / "h100.csv"
    assert invoke("golden", "update", str(r), "--golden", str(g)).exit_code == 0
    result = invoke("compare", str(r), "--golden", str(g), "--strict", "--json")
    assert result.exit_code == 0
    assert [row["verdict"] for row in json.loads(result.stdout)["rows"]] == ["expected OOM", "pass"]


# ----- the key of a point ---------------------------------------------------------------------------
def test_every_config_field_but_the_measurement_protocol_is_in_the_key():
    import dataclasses

    from recompute_bench.results.rows import key_fields, point_id
    from recompute_bench.config.fields import PROTOCOL_KEYS
    from recompute_bench.config.schema import SECTIONS

    base = record()
    changed_by = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            other = json.loads(json.dumps(base))
            table = other["recompute"] if section == "recompute" else other["config"][section]
            value = table.get(f.name, f.default)
            table[f.name] = (not value if isinstance(value, bool) else value + 1 if isinstance(value, (int, float))
                             else value + "x" if isinstance(value, str) else ["mlp"] if isinstance(value, list) else 3)
            differs = [c for c, v in key_fields(other).items() if v != key_fields(base)[c]]
            changed_by[f"{section}.{f.name}"] = differs
            if f.name in PROTOCOL_KEYS:
                assert differs == [] and point_id(other) == point_id(base)
            else:
                assert len(differs) == 1, (section, f.name, differs)
    assert sorted(c for cs in changed_by.values() for c in cs) == sorted(KEY_COLUMNS[1:])
    assert changed_by["model.hidden_size"] == ["hidden_size"] and changed_by["recompute.num_layers"] == ["recompute_num_layers"]


def test_an_integer_in_a_float_field_gives_the_same_key():
    a, b = record(), record()
    b["config"]["model"]["rotary_base"] = 10000
    a["config"]["model"]["rotary_base"] = 10000.0
    assert verdicts.row_key(record_row(a)) == verdicts.row_key(record_row(b))


def test_points_that_differ_only_in_hidden_size_are_two_golden_rows(tmp_path):
    """--set model.hidden_size=128 and the preset's 64: two points, two rows, both compared."""
    g, _ = _files(tmp_path, [record(name="Baseline")], [])
    r = write_results(tmp_path / "new" / "results.jsonl",
                      [record(name="Baseline", tflops_per_gpu=90.0), record(name="wide", sets=["model.hidden_size=128"])])
    update = invoke("golden", "update", str(r), "--golden", str(g))
    assert update.exit_code == 0, update.output
    assert f"wrote {g}: 1 added, 1 replaced, 0 kept;" in update.stderr
    assert [(row["setting"], row["hidden_size"]) for row in gold.read_golden(g)] == [("none", "64"), ("none", "128")]
    result = invoke("compare", str(r), "--golden", str(g), "--strict", "--json")
    assert result.exit_code == 0, result.output
    assert [row["verdict"] for row in json.loads(result.stdout)["rows"]] == ["pass", "pass"]


def test_kept_is_never_negative_when_two_results_share_a_key(tmp_path):
    g, _ = _files(tmp_path, [record(), record(["mlp"])], [])
    older = record(tflops_per_gpu=80.0)  # a v1 record of before the padded vocabulary: same key, other config_hash
    del older["config"]["model"]["make_vocab_size_divisible_by"]
    results = [record_row(older), record_row(record(tflops_per_gpu=90.0))]
    summary = gold.update_golden(g, results)
    assert (summary.added, summary.replaced, summary.kept) == ([], ["none"], 1)
    rows = gold.read_golden(g)
    assert [(row["setting"], row["tflops_per_gpu"]) for row in rows] == [("none", 90.0), ("selective[mlp]", 100.0)]


# The key columns of goldens written before the key covered every config field (4d9e33f and earlier).
OLDER_KEY_COLUMNS = (
    "workload", "num_layers", "seq_length", "micro_batch_size", "global_batch_size", "precision",
    "attention_backend", "tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
    "sequence_parallel", "recompute_granularity", "recompute_modules", "recompute_method", "recompute_num_layers",
    "activation_offload_layers")


def _older_golden(path, records, tolerance=None):
    """A golden in the format of 4d9e33f: the same rows without the key columns added since."""
    import pandas as pd

    write_golden_of(path, records, tolerance)
    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    frame.drop(columns=[c for c in KEY_COLUMNS if c not in OLDER_KEY_COLUMNS]).to_csv(path, index=False)
    return path


def test_an_older_golden_is_refused_by_compare_and_migrated_by_golden_update(tmp_path):
    g = _older_golden(tmp_path / "golden" / "h100.csv", [record(), record(["mlp"]), record(["core_attn"])],
                      tolerance={1: "tflops_per_gpu:9%"})
    before = g.read_bytes()
    r = write_results(tmp_path / "run" / "results.jsonl", [record(name="Baseline"), record(["mlp"], name="Exp 1")])
    refused = invoke("compare", str(r), "--golden", str(g))
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert refused.stderr.startswith(f"error: golden file {g} has the key of an older recompute-bench (no hidden_size, "
                                     "num_attention_heads, ffn_hidden_size, vocab_size, ... (22 in all) column); migrate it:")
    assert f"then `recompute-bench golden update RUN --golden {g}`" in refused.stderr and g.read_bytes() == before

    # These results lack the core_attn row: its new key is unknown, so nothing is written.
    partial = invoke("golden", "update", str(r), "--golden", str(g))
    assert partial.exit_code == 2 and "do not measure 1 of its rows (selective[core_attn])" in partial.stderr
    assert g.read_bytes() == before

    every = write_results(tmp_path / "all" / "results.jsonl",
                          [record(name="Baseline"), record(["mlp"], name="Exp 1", tflops_per_gpu=95.0),
                           record(["core_attn"], name="Exp 2"), record(["layernorm"], name="Exp 3")])
    update = invoke("golden", "update", str(every), "--golden", str(g))
    assert update.exit_code == 0, update.output
    assert "migrated the key: every row now has the column(s) hidden_size, num_attention_heads," in update.stderr
    assert f"wrote {g}: 1 added, 3 replaced, 0 kept;" in update.stderr
    header = g.read_text().splitlines()[0].split(",")
    assert [c for c in KEY_COLUMNS if c not in header] == []
    rows = {row["setting"]: row for row in gold.read_golden(g)}
    assert rows["selective[mlp]"]["tolerance"] == "tflops_per_gpu:9%" and rows["selective[mlp]"]["tflops_per_gpu"] == 95.0
    assert invoke("compare", str(every), "--golden", str(g), "--strict").exit_code == 0
