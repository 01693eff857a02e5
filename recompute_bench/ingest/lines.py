"""Reading log files as the launchers write them: rank prefixes, colour codes, the CUDA
out-of-memory error, and lines cut short.

A rank's uncaught exception is printed with every line prefixed `[rank<N>]: ` (torch
`distributed/distributed_c10d.py`, `init_process_group`: `_distributed_excepthook`, the global rank);
torchrun's `--tee` adds `[default<local rank>]:` (`distributed/elastic/multiprocessing/tail_log.py`)
and Slurm's `srun -l` adds `<task>: `. torchtitan colours its metric lines with ANSI escapes
(`torchtitan/components/metrics.py`, `Color`). The out-of-memory error is torch's
`torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ... GPU 0 has a total capacity of
79.11 GiB ...` (`torch.cuda.OutOfMemoryError` before torch 2.5), raised by the CUDA caching
allocator (c10/cuda/CUDACachingAllocator.cpp).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from recompute_bench.ingest.parsed import Failure, bad

ANSI = re.compile(r"\x1b\[[0-9;]*m")
PREFIX = re.compile(r"^(?:\d+:\s?)?(?:\[default(?P<local>\d+)\]:\s?)?(?:\[rank(?P<rank>\d+)\]:\s?)?")
OOM = re.compile(r"(?:torch\.(?:cuda\.)?)?OutOfMemoryError: CUDA out of memory\.(?P<rest>.*)")
CAPACITY = re.compile(r"has a total capacity of (?P<value>[\d.]+) (?P<unit>[KMGT]i?B)")
UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


@dataclass
class Line:
    """One line of a log: its number (from 1), the rank that printed it where a prefix says so,
    the text without prefix and colours, and whether it ended with a newline."""

    number: int
    rank: int | None
    text: str
    complete: bool


def read_lines(path: Path) -> list[Line]:
    """The lines of a log file. Bytes that are not UTF-8 become U+FFFD (logs mix NCCL and banner
    output; Megatron Bridge's own parser reads them the same way)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise bad(path, None, f"cannot be read ({e.strerror}); pass a readable log file") from None
    out = []
    for n, chunk in enumerate(raw.decode("utf-8", errors="replace").splitlines(keepends=True), 1):
        complete = chunk.endswith(("\n", "\r"))
        text = ANSI.sub("", chunk.rstrip("\r\n"))
        m = PREFIX.match(text)
        rank = m.group("rank")
        out.append(Line(n, int(rank) if rank is not None else None, text[m.end():], complete))
    return out


def find_oom(lines: list[Line]) -> Failure | None:
    """The first CUDA out-of-memory error in a log, with the rank its prefix names (None without one)
    and the capacity the message states."""
    for line in lines:
        m = OOM.search(line.text)
        if m:
            cap = CAPACITY.search(m.group("rest"))
            total = float(cap.group("value")) * UNITS[cap.group("unit")] if cap else None
            return Failure(rank=line.rank, line=line.number, message=line.text[m.start():].strip(),
                           device_total_bytes=total)
    return None


def parse_line(path: Path, line: Line, pattern: re.Pattern, what: str) -> re.Match:
    """`pattern` matched against a line that starts like `what`; bad input naming the line when it does
    not: a line cut short (the log's last line, without a newline) or one that is garbled."""
    m = pattern.search(line.text)
    if m:
        return m
    if not line.complete:
        raise bad(path, line.number, f"the last line is cut short (a {what} without its end); "
                                     "import the log once the run has finished writing it, or delete that line")
    raise bad(path, line.number, f"a {what} that does not parse: {line.text.strip()[:120]!r}; repair or delete that line")
