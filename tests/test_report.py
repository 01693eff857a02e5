"""load_results and the report: one DataFrame row per point, the Pareto front, report.md and the plot."""

import json

import pytest

from helpers import invoke
from helpers import CPU_ENV, record, write_results
from recompute_bench.config.schema import BadInput
from recompute_bench.render.plot import pareto_front
from recompute_bench.results.rows import KEY_COLUMNS, load_results

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
    with pytest.raises(BadInput, match="does not exist"):
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
    path = write_results(tmp_path / "cpu.jsonl", [record(device=CPU_ENV, name="Baseline"),
                                                  record(["mlp"], device=CPU_ENV, name="Exp 1", activation_bytes=10**8)])
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


def _cpu_run(tmp_path):
    """A CPU sweep as the demo's: wall-clock noise, FLOPs and activations measured. Exp 1 to Exp 4 sit
    in one corner (the demo's bottom-left cluster) with their activations and FLOPs a few % apart."""
    return write_results(tmp_path / "cpu" / "results.jsonl", [
        record(name="Baseline", device=CPU_ENV, tflops_per_gpu=0.002, measured_flops_per_step=300, activation_bytes=1000),
        record(["core_attn"], name="Exp 1", device=CPU_ENV, tflops_per_gpu=0.0001, measured_flops_per_step=310,
               activation_bytes=700),
        record(["mlp"], name="Exp 2", device=CPU_ENV, tflops_per_gpu=0.003, measured_flops_per_step=330, activation_bytes=600),
        record(full=("uniform", 1), name="Exp 3", device=CPU_ENV, tflops_per_gpu=0.002, measured_flops_per_step=400,
               activation_bytes=100),
        record(full=("uniform", 2), name="Exp 4", device=CPU_ENV, tflops_per_gpu=0.004, measured_flops_per_step=400,
               activation_bytes=102),
        record(full=("block", 1), name="Exp 5", device=CPU_ENV, tflops_per_gpu=0.002, measured_flops_per_step=401,
               activation_bytes=101),
    ])


def test_on_a_cpu_the_plot_shows_speed_from_flops_run_not_wall_clock(tmp_path):
    from recompute_bench.render.plot import draw_pareto, speed_axis

    df = load_results(_cpu_run(tmp_path))
    speed, label = speed_axis(df)
    # fewest FLOPs of the shape (300, the baseline's) over each point's, whatever the wall clock said
    assert list(speed.round(4)) == [1.0, round(300 / 310, 4), round(300 / 330, 4), 0.75, 0.75, round(300 / 401, 4)]
    assert "FLOPs run" in label and "CPU" in label
    fig = draw_pareto(df, "cpu run")
    ax = fig.axes[0]
    assert "FLOPs run" in ax.get_xlabel() and "activation bytes" in ax.get_ylabel()
    points = {tuple(p) for p in ax.collections[0].get_offsets().round(4).tolist()}
    assert (1.0, 1000.0) in points and len(points) == 6  # bytes: the largest value is under 1 KiB
    front_x, _ = ax.lines[0].get_data()  # the Pareto front: Baseline, Exp 1, Exp 2, Exp 3 (Exp 4 ties Exp 3, more bytes)
    assert sorted(round(x, 4) for x in front_x) == sorted([1.0, round(300 / 310, 4), round(300 / 330, 4), 0.75])


def test_plot_labels_name_every_point_and_never_cover_each_other(tmp_path):
    from recompute_bench.render.plot import draw_pareto

    for run in (_cpu_run(tmp_path), _gpu_run(tmp_path)):
        fig = draw_pareto(load_results(run), "labels")
        ax = fig.axes[0]
        renderer = fig.canvas.get_renderer()
        texts = [t for t in ax.texts if ": " in t.get_text()]
        names = {t.get_text().split(":")[0] for t in texts}
        assert names == set(load_results(run)["experiment"])  # every point labelled, OOM points too
        boxes = [t.get_window_extent(renderer) for t in texts]
        for i, a in enumerate(boxes):
            assert ax.get_window_extent(renderer).contains(a.x0, a.y0), texts[i].get_text()
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), (texts[i].get_text(), [t.get_text() for t in texts])
