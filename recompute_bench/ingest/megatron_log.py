"""Megatron-LM training logs (stdout of `pretrain_gpt.py`), format strings at Megatron-LM d98e8a64:

- the argument dump, `------------------------ arguments ------------------------` then
  `  <name> <dots> <value>` per argument (`megatron/training/arguments.py`, `_print_args`): the run's
  whole configuration, Megatron's own names, printed with `str()`;
- ` > padded vocab (size: N) with D dummy tokens (new size: M)` (`megatron/training/vocab_utils.py`,
  `calculate_padded_vocab_size`): the padded vocabulary, which the dump leaves unset (it is printed
  before the tokenizer is built);
- ` [time] iteration N/ M | consumed samples: ... | elapsed time per iteration (ms): T |
  throughput per GPU (TFLOP/s/GPU): F | ... | lm loss: L | ...` (`megatron/training/training.py`,
  `training_log`), printed by the last rank;
- `[Rank R] (after K iterations) memory (MB) | allocated: ... | max allocated: ... | reserved: ... |
  max reserved: ...` (`megatron/training/utils/common_utils.py`, `report_memory`), printed by every
  rank with data-parallel rank 0, after the first two iterations (or every `--log-memory-interval`);
  MB are 2**20 bytes; the peaks count since the process started;
- a CUDA out-of-memory traceback (`ingest.lines`).
"""

from __future__ import annotations

import re
from pathlib import Path

from recompute_bench.ingest.lines import Line, find_oom, parse_line, read_lines
from recompute_bench.ingest.parsed import ParsedRun, RankMemory, Step, bad
from recompute_bench.ingest.values import printed_value

FORMAT = "megatron-lm"
ARGS_START = re.compile(r"^-+ arguments -+$")
ARGS_END = re.compile(r"^-+ end of arguments -+$")
ARGUMENT = re.compile(r"^  (?P<name>\w+) \.* ?(?P<value>.*)$")
PADDED_VOCAB = re.compile(r"> padded vocab \(size: (?P<size>\d+)\) with \d+ dummy tokens \(new size: (?P<padded>\d+)\)")
ITERATION_START = re.compile(r"^\s*(?:\[(?P<time>[^\]]*)\])?\s*iteration\s+\d+/")
ITERATION = re.compile(r"iteration\s+(?P<step>\d+)/\s*(?P<of>\d+) \|.*? elapsed time per iteration \(ms\): (?P<ms>[\d.]+) \|"
                       r".* number of nan iterations: +\d+ \|")  # the line's last field (RL runs append more)
THROUGHPUT = re.compile(r" throughput per GPU \(TFLOP/s/GPU\): (?P<value>[\d.]+) \|")
LM_LOSS = re.compile(r" lm loss: (?P<value>[-+\d.eEinfa]+) \|")
MEMORY_START = re.compile(r"\[Rank \d+\] \(after \d+ iterations\) memory \(MB\)")
MEMORY = re.compile(r"\[Rank (?P<rank>\d+)\] \(after (?P<after>\d+) iterations\) memory \(MB\) \| allocated: (?P<a>[\d.]+) "
                    r"\| max allocated: (?P<ma>[\d.]+) \| reserved: (?P<r>[\d.]+) \| max reserved: (?P<mr>[\d.]+)")
MB = 2**20


def detect(head: str) -> bool:
    """Whether text from the start of a file looks like a Megatron-LM training log."""
    return bool(re.search(r"^-+ arguments -+$", head, re.M) or re.search(r"\) memory \(MB\) \| allocated:", head))


def read_arguments(path: Path, lines: list[Line]) -> tuple[dict, dict]:
    """The argument dump: {name: value}, {name: line}; bad input when it is missing or cut short."""
    start = next((i for i, line in enumerate(lines) if ARGS_START.match(line.text.strip())), None)
    if start is None:
        raise bad(path, None, "has no argument dump (`---- arguments ----`), so the run's configuration is unknown; "
                              "import the log from its first line (rank 0 prints the dump before training)")
    arguments, where = {}, {}
    for line in lines[start + 1:]:
        if ARGS_END.match(line.text.strip()):
            return arguments, where
        m = ARGUMENT.match(line.text)
        if m:
            arguments[m.group("name")] = printed_value(m.group("value"))
            where[m.group("name")] = line.number
    raise bad(path, lines[-1].number, "the argument dump never ends (no `---- end of arguments ----`); "
                                      "the log is cut short: import the whole log")


def read(path: Path) -> ParsedRun:
    """Read one Megatron-LM training log."""
    lines = read_lines(path)
    run = ParsedRun(FORMAT, Path(path), timing="megatron", complete=True,
                    memory_rule="the last `report_memory` line of each rank: max allocated and max reserved since the "
                                "process started (MB = 2**20 bytes)")
    run.arguments, run.argument_lines = read_arguments(path, lines)
    for line in lines:
        text = line.text
        if (m := PADDED_VOCAB.search(text)) and run.arguments.get("padded_vocab_size") is None:
            # The dump is printed before the tokenizer is built, so it holds padded_vocab_size None.
            run.arguments["padded_vocab_size"] = int(m.group("padded"))
            run.argument_lines["padded_vocab_size"] = line.number
        elif ITERATION_START.match(text):
            m = parse_line(path, line, ITERATION, "Megatron iteration line")
            throughput, loss = THROUGHPUT.search(text), LM_LOSS.search(text)
            run.steps.append(Step(int(m.group("step")), line.number, step_time_s=float(m.group("ms")) / 1e3,
                                  tflops_per_gpu=float(throughput.group("value")) if throughput else None,
                                  loss=float(loss.group("value")) if loss else None))
            if run.time is None:
                run.time = ITERATION_START.match(text).group("time")
        elif MEMORY_START.search(text):
            m = parse_line(path, line, MEMORY, "Megatron memory line")
            rank = int(m.group("rank"))
            run.ranks[rank] = RankMemory(rank, line.number, after_step=int(m.group("after")),
                                         allocated_bytes=float(m.group("a")) * MB,
                                         peak_allocated_bytes=float(m.group("ma")) * MB,
                                         reserved_bytes=float(m.group("r")) * MB,
                                         peak_reserved_bytes=float(m.group("mr")) * MB)
            run.memory_lines.append(run.ranks[rank])
    run.failure = find_oom(lines)
    if not run.steps and run.failure is None:
        raise bad(path, None, "has no iteration line (` iteration N/ M | ...`); import a log of a run that trained "
                              "at least one step (the last rank prints them; a log of rank 0 alone has none "
                              "when pipeline parallel is on)")
    world = run.arguments.get("world_size")
    run.world_size = world if isinstance(world, int) else None
    return run
