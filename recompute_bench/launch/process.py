"""One isolated process per point, with a time limit; what happened becomes a result record.

`run_isolated` starts `python -m recompute_bench.launch.worker` in its own session (process group), hands
it the resolved config as JSON on stdin and waits at most `timeout_s` seconds once the worker has
started (imported torch and the package: it says so with a file beside its record; the start itself
may take up to START_LIMIT_S on a loaded machine):

- the worker wrote a record (status ok, oom or error as `measure.run_point` decided): that record;
- the time limit passed: the worker's Python stacks are dumped into its log (SIGUSR1), the whole
  process group is killed, and the record says `status: "timeout"` with the stack's tail;
- the worker died without a record (a crash, a signal, an import error): `status: "error"` with
  the exit code and the tail of its stderr.

The worker also dies when the sweep dies, so a killed sweep leaves no orphan measuring in the
background: it is told the sweep's pid (PARENT_PID_ENV) and watches for it to go
(`launch.worker.die_with_parent`). The worker runs in a session of its own (`start_new_session`),
so the whole process group can be killed; no `preexec_fn`, which is unsafe once the parent has
threads (rich's live display) because the child runs Python between fork and exec.

This module never imports torch: the sweep parent outlives every worker, and a CUDA context in it
would hold device memory for the whole sweep. Device facts come from NVML (`launch.devices`).

Test hook: `RECOMPUTE_BENCH_FAULT_POINTS="Exp 1=oom:backward:0;Exp 3=hang:forward:0"` gives one
point's worker the `RECOMPUTE_BENCH_FAULT` of `measure.FAULT_ENV`, so a test can make one point of
a sweep fail while the others run normally.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from recompute_bench.config.schema import Config
from recompute_bench.launch.devices import default_device_type, visible_gpu_name
from recompute_bench.launch.worker import PARENT_PID_ENV, ready_path
from recompute_bench.measure.record import FAULT_ENV, make_record, unmeasured_metrics, unmeasured_rank
from recompute_bench.measure.telemetry import host_environment

WORKER_COMMAND = [sys.executable, "-m", "recompute_bench.launch.worker"]
FAULT_POINTS_ENV = "RECOMPUTE_BENCH_FAULT_POINTS"
STDERR_TAIL_LINES = 15
STACK_DUMP_WAIT_S = 1.0
START_LIMIT_S = 300.0
"""How long a point's processes may take to start (interpreter, imports of torch and the package)
before its own time limit begins: the start measures the machine's load, not the point."""
POLL_S = 0.2
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def fault_for(name: str) -> str | None:
    """The injected fault of the point called `name`, from RECOMPUTE_BENCH_FAULT_POINTS."""
    for item in os.environ.get(FAULT_POINTS_ENV, "").split(";"):
        point, sep, spec = item.partition("=")
        if sep and point.strip() == name:
            return spec.strip()
    return None


def worker_env(name: str) -> dict[str, str]:
    env = dict(os.environ)
    # The worker imports the same package as the sweep, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
    env[PARENT_PID_ENV] = str(os.getpid())
    env.pop(FAULT_ENV, None)
    fault = fault_for(name) or os.environ.get(FAULT_ENV)
    if fault:
        env[FAULT_ENV] = fault
    return env


