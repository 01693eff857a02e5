"""sweep: expansion of every flag combination and of grid files, isolated points (error, hang,
OOM, crash) recorded while the sweep goes on, resume after a killed sweep, the run lock."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import config, invoke, processes_naming
from recompute_bench.gate.golden import read_golden, write_golden
from recompute_bench.launch import process as launch
from recompute_bench.config.schema import BadInput
from recompute_bench.results.store import RunLock
from recompute_bench.launch.sweep import done_points, expand, plan_from_flags, point_record_id
from recompute_bench.recompute.settings import all_settings

SHIPPED_GOLDEN = Path(__file__).resolve().parent.parent / "results" / "golden" / "cpu.csv"
SMALL = ["--set", "training.warmup_steps=0", "--set", "training.measured_steps=1"]


def labels(settings):
    return [s.label for s in settings]


def plan(*args):
    """The plan `sweep --dry-run --json` prints: [(name, setting)]."""
    result = invoke("sweep", *args, "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    points = json.loads(result.stdout)["points"]
    return [(p["name"], _label(p["config"]["recompute"])) for p in points], points


def _label(r):
    from recompute_bench.config.labels import recompute_label
    return recompute_label(**r)


# ----- expansion ---------------------------------------------------------------------------------
def test_modules_expand_to_every_non_empty_subset_in_megatron_order():
    assert labels(expand(num_layers=4, modules=["mlp", "core_attn"])) == [
        "selective[core_attn]", "selective[mlp]", "selective[core_attn,mlp]"]
    assert len(expand(num_layers=4, modules=["core_attn", "mlp", "layernorm"])) == 7
    assert labels(expand(num_layers=4, modules=["mlp", "mlp"])) == ["selective[mlp]"]


def test_methods_cross_layer_counts_and_baseline_comes_first():
    assert labels(expand(num_layers=4, methods=["uniform", "block"], num_layers_recompute=[1, 2], baseline=True)) == [
        "none", "full uniform 1", "full uniform 2", "full block 1", "full block 2"]
    notes = []
    assert labels(expand(num_layers=4, num_layers_recompute=[2], notes=notes)) == ["full block 2"]
    assert "method block" in notes[0]
    assert labels(expand(num_layers=4, baseline=True)) == ["none"]


def test_no_flag_means_baseline_and_every_verify_setting():
    settings = expand(num_layers=4)
    assert labels(settings) == ["none"] + labels(all_settings(4)) and len(settings) == 16


@pytest.mark.parametrize("kwargs, words", [
    ({"modules": []}, "names no module"),
    ({"methods": ["uniform"]}, "needs --num-layers-recompute"),
    ({"methods": [], "num_layers_recompute": [1]}, "names no method"),
])
def test_bad_expansions_are_refused(kwargs, words):
    with pytest.raises(BadInput, match=words):
        expand(num_layers=4, **kwargs)


def test_every_flag_together_with_names_and_both_list_spellings():
    expected = [("Baseline", "none"), ("Exp 1", "selective[core_attn]"), ("Exp 2", "selective[layernorm]"),
                ("Exp 3", "selective[core_attn,layernorm]"), ("Exp 4", "full uniform 1"), ("Exp 5", "full uniform 3"),
                ("Exp 6", "full block 1"), ("Exp 7", "full block 3")]
    spaced, points = plan("--baseline", "--modules", "core_attn", "layernorm", "--methods", "uniform", "block",
                          "--num-layers-recompute", "1", "3")
    assert spaced == expected
    assert plan("--modules", "layernorm,core_attn", "--methods=uniform,block", "--num-layers-recompute", "1,3",
                "--baseline")[0] == expected
    assert plan("--modules", "core_attn", "--modules", "layernorm", "--methods", "uniform", "--methods", "block",
                "--num_layers_recompute", "1", "--num-layers-recompute", "3", "--baseline")[0] == expected
    assert {p["config"]["workload"] for p in points} == {"tiny"}


def test_workload_overrides_apply_to_every_point():
    _, points = plan("--workload", "llama3-8b", "--num-layers", "2", "--seq-length", "64", "--set",
                     "model.hidden_size=64", "--set", "model.num_attention_heads=8", "--set", "model.ffn_hidden_size=128",
                     "--modules", "core_attn", "--baseline")
    assert [(p["config"]["model"]["num_layers"], p["config"]["training"]["seq_length"],
             p["config"]["model"]["hidden_size"]) for p in points] == [(2, 64, 64), (2, 64, 64)]


def test_default_plan_is_what_the_shipped_cpu_golden_covers():
    from recompute_bench.gate.golden import read_golden
    from recompute_bench.gate.verdicts import row_key
    from recompute_bench.results.rows import config_hash, key_fields

    points, _ = plan_from_flags("tiny", overrides={}, sets=[], gpu="cpu")
    golden = {row_key(g): g for g in read_golden(SHIPPED_GOLDEN)}
    assert len(points) == len(golden) == 16
    for p in points:
        record = p.cfg.record_fields()
        row = golden[tuple(key_fields(record).values())]
        assert row["config_hash"] == config_hash(record) and row["status"] == "ok" and row["device_name"] == "cpu"


def test_grid_file(tmp_path):
    grid = tmp_path / "grid.toml"
    grid.write_text('workload = "tiny"\nset = ["training.measured_steps=2"]\n'
                    '[[point]]\n'
                    '[[point]]\nrecompute_modules = ["mlp", "core_attn"]\n'
                    '[[point]]\nname = "long full"\nrecompute_granularity = "full"\nrecompute_method = "uniform"\n'
                    'recompute_num_layers = 2\nseq_length = 64\nset = ["training.measured_steps=3"]\n'
                    '[[point]]\nname = "wide"\nhidden_size = 128\nffn_hidden_size = 512\n')
    names, points = plan("--grid", str(grid))
    assert names == [("Baseline", "none"), ("Exp 1", "selective[core_attn,mlp]"), ("long full", "full uniform 2"),
                     ("wide", "none")]
    assert [p["config"]["training"]["measured_steps"] for p in points] == [2, 2, 3, 2]
    assert [p["config"]["training"]["seq_length"] for p in points] == [128, 128, 64, 128]
    # Any field, by the name it has everywhere (config/fields.py), not only those with a flag.
    assert [p["config"]["model"]["hidden_size"] for p in points] == [64, 64, 64, 128]


@pytest.mark.parametrize("text, words", [
    ("[[point]]\nrecompute_modules = [\n", "not valid TOML"),
    ("workload = 'tiny'\n", "lists no [[point]]"),
    ("[[point]]\nrecompute_moduls = ['mlp']\n", "unknown key(s) recompute_moduls"),
    ("[[point]]\n[[point]]\n", "are the same setting"),
    ("[[point]]\nname = 'a'\n[[point]]\nname = 'a'\nrecompute_modules = ['mlp']\n", "two points are named 'a'"),
    ("[[point]]\nrecompute_granularity = 'full'\n", "point 1 of the grid: recompute_granularity full needs"),
])
def test_bad_grid_is_one_line_exit_2(tmp_path, text, words):
    grid = tmp_path / "grid.toml"
    grid.write_text(text)
    result = invoke("sweep", "--grid", str(grid), "--dry-run")
    assert result.exit_code == 2 and words in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("args, words", [
    (["--modules", "[]"], "names no module"),
    (["--modules", "moe"], "needs mixture-of-experts"),
    (["--modules", "attn"], "unknown recompute module"),
    (["--methods", "uniform"], "needs --num-layers-recompute"),
    (["--methods", "diagonal", "--num-layers-recompute", "1"], "recompute_method 'diagonal'"),
    (["--methods", "uniform", "--num-layers-recompute", "5"], "must lie between 1 and 4"),
    (["--num-layers-recompute", "one"], "takes integers"),
    (["--grid", "nope.toml"], "does not exist"),
    (["--grid", "g.toml", "--modules", "mlp"], "drop --modules"),
    (["--resume", "r1", "--modules", "mlp"], "drop --modules"),
    (["--resume", "no-such-run"], "no sweep to resume"),
    (["--run-id", "../escape"], "plain folder name"),
    (["--timeout", "0"], "--timeout must be a positive"),
    (["--tp", "2", "--baseline"], "does not divide the 1 rank(s) launched"),
    (["--golden", "missing.csv"], "does not exist"),
])
def test_bad_sweep_input_is_one_line_exit_2(tmp_path, args, words):
    (tmp_path / "g.toml").write_text("[[point]]\n")
    (tmp_path / "r1").mkdir()
    args = [str(tmp_path / a) if a == "g.toml" else a for a in args]
    result = invoke("sweep", *args, "--results-dir", str(tmp_path), "--dry-run")
    assert result.exit_code == 2, result.output
    assert words in result.stderr and "Traceback" not in result.output


# ----- isolated points -----------------------------------------------------------------------------
def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_error_hang_and_oom_are_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    # --timeout runs from the worker's start (torch imported), so 12 s hold on a loaded machine too.
    monkeypatch.setenv(launch.FAULT_POINTS_ENV, "Baseline=error:forward:0;Exp 1=hang:forward:0;Exp 2=oom:backward:0")
    result = invoke("sweep", "--baseline", "--modules", "core_attn", "mlp", *SMALL, "--num-layers", "2",
                    "--run-id", "faults", "--results-dir", str(tmp_path), "--timeout", "12", "--no-golden", "--json")
    assert result.exit_code == 1, result.output
    records = _records(tmp_path / "faults")
    assert [(r["point"]["name"], r["status"]) for r in records] == [
        ("Baseline", "error"), ("Exp 1", "timeout"), ("Exp 2", "oom"), ("Exp 3", "ok")]
    error, hang, oom, ok = records
    assert "injected failure" in error["failure"]["message"] and error["failure"]["phase"] == "forward"
    assert "time limit of 12 s" in hang["failure"]["message"] and "in inject_fault" in hang["failure"]["message"]
    assert hang["metrics"]["model_flops_per_step"] == ok["metrics"]["model_flops_per_step"]
    assert (oom["failure"]["phase"], oom["failure"]["step"], oom["failure"]["rank"]) == ("backward", 0, 0)
    assert ok["metrics"]["tflops_per_gpu"] > 0 and ok["ranks"][0]["status"] == "ok"
    table = " ".join(result.stderr.split())
    assert "OOM rank0" in table and "Timeout" in table and "Error" in table
    assert [row["status"] for row in json.loads(result.stdout)["rows"]] == ["error", "timeout", "oom", "ok"]


@pytest.mark.slow
def test_a_worker_that_dies_or_hangs_becomes_a_record(tmp_path, monkeypatch):
    cfg = config("tiny")
    monkeypatch.setattr(launch, "WORKER_COMMAND", [sys.executable, "-c",
                        "import os, signal, sys; sys.stderr.write('about to crash\\n'); sys.stderr.flush(); "
                        "os.kill(os.getpid(), signal.SIGSEGV)"])
    crashed = launch.run_isolated(cfg, name="c", out_path=tmp_path / "c.json", log_path=tmp_path / "c.log", timeout_s=30)
    assert crashed["status"] == "error" and "signal SIGSEGV" in crashed["failure"]["message"]
    assert "about to crash" in crashed["failure"]["message"]
    assert crashed["ranks"][0]["status"] == "error" and crashed["metrics"]["activation_bytes"] is None

    started = "import pathlib, sys, time; pathlib.Path(sys.argv[sys.argv.index('--out') + 1] + '.ready').touch(); "
    monkeypatch.setattr(launch, "WORKER_COMMAND", [sys.executable, "-c", started + "time.sleep(60)"])
    t0 = time.monotonic()
    hung = launch.run_isolated(cfg, name="h", out_path=tmp_path / "h.json", log_path=tmp_path / "h.log", timeout_s=0.5)
    assert hung["status"] == "timeout" and "time limit of 0.5 s" in hung["failure"]["message"]
    assert time.monotonic() - t0 < 10 and not (tmp_path / "h.json.ready").exists()


@pytest.mark.slow
def test_the_time_limit_runs_from_the_workers_start_and_the_start_has_its_own(tmp_path, monkeypatch):
    cfg = config("tiny")
    # A worker that takes 1.5 s to start (a slow import) and then 0.5 s to write its record: within a
    # 1 s limit, since the limit runs from the start.
    slow_start = ("import json, pathlib, sys, time; out = sys.argv[sys.argv.index('--out') + 1]; time.sleep(1.5); "
                  "pathlib.Path(out + '.ready').touch(); time.sleep(0.5); "
                  "pathlib.Path(out).write_text(json.dumps({'status': 'ok'}))")
    monkeypatch.setattr(launch, "WORKER_COMMAND", [sys.executable, "-c", slow_start])
    done = launch.run_isolated(cfg, name="s", out_path=tmp_path / "s.json", log_path=tmp_path / "s.log", timeout_s=1.0)
    assert done == {"status": "ok"}
    # One that never starts is cut at the start limit, and the record says so.
    monkeypatch.setattr(launch, "START_LIMIT_S", 0.5)
    monkeypatch.setattr(launch, "WORKER_COMMAND", [sys.executable, "-c", "import time; time.sleep(60)"])
    never = launch.run_isolated(cfg, name="n", out_path=tmp_path / "n.json", log_path=tmp_path / "n.log", timeout_s=30)
    assert never["status"] == "timeout" and "did not start within 0.5 s" in never["failure"]["message"]


@pytest.mark.slow
def test_resume_after_a_killed_sweep_measures_only_what_is_missing(tmp_path):
    run = tmp_path / "killed"
    command = [sys.executable, "-c", "from recompute_bench.cli.app import main; main()", "sweep", "--baseline",
               "--modules", "core_attn", *SMALL, "--run-id", "killed", "--results-dir", str(tmp_path), "--no-golden"]
    env = {**os.environ, "PYTHONPATH": str(Path(launch.PACKAGE_ROOT))}
    sweep = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not ((run / "results.jsonl").exists() and (run / "results.jsonl").read_text().count("\n") >= 1):
        assert sweep.poll() is None and time.monotonic() < deadline, "the sweep ended before its first record"
        time.sleep(0.05)
    sweep.send_signal(signal.SIGKILL)  # during the second point
    sweep.wait()
    first = (run / "results.jsonl").read_bytes()
    assert first.count(b"\n") == 1
    time.sleep(0.5)
    assert processes_naming(run) == []  # the second point's worker died with the sweep

    with RunLock(tmp_path / "another-run"):  # other run ids do not get in the way
        result = invoke("sweep", "--resume", "killed", "--results-dir", str(tmp_path), "--no-golden")
    assert result.exit_code == 0, result.output
    assert "done before, skipped" in result.stderr
    after = (run / "results.jsonl").read_bytes()
    assert after.startswith(first) and after.count(b"\n") == 2
    assert [r["point"]["name"] for r in _records(run)] == ["Baseline", "Exp 1"]
    # Both points are default `tiny` settings, so the shipped CPU golden's deterministic metrics hold.
    compare = invoke("compare", str(run), "--golden", str(SHIPPED_GOLDEN), "--tolerance", "tflops_per_gpu:off", "--json")
    rows = json.loads(compare.stdout)["rows"]
    assert compare.exit_code == 1 and {r["verdict"] for r in rows} == {"pass", "missing"}
    assert all(m["outcome"] in ("pass", "n/m", "info") for r in rows for m in r["metrics"])


@pytest.mark.slow
def test_a_second_sweep_on_the_same_run_id_is_refused(tmp_path):
    with RunLock(tmp_path / "busy"):
        result = invoke("sweep", "--baseline", "--run-id", "busy", "--results-dir", str(tmp_path), "--no-golden")
    assert result.exit_code == 2 and "being written by another sweep" in result.stderr
    assert not (tmp_path / "busy" / "plan.json").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "results.jsonl").write_text("")
    again = invoke("sweep", "--baseline", "--run-id", "used", "--results-dir", str(tmp_path), "--no-golden")
    assert again.exit_code == 2
    assert f"continue it with `recompute-bench sweep --resume used --results-dir {tmp_path}`" in again.stderr


def test_only_ok_and_oom_records_count_as_done(tmp_path):
    from helpers import record, write_results
    from recompute_bench.launch.sweep import Point

    path = write_results(tmp_path / "results.jsonl", [record(status="error"), record(["mlp"], status="oom"),
                                                      record(["core_attn"])])
    done = done_points(path)
    ids = {name: point_record_id(Point(name, config("tiny", **kw))) for name, kw in (
        ("none", {}), ("mlp", {"recompute__granularity": "selective", "recompute__modules": ["mlp"]}),
        ("core_attn", {"recompute__granularity": "selective", "recompute__modules": ["core_attn"]}))}
    assert ids["none"] not in done and ids["mlp"] in done and ids["core_attn"] in done


def test_a_single_rank_sweep_passes_its_memory_limit_to_the_worker_and_records_it(tmp_path, monkeypatch):
    # "Would this fit a 40 GB card": the sweep's worker is started with the limit and caps its
    # allocator before it measures; the point's record says so in its launch, as `run`'s does.
    from recompute_bench.launch import worker
    from recompute_bench.launch.sweep import Point, RunSettings, run_sweep
    from recompute_bench.launch.torchrun import Launch
    from recompute_bench.measure import memory, point

    commands = []

    def fake_group(command, log_path, env, timeout_s, **kw):  # the worker's command line, then a record
        commands.append(command)
        out = Path(command[command.index("--out") + 1])
        out.write_text(json.dumps({"status": "ok", "failure": None}))
        return 0

    monkeypatch.setattr(launch, "run_group", fake_group)
    [record] = run_sweep([Point("Baseline", config())], tmp_path / "capped",
                         RunSettings(Launch(memory_limit_gb=40.0), device="cuda", timeout_s=60))
    assert commands[0][commands[0].index("--memory-limit-gb") + 1] == "40"
    assert record["launch"]["memory_limit_gb"] == 40.0 and record["launch"]["world_size"] == 1

    # The worker, given that command line: the limit is set on its device before the point runs.
    calls = []
    monkeypatch.setattr(worker, "die_with_parent", lambda: None)
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO(json.dumps(config().to_dict())))
    monkeypatch.setattr(memory, "limit_memory", lambda device, gb: calls.append(("limit", device.type, gb)))
    monkeypatch.setattr(point, "run_point", lambda cfg, **kw: calls.append(("run",)) or {"status": "ok"})
    assert worker.main(["--out", str(tmp_path / "w.json"), "--device", "cpu", "--memory-limit-gb", "40"]) == 0
    assert calls == [("limit", "cpu", 40.0), ("run",)]


def test_a_resumed_sweep_runs_as_its_plan_says_and_refuses_another_launch(tmp_path):
    # The plan keeps how its points run (ranks, engine, device, time limits), so `--resume RUN` alone
    # launches them as the sweep did; a resume asking for other ranks is one line, exit 2, before
    # anything runs. This attempt's time limits and rendezvous may differ from the first's.
    from recompute_bench.launch.sweep import RunSettings, load_run_settings, plan_to_dict
    from recompute_bench.launch.torchrun import Launch
    from recompute_bench.results.store import write_json_atomic

    run = tmp_path / "two"
    points, _ = plan_from_flags("tiny", overrides={}, sets=[], gpu="cpu", baseline=True)
    saved = RunSettings(Launch(nproc_per_node=2, data_parallel="fsdp", watchdog_s=60.0), "cpu", 90.0, None)
    write_json_atomic(run / "plan.json", plan_to_dict(points, saved))
    assert load_run_settings(run) == saved
    result = invoke("sweep", "--resume", "two", "--results-dir", str(tmp_path), "--nproc-per-node", "4", "--no-golden")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert " ".join(result.stderr.split()) == ("error: run two was launched with --nproc-per-node 2, and a resumed sweep "
                                               "measures its remaining points as its first ones; drop --nproc-per-node 4")
    assert sorted(p.name for p in run.iterdir()) == ["plan.json"]  # nothing ran
    again = RunSettings(Launch(nproc_per_node=2, watchdog_s=30.0), None, 1200.0, None)
    assert saved.resumed(again, {"nproc_per_node", "watchdog_s", "timeout_s"}, "two") == RunSettings(
        Launch(nproc_per_node=2, data_parallel="fsdp", watchdog_s=30.0), "cpu", 1200.0, None)


def _sweep_process(args: list[str], sigint) -> subprocess.Popen:
    """`recompute-bench sweep ARGS` in a child process whose SIGINT disposition is `sigint` when it
    starts, whatever this test run inherited (a background job or `nohup` runs pytest with SIGINT
    ignored, and a child inherits that). A small Python sets it and then execs the sweep."""
    start = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.%s); "
             "os.execv(sys.executable, [sys.executable, '-c', 'from recompute_bench.cli.app import main; main()', "
             "*sys.argv[1:]])" % sigint.name)
    env = {**os.environ, "PYTHONPATH": str(Path(launch.PACKAGE_ROOT))}
    return subprocess.Popen([sys.executable, "-c", start, "sweep", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _interrupt_at_first_worker(sweep: subprocess.Popen, run: Path) -> str:
    """Send SIGINT once the first point's worker runs; the sweep's stderr."""
    deadline = time.monotonic() + 60
    while not processes_naming(run):
        assert sweep.poll() is None and time.monotonic() < deadline, "no worker started"
        time.sleep(0.05)
    sweep.send_signal(signal.SIGINT)
    _, stderr = sweep.communicate(timeout=30)
    return stderr


def _printed_command(stderr: str, lead: str) -> list[str]:
    """The command printed on the line after `lead`, split as a shell would; it must be that one line."""
    lines = stderr.splitlines()
    assert lead in lines, stderr
    command = lines[lines.index(lead) + 1]
    assert command.startswith("  recompute-bench "), stderr
    return shlex.split(command)[1:]


@pytest.mark.slow
def test_ctrl_c_stops_the_worker_and_says_how_to_resume(tmp_path):
    """Ctrl-C kills the running worker and exits 130; each printed command (resume, then report and
    golden update) is one line and runs as printed, --results-dir and --golden included."""
    run = tmp_path / "a long folder name, as CI workspaces have" / "interrupted"
    golden = tmp_path / "golden with spaces.csv"
    rows = read_golden(SHIPPED_GOLDEN)
    rows[0]["activation_bytes"] += 1  # the Baseline's golden: one byte more than any honest run saves
    write_golden(golden, rows)
    sweep = _sweep_process(["--baseline", *SMALL, "--run-id", "interrupted", "--results-dir", str(run.parent),
                            "--golden", str(golden)], signal.SIG_DFL)
    stderr = _interrupt_at_first_worker(sweep, run)
    assert sweep.returncode == 130, stderr
    assert processes_naming(run) == [] and not (run / "results.jsonl").exists()
    resume = _printed_command(stderr, f"interrupted: finished points are in {run}/results.jsonl; continue with")
    assert resume == ["sweep", "--resume", "interrupted", "--results-dir", str(run.parent), "--golden", str(golden)]

    resumed = invoke(*resume)
    assert resumed.exit_code == 1, resumed.output  # the tampered golden row: a changed program
    assert [r["point"]["name"] for r in _records(run)] == ["Baseline"]
    report = invoke(*_printed_command(resumed.stderr, "report:"))
    assert report.exit_code == 0 and (run / "report.md").is_file(), report.output
    update = _printed_command(resumed.stderr, "to accept these numbers as the new golden (then review the git diff):")
    assert update == ["golden", "update", "interrupted", "--golden", str(golden), "--results-dir", str(run.parent)]
    assert invoke(*update).exit_code == 0
    assert read_golden(golden)[0]["activation_bytes"] == rows[0]["activation_bytes"] - 1
    again = invoke(*resume)  # every point done: nothing measured, and the updated golden passes
    assert again.exit_code == 0 and "done before, skipped" in again.stderr, again.output


@pytest.mark.slow
def test_ctrl_c_stops_a_sweep_started_with_sigint_ignored(tmp_path):
    """`nohup recompute-bench sweep ... &` starts with SIGINT ignored; a SIGINT still stops it cleanly."""
    run = tmp_path / "ignored"
    sweep = _sweep_process(["--baseline", *SMALL, "--run-id", "ignored", "--results-dir", str(tmp_path),
                            "--no-golden"], signal.SIG_IGN)
    stderr = _interrupt_at_first_worker(sweep, run)
    assert sweep.returncode == 130, stderr
    assert processes_naming(run) == [] and not (run / "results.jsonl").exists()
    assert _printed_command(stderr, f"interrupted: finished points are in {run}/results.jsonl; continue with") == [
        "sweep", "--resume", "ignored", "--results-dir", str(tmp_path), "--no-golden"]


# ----- corrupt results ----------------------------------------------------------------------------
@pytest.mark.parametrize("junk, words", [(b"\xff\xfe\n", "is not UTF-8 text"), (b"42\n", "is a JSON number, not a record")])
def test_corrupt_results_are_one_line_exit_2_in_resume_compare_and_report(tmp_path, junk, words):
    """`printf '\\xff\\xfe\\n' >> results.jsonl` and `echo 42 >> results.jsonl`: every reader names file:line,
    exits 2 without a traceback, and writes nothing (no point measured, no report)."""
    from helpers import record
    from recompute_bench.launch.sweep import plan_to_dict
    from recompute_bench.results.store import write_json_atomic

    run = tmp_path / "corrupt"
    points, _ = plan_from_flags("tiny", overrides={}, sets=[], gpu="cpu", baseline=True, modules=["mlp"])
    write_json_atomic(run / "plan.json", plan_to_dict(points))
    results = run / "results.jsonl"
    results.write_bytes(json.dumps(record(name="Baseline", device=("cpu", "2.13.0+cpu"))).encode() + b"\n" + junk)
    before = results.read_bytes()
    golden = tmp_path / "golden.csv"
    for args in (["sweep", "--resume", "corrupt", "--no-golden"], ["compare", "corrupt", "--golden", str(golden)],
                 ["report", "corrupt"]):
        result = invoke(*args, "--results-dir", str(tmp_path))
        assert result.exit_code == 2, (args, result.output)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(f"error: {results}:2 {words}"), result.stderr
        assert "remove or repair that line" in errors[0] and "Traceback" not in result.output
        assert results.read_bytes() == before
    assert sorted(p.name for p in run.iterdir()) == [".lock", "plan.json", "results.jsonl"]
