"""Everything the GPU tests and the GPU-only fixes need, in three bounded calls on one H100/H200 (one
device command runs at most 10 minutes, and only 8 files of at most 16 MiB, two folders deep, come
back from it), or in one quick call of what matters most, from the working tree, with the device's
own Python and torch (docs/gpu-check.md):

    PYTHONPATH=. python bench/gpu_check.py --quick --out gpu-check      # at most 6 minutes
    PYTHONPATH=. python bench/gpu_check.py --call 1 --out gpu-check     # then --call 2, --call 3
    PYTHONPATH=. python bench/gpu_check.py --steps "real OOM",tiny --out gpu-check   # in this order
    python bench/gpu_check.py --dry-run                                   # every call's plan, on any machine

Each step runs the CLI (or pytest) as its own processes, its output in `logs/<step>.log`, under its
own time limit and the call's budget (`--budget-s`, default 480 s: the planned limits of each call's
steps add up to no more, well inside the 9 minutes a call may take once the machine has started;
`--quick` 330 s, its steps in the order of what matters most, so a step the budget cuts is the least
needed); a failed, hung or skipped step is recorded and the next one runs. Results go to a work
folder (`--work`, default a fresh temporary one): runs, sweeps, a golden file named after the GPU,
logs. After every step OUT gets `summary-<call>.md` and `.json` (a call cut short still returns what
finished) and `gpu-check-<call>.tar.gz`, the whole work folder: three files. A step that needs two
GPUs on a machine with one is "not proven (needs 2 GPUs)", never passed; a step whose file or package
is absent (bench/step_overhead.py, Transformer Engine) is "not run (why)". Without a GPU (NVML sees
none) the script prints what it would run and exits 0. This process never imports torch: a CUDA
context here would hold device memory while the steps measure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recompute_bench.launch.devices import visible_gpu_count, visible_gpu_name  # noqa: E402  (no torch)

BUDGET_S = 480.0
"""One call's time for its steps: a device command runs at most 10 minutes; 8 leave room for the
machine's start, the packing and the transfer back."""
QUICK_BUDGET_S = 330.0
"""`--quick`'s time for its steps: a whole device lease is 15 minutes, its start (about a minute)
included, so the quick call stays within 6 minutes with its packing and transfer, and leaves room to
run it again."""


def not_proven(gpus: int) -> str:
    """The status of a step that needs more GPUs than the machine has."""
    return f"not proven (needs {gpus} GPUs)"


def not_run(why: str) -> str:
    """The status of a step this tree or environment cannot run (a file another change adds, a
    package the device lacks): said, not failed."""
    return f"not run ({why})"


def passed(status: str) -> bool:
    """Whether a step's status lets the call exit 0: it did its job, or it could not run here and says why."""
    return status == "ok" or status.startswith(("not proven", "not run"))


CLI = [sys.executable, "-c", "from recompute_bench.cli import main; main()"]
LLAMA_SLICE = ["-w", "llama3-8b", "--num-layers", "4", "--seq-length", "8192", "--micro-batch-size", "1",
               "--global-batch-size", "1", "--precision", "bf16"]
LLAMA_POINTS = [("none", {}), ("selective core_attn", {"recompute_modules": ["core_attn"]}),
                ("selective mlp", {"recompute_modules": ["mlp"]}), ("selective layernorm", {"recompute_modules": ["layernorm"]}),
                ("full uniform 1", {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1})]
MIXTRAL_SLICE = ["-w", "mixtral-8x7b", "--num-layers", "2", "--set", "model.num_moe_experts=4", "--micro-batch-size", "1",
                 "--global-batch-size", "1"]
