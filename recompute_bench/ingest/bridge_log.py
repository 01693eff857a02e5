"""Megatron Bridge performance logs (`scripts/performance/setup_experiment.py` runs, the all-ranks
capture), format strings at Megatron-Bridge 067f987d:

- `Step Time : 7.45s GPU utilization: 704.1MODEL_TFLOP/s/GPU`, printed by rank 0 every log interval
  (`src/megatron/bridge/training/utils/train_utils.py`, `training_log`, line 1050);
- the iteration line Megatron-LM prints too (same function, lines 1089-1093: `elapsed time per
  iteration (ms)`, `lm loss`), by the last rank;
- `[Rank R] (after K iterations) memory (GB) | mem-allocated-gigabytes: ... | mem-max-allocated-gigabytes:
  ... | mem-max-reserved-gigabytes: ... | ...` (same function, line 1146, with `report_memory` and
  `MEMORY_KEYS`, line 166), printed by every rank with data-parallel rank 0 after the first two
  iterations; GB are 1e9 bytes (`report_memory` divides by 1.0e9), peaks since the process started;
- the configuration summary every run prints (`src/megatron/bridge/training/config.py`,
  `ConfigContainer.log_non_default_values`, line 1809): `[model] Non-default values (vs Mcore ...)`
  with `  name: repr  (Mcore default: repr)`, then `[train]:`, `[dataset]:`, ... with `  name: repr`.
  It states only the model values that differ from Megatron Core's `TransformerConfig` defaults, and
  nothing of the GPT model's own fields (vocabulary, position embedding, tied output layer), so a
  preset (`--workload`) supplies the model and the summary what this run changed;
- `Using preset vocab_size: N over the tokenizer vocab_size: T` (`src/megatron/bridge/training/setup.py`,
  `_validate_and_set_vocab_size`, line 778) or Megatron's ` > padded vocab (size: N) ...`: the vocabulary;
- a CUDA out-of-memory traceback (`ingest.lines`).
"""

from __future__ import annotations

import re
from pathlib import Path

from recompute_bench.ingest.lines import find_oom, parse_line, read_lines
from recompute_bench.ingest.megatron_log import ITERATION, ITERATION_START, LM_LOSS, PADDED_VOCAB
from recompute_bench.ingest.parsed import ParsedRun, RankMemory, Step, bad
from recompute_bench.ingest.values import printed_value

FORMAT = "megatron-bridge"
STEP_TIME_START = re.compile(r"Step Time :")
STEP_TIME = re.compile(r"Step Time : (?P<s>[\d.]+)s GPU utilization: (?P<tflops>[\d.]+)MODEL_TFLOP/s/GPU")
MEMORY_START = re.compile(r"\[Rank \d+\] \(after \d+ iterations\) memory \(GB\)")
MEMORY = re.compile(r"\[Rank (?P<rank>\d+)\] \(after (?P<after>\d+) iterations\) memory \(GB\)(?P<items>( \| [\w-]+: [\d.eE+-]+)+)\s*$")
ITEM = re.compile(r" \| (?P<key>[\w-]+): (?P<value>[\d.eE+-]+)")
SUMMARY = "Configuration Summary (Non-Default Values vs Megatron Core)"
SECTION = re.compile(r"^\[(?P<section>\w+)\]")
SETTING = re.compile(r"^  (?P<name>\w+): (?P<value>.*?)(?:  \(Mcore default: .*\))?$")
PRESET_VOCAB = re.compile(r"Using preset vocab_size: (?P<size>\d+) over the tokenizer vocab_size")
GB = 1e9
# The summary's sections whose values this reader takes, and the Megatron argument each becomes
# (the name Megatron-LM's argument parser stores; Megatron-Bridge scripts/translate_mlm_to_bridge.py
# maps the same pairs the other way). The model section's names are Megatron Core's TransformerConfig
# fields, which are the argument names already.
SECTION_ARGUMENTS = {
    ("train", "global_batch_size"): "global_batch_size",
    ("train", "micro_batch_size"): "micro_batch_size",
    ("dataset", "seq_length"): "seq_length",
    ("ddp", "use_distributed_optimizer"): "use_distributed_optimizer",
}


