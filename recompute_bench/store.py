"""The results store: append-only JSONL files, one record per line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .config import ConfigError

DEFAULT_RUNS_FILE = Path("results") / "runs.jsonl"


def append_record(path: Path, record: dict) -> None:
    """Append one record as one line, written with a single call on an O_APPEND descriptor, so a
    crash never leaves a half-written line behind a complete one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def load_records(path: Path) -> list[dict]:
    """Every record of a JSONL file; a corrupt line is bad input (ConfigError), naming file and line."""
    if not path.is_file():
        raise ConfigError(f"results file {path} does not exist; pass a JSONL file written by `recompute-bench run`")
    records = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n} is not a JSON record ({e.msg}); remove or repair that line") from None
    return records