TINY_SWEEP = ["-w", "tiny", "--baseline", "--modules", "core_attn", "--methods", "uniform",
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
    """A check: what it proves, its commands (built once the GPUs are known), how many GPUs it
    needs, and the call it runs in (`CALLS`)."""

    name: str
    proves: str
    commands: Callable[["Context"], list[Command]]
    gpus: int = 1
    call: int = 1
    quick: bool = False
    """Part of `--quick`: what matters most, in one call of at most `QUICK_BUDGET_S`."""
    absent: Callable[[], str | None] = lambda: None
    """Why the step cannot run in this tree or environment (it is then "not run (why)", not failed); None: it can."""


@dataclass
class Context:
    """What the commands are built from: the out folder and the GPUs NVML sees."""

    out: Path
    gpus: int
    gpu_name: str

    @property
    def kind(self) -> str:
        from recompute_bench.config.presets import gpu_type
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
                   ok=(0, 1), limit_s=point_limit_s * len(points) + 15, files={path: grid(points)})


def oom_limit_gib(gpu: str) -> float:
    """A --memory-limit-gb the llama slice cannot hold without recompute but can with full
    recompute: half way between the two estimated peaks."""
    from recompute_bench.analysis.harness.rank import record_estimate
    from recompute_bench.workload import resolve

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
                        "--results", "oom.jsonl"), ok=(0, 1), limit_s=50) for _, args in runs]


def _golden(ctx: Context) -> list[Command]:
    golden = f"results/golden/{ctx.kind}.csv"
    measure = lambda run_id: Command(cli("sweep", *TINY_SWEEP, "--device", "cuda", "--run-id", run_id,  # noqa: E731
                                         "--results-dir", "results", "--no-golden", "--timeout", "25"), limit_s=90)
    # tiny's steps take a few milliseconds, launch overhead more than compute: its TFLOP/s is not a
    # figure to gate on; the bytes, FLOPs and memory are.
    return [measure("golden-source"),
            Command(cli("golden", "update", "golden-source", "--results-dir", "results", "--golden", golden), limit_s=20),
            measure("gate"),
            Command(cli("compare", "gate", "--results-dir", "results", "--golden", golden, "--tolerance",
                        "tflops_per_gpu:off", "--junit", "results/gate/junit.xml", "--markdown",
                        "results/gate/compare.md"), limit_s=20)]


STEP_OVERHEAD = ROOT / "bench" / "step_overhead.py"
"""The harness's step against a plain PyTorch loop on the same shape (where the 0.82x of the first
H200 run goes); another change adds it, so the step says so where it is absent."""


def te_tests() -> list[str]:
    """The test files that import Transformer Engine (tests/gpu's too: this step runs them by name)."""
    found = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        text = path.read_text(errors="replace")
        if re.search(
                r"^\s*(import transformer_engine|from transformer_engine|.*importorskip\([\"']transformer_engine)", text, re.M):
            found.append(str(path.relative_to(ROOT)))
    return found


