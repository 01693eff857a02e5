"""The results store: append-only JSONL files, one record per line.

A sweep writes into its own folder, `results/<run-id>/`: `plan.json` (the points it will measure),
`results.jsonl` (one record appended per finished point), `logs/` (each point's stderr) and
`.lock` (held while the sweep runs).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import secrets
from pathlib import Path

from recompute_bench.config.schema import BadInput

# What json.loads returns, in JSON's own words, for the message about a line that is not an object.
_JSON_TYPES = {int: "number", float: "number", str: "string", list: "array", bool: "boolean", type(None): "null"}


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
    """Every record of a JSONL file, one JSON object per line. A line that is not UTF-8, not JSON or
    not an object is bad input (BadInput naming file:line); the file is only read."""
    if not path.is_file():
        raise BadInput(f"results file {path} does not exist; pass a JSONL file written by `recompute-bench run`")
    records = []
    # Bytes, decoded line by line: one bad byte must name its line, not end in a UnicodeDecodeError.
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadInput(f"{path}:{n} is not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                  "remove or repair that line") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise BadInput(f"{path}:{n} is not a JSON record ({e.msg}); remove or repair that line") from None
            if not isinstance(record, dict):
                raise BadInput(f"{path}:{n} is a JSON {_JSON_TYPES.get(type(record), 'value')}, not a record "
                                  "(a JSON object); remove or repair that line")
            records.append(record)
    return records


# ----- sweep runs: results/<run-id>/ ------------------------------------------------------------
RESULTS_FILE = "results.jsonl"
PLAN_FILE = "plan.json"
LOCK_FILE = ".lock"


def new_run_id() -> str:
    """A fresh run id: UTC time plus four random hex digits, so two sweeps started in the same
    second still get different folders."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{secrets.token_hex(2)}"


def check_run_id(run_id: str) -> str:
    """A run id names one folder under the results folder: no path separators, no leading dot."""
    if not run_id or run_id.startswith(".") or "/" in run_id or os.sep in run_id:
        raise BadInput(f"run id {run_id!r} must be a plain folder name (letters, digits, - and _); "
                          "pass for example --run-id nightly-1")
    return run_id


def write_json_atomic(path: Path, data) -> None:
    """Write a JSON document through a temporary file and a rename: readers see the old file or the
    new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


class RunLock:
    """An exclusive `fcntl.flock` on `<run dir>/.lock`, held for a whole sweep: a second sweep on the
    same run id is refused (BadInput naming the holder); other run ids have other locks. The
    kernel drops the lock when the holder dies, so a killed sweep never leaves a stale lock."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise BadInput(f"run {self.path.parent.name} is being written by another sweep (pid {holder}); "
                              "wait for it to finish or pass another --run-id") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def resolve_results(arg: str, results_dir: Path) -> Path:
    """A RESULTS argument -> a path: an existing file or folder as given, else a run id under
    `results_dir`."""
    path = Path(arg)
    if path.exists():
        return path
    run = Path(results_dir) / arg
    if "/" not in arg and run.is_dir():
        return run
    raise BadInput(f"results {arg} is neither a file, a folder nor a run id under {results_dir}/; "
                      "pass a run id printed by `recompute-bench sweep`, a results folder or a JSONL file")
