"""Which logged steps a record's step time and TFLOP/s come from: each source's own convention, so an
imported figure is the one that source's own checks would compare.

- megatron (Megatron-LM logs and `golden_values_*.json`): Megatron's functional tests compare the
  **median** iteration time over a steady window after warm-up: steps 5..20 when the last finite
  step is at most 25, else 30..45; when no step falls in it, the first four steps from the window's
  start (Megatron-LM `tests/functional_tests/python_test_utils/common.py`, `pipeline`, the
  `iteration-time` branch).
- bridge (Megatron Bridge logs and golden JSON): Bridge's performance check averages (**mean**) GPU
  utilization over the steps from `max(1, int(n * skip_first_percent_time))` to the end, n the number
  of steps, with `--skip_first_percent_time` 0.70 by default: steps 35..49 of 50 (Megatron-Bridge
  `scripts/performance/utils/evaluate.py`, `validate_performance`; the default in
  `scripts/performance/argument_parser.py`).
- torchtitan: each metric line already averages the steps since the previous one; torchtitan's own
  guidance reads steady state off the **last** logged step (torchtitan
  `experiments/graph_trainer/.claude/CLAUDE.md`, "Look at the last logged step").
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

from recompute_bench.ingest.parsed import Step

BRIDGE_SKIP_FIRST_PERCENT_TIME = 0.70


@dataclass
class Window:
    """The steps a figure comes from, how they are combined, and the rule in words."""

    steps: list[Step]
    combine: Callable[[list[float]], float]
    rule: str

    def value(self, name: str) -> float | None:
        """The combined figure `name` of the window's steps (None when no step has it)."""
        values = [getattr(s, name) for s in self.steps]
        values = [v for v in values if v is not None and math.isfinite(v)]
        return self.combine(values) if values else None


def megatron_window(steps: list[Step]) -> Window:
    """Megatron's steady window, median."""
    finite = [s for s in steps if s.step_time_s is not None and math.isfinite(s.step_time_s)]
    if not finite:
        return Window([], statistics.median, "no step with a time")
    last = max(s.step for s in finite)
    window = range(5, 21) if last <= 25 else range(30, 46)
    chosen = [s for s in finite if s.step in window]
    rule = f"median over steps {window.start}..{window.stop - 1} (Megatron's functional-test window)"
    if not chosen:
        chosen = [s for s in finite if s.step >= window.start][:4]
        rule = f"median over the first four steps from {window.start} (Megatron's rule when the run is shorter)"
    return Window(chosen, statistics.median, rule)


def bridge_window(steps: list[Step], skip_first_percent_time: float = BRIDGE_SKIP_FIRST_PERCENT_TIME) -> Window:
    """Megatron Bridge's window: the last 30% of the steps (at least all but the first), mean."""
    ordered = sorted(steps, key=lambda s: s.step)
    start = max(1, int(len(ordered) * skip_first_percent_time))
    return Window(ordered[start:], statistics.fmean,
                  f"mean over steps [{start}:{len(ordered)}] of {len(ordered)} (Megatron Bridge skips the first "
                  f"{100 * skip_first_percent_time:g}%)")


def torchtitan_window(steps: list[Step]) -> Window:
    """torchtitan's last logged step (itself an average over the steps since the previous log)."""
    last = max(steps, key=lambda s: s.step)
    return Window([last], lambda values: values[-1], f"the last logged step ({last.step}), torchtitan's steady state")


WINDOWS = {"megatron": megatron_window, "bridge": bridge_window, "torchtitan": torchtitan_window}


def window(timing: str, steps: list[Step]) -> Window:
    """The window of a source's convention (`ParsedRun.timing`)."""
    return WINDOWS[timing](steps)