def te_absent() -> str | None:
    """Why the Transformer Engine tests cannot run here, or None (found without importing it or torch)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer_engine does not import on this machine"
    return None if te_tests() else "no test file imports transformer_engine"


def pytest_command(ctx: "Context", paths: list[str], junit: str, limit_s: float) -> Command:
    return Command([sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", "--junitxml",
                    str(ctx.out / junit)], cwd="root", limit_s=limit_s)


STEPS = [
    # call 1: the basics
    Step("preflight", "the device's Python has what the package needs; the GPUs NVML and torch see",
         lambda ctx: [Command([sys.executable, "-c", "import torch, typer, rich, pandas, pynvml, pytest; "
                               "print(torch.__version__, torch.version.cuda, torch.cuda.device_count(), "
                               "torch.cuda.get_device_name(0))"], limit_s=30),
                      Command(["nvidia-smi", "-L"], limit_s=15)], quick=True),
    Step("pytest tests/gpu", "the GPU tests: allocator peaks, real OOMs, no host sync, TF32, offload bytes",
         lambda ctx: [pytest_command(ctx, ["tests/gpu"], "pytest-gpu.xml", 120)], quick=True),
    Step("tiny", "one point end to end on cuda", lambda ctx: [
        Command(cli("run", "-w", "tiny", "--device", "cuda", "--results", "runs.jsonl"), limit_s=30)]),
    Step("ranks > GPUs", "more ranks than GPUs: one line, exit 2, before launch (item 12)", lambda ctx: [
        Command(cli("run", "-w", "tiny", "--nproc-per-node", str(ctx.gpus + 1), "--results", "refused.jsonl"),
                ok=(2,), limit_s=20)]),
    # tiny needs about 1.08 GiB with the plan's allowance (10% and a fixed 1 GiB): 2 GiB fits
    Step("profile on cuda", "plan --profile times spans and the host link on the device's stream (item 1)", lambda ctx: [
        Command(cli("plan", "-w", "tiny", "--memory-gb", "2", "--auto", "--profile", "--profile-steps", "2",
                    "--output", "tiny-policy.toml"), limit_s=45)]),
    Step("megatron rates profile", "plan --framework megatron --profile measures bf16/FP8 matmuls, the copy and the "
                                   "run's own GEMM shapes, caches them and prices the plan with them (issue 33)",
         lambda ctx: [Command(cli("plan", "--framework", "megatron", "-w", "llama3-8b", "--gpu", "h200",
                                  "--tensor-model-parallel-size", "2", "--sequence-parallel", "--gpus", "2",
                                  "--seq-length", "4096", "--global-batch-size", "8", "--memory-gb", "140",
                                  "--profile", "--json"), limit_s=90)]),
    Step("verify on cuda", "every setting bitwise under torch's deterministic algorithms (item 13)", lambda ctx: [
        Command(cli("verify", "-w", "tiny", "--device", "cuda"), limit_s=60),
        Command(cli("verify", "-w", "tiny-moe", "--device", "cuda", "--attention-backend", "sdpa"), limit_s=60)]),
    Step("Transformer Engine tests", "the tests that import Transformer Engine, where it imports",
         lambda ctx: [pytest_command(ctx, te_tests(), "pytest-te.xml", 90)], absent=te_absent),
    # call 2: the llama3-8b slice
    Step("llama3-8b slice", "measured vs estimated peak and hardware FLOPs, step time, TFLOP/s, MFU (issue 20)",
         lambda ctx: [sweep(ctx, "llama", LLAMA_SLICE, LLAMA_POINTS, 40)], call=2, quick=True),
    Step("real OOM", "none OOMs under --memory-limit-gb, full fits at the same limit", _oom, call=2, quick=True),
    Step("step overhead", "the harness's step against a plain PyTorch loop on the same shape",
         lambda ctx: [Command([sys.executable, str(STEP_OVERHEAD)], cwd="root", limit_s=100)], call=2,
         absent=lambda: None if STEP_OVERHEAD.exists() else "bench/step_overhead.py is not in this tree"),
    # call 3: MoE, MLA, the golden gate, and what needs a second GPU
    Step("sweep and golden", "a real sweep, golden update into results/golden/<gpu>.csv, a second sweep gated "
                             "against it (tiny's TFLOP/s not gated)", _golden, call=3, quick=True),
    Step("moe and mla", "moe_act / moe / mla_up_proj on CUDA, the grouped-matmul path recorded", lambda ctx: [
        sweep(ctx, "tiny-moe", ["-w", "tiny-moe"], [("none", {}), ("moe_act", {"recompute_modules": ["moe_act"]}),
                                                     ("moe", {"recompute_modules": ["moe"]})], 25),
        sweep(ctx, "tiny-mla", ["-w", "tiny-mla"], [("none", {}), ("mla_up_proj", {"recompute_modules": ["mla_up_proj"]})], 25)],
         call=3, quick=True),
    Step("torchao FP8", "--precision fp8 through torchao's float8 training: the FP8 GPU tests, then the llama3-8b slice "
                        "in FP8 (tensorwise, rowwise) beside its bf16 points (issue 35)", lambda ctx: [
        pytest_command(ctx, ["tests/gpu/test_float8_cuda.py"], "pytest-fp8.xml", 60),
        sweep(ctx, "llama-fp8", [*LLAMA_SLICE[:-2], "--precision", "fp8", "--fp8-recipe", "tensorwise"],
              [("none tensorwise", {}), ("none rowwise", {"fp8_recipe": "rowwise"}),
               ("selective mlp tensorwise", {"recompute_modules": ["mlp"]})], 40)], call=4,
         absent=lambda: None if importlib.util.find_spec("torchao") else
         "torchao does not import on this machine (bring its wheel: docs/gpu-check.md)"),
    Step("mixtral slice", "a MoE slice of a real size: moe_act's saving and the grouped-matmul path", lambda ctx: [
        sweep(ctx, "mixtral", MIXTRAL_SLICE, [("none", {}), ("moe_act", {"recompute_modules": ["moe_act"]})], 45)],
         call=3),
    Step("cuda:1", "a point on the second GPU is timed on it (item 1)", lambda ctx: [
        Command(cli("run", "-w", "tiny", "--device", "cuda:1", "--results", "runs.jsonl"), limit_s=30)], gpus=2, call=3),
    Step("2 ranks on NCCL", "barrier, slowest rank and spread over NCCL (item 2); rank 1 hung: the watchdog's "
                            "verdict is the record's (item 11)", lambda ctx: [
        Command(cli("run", "-w", "tiny", "--nproc-per-node", "2", "--results", "ranks.jsonl"), limit_s=60),
        Command(cli("run", "-w", "tiny", "--nproc-per-node", "2", "--watchdog-s", "20", "--timeout", "120",
                    "--results", "ranks.jsonl"), ok=(1,), limit_s=130,
                env={"RECOMPUTE_BENCH_FAULT": "hang:forward:3@1"})], gpus=2, call=3),
]
CALLS = sorted({step.call for step in STEPS})


def planned_s(step: Step, ctx: "Context") -> float:
    """The step's planned time on `ctx`'s GPUs: its commands' limits (nothing where it cannot run)."""
    return 0.0 if ctx.gpus < step.gpus or step.absent() else sum(c.limit_s for c in step.commands(ctx))


