"""Everything the GPU tests and the GPU-only fixes need, in one call of at most 20 minutes on one
H100/H200 (issue 16's checks, issue 20's first numbers), from the working tree:

    PYTHONPATH=. python bench/gpu_check.py --out gpu-check      # or: make gpu-check OUT=gpu-check
    python bench/gpu_check.py --out gpu-check --dry-run         # the plan only, on any machine

Each step runs the CLI (or pytest) as its own processes, its output in `OUT/logs/<step>.log`, under
its own time limit and the call's overall budget; a failed, hung or skipped step is recorded and the
next one runs. Results land under OUT (runs, sweeps, a golden file named after the GPU), tables in
`OUT/summary.md` and `OUT/summary.json`, and the summary table is printed last. Without a GPU (NVML
sees none) the script prints what it would run and exits 0. This process never imports torch: a
CUDA context here would hold device memory while the steps measure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recompute_bench.launch.devices import visible_gpu_count, visible_gpu_name  # noqa: E402  (no torch)

BUDGET_S = 19 * 60.0
"""The whole call's time: one device call is at most 20 minutes, start-up included."""
CLI = [sys.executable, "-c", "from recompute_bench.cli import main; main()"]
LLAMA_SLICE = ["-w", "llama3-8b", "--num-layers", "4", "--seq-length", "8192", "--micro-batch-size", "1",
               "--global-batch-size", "1", "--precision", "bf16"]
LLAMA_POINTS = [("none", {}), ("selective core_attn", {"recompute_modules": ["core_attn"]}),
                ("selective mlp", {"recompute_modules": ["mlp"]}), ("selective layernorm", {"recompute_modules": ["layernorm"]}),
                ("full uniform 1", {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1})]
MIXTRAL_SLICE = ["-w", "mixtral-8x7b", "--num-layers", "2", "--set", "model.num_moe_experts=4", "--micro-batch-size", "1",
                 "--global-batch-size", "1"]
TINY_SWEEP = ["-w", "tiny", "--baseline", "--modules", "core_attn", "mlp", "--methods", "uniform",
              "--num-layers-recompute", "1"]


@dataclass
class Command:
    """One process of a step: its argv, the exit codes that mean it did its job, its time limit."""

    argv: list[str]
    ok: tuple[int, ...] = (0,)
    limit_s: float = 120.0
    cwd: str = "out"
    """"out" (the results land under --out) or "root" (the working tree: pytest)."""
    env: dict[str, str] = field(default_factory=dict)
    files: dict[Path, str] = field(default_factory=dict)
    """Written before the command runs (a sweep's grid file): planning writes nothing."""


@dataclass
class Step:
    """A check: what it proves, its commands (built once the GPUs are known), how many GPUs it needs."""

    name: str
    proves: str
    commands: Callable[["Context"], list[Command]]
    gpus: int = 1


@dataclass
class Context:
    """What the commands are built from: the out folder and the GPUs NVML sees."""

    out: Path
    gpus: int
    gpu_name: str

    @property
    def kind(self) -> str:
        from recompute_bench.spec.presets import gpu_type
        return gpu_type(self.gpu_name)


def cli(*args: str) -> list[str]:
    return [*CLI, *args]


def grid(points: list[tuple[str, dict]]) -> str:
    """A sweep grid file's text: one [[point]] per (name, recompute keys)."""
    lines = []
    for point, keys in points:
        lines += ["[[point]]", f'name = "{point}"', *(f"{k} = {json.dumps(v)}" for k, v in keys.items())]
    return "\n".join(lines) + "\n"


def sweep(ctx: Context, run_id: str, workload_args: list[str], points: list[tuple[str, dict]],
          point_limit_s: float) -> Command:
    """A sweep of `points` into OUT/results/<run_id>, each point in its own worker, none compared."""
    path = ctx.out / "grids" / f"{run_id}.toml"
    return Command(cli("sweep", *workload_args, "--grid", str(path), "--run-id", run_id, "--results-dir", "results",
                       "--device", "cuda", "--timeout", f"{point_limit_s:g}", "--no-golden"),
                   ok=(0, 1), limit_s=point_limit_s * len(points) + 30, files={path: grid(points)})


