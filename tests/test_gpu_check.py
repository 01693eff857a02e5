"""bench/gpu_check.py without a GPU: it prints each call's plan and exits 0, each call's planned time
fits one device command, every sweep it plans is a valid plan, a failing, hanging or refused step is
recorded and the next one runs, a call writes its summary after every step and packs the rest into
one archive (three files in OUT), a step that needs two GPUs is not proven on one, and the summary
tables are built from records."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import invoke

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up there
spec.loader.exec_module(gpu_check)


def _ctx(tmp_path, gpus=1):
    return gpu_check.Context(tmp_path / "out", gpus, "NVIDIA H100 80GB HBM3")


def test_without_a_gpu_it_prints_the_plan_and_exits_0(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--call", "3", "--out",
                           str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no GPU is visible here" in done.stdout
    for step in gpu_check.STEPS:
        assert (f"- {step.name}: " in done.stdout) == (step.call == 3)
    assert "golden update" in done.stdout and "--tolerance tflops_per_gpu:off" in done.stdout
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()  # planning writes nothing


@pytest.mark.parametrize("call", gpu_check.CALLS)
def test_each_call_fits_one_device_command(call, tmp_path, capsys):
    # One device command runs at most 10 minutes, the machine's start included: a call's steps
    # plan at most --budget-s (8 minutes) on one GPU, and its dry run lists them with that sum.
    ctx = _ctx(tmp_path)
    steps = [s for s in gpu_check.STEPS if s.call == call]
    planned = sum(gpu_check.planned_s(s, ctx) for s in steps)
    assert 0 < planned <= gpu_check.BUDGET_S <= 9 * 60 - 60
    assert gpu_check.main(["--call", str(call), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"call {call}: {planned:.0f} s planned" in out
    assert [line[2:].split(": ")[0] for line in out.splitlines() if line.startswith("- ")] == [s.name for s in steps]
    assert gpu_check.CALLS == [1, 2, 3, 4] and {s.call for s in gpu_check.STEPS} == {1, 2, 3, 4}


def test_every_planned_sweep_is_a_plan_the_cli_accepts(tmp_path):
    ctx = _ctx(tmp_path)
    sweeps = [c for step in gpu_check.STEPS for c in step.commands(ctx) if c.argv[len(gpu_check.CLI):][:1] == ["sweep"]]
    assert len(sweeps) == 7
    for command in sweeps:
        for path, text in command.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        args = command.argv[len(gpu_check.CLI):]
        args[args.index("--device") + 1] = "cpu"  # the plan is checked here; the points run on the GPU
        result = invoke(*args, "--dry-run", "--json")
        assert result.exit_code == 0, result.output
    llama = json.loads(invoke(*[a if a != "cuda" else "cpu" for a in sweeps[0].argv[len(gpu_check.CLI):]],
                              "--dry-run", "--json").stdout)
    assert [p["name"] for p in llama["points"]] == [name for name, _ in gpu_check.LLAMA_POINTS]


def test_the_oom_limit_lies_between_the_estimated_peaks():
    from recompute_bench.analysis.harness.rank import record_estimate
    from recompute_bench.workload import resolve

    overrides = {"model.num_layers": 4, "training.seq_length": 8192, "training.micro_batch_size": 1,
                 "training.global_batch_size": 1}
    peak = {name: record_estimate(resolve("llama3-8b", overrides={**overrides, **extra}, gpu="h100")[0],
                                  "cuda")["estimated_peak_allocated_bytes"] / 2**30
            for name, extra in (("none", {}), ("full", {"recompute.granularity": "full", "recompute.method": "uniform",
                                                         "recompute.num_layers": 1}))}
    assert peak["full"] < gpu_check.oom_limit_gib("h100") < peak["none"]


def test_a_failed_hung_or_skipped_step_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    ctx = _ctx(tmp_path)
    ctx.out.mkdir(parents=True)
    py = lambda code, **kw: gpu_check.Command([sys.executable, "-c", code], **kw)  # noqa: E731
    steps = [gpu_check.Step("fails", "", lambda c: [py("raise SystemExit(3)"), py("open('never', 'w')")]),
             gpu_check.Step("hangs", "", lambda c: [py("import time; time.sleep(60)", limit_s=1)]),
             gpu_check.Step("refused as it should be", "", lambda c: [py("raise SystemExit(2)", ok=(2,))]),
             gpu_check.Step("two GPUs", "", lambda c: [py("pass")], gpus=2),
             gpu_check.Step("writes its grid", "", lambda c: [py("import pathlib; assert pathlib.Path('g.toml').read_text() == 'x'",
                                                                 files={c.out / "g.toml": "x"})])]
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    results = [gpu_check.run_step(s, ctx, deadline=gpu_check.time.monotonic() + 60, log=ctx.out / f"{i}.log")
               for i, s in enumerate(steps)]
    assert [r["status"] for r in results] == ["failed (exit 3)", "timeout (1 s)", "ok", "not proven (needs 2 GPUs)", "ok"]
    assert results[0]["codes"] == [3] and not (ctx.out / "never").exists()  # a step stops at its first failure
    spent = gpu_check.run_step(steps[4], ctx, deadline=gpu_check.time.monotonic() + 5, log=ctx.out / "late.log")
    assert spent["status"] == "skipped (the call's budget is spent)"


def _record(name, status="ok", **metrics):
    return {"point": {"name": name}, "status": status, "env": {"grouped_gemm_path": "grouped_mm"},
            "metrics": {"peak_allocated_bytes": None, "estimated_peak_allocated_bytes": None, "step_time_s": None,
                        "measured_flops_per_step": None, "estimated_hardware_flops_per_step": None,
                        "tflops_per_gpu": None, "mfu": None, **metrics}}


def test_the_summary_tables_from_hand_made_records(tmp_path):
    rows = gpu_check.point_rows([
        _record("none", peak_allocated_bytes=40 * 2**30, estimated_peak_allocated_bytes=41 * 2**30, step_time_s=0.25,
                measured_flops_per_step=1.0e15, estimated_hardware_flops_per_step=1.1e15, tflops_per_gpu=400.0, mfu=0.404,
                peak_source="H100 SXM bf16", step_time_spread_s=0.002),
        _record("full uniform 1", status="oom")])
    assert rows[0] == {"point": "none", "status": "ok", "peak alloc GiB": "40.00", "estimated GiB": "41.00",
                       "peak error": "+2.5%", "FLOPs error": "+10.0%", "step ms": "250.0", "rank spread ms": "2.0",
                       "TFLOP/s": "400.0", "MFU": "40.4% of H100 SXM bf16", "grouped_gemm_path": "grouped_mm"}
    assert rows[1]["status"] == "oom" and rows[1]["peak alloc GiB"] == rows[1]["step ms"] == "-"
    out = tmp_path / "out"
    (out / "results" / "llama").mkdir(parents=True)
    (out / "results" / "llama" / "results.jsonl").write_text(json.dumps(_record("none")) + "\n")
    text = gpu_check.summary([{"step": "tiny", "status": "ok", "seconds": 3.5, "codes": [0]},
                              {"step": "cuda:1", "status": "not proven (needs 2 GPUs)", "seconds": 0.0, "codes": []}], out)
    assert text.index("## llama3-8b slice") < text.index("## steps")  # the steps' table comes last
    assert text.rstrip().splitlines()[-2:] == ["| tiny | ok | 3.5 | 0 |", "| cuda:1 | not proven (needs 2 GPUs) | 0.0 | - |"]


@pytest.mark.parametrize("argv", [["--out", "x", "--dry-run"], ["--steps", "tiny,real OOM", "--dry-run"]])
def test_dry_run_prints_the_plan_on_any_machine(argv, capsys):
    assert gpu_check.main(argv) == 0
    out = capsys.readouterr().out
    assert ("pytest tests/gpu" in out) == ("--steps" not in argv) and "- tiny: " in out


def test_a_call_writes_its_summary_after_every_step_and_packs_the_rest(tmp_path, monkeypatch):
    # On one GPU (NVML faked): a step that passes, one that fails, one that needs two GPUs. After
    # each step OUT holds the call's summary so far and the archive of the work folder: three files
    # at its top, what one device command brings back (at most 8, two folders deep).
    import tarfile

    py = lambda code, **kw: gpu_check.Command([sys.executable, "-c", code], **kw)  # noqa: E731
    steps = [gpu_check.Step("writes", "", lambda c: [py("open('made.txt', 'w').write('x')")]),
             gpu_check.Step("fails", "", lambda c: [py("raise SystemExit(3)")]),
             gpu_check.Step("two GPUs", "", lambda c: [py("pass")], gpus=2)]
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    monkeypatch.setattr(gpu_check, "visible_gpu_count", lambda: 1)
    monkeypatch.setattr(gpu_check, "visible_gpu_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    seen = []
    write = gpu_check.write_outputs
    monkeypatch.setattr(gpu_check, "write_outputs", lambda results, ctx, dest, call: seen.append(
        [r["step"] for r in json.loads(write(results, ctx, dest, call)[1].read_text())["steps"]]))
    out, work = tmp_path / "out", tmp_path / "work"
    assert gpu_check.main(["--call", "1", "--out", str(out), "--work", str(work)]) == 1  # a step failed
    assert seen == [["writes"], ["writes", "fails"], ["writes", "fails", "two GPUs"]]
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check-call1.tar.gz", "summary-call1.json", "summary-call1.md"]
    statuses = [r["status"] for r in json.loads((out / "summary-call1.json").read_text())["steps"]]
    assert statuses == ["ok", "failed (exit 3)", "not proven (needs 2 GPUs)"]
    with tarfile.open(out / "gpu-check-call1.tar.gz") as tar:
        names = tar.getnames()
    assert "gpu-check-call1/made.txt" in names and "gpu-check-call1/logs/fails.log" in names


def test_steps_run_in_the_order_given(tmp_path, monkeypatch):
    py = lambda code, **kw: gpu_check.Command([sys.executable, "-c", code], **kw)  # noqa: E731
    steps = [gpu_check.Step(name, "", lambda c, n=name: [py(f"open('order.txt', 'a').write('{n} ')")])
             for name in ("first", "second", "third")]
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    assert [s.name for s in gpu_check.chosen(None, ["third", "first"])] == ["third", "first"]
    monkeypatch.setattr(gpu_check, "visible_gpu_count", lambda: 1)
    monkeypatch.setattr(gpu_check, "visible_gpu_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    work = tmp_path / "work"
    assert gpu_check.main(["--steps", "third,first,second", "--out", str(tmp_path / "out"), "--work", str(work)]) == 0
    assert (work / "order.txt").read_text() == "third first second "
    with pytest.raises(SystemExit, match="unknown step"):
        gpu_check.chosen(None, ["nope"])


def test_quick_is_what_matters_most_in_one_short_call(capsys):
    # A lease is 15 minutes, its start included: the quick call's steps stop at a budget that keeps the
    # call within 6 minutes. On the first H200 these steps took 8 + 34 + 71 + 34 + 78 + 60 s (290 s).
    quick = [s.name for s in gpu_check.chosen(None, None, quick=True)]
    assert quick == ["preflight", "pytest tests/gpu", "llama3-8b slice", "real OOM", "sweep and golden", "moe and mla"]
    assert gpu_check.QUICK_BUDGET_S <= 6 * 60 - 20
    assert gpu_check.main(["--quick", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"budget {gpu_check.QUICK_BUDGET_S:.0f} s" in out and "quick: " in out
    assert [line[2:].split(": ")[0] for line in out.splitlines() if line.startswith("- ")] == quick
    with pytest.raises(SystemExit):
        gpu_check.main(["--quick", "--call", "1", "--dry-run"])


def test_a_step_whose_file_or_package_is_absent_is_not_run_and_says_why(tmp_path, monkeypatch):
    ctx = _ctx(tmp_path)
    ctx.out.mkdir(parents=True)
    overhead = next(s for s in gpu_check.STEPS if s.name == "step overhead")
    monkeypatch.setattr(gpu_check, "STEP_OVERHEAD", tmp_path / "step_overhead.py")
    result = gpu_check.run_step(overhead, ctx, gpu_check.time.monotonic() + 60, ctx.out / "o.log")
    assert result["status"] == "not run (bench/step_overhead.py is not in this tree)" and gpu_check.passed(result["status"])
    assert gpu_check.planned_s(overhead, ctx) == 0
    (tmp_path / "step_overhead.py").write_text("open('ran.txt', 'w').write('yes')\n")
    result = gpu_check.run_step(overhead, ctx, gpu_check.time.monotonic() + 60, ctx.out / "o.log")
    assert result["status"] == "ok" and (ROOT / "ran.txt").read_text() == "yes"  # it runs in the working tree
    (ROOT / "ran.txt").unlink()
    te = next(s for s in gpu_check.STEPS if s.name == "Transformer Engine tests")
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None)
    assert gpu_check.run_step(te, ctx, gpu_check.time.monotonic() + 60, ctx.out / "t.log")["status"] == \
        "not run (transformer_engine does not import on this machine)"
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(gpu_check, "te_tests", lambda: ["tests/test_te.py"])
    assert te.absent() is None and te.commands(ctx)[0].argv[3] == "tests/test_te.py"
    assert not gpu_check.passed("skipped (the call's budget is spent)") and not gpu_check.passed("failed (exit 1)")


def test_the_profile_check_plans_a_budget_that_fits_and_says_a_miss_in_digits(tmp_path):
    # The first H200 call ran `plan --auto --profile` at --memory-gb 1: tiny needs its allocated peak
    # plus the plan's allowance (10% and a fixed 1 GiB), more than 1 GiB, and the refusal read
    # "1.0 GiB of 1.0 GiB". The check's budget fits (here without --profile, which needs the device).
    profile = next(s for s in gpu_check.STEPS if s.name == "profile on cuda").commands(_ctx(tmp_path))[0]
    args = profile.argv[len(gpu_check.CLI):]
    steps = args.index("--profile-steps")
    args = [a for i, a in enumerate(args) if a != "--profile" and i not in (steps, steps + 1)]
    args[args.index("--output") + 1] = str(tmp_path / "policy.toml")
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    refused = invoke("plan", "-w", "tiny", "--memory-gb", "1", "--auto", "--output", str(tmp_path / "p.toml"))
    assert refused.exit_code == 1
    assert "needs 1.07 GiB of 1.00 GiB" in " ".join(refused.output.split())
