"""Golden files: one CSV per hardware kind, read (with a clear line for a corrupt or older file),
written atomically, and updated from results.

A golden row is keyed by `results.KEY_COLUMNS` (the workload and every resolved model, training,
parallel and recompute field except warm-up and measured steps) and carries `config_hash` (a hash
of the record's config as written), `status` (ok or oom), the metrics of `gate.metrics.METRICS`,
an optional `tolerance` column of per-row overrides ("tflops_per_gpu:10%;loss:2%") and provenance
(`device_name`, `torch_version`, `package_version`, `git_sha`, `measured_at`, `run_id`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from recompute_bench.gate.metrics import METRICS
from recompute_bench.gate.tolerances import parse_tolerances
from recompute_bench.gate.verdicts import older_row_key, row_key
from recompute_bench.results.rows import KEY_COLUMNS, key_text
from recompute_bench.config.schema import BadInput
from recompute_bench.config.fields import LATER_KEYS, field as registry_field

PROVENANCE_COLUMNS = ("device_name", "torch_version", "package_version", "git_sha", "measured_at", "run_id")
GOLDEN_COLUMNS = ("setting", *KEY_COLUMNS, "config_hash", "status", *METRICS, "tolerance", *PROVENANCE_COLUMNS)
# Without these a file is no golden at all; key columns it lacks make it a golden of an older key.
REQUIRED_COLUMNS = ("workload", "config_hash", "status", "device_name", "torch_version")
# Marks a row read from a golden written with fewer key columns: the key columns that file has.
OLDER_KEY = "older_key_columns"
GOLDEN_STATUSES = ("ok", "oom")


def golden_path_for(device_kind: str, results_dir: Path = Path("results")) -> Path:
    """The golden file of a hardware kind (`gpu_type` of the device: cpu, h100, ...)."""
    return Path(results_dir) / "golden" / f"{device_kind}.csv"


def choose_golden(given: Path | None, device_kind: str, results_dir: Path) -> tuple[Path, list[dict] | None]:
    """The golden a run of `device_kind` is compared with: `given`, else the kind's file under
    `results_dir` (None rows where that default does not exist; a given file must exist)."""
    path = given or golden_path_for(device_kind, results_dir)
    return path, read_golden(path) if given is not None or path.is_file() else None


def _number(text: str, where: str) -> int | float | None:
    text = text.strip()
    if text == "":
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise BadInput(f"{where} is {text!r}, not a number; fix or regenerate the golden with "
                          "`recompute-bench golden update`") from None


def read_golden(path: Path, *, migrate: bool = False) -> list[dict]:
    """The rows of a golden CSV with metrics as numbers; BadInput (one line) for a missing or
    corrupt file.

    A golden written by an older version may lack key columns that are part of `KEY_COLUMNS` now.
    Comparing with it is refused (its rows cannot be matched by key); with `migrate=True`
    (`update_golden`) its rows are returned marked with `OLDER_KEY`, the key columns the file
    has, so that results of the same points can give them their full key.
    """
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"golden file {path} does not exist; create it with "
                          f"`recompute-bench golden update RESULTS --golden {path}`")
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BadInput(f"golden file {path} is not a readable CSV ({reason}); restore it from git "
                          "or regenerate it with `recompute-bench golden update`") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise BadInput(f"golden file {path} lacks the column(s) {', '.join(missing)}; restore it from git "
                          "or regenerate it with `recompute-bench golden update`")
    for later in LATER_KEYS:  # a field newer than the file: every row has its default
        if later not in frame.columns:
            frame[later] = key_text(registry_field(later).default)
    absent = [c for c in KEY_COLUMNS if c not in frame.columns]
    if absent and not migrate:
        raise BadInput(f"golden file {path} has the key of an older recompute-bench (no {_some(absent)} column); "
                          "migrate it: measure its points (e.g. `recompute-bench sweep --no-golden --run-id RUN`), "
                          f"then `recompute-bench golden update RUN --golden {path}`")
    present = tuple(c for c in KEY_COLUMNS if c in frame.columns)
    rows, seen = [], {}
    for n, raw in enumerate(frame.to_dict("records"), 2):  # line 1 is the header
        row: dict[str, Any] = dict(raw)
        if row["status"] not in GOLDEN_STATUSES:
            raise BadInput(f"{path}:{n}: status {row['status']!r} is not ok or oom; fix the row")
        for name in METRICS:
            if name in row:
                row[name] = _number(row[name], f"{path}:{n} column {name}")
        row["tolerance_parsed"] = parse_tolerances([row.get("tolerance", "")], f"{path}:{n} tolerance")
        if absent:
            row[OLDER_KEY] = present
        key = older_row_key(row, present) if absent else row_key(row)
        if key in seen:
            raise BadInput(f"{path}:{n} repeats the key of line {seen[key]} ({row.get('setting')}); "
                              "delete one of the two rows")
        seen[key] = n
        rows.append(row)
    return rows


def _some(names: list[str], shown: int = 4) -> str:
    """"hidden_size, ffn_hidden_size, ... (21 in all)": a long list of names kept to one line."""
    return ", ".join(names) if len(names) <= shown else f"{', '.join(names[:shown])}, ... ({len(names)} in all)"


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e18:
            return str(int(value))
        return f"{value:.8g}"
    return str(value)


def write_golden(path: Path, rows: list[dict]) -> None:
    """Write golden rows (GOLDEN_COLUMNS first, any extra columns after) through a temporary file
    and a rename, so a failure never leaves half a golden."""
    path = Path(path)
    extra = [c for r in rows for c in r if c not in GOLDEN_COLUMNS and c not in ("tolerance_parsed", OLDER_KEY)]
    columns = [*GOLDEN_COLUMNS, *dict.fromkeys(extra)]
    frame = pd.DataFrame([[_cell(r.get(c)) for c in columns] for r in rows], columns=columns, dtype=str)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    frame.to_csv(tmp, index=False)
    os.replace(tmp, path)


def golden_row(result: dict, tolerance: str = "") -> dict:
    """A result row (`results.record_row`) as a golden row, with provenance."""
    row = {"setting": result["setting"], **{c: result[c] for c in KEY_COLUMNS}, "config_hash": result["config_hash"],
           "status": result["status"], **{m: result.get(m) for m in METRICS}, "tolerance": tolerance,
           "device_name": result.get("device_name"), "torch_version": result.get("torch_version"),
           "package_version": result.get("package_version"), "git_sha": result.get("git_sha"),
           "measured_at": result.get("time"), "run_id": result.get("run_id")}
    return row


@dataclass
class UpdateSummary:
    """What `update_golden` did."""

    added: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    kept: int = 0
    """Rows of the file left as they were (never negative: a row replaced twice counts once)."""
    skipped: list[str] = field(default_factory=list)
    migrated_columns: list[str] = field(default_factory=list)
    """Key columns the file lacked (it came from an older version) and every row now has."""


def select_rows(results: list[dict], select: list[str] | None) -> list[dict]:
    """Result rows whose experiment name or setting is selected (all when `select` is empty)."""
    if not select:
        return results
    chosen = [r for r in results if r.get("experiment") in select or r.get("setting") in select]
    unknown = [s for s in select if not any(s in (r.get("experiment"), r.get("setting")) for r in results)]
    if unknown:
        names = ", ".join(dict.fromkeys(r.get("experiment") or r["setting"] for r in results))
        raise BadInput(f"--select {', '.join(unknown)} matches no result; choose experiments or settings of: {names}")
    return chosen


def update_golden(path: Path, results: list[dict], select: list[str] | None = None) -> UpdateSummary:
    """Promote result rows into the golden file: replace the rows with the same key (keeping their
    `tolerance` overrides), append new ones, keep every other row. Points that ended with error or
    timeout are skipped. Refuses rows from another device than the file's. Of two results with one
    key the later wins, as when results are read.

    A golden with the key of an older version is migrated: each of its rows takes the full key of
    the result that matches it on the key columns the file has plus `config_hash`. Every row must
    find its result (else BadInput and the file is untouched), since no other source knows the
    new columns' values.
    """
    path = Path(path)
    existing = read_golden(path, migrate=True) if path.exists() else []
    chosen = select_rows(results, select)
    devices = {g.get("device_name") for g in existing}
    older_columns = existing[0].get(OLDER_KEY) if existing else None
    index = {} if older_columns else {row_key(g): i for i, g in enumerate(existing)}
    unmigrated = {older_row_key(g, older_columns): i for i, g in enumerate(existing)} if older_columns else {}
    rows: list[dict] = list(existing)
    added: dict[int, str] = {}
    replaced: dict[int, str] = {}
    summary = UpdateSummary()
    for r in chosen:
        label = r.get("experiment") or r["setting"]
        if r["status"] not in GOLDEN_STATUSES:
            summary.skipped.append(f"{label} ({r['status']})")
            continue
        if devices and r.get("device_name") not in devices:
            raise BadInput(f"golden file {path} holds rows measured on {', '.join(sorted(map(str, devices)))}, "
                              f"but {label} was measured on {r.get('device_name')!r}; pass the golden file of that "
                              "device, e.g. --golden results/golden/<kind>.csv")
        key = row_key(r)
        i = index.get(key)
        if i is None and older_columns:
            i = unmigrated.pop(older_row_key(r, older_columns), None)  # each old row takes one full key
        if i is None:
            i = len(rows)
            rows.append({})
            added[i] = label
        elif i in added:
            added[i] = label
        else:
            replaced[i] = label
        rows[i] = golden_row(r, rows[i].get("tolerance", ""))
        index[key] = i
    if unmigrated:
        left = [existing[i].get("setting") or str(i + 2) for i in unmigrated.values()]
        raise BadInput(f"golden file {path} has the key of an older recompute-bench (no "
                          f"{_some([c for c in KEY_COLUMNS if c not in older_columns])} column) and these results do "
                          f"not measure {len(left)} of its rows ({_some(left)}), whose full key is therefore unknown; "
                          "pass results that measured every row (for a default golden: `recompute-bench sweep "
                          "--no-golden`) or delete those rows")
    summary.added, summary.replaced = list(added.values()), list(replaced.values())
    summary.kept = len(existing) - len(replaced)
    if older_columns:
        summary.migrated_columns = [c for c in KEY_COLUMNS if c not in older_columns]
    if summary.added or summary.replaced:
        write_golden(path, rows)
    return summary