def oom_limit_gib(gpu: str) -> float:
    """A --memory-limit-gb the llama slice cannot hold without recompute but can with full
    recompute: half way between the two estimated peaks."""
    from recompute_bench.analysis.rank import record_estimate
    from recompute_bench.spec.presets import resolve

    def estimated(**recompute) -> float:
        overrides = {"model.num_layers": 4, "training.seq_length": 8192, "training.micro_batch_size": 1,
                     "training.global_batch_size": 1, "training.precision": "bf16",
                     **{f"recompute.{k}": v for k, v in recompute.items()}}
        cfg, _ = resolve("llama3-8b", overrides=overrides, gpu=gpu)
        return record_estimate(cfg, "cuda")["estimated_peak_allocated_bytes"]

    return round((estimated() + estimated(granularity="full", method="uniform", num_layers=1)) / 2 / 2**30, 2)


def _oom(ctx: Context) -> list[Command]:
    limit = f"{oom_limit_gib(ctx.kind):g}"
    runs = [("none", []), ("selective core_attn", ["--recompute-modules", "core_attn"]),
            ("full uniform 1", ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                "--recompute-num-layers", "1"])]
    return [Command(cli("run", *LLAMA_SLICE, *args, "--device", "cuda", "--memory-limit-gb", limit,
                        "--results", "oom.jsonl"), ok=(0, 1), limit_s=240) for _, args in runs]


def _golden(ctx: Context) -> list[Command]:
    golden = f"results/golden/{ctx.kind}.csv"
    measure = lambda run_id: Command(cli("sweep", *TINY_SWEEP, "--device", "cuda", "--run-id", run_id,  # noqa: E731
                                         "--results-dir", "results", "--no-golden"), limit_s=240)
    return [measure("golden-source"),
            Command(cli("golden", "update", "golden-source", "--results-dir", "results", "--golden", golden), limit_s=60),
            measure("gate"),
            Command(cli("compare", "gate", "--results-dir", "results", "--golden", golden,
                        "--junit", "results/gate/junit.xml", "--markdown", "results/gate/compare.md"), limit_s=60)]


STEPS = [
    Step("preflight", "the device's Python has what the package needs; the GPUs NVML and torch see",
         lambda ctx: [Command([sys.executable, "-c", "import torch, typer, rich, pandas, pynvml, pytest; "
                               "print(torch.__version__, torch.version.cuda, torch.cuda.device_count(), "
                               "torch.cuda.get_device_name(0))"], limit_s=60),
                      Command(["nvidia-smi", "-L"], limit_s=30)]),
    Step("pytest tests/gpu", "the GPU tests: allocator peaks, real OOMs, no host sync, TF32, offload bytes",
         lambda ctx: [Command([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider",
                               "--junitxml", str(ctx.out / "pytest-gpu.xml")], cwd="root", limit_s=300)]),
    Step("tiny", "one point end to end on cuda", lambda ctx: [
        Command(cli("run", "-w", "tiny", "--device", "cuda", "--results", "runs.jsonl"), limit_s=120)]),
    Step("ranks > GPUs", "more ranks than GPUs: one line, exit 2, before launch (item 12)", lambda ctx: [
        Command(cli("run", "-w", "tiny", "--nproc-per-node", str(ctx.gpus + 1), "--results", "refused.jsonl"),
                ok=(2,), limit_s=60)]),
    Step("llama3-8b slice", "measured vs estimated peak and hardware FLOPs, step time, TFLOP/s, MFU (issue 20)",
         lambda ctx: [sweep(ctx, "llama", LLAMA_SLICE, LLAMA_POINTS, 150)]),
    Step("real OOM", "none OOMs under --memory-limit-gb, full fits at the same limit", _oom),
    Step("moe and mla", "moe_act / moe / mla_up_proj on CUDA, the grouped-matmul path recorded", lambda ctx: [
        sweep(ctx, "tiny-moe", ["-w", "tiny-moe"], [("none", {}), ("moe_act", {"recompute_modules": ["moe_act"]}),
                                                     ("moe", {"recompute_modules": ["moe"]})], 90),
        sweep(ctx, "tiny-mla", ["-w", "tiny-mla"], [("none", {}), ("mla_up_proj", {"recompute_modules": ["mla_up_proj"]})], 90),
        sweep(ctx, "mixtral", MIXTRAL_SLICE, [("none", {}), ("moe_act", {"recompute_modules": ["moe_act"]}),
                                              ("moe", {"recompute_modules": ["moe"]})], 150)]),
    Step("verify on cuda", "every setting bitwise under torch's deterministic algorithms (item 13)", lambda ctx: [
        Command(cli("verify", "-w", "tiny", "--device", "cuda"), limit_s=240),
        Command(cli("verify", "-w", "tiny-moe", "--device", "cuda", "--attention-backend", "sdpa"), limit_s=240)]),
    Step("profile on cuda", "plan --profile times spans and the host link on the device's stream (item 1)", lambda ctx: [
        Command(cli("plan", "-w", "tiny", "--memory-gb", "1", "--auto", "--profile", "--profile-steps", "2",
                    "--output", "tiny-policy.toml"), limit_s=120)]),
    Step("sweep and golden", "a real sweep, golden update into OUT/results/golden/<gpu>.csv, a second sweep gated "
                             "against it", _golden),
    Step("cuda:1", "a point on the second GPU is timed on it (item 1)", lambda ctx: [
        Command(cli("run", "-w", "tiny", "--device", "cuda:1", "--results", "runs.jsonl"), limit_s=120)], gpus=2),
    Step("2 ranks on NCCL", "barrier, slowest rank and spread over NCCL (item 2); rank 1 hung: the watchdog's "
                            "verdict is the record's (item 11)", lambda ctx: [
        Command(cli("run", "-w", "tiny", "--nproc-per-node", "2", "--results", "ranks.jsonl"), limit_s=180),
        Command(cli("run", "-w", "tiny", "--nproc-per-node", "2", "--watchdog-s", "20", "--timeout", "240",
                    "--results", "ranks.jsonl"), ok=(1,), limit_s=260,
                env={"RECOMPUTE_BENCH_FAULT": "hang:forward:3@1"})], gpus=2),
]


