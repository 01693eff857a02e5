"""torchtitan training logs, format strings at torchtitan b5bcd76c:

- the metric line `step: 20  loss: 11.83506  grad_norm:  9.6669  memory: 48.87GiB(51.44%)  tps: 4,376
  tflops: 253.41  mfu: 25.62%` (`torchtitan/components/metrics.py`, `MetricsProcessor.log`, line 527),
  coloured with ANSI escapes. Every figure averages the steps since the previous metric line; `memory`
  is `max_reserved` since then (the peak counters are reset after each line), GiB = 2**30 bytes; the
  allocated peak is not printed; `tps` is tokens per second per GPU; `tflops` is torchtitan's own
  count (`num_flops_per_token x tps`), not Megatron's formula;
- `CUDA capacity: <device name> with 79.11GiB memory` (same file, `build_device_memory_monitor`, line 97);
- `Trainer is initialized with X tokens per DP rank, Y tokens per train step, gradient accumulation
  steps G, maximum context length S, ...` (`torchtitan/trainer.py`, line 621): checked against the
  preset that says what ran, since torchtitan's log states no model in Megatron's terms;
- the `[rank<N>]:` prefix of torchrun `--role rank --tee 3` (`run_train.sh`), a CUDA out-of-memory
  traceback (`ingest.lines`).
"""

from __future__ import annotations

import re
from pathlib import Path

from recompute_bench.ingest.lines import find_oom, parse_line, read_lines
from recompute_bench.ingest.parsed import ParsedRun, RankMemory, Step, bad

FORMAT = "torchtitan"
METRIC_START = re.compile(r"\bstep:\s*\d+\s+loss:")
METRIC = re.compile(r"\bstep:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+\d.eEnaif]+)\s+(?:grad_norm:\s*[-+\d.eEnaif]+\s+)?"
                    r"memory:\s*(?P<gib>[\d.]+)GiB\((?P<pct>[\d.]+)%\)\s+tps:\s*(?P<tps>[\d,]+)\s+"
                    r"tflops:\s*(?P<tflops>[\d,.]+)\s+mfu:\s*(?P<mfu>[\d.]+%|N/A)")
CAPACITY = re.compile(r"[A-Z]+ capacity: (?P<name>.+) with (?P<gib>[\d.]+)GiB memory")
TRAINER = re.compile(r"Trainer is initialized with (?P<per_dp>\d+) tokens per DP rank, (?P<per_step>\d+) tokens per "
                     r"train step, gradient accumulation steps (?P<accum>\d+), maximum context length (?P<context>\d+)")
GIB = 2**30


def detect(head: str) -> bool:
    """Whether text from the start of a file looks like a torchtitan log."""
    return bool(METRIC_START.search(re.sub(r"\x1b\[[0-9;]*m", "", head)) or "Trainer is initialized with" in head)


def read(path: Path) -> ParsedRun:
    """Read one torchtitan log."""
    lines = read_lines(path)
    run = ParsedRun(FORMAT, Path(path), timing="torchtitan", complete=False, peaks_since_start=False,
                    memory_rule="torchtitan's `memory` of the last metric line of each rank: max reserved since the "
                                "previous metric line (GiB = 2**30 bytes); max allocated is not printed")
    steps: dict[int, Step] = {}
    for line in lines:
        text = line.text
        if m := CAPACITY.search(text):
            run.device_name = m.group("name").strip()
        elif m := TRAINER.search(text):
            run.arguments["tokens_per_train_step"] = int(m.group("per_step"))
            run.arguments["max_context_length"] = int(m.group("context"))
            run.argument_lines.update(tokens_per_train_step=line.number, max_context_length=line.number)
        elif METRIC_START.search(text):
            m = parse_line(path, line, METRIC, "torchtitan metric line")
            # torchrun's --tee prefix names the rank; a log without one is a single process: rank 0.
            rank = line.rank if line.rank is not None else 0
            step = int(m.group("step"))
            loss = float(m.group("loss"))
            tps = float(m.group("tps").replace(",", ""))
            # Ranks log the same step with their own figures; the step's throughput is rank 0's line
            # (or the first rank's that logged it), as torchtitan's run_train.sh shows rank 0.
            if step not in steps or rank == 0:
                steps[step] = Step(step, line.number, loss=loss, tokens_per_s_per_gpu=tps,
                                   tflops_per_gpu=float(m.group("tflops").replace(",", "")))
            run.ranks[rank] = RankMemory(rank, line.number, after_step=step, peak_reserved_bytes=float(m.group("gib")) * GIB)
    run.steps = [steps[s] for s in sorted(steps)]
    run.failure = find_oom(lines)
    if not run.steps and run.failure is None:
        raise bad(path, None, "has no torchtitan metric line (`step: N  loss: ...  tps: ...  tflops: ...`); import the "
                              "log of a run that logged at least one step")
    return run
