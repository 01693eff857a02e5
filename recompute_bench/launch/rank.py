"""What torchrun runs: `python -m recompute_bench.launch.rank agent ...` is the launcher process
(torch.distributed.run, which dies with the recompute-bench process that started it), and
`python -m recompute_bench.launch.rank measure --pieces DIR ...` is each rank, started by it
(`... verify --pieces DIR` runs `verify` over the ranks instead).

A rank reads the resolved config from `DIR/config.json`, measures its share of the point
(`measure.distributed.measure_rank`), and writes `DIR/rank<N>.json` after every step. A rank that
ran out of memory or failed exits 1 after writing its piece (through `destroy_process_group`,
bounded in time), so torchrun tears the group down instead of leaving its peers waiting in a
collective; the traceback of an uncaught error goes to torchrun's per-rank error file
(`elastic.multiprocessing.errors.record`). SIGUSR1 dumps every thread's stack to the log, as the
single-rank worker does.

Every process here dies with the one that started it (`launch.worker.die_with_parent`): the agent
with the recompute-bench process, and each rank with the agent. torchrun starts each rank in a
session of its own (torch/distributed/elastic/multiprocessing/subprocess_handler, `start_new_session`),
so killing the agent's process group (a point's time limit, Ctrl-C) or the agent dying with a killed
sweep does not reach the ranks: without their own guard they measured on, holding their GPU memory
and NCCL communicators, and every later point ran out of memory or hung.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
from pathlib import Path


def agent(argv: list[str]) -> int:
    """torchrun, tied to the process that started it (a killed sweep leaves no ranks behind).
    `agent --exits FILE TORCHRUN-ARGS...`: when a rank fails, FILE gets torchrun's verdict on each
    failed rank (`exits_of`), which the launcher reads to tell a killed rank from its peers."""
    from recompute_bench.launch.worker import PARENT_PID_ENV, die_with_parent
    die_with_parent()
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # the ranks torchrun starts watch this process
    exits = None
    if argv[:1] == ["--exits"]:
        exits, argv = Path(argv[1]), argv[2:]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    try:
        torchrun(argv)
    except ChildFailedError as e:
        if exits is not None:
            from recompute_bench.results.store import write_json_atomic
            write_json_atomic(exits, exits_of(e))
        raise
    return 0


def exits_of(failed) -> dict:
    """What torchrun knows of each failed rank (`ChildFailedError.failures`, by global rank): its exit
    code, the signal that ended it ("SIGKILL"; None for an exit code), and which failure torchrun
    observed first (`get_first_failure`, the root cause; the others it stopped, with SIGTERM)."""
    first, _ = failed.get_first_failure()
    return {"first": first, "ranks": {str(rank): {"local_rank": f.local_rank, "exitcode": f.exitcode,
                                                  "signal": f.signal_name() if f.exitcode < 0 else None}
                                      for rank, f in failed.failures.items()}}


def verify(argv: list[str]) -> int:
    """`verify` over the ranks: DIR/verify-in.json holds the config, the settings and the backends;
    rank 0 writes DIR/verify.json (`measure.distributed.verify_ranks`)."""
    parser = argparse.ArgumentParser(prog="python -m recompute_bench.launch.rank verify")
    parser.add_argument("--pieces", type=Path, required=True)
    parser.add_argument("--data-parallel", default="ddp")
    parser.add_argument("--device", default=None)
    parser.add_argument("--watchdog-s", type=float, default=300.0)
    args, _ = parser.parse_known_args(argv)
    _die_with_agent()
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def run() -> int:
        import torch.distributed as dist
        from recompute_bench.workload import config_from_dict
        from recompute_bench.measure.distributed import init_process_group, rank_device, verify_ranks
        from recompute_bench.measure.verify import deterministic
        from recompute_bench.results.store import write_json_atomic
        from recompute_bench.config.schema import RecomputeConfig

        given = json.loads((args.pieces / "verify-in.json").read_text())
        cfg = config_from_dict(given["config"])
        device = rank_device(args.device)
        with deterministic(device):  # before the process group: NCCL then leaves out its NVLS reductions
            init_process_group(device, args.watchdog_s)
            result = verify_ranks(cfg, [RecomputeConfig(**r) for r in given["settings"]], given["backends"], device,
                                  args.data_parallel)
        if dist.get_rank() == 0:
            write_json_atomic(args.pieces / "verify.json", result)
        dist.destroy_process_group()
        return 0

    return run()


def measure(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m recompute_bench.launch.rank measure")
    parser.add_argument("--pieces", type=Path, required=True, help="folder of config.json and the rank pieces")
    parser.add_argument("--data-parallel", default="ddp")
    parser.add_argument("--device", default=None)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--memory-limit-gb", type=float, default=None)
    parser.add_argument("--watchdog-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    _die_with_agent()
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)

    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def run() -> int:
        from recompute_bench.workload import config_from_dict
        from recompute_bench.measure.distributed import leave_group, measure_rank

        cfg = config_from_dict(json.loads((args.pieces / "config.json").read_text()))
        rank = int(os.environ["RANK"])
        piece = measure_rank(cfg, data_parallel=args.data_parallel, piece_path=args.pieces / f"rank{rank}.json",
                             device=args.device, peak_tflops=args.peak_tflops, memory_limit_gb=args.memory_limit_gb,
                             watchdog_s=args.watchdog_s)
        # A failed rank exits 1 (torchrun then stops the peers, which may wait for it in a
        # collective), through destroy_process_group like a finished one; where that does not
        # return, the process leaves without the exit handlers that would wait on it again.
        code = 0 if piece["rank_entry"]["status"] == "ok" else 1
        if not leave_group():
            sys.stderr.flush()
            os._exit(code)
        return code

    return run()


def _die_with_agent() -> None:
    """A rank ends with torchrun's agent, before it imports torch (see the module docstring): the
    agent's pid comes in the environment (`agent` sets it), else the rank's parent is taken."""
    from recompute_bench.launch.worker import die_with_parent
    die_with_parent()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    programs = {"agent": agent, "measure": measure, "verify": verify}
    if not argv or argv[0] not in programs:
        sys.stderr.write("usage: python -m recompute_bench.launch.rank {agent|measure|verify} ...\n")
        return 2
    return programs[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