def run_step(step: Step, ctx: Context, deadline: float, log: Path) -> dict:
    """Run a step's commands in order until one fails; its status, seconds and exit codes."""
    started = time.monotonic()
    result = {"step": step.name, "status": "ok", "seconds": 0.0, "codes": []}
    if ctx.gpus < step.gpus:
        return {**result, "status": f"skipped (needs {step.gpus} GPUs)"}
    try:
        commands = step.commands(ctx)
    except Exception as e:  # a plan that cannot be built is this step's failure, not the call's
        return {**result, "status": f"failed ({type(e).__name__}: {e})"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    with log.open("a") as out:
        for command in commands:
            left = deadline - time.monotonic()
            if left < 10:
                result["status"] = "skipped (the call's budget is spent)"
                break
            out.write(f"\n=== {' '.join(command.argv)}\n")
            out.flush()
            for path, text in command.files.items():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            try:
                done = subprocess.run(command.argv, cwd=ROOT if command.cwd == "root" else ctx.out, stdout=out,
                                      stderr=subprocess.STDOUT, env={**env, **command.env},
                                      timeout=min(command.limit_s, left))
            except subprocess.TimeoutExpired:
                result["status"] = f"timeout ({min(command.limit_s, left):.0f} s)"
                break
            except OSError as e:
                result["status"] = f"failed ({e})"
                break
            result["codes"].append(done.returncode)
            if done.returncode not in command.ok:
                result["status"] = f"failed (exit {done.returncode})"
                break
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


# ----- tables --------------------------------------------------------------------------------------
def _records(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def _pct(measured, estimated) -> str:
    return "-" if not measured or estimated is None else f"{100 * (estimated - measured) / measured:+.1f}%"


def point_rows(records: list[dict]) -> list[dict]:
    """One row per measured point: measured against estimated peak memory and hardware FLOPs, and
    the rates (what issue 20 asks of the llama3-8b slice)."""
    rows = []
    for r in records:
        m, env = r.get("metrics") or {}, r.get("env") or {}
        step = m.get("step_time_s")
        rows.append({
            "point": (r.get("point") or {}).get("name", "-"), "status": r.get("status"),
            "peak alloc GiB": _gib(m.get("peak_allocated_bytes")),
            "estimated GiB": _gib(m.get("estimated_peak_allocated_bytes")),
            "peak error": _pct(m.get("peak_allocated_bytes"), m.get("estimated_peak_allocated_bytes")),
            "FLOPs error": _pct(m.get("measured_flops_per_step"), m.get("estimated_hardware_flops_per_step")),
            "step ms": "-" if step is None else f"{1e3 * step:.1f}",
            "rank spread ms": "-" if m.get("step_time_spread_s") is None else f"{1e3 * m['step_time_spread_s']:.1f}",
            "TFLOP/s": "-" if m.get("tflops_per_gpu") is None else f"{m['tflops_per_gpu']:.1f}",
            "MFU": "-" if m.get("mfu") is None else f"{100 * m['mfu']:.1f}% of {m.get('peak_source')}",
            "grouped_gemm_path": env.get("grouped_gemm_path", "-"),
        })
    return rows


def markdown(rows: list[dict]) -> str:
    """A Markdown table of `rows` (dicts with the same keys)."""
    if not rows:
        return "(no rows)\n"
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def summary(results: list[dict], out: Path) -> str:
    """The whole call in Markdown: each point table, then the steps (the summary, last)."""
    tables = {"llama3-8b slice": out / "results/llama/results.jsonl", "real OOM": out / "oom.jsonl",
              "tiny-moe": out / "results/tiny-moe/results.jsonl", "tiny-mla": out / "results/tiny-mla/results.jsonl",
              "mixtral slice": out / "results/mixtral/results.jsonl", "tiny and cuda:1": out / "runs.jsonl",
              "2 ranks": out / "ranks.jsonl"}
    text = ""
    for title, path in tables.items():
        records = _records(path)
        if records:
            text += f"\n## {title}\n\n" + markdown(point_rows(records))
    steps = [{"step": r["step"], "status": r["status"], "seconds": r["seconds"],
              "exit codes": ",".join(map(str, r["codes"])) or "-"} for r in results]
    return text + "\n## steps\n\n" + markdown(steps)


def plan_text(ctx: Context) -> str:
    """What the call would run, step by step."""
    lines = [f"GPUs: {ctx.gpus} ({ctx.gpu_name}); out: {ctx.out}; budget {BUDGET_S:.0f} s"]
    for step in STEPS:
        lines.append(f"- {step.name}: {step.proves}" + (f" [needs {step.gpus} GPUs]" if step.gpus > 1 else ""))
        try:
            commands = step.commands(ctx)
        except Exception as e:
            lines.append(f"    (cannot plan: {e})")
            continue
        for c in commands:
            argv = ["recompute-bench", *c.argv[len(CLI):]] if c.argv[:len(CLI)] == CLI else c.argv
            env = "".join(f"{k}={v} " for k, v in c.env.items())
            lines.append(f"    {env}{' '.join(argv)}  (limit {c.limit_s:g} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Exit code 0 when every step that ran did its job, 1 otherwise.")
    parser.add_argument("--out", type=Path, required=True, help="folder for the results, logs and tables")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = parser.parse_args(argv)
    gpus = visible_gpu_count() or 0
    ctx = Context(args.out.resolve(), gpus, visible_gpu_name(0) if gpus else "NVIDIA H100 80GB HBM3")
    if args.dry_run or not gpus:
        if not gpus:
            print(f"no GPU is visible here (NVML); on one {ctx.gpu_name} this call would run:")
        print(plan_text(ctx))
        return 0
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "logs").mkdir(exist_ok=True)
    deadline = time.monotonic() + BUDGET_S
    results = []
    for step in STEPS:
        print(f"[{time.strftime('%H:%M:%S')}] {step.name} ...", flush=True)
        result = run_step(step, ctx, deadline, ctx.out / "logs" / f"{step.name.replace(' ', '_').replace('/', '_')}.log")
        results.append(result)
        print(f"    {result['status']} in {result['seconds']} s", flush=True)
    text = summary(results, ctx.out)
    (ctx.out / "summary.md").write_text(f"# gpu_check on {ctx.gpu_name}\n" + text)
    (ctx.out / "summary.json").write_text(json.dumps({"gpu": ctx.gpu_name, "gpus": ctx.gpus, "steps": results}, indent=2))
    print(text)
    return 0 if all(r["status"] == "ok" or r["status"].startswith("skipped (needs") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
