"""The pipeline schedule: in what order one stage runs the forward and backward passes of a step,
and so how many model-chunk forwards wait for their backward at once. Megatron's schedules
(megatron/core/pipeline_parallel/schedules.py), which both frameworks' estimates follow. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from recompute_bench.config.schema import Config

Pass = tuple[str, int, int]
"""("F" or "B", micro-batch, model chunk)."""


def schedule(cfg: Config, stage: int) -> list[Pass]:
    """The passes pipeline stage `stage` runs in a step, in order.

    - No pipelining (`forward_backward_no_pipelining`): each micro-batch's forward, then its backward.
    - 1F1B (`forward_backward_pipelining_without_interleaving`): min(n, p - r - 1) warm-up forwards,
      then one forward and one backward at a time, then the remaining backwards.
    - Interleaved, vp model chunks per rank (`forward_backward_pipelining_with_interleaving`,
      `get_pp_rank_microbatches`): (p - r - 1) x 2 + (vp - 1) x group warm-up chunk forwards (all
      n x vp when that is more), group = microbatch_group_size_per_vp_stage, Megatron's default p;
      forwards in `get_schedule_table` order (a group of micro-batches through chunk 0, then chunk
      1, ...), backwards in the same order over the chunks reversed."""
    par = cfg.parallel
    p, vp, n = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1, cfg.num_microbatches
    if p == 1:
        return [ev for mb in range(n) for ev in (("F", mb, 0), ("B", mb, 0))]
    if vp == 1:
        table = [(mb, 0) for mb in range(n)]
        backward_table, warmup = table, min(n, p - stage - 1)
    else:
        # microbatch_group_size_per_vp_stage (ModelParallelConfig: None means p)
        group, table = par.microbatch_group_size_per_vp_stage or p, []
        for first in range(0, n, group):
            last = n if first + group >= n else first + group
            table += [(mb, chunk) for chunk in range(vp) for mb in range(first, last)]
        backward_table = [(mb, vp - 1 - chunk) for mb, chunk in table]
        warmup = min(n * vp, (p - stage - 1) * 2 + (vp - 1) * group)
    events = [("F", *table[i]) for i in range(warmup)]
    for k in range(len(table) - warmup):
        events += [("F", *table[warmup + k]), ("B", *backward_table[k])]
    return events + [("B", *backward_table[k]) for k in range(len(table) - warmup, len(table))]


def chunk_forwards_in_flight(cfg: Config, stage: int) -> int:
    """The most model-chunk forwards stage `stage` holds at once (their activations wait for their
    backward): 1F1B min(n, p - r); interleaved, the warm-up count plus one. The last stage of an
    interleaved pipeline holds (vp - 1) x p + 1, not 1."""
    held = most = 0
    for kind, _, _ in schedule(cfg, stage):
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


@dataclass(frozen=True)
class SchedulePeak:
    """The most a stage's passes hold at once, and its parts."""

    total: float
    others: float
    """Stored by the chunk forwards waiting for their backward, other than the pass at the peak."""
    own: float
    """Stored by the pass at the peak (its chunk's activations)."""
    transient: float
    """What the pass at the peak holds beyond what it stores (recompute, loss, gradients)."""
    chunk: int
    """The model chunk of the pass at the peak."""
    kind: str = "B"
    """Whether the peak is in that chunk's forward ("F") or backward ("B")."""
    retained: float = 0.0
    """Kept by earlier backwards until the step ends (deferred weight-gradient buffers)."""
    held: tuple[int, ...] = ()
    """The model chunk of every forward whose activations are held at the peak, the pass at the
    peak's own included (what `others + own` stores)."""


def schedule_peak(cfg: Config, stage: int, stored: Callable[[int], float],
                  backward: Callable[[int], float], forward: Callable[[int], float] = lambda c: 0.0,
                  retained: Callable[[int, int], float] = lambda mb, c: 0.0) -> SchedulePeak:
    """The peak over a stage's schedule: a chunk's forward adds `stored(chunk)` until its backward,
    which holds `backward(chunk)` more than that at its most; a forward may hold `forward(chunk)`
    more than it stores while it runs (the loss's fp32 logits); a backward may leave
    `retained(micro-batch, chunk)` held until the step ends (deferred weight gradients)."""
    held = kept = 0.0
    best, chunks = SchedulePeak(0.0, 0.0, 0.0, 0.0, 0), []
    for kind, mb, c in schedule(cfg, stage):
        own = stored(c)
        if kind == "F":
            extra, others = forward(c), held
            held += own
            chunks.append(c)
            now = tuple(chunks)
        else:
            extra, others = backward(c), held - own
            now = tuple(chunks)
            held -= own
            chunks.remove(c)
        if others + own + extra + kept > best.total:
            best = SchedulePeak(others + own + extra + kept, others, own, extra, c, kind, kept, now)
        if kind == "B":
            kept += retained(mb, c)
    return best
