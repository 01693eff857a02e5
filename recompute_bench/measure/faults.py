"""Failures injected on purpose (`RECOMPUTE_BENCH_FAULT`), so the tests can show what a rank that runs
out of memory, hangs, is slow, is aborted by NCCL's watchdog or raises leaves in its record."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch

from recompute_bench.measure.record import FAULT_ENV


FAULT_DELAY_S = 3.0
"""How long a "delay" fault holds its rank."""


@dataclass(frozen=True)
class Fault:
    """A failure to inject, as RECOMPUTE_BENCH_FAULT says ("KIND:PHASE:STEP[@RANK]"; no "@RANK"
    means every rank, the rank being torchrun's RANK, 0 on a single-rank point). Phases: forward,
    backward, optimizer (inside a step) and write (after a step, before its piece is written). Read
    once per point (`from_env`), so the timed steps only ask whether there is one."""

    kind: str
    phase: str
    step: int
    rank: int | None
    spec: str

    @classmethod
    def from_env(cls) -> "Fault | None":
        spec = os.environ.get(FAULT_ENV)
        if not spec:
            return None
        where, _, rank = spec.partition("@")
        kind, phase, step = where.split(":")
        return cls(kind, phase, int(step), int(rank) if rank else None, spec)

    def at(self, phase: str, step: int) -> None:
        """Fail here if this is the phase, step and rank the fault names."""
        if phase != self.phase or step != self.step:
            return
        rank = int(os.environ.get("RANK", "0"))
        if self.rank is not None and self.rank != rank:
            return
        inject_fault(self.kind, self.spec, rank)


def inject_fault(kind: str, spec: str, rank: int) -> None:
    """Fail the way `kind` names: an OOM, a hang, a delay, the NCCL watchdog's abort, an error."""
    if kind == "oom":
        raise torch.OutOfMemoryError(f"CUDA out of memory (injected by {FAULT_ENV}={spec})")
    if kind == "hang":
        time.sleep(10**6)
    if kind == "delay":  # a slow rank, as a slow disk makes its piece write
        time.sleep(FAULT_DELAY_S)
        return
    if kind == "watchdog":
        # ProcessGroupNCCL's end under TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (its default): the watchdog
        # thread logs the timed-out work (`WorkNCCL::checkTimeout`, c10 LOG(ERROR) to stderr), then
        # rethrows from that thread (`WorkNCCL::handleException`): std::terminate, SIGABRT, no
        # Python exception on the main thread. Written here as torch writes it.
        sys.stderr.write(f"[rank{rank}]:[E1123 12:00:00.000000000 ProcessGroupNCCL.cpp:632] [PG ID 0 PG GUID 0(default_pg) "
                         f"Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, "
                         "NumelIn=1, NumelOut=1, Timeout(ms)=300000) ran for 300042 milliseconds before timing out.\n")
        sys.stderr.flush()
        os.abort()
    raise RuntimeError(f"injected failure ({FAULT_ENV}={spec})")
