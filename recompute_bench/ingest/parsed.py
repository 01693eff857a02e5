"""What a reader takes from one file before it becomes a record: the run's stated settings under
Megatron's argument names, its steps, its ranks' memory and its failure. Readers fill a `ParsedRun`;
`ingest.record` turns it into a result record. Bytes and seconds here, as everywhere inside.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recompute_bench.config.schema import BadInput


@dataclass
class Step:
    """One logged training step."""

    step: int
    """The step number as the source counts it (Megatron's iteration from 1, Bridge's step from 0)."""
    line: int
    step_time_s: float | None = None
    tflops_per_gpu: float | None = None
    """As the source computed it (Megatron's model-FLOPs formula for Megatron-LM and Bridge)."""
    loss: float | None = None
    tokens_per_s_per_gpu: float | None = None


@dataclass
class RankMemory:
    """A memory report of one rank (the allocator's counters since the process started)."""

    rank: int
    line: int
    after_step: int | None = None
    allocated_bytes: float | None = None
    peak_allocated_bytes: float | None = None
    reserved_bytes: float | None = None
    peak_reserved_bytes: float | None = None
    alloc_retries: int | None = None


@dataclass
class Failure:
    """How the run ended when it did not finish: a CUDA out-of-memory error on a rank."""

    rank: int | None
    line: int
    message: str
    step: int | None = None
    """The step that was running: one after the last step the log completed."""
    device_total_bytes: float | None = None
    """The GPU's capacity as the error states it ("GPU 0 has a total capacity of 79.11 GiB")."""


@dataclass
class ParsedRun:
    """Everything one file says about one run."""

    format: str
    path: Path
    timing: str
    """The source's convention for choosing the measured steps: megatron, bridge or torchtitan (`ingest.timing`)."""
    arguments: dict[str, Any] = field(default_factory=dict)
    """The settings the file states, under Megatron's argument names (underscored: `num_layers`)."""
    argument_lines: dict[str, int] = field(default_factory=dict)
    """Where each argument was read (a line of `config_file` when that is set, else of `path`)."""
    complete: bool = False
    """Whether `arguments` is a whole Megatron argument list (Megatron's defaults fill the rest), or only
    what the file happens to state (a preset must give the rest)."""
    config_file: Path | None = None
    steps: list[Step] = field(default_factory=list)
    ranks: dict[int, RankMemory] = field(default_factory=dict)
    memory_lines: list[RankMemory] = field(default_factory=list)
    """Every memory line, in the file's order (`ranks` keeps each rank's last): Bridge prints one per
    rank after iterations 1 and 2, Megatron after the first log interval and every
    --log-memory-interval; each peak counts since the process started."""
    failure: Failure | None = None
    device_name: str | None = None
    world_size: int | None = None
    name: str | None = None
    """A workload name the source gives (a Megatron functional-test case)."""
    peaks_since_start: bool = True
    """Whether the ranks' peaks count since the process started (Megatron, Bridge) rather than since the
    previous report (torchtitan resets them after each metric line)."""
    memory_rule: str = ""
    """Which memory figure the record's peaks are, in words."""
    peaks: dict[str, float | None] = field(default_factory=dict)
    """Memory of the run that no rank is named for (`peak_allocated_bytes`, `peak_reserved_bytes`,
    `allocated_bytes`): a Bridge golden's figures."""
    time: str | None = None
    """When the run logged its first step, as the log writes it."""
    argument_keys: dict[str, str] = field(default_factory=dict)
    """The file's own name of an argument where it is not Megatron-LM's flag (Bridge's
    `model.transformer.fp8`), for messages."""
    env: dict[str, Any] = field(default_factory=dict)
    """The environment the file says the run had (a model_config.yaml's ENV_VARS, Bridge's env_vars,
    the assignments before a command line): CUBLAS_WORKSPACE_CONFIG sizes torch's workspaces."""

    def where(self, argument: str) -> str:
        """"file:line" of an argument (the file alone when the line is unknown)."""
        source = self.config_file or self.path
        line = self.argument_lines.get(argument)
        return f"{source}:{line}" if line else str(source)


def bad(path: Path | str, line: int | None, message: str) -> BadInput:
    """Bad input in a file: one line naming the file (and line), the problem and the fix."""
    return BadInput(f"{path}:{line}: {message}" if line else f"{path}: {message}")