def run_step(step: Step, ctx: Context, deadline: float, log: Path) -> dict:
    """Run a step's commands in order until one fails; its status, seconds and exit codes."""
    started = time.monotonic()
    result = {"step": step.name, "status": "ok", "seconds": 0.0, "codes": []}
    if ctx.gpus < step.gpus:
        return {**result, "status": not_proven(step.gpus)}
    why = step.absent()
    if why:
        return {**result, "status": not_run(why)}
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


def write_outputs(results: list[dict], ctx: Context, dest: Path, call: str) -> list[Path]:
    """The call's summary (Markdown and JSON) and the whole work folder packed in one archive, into
    `dest`: three files at its top, what a device call brings back. Written after every step."""
    dest.mkdir(parents=True, exist_ok=True)
    text = summary(results, ctx.out)
    md, js, archive = (dest / f"summary-{call}.md", dest / f"summary-{call}.json", dest / f"gpu-check-{call}.tar.gz")
    md.write_text(f"# gpu_check {call} on {ctx.gpu_name}\n" + text)
    js.write_text(json.dumps({"gpu": ctx.gpu_name, "gpus": ctx.gpus, "call": call, "steps": results}, indent=2))
    partial = archive.with_name(archive.name + ".part")
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(ctx.out, arcname=f"gpu-check-{call}")
    partial.replace(archive)  # a call cut while packing still leaves the previous whole archive
    return [md, js, archive]


def chosen(call: int | None, names: list[str] | None, quick: bool = False) -> list[Step]:
    """The steps named, in the order given; else the `--quick` steps or those of `call`, in plan
    order; every step for none of them."""
    if names:
        by_name = {step.name: step for step in STEPS}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise SystemExit(f"unknown step(s) {', '.join(unknown)}; the steps: {', '.join(by_name)}")
        return [by_name[n] for n in dict.fromkeys(names)]
    if quick:
        return [step for step in STEPS if step.quick]
    return [step for step in STEPS if call is None or step.call == call]