def tail_of(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def innermost_frame(stack: str) -> str | None:
    """"faults.py:57 in inject_fault" from a faulthandler dump: the top frame of the thread it interrupted
    (lines torchrun's --tee prefixed with "[default<local rank>]:" read as the rank wrote them)."""
    lines = [re.sub(r"^\[\w*?\d+\]:", "", line) for line in stack.splitlines()]
    start = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    for line in lines[start + 1:] if start is not None else []:
        match = re.match(r'\s*File "(.+)", line (\d+) in (\S+)', line)
        if match:
            return f"{Path(match[1]).name}:{match[2]} in {match[3]}"
    return None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@functools.lru_cache(maxsize=None)
def _device(device: str | None) -> tuple[str, str]:
    """(device type, device name) a worker given `--device device` measures on, learnt without torch."""
    kind = device.split(":")[0] if device else default_device_type()
    if kind != "cuda":
        return kind, "cpu"
    index = device.partition(":")[2] if device else ""
    return kind, visible_gpu_name(int(index) if index.isdigit() else 0)


def failed_record(cfg: Config, status: str, failure: dict, device: str | None = None) -> dict:
    """A complete result record for a point whose worker left none: nothing measured (None), the
    formula FLOPs and the estimate filled in as `measure.run_point` does for any failed point.
    Built without torch (the env block from `telemetry.host_environment`, the GPU from NVML)."""
    kind, name = _device(device)
    env = host_environment(kind, name)
    return make_record(cfg, env, unmeasured_rank(0, name, status, failure), unmeasured_metrics(cfg, kind))


def run_group(command: list[str], log_path: Path, env: dict[str, str], timeout_s: float, *, header: str,
              stdin: bytes = b"", started: Callable[[], bool] | None = None) -> int | None:
    """Run `command` in a session of its own, its output appended to `log_path` under a `header`
    line, `stdin` written to it; wait at most `timeout_s` seconds from the moment `started()` is
    first true (the processes have started and imported what they need; at most START_LIMIT_S
    seconds after launch; no `started`: from launch). Returns its exit code, or None when a limit
    passed: then its Python stacks were dumped into the log (SIGUSR1 to the whole group) and the
    group killed. KeyboardInterrupt (or any error) kills the group and propagates."""
    with log_path.open("ab") as log:
        log.write(f"=== {header} {time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode())
        log.flush()
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=log, stderr=log, env=env,
                                start_new_session=True)
        try:
            proc.stdin.write(stdin)
            proc.stdin.close()
            deadline = time.monotonic() + (START_LIMIT_S if started else timeout_s)
            while proc.poll() is None:
                if started and started():
                    deadline, started = time.monotonic() + timeout_s, None
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(command, timeout_s)
                time.sleep(POLL_S)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGUSR1)  # the worker's faulthandler dumps its stacks
                time.sleep(STACK_DUMP_WAIT_S)
            except ProcessLookupError:
                pass
            _kill_group(proc)
            return None
        except BaseException:
            _kill_group(proc)
            raise
    return proc.returncode


def run_isolated(cfg: Config, *, name: str, out_path: Path, log_path: Path, timeout_s: float,
                 device: str | None = None, peak_tflops: float | None = None,
                 memory_limit_gb: float | None = None) -> dict:
    """Measure `cfg` in a fresh worker process and return its result record (never raises for a
    failed, crashed or hung point; KeyboardInterrupt kills the worker and propagates). The worker
    caps its CUDA allocator at `memory_limit_gb` GiB before it measures."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.unlink(missing_ok=True)
    ready = ready_path(out_path)
    ready.unlink(missing_ok=True)
    command = [*WORKER_COMMAND, "--out", str(out_path)]
    if device:
        command += ["--device", device]
    if peak_tflops:
        command += ["--peak-tflops", str(peak_tflops)]
    if memory_limit_gb:
        command += ["--memory-limit-gb", f"{memory_limit_gb:g}"]

    code = run_group(command, log_path, worker_env(name), timeout_s,
                     header=f"{name} {cfg.recompute.label}", stdin=json.dumps(cfg.to_dict()).encode(),
                     started=ready.exists)
    started = ready.exists()
    ready.unlink(missing_ok=True)
    if code is None:
        stack = tail_of(log_path, 40)
        where = innermost_frame(stack)
        failure = {"rank": 0, "step": None, "phase": None,
                   "message": (f"no result within the time limit of {timeout_s:g} s; the worker was killed"
                               if started else f"the worker did not start within {START_LIMIT_S:g} s; it was killed")
                              + (f" while in {where}" if where else ""),
                   "traceback": stack}
        return failed_record(cfg, "timeout", failure, device)
    if out_path.is_file():
        try:
            record = json.loads(out_path.read_text())
            out_path.unlink()
            return record
        except json.JSONDecodeError:
            pass
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    tail = tail_of(log_path)
    last = tail.splitlines()[-1] if tail else "no output"
    failure = {"rank": 0, "step": None, "phase": None,
               "message": f"worker ended with {how} and no result: {last}", "traceback": tail}
    return failed_record(cfg, "error", failure, device)
