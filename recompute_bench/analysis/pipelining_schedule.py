"""Pipeline schedules as the order of work on each pipeline rank: which model chunk runs which
micro-batch's forward (F), full backward (B), input-gradient backward (I) or weight-gradient
backward (W), and what each order means for memory and for the bubble. Pure Python.

The orders are those of torch 2.13's `torch.distributed.pipelining.schedules` (`run` measures with
it), written out so that `estimate` and `plan` need no torch; `tests/test_schedules.py` checks them
against torch's own `_calculate_single_rank_operations`. For 1F1B and the interleaved 1F1B they are
also Megatron's (`megatron/core/pipeline_parallel/schedules.py`: warm-up, then one forward and one
backward in turn, then the cool-down), when the micro-batches are a multiple of p.

Memory follows from an order (`walk`): a chunk-forward's saved tensors live from its F until its B,
or, split in two, until its W: torch's input-gradient pass runs `autograd.grad(...,
retain_graph=True)` (`stage_backward_input`), which frees nothing but the loss's saved tensors on the
last stage (it detaches the loss, the only reference to the loss's nodes), and the weight pass frees
the graph (measured: a chunk's saved bytes stay through I, but the loss's, and are gone after W).
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

from recompute_bench.config.choices import INTERLEAVED_SCHEDULES as INTERLEAVED
from recompute_bench.config.choices import V_SCHEDULES as V_SHAPED


class Action(NamedTuple):
    """One unit of work on a rank: `kind` F, B, I or W on virtual stage `stage` for micro-batch `microbatch`."""

    kind: str
    stage: int
    microbatch: int


def rank_stages(schedule: str, p: int, vp: int, rank: int) -> list[int]:
    """The virtual stages pipeline rank `rank` holds, in order (torch's `generate_rank_to_stage_mapping`)."""
    if schedule in V_SHAPED:
        return [rank, 2 * p - 1 - rank]
    return [rank + k * p for k in range(vp)]


def rank_actions(schedule: str, p: int, vp: int, n: int, rank: int) -> list[Action]:
    """The work of pipeline rank `rank` in one step of `n` micro-batches, in the order it runs."""
    if schedule == "GPipe":  # ScheduleGPipe._step_microbatches: every forward, then every backward
        return [Action("F", rank, i) for i in range(n)] + [Action("B", rank, i) for i in range(n)]
    if schedule == "1F1B":
        return _one_f_one_b(p, n, rank)
    if schedule in INTERLEAVED:
        return _interleaved(p, vp, n, rank, zero_bubble=schedule == "InterleavedZeroBubble")
    if schedule == "ZBVZeroBubble":
        return _zbv(p, n, rank)
    if schedule == "DualPipeV":
        return _dualpipev(p, n, rank)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def _one_f_one_b(p: int, n: int, rank: int) -> list[Action]:
    """Schedule1F1B._step_microbatches: min(n, p - r) forwards, then a backward and a forward in turn
    (Megatron warms up with one forward fewer and starts its steady state with a forward: the same order)."""
    out = [Action("F", rank, i) for i in range(min(n, p - rank))]
    f, b = len(out), 0
    while True:
        out.append(Action("B", rank, b))
        b += 1
        if f == n:
            break
        out.append(Action("F", rank, f))
        f += 1
    out += [Action("B", rank, i) for i in range(b, n)]
    return out


def _interleaved(p: int, vp: int, n: int, rank: int, zero_bubble: bool) -> list[Action]:
    """`_get_1f1b_rank_ops` as ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble call it:
    the micro-batches go in rounds of `per_round` (p when p divides n), each round through chunk 0,
    then chunk 1, ...; warm-up `(vp - 1) per_round + 2 (p - 1 - r)` chunk-forwards (zero bubble:
    `+ (p - 1 - r)`, and a W for each I from the r-th steady-state step on, the rest at the end)."""
    rounds = max(1, n // p)
    per_round = n // rounds
    warmup = min((vp - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), n * vp)
    steady = n * vp - warmup

    def forward_stage(op: int) -> int:
        return (op // per_round) % vp * p + rank

    def backward_stage(op: int) -> int:
        return (vp - 1 - (op - warmup) // per_round % vp) * p + rank

    counts: dict[tuple[str, int], int] = {}

    def take(kind: str, stage: int) -> Action:
        i = counts.get((kind, stage), 0)
        counts[(kind, stage)] = i + 1
        return Action(kind, stage, i)

    out: list[Action] = []
    backward_ops: list[int] = []
    weights = 0
    for op in range(warmup + steady + warmup):
        if op < warmup + steady:
            out.append(take("F", forward_stage(op)))
        if op >= warmup:
            out.append(take("I" if zero_bubble else "B", backward_stage(op)))
            backward_ops.append(op)
            if zero_bubble and op - warmup >= rank:
                out.append(take("W", backward_stage(backward_ops[weights])))
                weights += 1
    while zero_bubble and weights < len(backward_ops):
        out.append(take("W", backward_stage(backward_ops[weights])))
        weights += 1
    return out


def _zbv(p: int, n: int, rank: int) -> list[Action]:
    """ScheduleZBVZeroBubble._calculate_single_rank_operations: written for at least 2p - 1
    micro-batches; the actions of the ones beyond n are dropped."""
    chunk0, chunk1 = rank, 2 * p - 1 - rank
    n_micro = max(2 * p - 1, n)
    out: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - rank) - 1):
        out.append(Action("F", chunk0, f0))
        f0 += 1
    for _ in range(rank):
        out += [Action("F", chunk1, f1), Action("F", chunk0, f0)]
        f0, f1 = f0 + 1, f1 + 1
    for _ in range(p - rank):
        out += [Action("F", chunk1, f1), Action("I", chunk1, b1), Action("W", chunk1, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n_micro:
        if f0 < n_micro:
            out.append(Action("F", chunk0, f0))
            f0 += 1
        out += [Action("I", chunk0, b0), Action("W", chunk0, b0)]
        b0 += 1
        out += [Action("F", chunk1, f1), Action("I", chunk1, b1), Action("W", chunk1, b1)]
        f1, b1 = f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        out += [Action("I", chunk0, b0), Action("I", chunk1, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(p - rank):
        out += [Action("I", chunk0, b0), Action("W", chunk0, w0)]
        b0, w0 = b0 + 1, w0 + 1
    out += [Action("W", chunk1, i) for i in range(w1, b1)] + [Action("W", chunk0, i) for i in range(w0, b0)]
    return [a for a in out if a.microbatch < n]


def _dualpipev(p: int, n: int, rank: int) -> list[Action]:
    """ScheduleDualPipeV._calculate_single_rank_operations (an overlapped forward-backward pair runs
    its forward first); a full backward counts as its I and its W at once."""
    chunk0, chunk1 = rank, 2 * p - 1 - rank
    counts: dict[tuple[int, str], int] = {}
    pending: list[tuple[int, int]] = []  # (stage, micro-batch) of I's whose W is still to run
    out: list[Action] = []

    def add(stage: int, kind: str) -> None:
        key = (stage, "I" if kind == "B" else kind)
        i = counts.get(key, 0)
        out.append(Action(kind, stage, i))
        counts[key] = i + 1
        if kind == "B":
            counts[(stage, "W")] = counts.get((stage, "W"), 0) + 1
        elif kind == "I":
            pending.append((stage, i))

    def weight() -> None:
        if pending:
            stage, i = pending.pop(0)
            out.append(Action("W", stage, i))

    for _ in range(2 * (p - rank - 1)):
        add(chunk0, "F")
    for _ in range(rank + 1):
        add(chunk0, "F")
        add(chunk1, "F")
    for _ in range(p - rank - 1):
        add(chunk1, "I")
        weight()
        add(chunk1, "F")
    for _ in range(n - 2 * p + rank + 1):  # torch overlaps each pair (or, first on the last rank, not): same order
        add(chunk0, "F")
        add(chunk1, "B")
        add(chunk1, "F")
        add(chunk0, "B")
    for _ in range(p - rank - 1):
        add(chunk1, "B")
        add(chunk1, "F")
        add(chunk0, "B")
    split = False
    steps = rank + 1
    for i in range(steps):
        if i == steps // 2 and rank % 2 == 1:
            split = True
        add(chunk1, "I" if split else "B")
        if i == steps // 2 and rank % 2 == 0:
            split = True
        add(chunk0, "I" if split else "B")
    for _ in range(p - rank - 1):
        weight()
        add(chunk0, "I" if split else "B")
    for _ in range(rank + 1):
        weight()
    return out


class Walk(NamedTuple):
    """What a rank's order holds (`walk`): after a forward, and during a backward."""

    saved_peak: float
    """The most held at once right after a forward (the saved tensors of every chunk-forward not yet freed)."""
    held: dict[int, int]
    """Chunk-forwards held then, by virtual stage (the first time that most is held)."""
    backward_peak: float
    """The most held during a backward: all that is held then plus that chunk's own transient."""
    in_backward: int | None
    """The virtual stage whose backward gives `backward_peak` (None: no backward)."""


def walk(actions: Iterable[Action], stored: Callable[[int], float], transient: Callable[[int], float] = lambda _: 0.0,
         freed_at_input: Callable[[int], float] = lambda _: 0.0) -> Walk:
    """Follow a rank's order with each chunk-forward weighing `stored(stage)`: F adds it, B frees it,
    I adds `transient(stage)` while it runs and frees `freed_at_input(stage)` (torch keeps the graph
    for W, all but what hangs below the stage's output: the loss, whose tensor it detaches), W frees
    the rest."""
    live, held = 0.0, {}
    saved_peak, at_peak = 0.0, {}
    backward_peak, in_backward = 0.0, None
    for a in actions:
        if a.kind == "F":
            live += stored(a.stage)
            held[a.stage] = held.get(a.stage, 0) + 1
            if live > saved_peak:
                saved_peak, at_peak = live, dict(held)
            continue
        if a.kind in ("B", "I") and live + transient(a.stage) > backward_peak:
            backward_peak, in_backward = live + transient(a.stage), a.stage
        if a.kind == "I":
            live -= freed_at_input(a.stage)
        elif a.kind == "B":
            live -= stored(a.stage)
            held[a.stage] -= 1
        elif a.kind == "W":
            live -= stored(a.stage) - freed_at_input(a.stage)
            held[a.stage] -= 1
    return Walk(saved_peak, at_peak, backward_peak, in_backward)


def peak_chunks(actions: list[Action]) -> dict[int, int]:
    """The chunk-forwards held, by virtual stage, at the first moment the most are held (every chunk
    weighing alike)."""
    return walk(actions, lambda _: 1.0).held


def bubble_fraction(schedule: str, p: int, vp: int, n: int) -> float:
    """The schedule's theoretical bubble: the share of the step a rank idles when a chunk's forward
    takes 1/vp of a stage's forward, its full backward twice that, and I and W one each (the
    zero-bubble papers' time model), simulated over every rank's order with the pipeline's
    dependencies. 1F1B and GPipe give (p - 1)/(n + p - 1), the interleaved 1F1B (p - 1)/(n vp + p - 1)
    (tested)."""
    orders = {r: rank_actions(schedule, p, vp, n, r) for r in range(p)}
    chunks = len(rank_stages(schedule, p, vp, 0))
    stages = p * chunks
    cost = {"F": 1.0 / chunks, "B": 2.0 / chunks, "I": 1.0 / chunks, "W": 1.0 / chunks}
    done: dict[tuple[str, int, int], float] = {}  # ("F" or "G" (input gradient), stage, micro-batch) -> finish

    def ready(a: Action) -> float | None:
        """When `a` may start as far as other ranks go, or None while a dependency is not done."""
        if a.kind == "F":
            return 0.0 if a.stage == 0 else done.get(("F", a.stage - 1, a.microbatch))
        if a.kind == "W":
            return done.get(("G", a.stage, a.microbatch))
        return done.get(("F", a.stage, a.microbatch) if a.stage == stages - 1 else ("G", a.stage + 1, a.microbatch))

    clock, position = [0.0] * p, [0] * p
    remaining = sum(len(o) for o in orders.values())
    while remaining:
        progressed = False
        for r in range(p):
            while position[r] < len(orders[r]):
                a = orders[r][position[r]]
                start = ready(a)
                if start is None:
                    break
                clock[r] = max(clock[r], start) + cost[a.kind]
                done[("F" if a.kind == "F" else "W" if a.kind == "W" else "G", a.stage, a.microbatch)] = clock[r]
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} deadlocks for p={p}, vp={vp}, n={n}")  # a wrong order, not bad input
    makespan = max(clock)
    busy = n * 3.0  # every rank runs each micro-batch's forward and backward through its chunks once
    return 1 - busy / makespan