def plan_text(ctx: Context, steps: list[Step], budget_s: float, group: str | None = None) -> str:
    """What the calls would run, step by step, with each call's planned time against its budget;
    `group`: the steps run as one call of that name, in their order."""
    lines = [f"GPUs: {ctx.gpus} ({ctx.gpu_name}); work: {ctx.out}; budget {budget_s:.0f} s a call"]
    groups = [(f"call {call}", [step for step in steps if step.call == call]) for call in sorted({s.call for s in steps})]
    if group is not None:  # --quick or --steps: one call, in the order it runs
        groups = [(group, steps)]
    for title, mine in groups:
        lines.append(f"{title}: {sum(planned_s(step, ctx) for step in mine):.0f} s planned"
                     + (f" (step limits; the call stops at its {budget_s:.0f} s budget, its steps in this order)"
                        if title == "quick" else ""))
        for step in mine:
            where = f" [needs {step.gpus} GPUs: {not_proven(step.gpus) if ctx.gpus < step.gpus else 'runs'}]" if step.gpus > 1 else ""
            why = step.absent()
            lines.append(f"- {step.name}: {step.proves}{where}{f' [{not_run(why)}]' if why else ''}")
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
                                     epilog="Exit code 0 when every step that ran did its job (a step that needs "
                                            "two GPUs on one is not proven, not failed), 1 otherwise.")
    parser.add_argument("--out", type=Path, default=Path("gpu-check"),
                        help="folder that receives the summary and the archive (three files a call)")
    parser.add_argument("--call", type=int, choices=CALLS, help="run the steps of this call")
    parser.add_argument("--steps", help="run these steps instead, in the order given (comma-separated names)")
    parser.add_argument("--quick", action="store_true",
                        help=f"one call of what matters most, in this order: "
                             f"{', '.join(s.name for s in STEPS if s.quick)} (budget {QUICK_BUDGET_S:.0f} s)")
    parser.add_argument("--budget-s", type=float, help=f"time for the call's steps (default {BUDGET_S:.0f} s, "
                                                       f"--quick {QUICK_BUDGET_S:.0f} s)")
    parser.add_argument("--work", type=Path, help="folder for the runs, logs and tables (default: a new temporary one)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = parser.parse_args(argv)
    if sum(map(bool, (args.call is not None, args.steps, args.quick))) > 1:
        parser.error("pass one of --call N, --steps and --quick")
    budget_s = args.budget_s or (QUICK_BUDGET_S if args.quick else BUDGET_S)
    steps = chosen(args.call, [n.strip() for n in args.steps.split(",")] if args.steps else None, args.quick)
    name = "quick" if args.quick else f"call{args.call}" if args.call is not None else "steps" if args.steps else None
    gpus = visible_gpu_count() or 0
    work = (args.work or Path(tempfile.gettempdir()) / f"gpu-check-{os.getpid()}").resolve()
    ctx = Context(work, gpus, visible_gpu_name(0) if gpus else "NVIDIA H100 80GB HBM3")
    if args.dry_run or not gpus:
        if not gpus:
            print(f"no GPU is visible here (NVML); on one {ctx.gpu_name} this would run:")
        print(plan_text(Context(work, max(gpus, 1), ctx.gpu_name), steps, budget_s,
                        name if name in ("quick", "steps") else None))
        return 0
    if name is None:
        parser.error("pass --call N (1 to %d), --quick or --steps: one device command runs one call" % max(CALLS))
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "logs").mkdir(exist_ok=True)
    deadline = time.monotonic() + budget_s
    results = []
    for step in steps:
        print(f"[{time.strftime('%H:%M:%S')}] {step.name} ...", flush=True)
        result = run_step(step, ctx, deadline, ctx.out / "logs" / f"{step.name.replace(' ', '_').replace('/', '_')}.log")
        results.append(result)
        print(f"    {result['status']} in {result['seconds']} s", flush=True)
        write_outputs(results, ctx, args.out.resolve(), name)  # a call cut after this step keeps it
    print(summary(results, ctx.out))
    return 0 if all(passed(r["status"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
