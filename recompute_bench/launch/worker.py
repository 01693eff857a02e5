"""The process that measures one point: `python -m recompute_bench.launch.worker --out FILE < config.json`.

The launcher starts one worker per point, so an out-of-memory error, a crash or a leaked allocation
never reaches the next point, and the CUDA allocator starts fresh each time. The resolved config
comes as JSON on stdin (`Config.to_dict()`); the worker validates it again, runs
`measure.run_point`, and writes the result record to `--out` (through a rename, so the launcher
reads a whole record or none). Its stderr is the point's log. SIGUSR1 dumps every thread's Python
stack to stderr, which is how the launcher learns where a hung point was stuck.

The worker dies with the process that started it (`die_with_parent`), before anything else runs:
a killed sweep leaves no worker measuring in the background.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from recompute_bench.workload import config_from_dict

PARENT_PID_ENV = "RECOMPUTE_BENCH_PARENT_PID"
"""The pid of the process the worker must not outlive (set by launch.process)."""
PARENT_POLL_S = 0.5


def _exit_group() -> None:
    """Kill this worker and whatever it started: the whole process group when it leads one (the
    launcher starts it in a session of its own), else only itself."""
    sys.stderr.write(f"recompute-bench worker {os.getpid()}: its parent is gone; exiting\n")
    sys.stderr.flush()
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(parent_pid: int | None = None, poll_s: float = PARENT_POLL_S) -> None:
    """Exit, with the process group, as soon as `parent_pid` is no longer this process's parent
    (default: $RECOMPUTE_BENCH_PARENT_PID, else the parent it has now).

    Two guards, both set from inside the worker: Linux's parent-death signal (immediate, where
    prctl exists), and a daemon thread that compares os.getppid() with the original parent every
    `poll_s` seconds (any POSIX system; it also catches a parent that died before prctl was set,
    since the orphan is then re-parented to init or a subreaper).
    """
    if parent_pid is None:
        # Taken out of the environment: what this worker starts must not watch the sweep.
        parent_pid = int(os.environ.pop(PARENT_PID_ENV, None) or os.getppid())
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: fires when the parent (thread) exits
    except (OSError, AttributeError):  # not Linux: the polling thread alone does it
        pass
    if os.getppid() != parent_pid:  # the parent died before the guards were in place
        _exit_group()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent_pid:
                _exit_group()

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def ready_path(out: Path) -> Path:
    """The file a worker creates once it has started (imports done), beside its record `out`:
    the launcher's time limit for the point runs from then."""
    return out.with_name(out.name + ".ready")



def main(argv: list[str] | None = None) -> int:
    """Measure the point on stdin and write its record to --out; 0 when a record was written."""
    parser = argparse.ArgumentParser(prog="python -m recompute_bench.launch.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="file the result record is written to")
    parser.add_argument("--device", default=None, help="torch device; default CUDA when present")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU")
    parser.add_argument("--memory-limit-gb", type=float, default=None, help="cap of the CUDA allocator in GiB")
    args = parser.parse_args(argv)
    die_with_parent()
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)

    cfg = config_from_dict(json.load(sys.stdin))
    from recompute_bench.measure.memory import limit_memory
    from recompute_bench.measure.point import pick_device, run_point
    from recompute_bench.results.store import write_json_atomic

    ready_path(args.out).touch()
    device = pick_device(args.device)
    limit_memory(device, args.memory_limit_gb)  # before anything is allocated on it
    record = run_point(cfg, device=device, peak_tflops=args.peak_tflops)
    write_json_atomic(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