def detect(head: str) -> bool:
    """Whether text from the start of a file looks like a Megatron Bridge log."""
    return bool(STEP_TIME_START.search(head) or MEMORY_START.search(head) or SUMMARY in head)


def read(path: Path) -> ParsedRun:
    """Read one Megatron Bridge performance log."""
    lines = read_lines(path)
    run = ParsedRun(FORMAT, Path(path), timing="bridge", complete=False,
                    memory_rule="the last `memory (GB)` line of each rank: mem-max-allocated and mem-max-reserved "
                                "since the process started (GB = 1e9 bytes)")
    step_times, iterations = [], []
    section = None
    in_summary = False
    for line in lines:
        text = line.text
        if SUMMARY in text:
            in_summary, section = True, None
            continue
        if in_summary:
            if s := SECTION.match(text.strip()):
                section = s.group("section")
            elif (m := SETTING.match(text)) and section:
                name = m.group("name")
                argument = name if section == "model" else SECTION_ARGUMENTS.get((section, name))
                if argument:
                    run.arguments[argument] = printed_value(m.group("value"))
                    run.argument_lines[argument] = line.number
            elif text.startswith("=") and section is not None:
                in_summary = False
            continue
        if m := PRESET_VOCAB.search(text):
            run.arguments["padded_vocab_size"] = int(m.group("size"))
            run.argument_lines["padded_vocab_size"] = line.number
        elif m := PADDED_VOCAB.search(text):
            run.arguments["padded_vocab_size"] = int(m.group("padded"))
            run.argument_lines["padded_vocab_size"] = line.number
        elif STEP_TIME_START.search(text):
            step_times.append((line, parse_line(path, line, STEP_TIME, "Bridge `Step Time` line")))
        elif ITERATION_START.match(text):
            iterations.append((line, parse_line(path, line, ITERATION, "iteration line")))
        elif MEMORY_START.search(text):
            m = parse_line(path, line, MEMORY, "Bridge memory line")
            items = {i.group("key"): float(i.group("value")) for i in ITEM.finditer(m.group("items"))}
            gb = lambda key: items[key] * GB if key in items else None  # noqa: E731
            rank = int(m.group("rank"))
            retries = items.get("mem-alloc-retires")  # Bridge's spelling (MEMORY_KEYS)
            run.ranks[rank] = RankMemory(rank, line.number, after_step=int(m.group("after")),
                                         allocated_bytes=gb("mem-allocated-gigabytes"),
                                         peak_allocated_bytes=gb("mem-max-allocated-gigabytes"),
                                         reserved_bytes=gb("mem-reserved-gigabytes"),
                                         peak_reserved_bytes=gb("mem-max-reserved-gigabytes"),
                                         alloc_retries=None if retries is None else int(retries))
            run.memory_lines.append(run.ranks[rank])
    # Bridge's own parser pairs the n-th value with the n-th iteration line, step = iteration - 1
    # (`get_metrics_from_logfiles`); a log without iteration lines (rank 0's alone) counts steps from 0.
    for k, (line, m) in enumerate(step_times):
        it = iterations[k][1] if k < len(iterations) else None
        loss = LM_LOSS.search(iterations[k][0].text) if it else None
        run.steps.append(Step(int(it.group("step")) - 1 if it else k, line.number,
                              step_time_s=float(it.group("ms")) / 1e3 if it else float(m.group("s")),
                              tflops_per_gpu=float(m.group("tflops")), loss=float(loss.group("value")) if loss else None))
    run.failure = find_oom(lines)
    if not run.steps and run.failure is None:
        raise bad(path, None, "has no `Step Time : ...s GPU utilization: ...MODEL_TFLOP/s/GPU` line; import the log "
                              "of a run that trained at least one step")
    return run
