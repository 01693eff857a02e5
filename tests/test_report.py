"""load_results and the report: one DataFrame row per point, the Pareto front, report.md and the plot."""

import json

import pytest

from conftest import invoke
from records import CPU, record, write_results
from recompute_bench.spec.config import ConfigError
from recompute_bench.render.plot import pareto_front
from recompute_bench.results.records import KEY_COLUMNS, load_results

GiB = 2**30


def _gpu_run(tmp_path):
    return write_results(tmp_path / "run" / "results.jsonl", [
        record(name="Baseline", tflops_per_gpu=400.0, peak_allocated_bytes=70 * GiB, activation_bytes=40 * 10**8),
        record(["core_attn"], name="Exp 1", tflops_per_gpu=390.0, peak_allocated_bytes=50 * GiB, activation_bytes=20 * 10**8),
        record(["mlp"], name="Exp 2", tflops_per_gpu=350.0, peak_allocated_bytes=60 * GiB, activation_bytes=30 * 10**8),
        record(full=("uniform", 1), name="Exp 3", tflops_per_gpu=300.0, peak_allocated_bytes=30 * GiB),
        record(["layernorm"], name="Exp 4", status="oom", failure_rank=2),
    ])


def test_load_results_is_one_row_per_point_with_the_latest_record(tmp_path):
    path = _gpu_run(tmp_path)
    with path.open("a") as f:  # Exp 2 measured again (a resumed point): the later record wins
        f.write(json.dumps(record(["mlp"], name="Exp 2", tflops_per_gpu=360.0)) + "\n")
    df = load_results(path.parent)
    assert list(df["experiment"]) == ["Baseline", "Exp 1", "Exp 2", "Exp 3", "Exp 4"]
    assert df.loc[df["experiment"] == "Exp 2", "tflops_per_gpu"].item() == 360.0
    assert len(load_results(path, latest=False)) == 6
    assert set(KEY_COLUMNS) <= set(df.columns) and df["recompute_modules"].tolist()[:3] == ["", "core_attn", "mlp"]
    assert df.loc[4, "status"] == "oom" and df.loc[4, "failure_rank"] == 2
    assert df.loc[0, "memory_limit_bytes"] == 80 * GiB and df.loc[0, "device_name"].startswith("NVIDIA")


def test_load_results_bad_input():
    with pytest.raises(ConfigError, match="does not exist"):
        load_results("no/such/results.jsonl")


def test_pareto_front_keeps_only_undominated_points(tmp_path):
    df = load_results(_gpu_run(tmp_path))
    front = set(df.loc[pareto_front(df, "peak_allocated_bytes"), "experiment"])
    assert front == {"Baseline", "Exp 1", "Exp 3"}  # Exp 2 is slower and bigger than Exp 1


def test_report_writes_markdown_and_a_png(tmp_path):
    path = _gpu_run(tmp_path)
    result = invoke("report", str(path.parent))
    assert result.exit_code == 0, result.output
    md = (path.parent / "report.md").read_text()
    png = (path.parent / "pareto.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "Exp 1 (`selective[core_attn]`)" in md and "Exp 2 (`selective[mlp]`)" not in md.split("Pareto-optimal")[1]
    exp1 = next(line for line in md.splitlines() if line.startswith("| Exp 1 "))
    assert "0.50x" in exp1 and "50.00 GiB" in exp1  # activations half the baseline's
    assert "OOM rank2" in md


def test_cpu_report_uses_activation_bytes(tmp_path):
    path = write_results(tmp_path / "cpu.jsonl", [record(device=CPU, name="Baseline"),
                                                  record(["mlp"], device=CPU, name="Exp 1", activation_bytes=10**8)])
    result = invoke("report", str(path), "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    md = (tmp_path / "out" / "report.md").read_text()
    assert "Peak memory is n/m (not measured)" in md and "0.10x" in md
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 10_000


def test_report_of_nothing_is_bad_input(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    result = invoke("report", str(tmp_path / "empty.jsonl"))
    assert result.exit_code == 2 and "no record" in result.stderr


def test_report_header_names_the_versions_that_measured_and_wrote_it(tmp_path):
    from importlib import metadata

    version = metadata.version("recompute-bench")

    older = [record(name="Baseline"), record(["mlp"], name="Exp 1")]
    for r in older:
        r["env"]["package_version"] = "0.0.9"
    path = write_results(tmp_path / "run" / "results.jsonl", older)
    assert invoke("report", str(path.parent)).exit_code == 0
    header = (path.parent / "report.md").read_text().splitlines()[2]
    assert version != "0.0.9"
    assert header == (f"device `NVIDIA H100 80GB HBM3`, torch 2.13.0+cu128, measured with recompute-bench 0.0.9 "
                      f"(git abc), 2 points; report written by recompute-bench {version}")
