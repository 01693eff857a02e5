"""Golden files (one CSV per hardware kind), tolerances, and the verdict of every row.

A golden row is keyed by `results.KEY_COLUMNS` (the workload and every resolved model, training,
parallel and recompute field except warm-up and measured steps) and carries `config_hash` (a hash
of the record's config as written), `status` (ok or oom),
the metrics of `METRICS`, an optional `tolerance` column of per-row overrides
("tflops_per_gpu:10%;loss:2%") and provenance (`device_name`, `torch_version`,
`package_version`, `git_sha`, `measured_at`, `run_id`).

The verdicts (the constants below) and which of them fail, the metrics' directions and default
tolerances are tabled once, in docs/gate.md.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from recompute_bench.spec.config import BadInput
from recompute_bench.results.rows import KEY_COLUMNS, key_text
from recompute_bench.spec.fields import LATER_KEYS, field as registry_field

@dataclass(frozen=True)
class Metric:
    """How one metric is compared: kind, direction and default relative tolerance."""

    name: str
    kind: str
    """perf, memory or exact (no better direction)."""
    higher_is_better: bool | None
    tolerance: float | None
    """Relative tolerance; 0 is exact; None reports the difference without gating it."""
    wall_clock: bool = False
    """A wall-clock metric: reported but not gated on golden rows measured on a CPU."""
    deterministic: bool = False
    """The same program on the same config gives the same value, so a difference in either direction
    means the program changed: worse is a regression, better is "changed" (it fails too)."""


# Wall-clock numbers on a CPU swing with whatever else runs there: on the shared 2-core machine the
# CPU golden was made on, the same `tiny` point ran from 0.0002 to 0.0038 TFLOP/s (18x) depending
# on a concurrent test run. No tolerance short of ~99% would stay quiet, so CPU rows report
# TFLOP/s with its signed difference and the deterministic metrics (FLOPs, bytes, parameters,
# loss) carry the gate. A row's `tolerance` column or --tolerance still gates it on purpose.
METRICS = {m.name: m for m in (
    Metric("tflops_per_gpu", "perf", True, 0.05, wall_clock=True),
    Metric("step_time_s", "perf", False, None, wall_clock=True),  # same information as TFLOP/s: reported only
    Metric("peak_allocated_bytes", "memory", False, 0.05),
    Metric("peak_reserved_bytes", "memory", False, 0.05),
    Metric("activation_bytes", "memory", False, 0.0, deterministic=True),
    Metric("measured_flops_per_step", "perf", False, 0.0, deterministic=True),
    Metric("hardware_flops_per_step", "perf", False, 0.0, deterministic=True),
    Metric("model_flops_per_step", "exact", None, 0.0, deterministic=True),
    Metric("num_parameters", "exact", None, 0.0, deterministic=True),
    Metric("loss", "exact", None, 0.01),  # kernels differ slightly between CPUs in bf16
)}
PROVENANCE_COLUMNS = ("device_name", "torch_version", "package_version", "git_sha", "measured_at", "run_id")
GOLDEN_COLUMNS = ("setting", *KEY_COLUMNS, "config_hash", "status", *METRICS, "tolerance", *PROVENANCE_COLUMNS)
# Without these a file is no golden at all; key columns it lacks make it a golden of an older key.
REQUIRED_COLUMNS = ("workload", "config_hash", "status", "device_name", "torch_version")
# Marks a row read from a golden written with fewer key columns: the key columns that file has.
OLDER_KEY = "older_key_columns"
GOLDEN_STATUSES = ("ok", "oom")

PASS, PERF, MEMORY, IMPROVED, CHANGED = "pass", "perf regression", "memory regression", "unexpected improvement", "changed"
EXPECTED_OOM, UNEXPECTED_OOM, NOW_FITS = "expected OOM", "unexpected OOM", "now fits"
MISSING, NEW, NOT_COMPARABLE, FAILED = "missing", "new", "not comparable", "failed"
# Most severe first: a row shows the first of its verdicts in this order.
SEVERITY = (FAILED, NOT_COMPARABLE, MISSING, UNEXPECTED_OOM, CHANGED, PERF, MEMORY, IMPROVED, NOW_FITS, NEW,
            EXPECTED_OOM, PASS)
FAILING = frozenset({FAILED, NOT_COMPARABLE, MISSING, UNEXPECTED_OOM, CHANGED, PERF, MEMORY})
STRICT_FAILING = FAILING | {IMPROVED, NOW_FITS, NEW}
EDGE = 1e-9  # a difference exactly at a tolerance passes despite float rounding; tolerance 0 is equality


def golden_path_for(device_kind: str, results_dir: Path = Path("results")) -> Path:
    """The golden file of a hardware kind (`gpu_type` of the device: cpu, h100, ...)."""
    return Path(results_dir) / "golden" / f"{device_kind}.csv"


def choose_golden(given: Path | None, device_kind: str, results_dir: Path) -> tuple[Path, list[dict] | None]:
    """The golden a run of `device_kind` is compared with: `given`, else the kind's file under
    `results_dir` (None rows where that default does not exist; a given file must exist)."""
    path = given or golden_path_for(device_kind, results_dir)
    return path, read_golden(path) if given is not None or path.is_file() else None


# ----- tolerances ---------------------------------------------------------------------------------
def parse_tolerance(spec: str, where: str = "--tolerance") -> tuple[str, float | None]:
    """"tflops_per_gpu:10%" -> ("tflops_per_gpu", 0.1); "0.1" means 10% too; "off" reports only."""
    name, sep, raw = spec.strip().partition(":")
    name, raw = name.strip(), raw.strip().lower()
    if not sep or name not in METRICS:
        raise BadInput(f"{where} {spec!r} is not METRIC:TOLERANCE with a metric of {', '.join(METRICS)}; "
                          "write for example tflops_per_gpu:10%")
    if raw in ("off", "none"):
        return name, None
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or math.isinf(value):
        raise BadInput(f"{where} {spec!r}: the tolerance must be a number >= 0, a percentage or off; "
                          "write for example tflops_per_gpu:10% or activation_bytes:0")
    return name, value


def parse_tolerances(specs: list[str] | None, where: str = "--tolerance") -> dict[str, float | None]:
    """Several specs (each may hold ";"-separated items) -> {metric: tolerance}."""
    out: dict[str, float | None] = {}
    for spec in specs or []:
        for item in spec.split(";"):
            if item.strip():
                name, value = parse_tolerance(item, where)
                out[name] = value
    return out


def tolerance_for(metric: Metric, golden_row: dict, overrides: dict[str, float | None]) -> float | None:
    """The tolerance in force: command line, then the row's `tolerance` column, then none for
    wall-clock metrics of CPU rows, then the registry."""
    if metric.name in overrides:
        return overrides[metric.name]
    row = golden_row.get("tolerance_parsed") or {}
    if metric.name in row:
        return row[metric.name]
    if golden_row.get("device_name") == "cpu" and metric.wall_clock:
        return None
    return metric.tolerance


# ----- the comparison ----------------------------------------------------------------------------
@dataclass
class MetricResult:
    """One metric of one row: golden and measured value, signed relative difference, outcome
    (pass, worse, better, changed, info (not gated), n/m (measured on neither side), absent (one side))."""

    name: str
    golden: Any
    actual: Any
    rel_diff: float | None
    tolerance: float | None
    outcome: str


@dataclass
class RowResult:
    """The verdict of one point (a result row, a golden row, or both)."""

    key: tuple[str, ...]
    actual: dict | None
    golden: dict | None
    verdict: str | None
    """None when there is no golden to compare with (the result's status decides)."""
    verdicts: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    metrics: list[MetricResult] = field(default_factory=list)

    @property
    def source(self) -> dict:
        return self.actual if self.actual is not None else self.golden

    @property
    def experiment(self) -> str:
        return (self.actual or {}).get("experiment") or self.source.get("setting", "")

    @property
    def setting(self) -> str:
        return self.source.get("setting", "")

    def metric(self, name: str) -> MetricResult | None:
        return next((m for m in self.metrics if m.name == name), None)

    def failing(self, strict: bool = False) -> bool:
        if self.verdict is None:
            return (self.actual or {}).get("status") != "ok"
        return self.verdict in (STRICT_FAILING if strict else FAILING)


@dataclass
class Comparison:
    """Every row's verdict, and whether the whole comparison passes."""

    rows: list[RowResult]
    strict: bool = False
    golden_path: Path | None = None

    @property
    def failing_rows(self) -> list[RowResult]:
        return [r for r in self.rows if r.failing(self.strict)]

    @property
    def passed(self) -> bool:
        return not self.failing_rows

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows:
            v = r.verdict or (r.actual or {}).get("status", "")
            out[v] = out.get(v, 0) + 1
        return out

    def update_selection(self) -> list[str] | None:
        """The rows `golden update` would have to promote to make this comparison pass: their
        experiment names (or settings); None when that is every result row."""
        fixable = [r for r in self.rows if r.actual is not None and r.verdict not in (PASS, EXPECTED_OOM, FAILED, MISSING, None)
                   and r.failing(strict=True)]
        results = [r for r in self.rows if r.actual is not None]
        if not fixable:
            return []
        if len(fixable) == len(results):
            return None
        return list(dict.fromkeys(r.experiment for r in fixable))


def row_key(row: dict) -> tuple[str, ...]:
    """The key of a result or golden row: its KEY_COLUMNS as strings."""
    return tuple(str(row[c]) for c in KEY_COLUMNS)


def _older_row_key(row: dict, columns: tuple[str, ...]) -> tuple[str, ...]:
    """The key of a row as a golden with only `columns` of KEY_COLUMNS sees it. With `config_hash`
    (every model, training and parallel field as written) it still names one point exactly."""
    return (*(str(row[c]) for c in columns), str(row["config_hash"]))


def _torch_minor(version: Any) -> str:
    return ".".join(str(version or "").split("+")[0].split(".")[:2])


def _compare_metric(metric: Metric, golden: Any, actual: Any, tolerance: float | None) -> MetricResult:
    if golden is None and actual is None:
        return MetricResult(metric.name, None, None, None, tolerance, "n/m")
    if golden is None or actual is None:
        return MetricResult(metric.name, golden, actual, None, tolerance, "absent")
    if golden == 0:
        rel = 0.0 if actual == 0 else math.copysign(math.inf, actual)
    else:
        rel = (actual - golden) / abs(golden)
    if tolerance is None:
        outcome = "info"
    elif actual == golden or (tolerance > 0 and abs(rel) <= tolerance * (1 + EDGE)):
        outcome = "pass"
    elif metric.higher_is_better is None:
        outcome = "changed"
    elif (rel > 0) != metric.higher_is_better:
        outcome = "worse"
    else:
        # Fewer bytes or FLOPs than a deterministic golden is no speed-up to wave through: the
        # program now computes something else (a recompute that stopped recomputing, a lost layer).
        outcome = "changed" if metric.deterministic else "better"
    return MetricResult(metric.name, golden, actual, rel, tolerance, outcome)


def _not_comparable(golden: dict, actual: dict) -> list[str]:
    reasons = []
    if (golden.get("device_name") or None) != (actual.get("device_name") or None):  # a CSV cell "" is None
        reasons.append(f"golden measured on {golden.get('device_name')!r}, results on {actual.get('device_name')!r}")
    if _torch_minor(golden.get("torch_version")) != _torch_minor(actual.get("torch_version")):
        reasons.append(f"golden from torch {golden.get('torch_version')}, results from torch {actual.get('torch_version')}")
    if golden.get("config_hash") != actual.get("config_hash"):
        reasons.append("the workload's resolved config differs from the golden's (config_hash "
                       f"{golden.get('config_hash')} vs {actual.get('config_hash')})")
    return reasons


def compare_row(actual: dict | None, golden: dict | None, overrides: dict[str, float | None]) -> RowResult:
    """The verdict of one key: a result row (`results.record_row`), a golden row, or both."""
    key = row_key(actual if actual is not None else golden)
    row = RowResult(key, actual, golden, None)
    status = (actual or {}).get("status")
    if actual is not None and status not in ("ok", "oom"):
        row.verdicts, row.reasons = [FAILED], [f"{status}: {actual.get('failure_message')}"]
    elif golden is None:
        row.verdicts, row.reasons = [NEW], ["no golden row for this point"]
    elif actual is None:
        row.verdicts, row.reasons = [MISSING], ["a golden row without a result"]
    elif reasons := _not_comparable(golden, actual):
        row.verdicts, row.reasons = [NOT_COMPARABLE], reasons
    elif golden["status"] == "ok" and status == "oom":
        row.verdicts, row.reasons = [UNEXPECTED_OOM], [f"out of memory on rank {actual.get('failure_rank')}: "
                                                       f"{actual.get('failure_message')}"]
        row.metrics = _oom_metrics(golden, actual)
    elif golden["status"] == "oom" and status == "oom":
        row.verdicts = [EXPECTED_OOM]
        row.metrics = _oom_metrics(golden, actual)
    elif golden["status"] == "oom":
        row.verdicts, row.reasons = [NOW_FITS], ["the golden says out of memory; run `golden update` to record the fit"]
    else:
        for name, metric in METRICS.items():
            m = _compare_metric(metric, golden.get(name), actual.get(name), tolerance_for(metric, golden, overrides))
            row.metrics.append(m)
            verdict = {"absent": NOT_COMPARABLE, "changed": CHANGED, "better": IMPROVED,
                       "worse": PERF if metric.kind == "perf" else MEMORY}.get(m.outcome)
            if verdict:
                row.verdicts.append(verdict)
                row.reasons.append(describe_metric(m))
        row.verdicts = row.verdicts or [PASS]
    row.verdict = min(row.verdicts, key=SEVERITY.index)
    return row


def _oom_metrics(golden: dict, actual: dict) -> list[MetricResult]:
    """TFLOP/s and peak memory of a point that ran out of memory, beside the golden's, reported and not
    gated: an imported run measured steps before it failed (the seeds' "~704 TFLOP/s, OOM rank0")."""
    names = ("tflops_per_gpu", "peak_allocated_bytes")
    return [_compare_metric(METRICS[n], golden.get(n), actual.get(n), None) for n in names
            if golden.get(n) is not None and actual.get(n) is not None]


def describe_metric(m: MetricResult) -> str:
    """"activation_bytes 9677824 vs golden 9437184 (+2.5%, tolerance 0%): worse"."""
    if m.outcome == "absent":
        return f"{m.name} measured on one side only (golden {m.golden}, result {m.actual})"
    tol = "not gated" if m.tolerance is None else f"tolerance {100 * m.tolerance:g}%"
    text = f"{m.name} {m.actual} vs golden {m.golden} ({signed_percent(m.rel_diff)}, {tol}): {m.outcome}"
    if m.outcome == "changed":
        text += " (the program computes something else; if that is intended, update the golden)"
    return text


def signed_percent(rel: float | None) -> str:
    """+3.1%, -0.4%, ±0.0% (equal), -1e-07% (a change too small for one decimal); "n/a" when there is
    nothing to compare."""
    if rel is None:
        return "n/a"
    if math.isinf(rel):
        return "+inf%" if rel > 0 else "-inf%"
    if rel == 0:
        return "±0.0%"
    text = f"{100 * rel:+.1f}%"
    # One byte off a gigabyte must not read as no difference: show such a change in two digits.
    return f"{100 * rel:+.2g}%" if text in ("+0.0%", "-0.0%") else text


def compare(results: list[dict], golden: list[dict] | None, *, tolerances: dict[str, float | None] | None = None,
            strict: bool = False, only_keys: set[tuple[str, ...]] | None = None,
            golden_path: Path | None = None) -> Comparison:
    """Compare result rows (`results.record_row`) with golden rows (`read_golden`).

    Result rows come first in their own order, then golden rows without a result (missing).
    `only_keys` restricts the golden to the points a sweep planned. `golden=None` compares nothing:
    every row's verdict is None and the result's status alone decides.
    """
    tolerances = tolerances or {}
    if golden is None:
        return Comparison([RowResult(row_key(r), r, None, None) for r in results], strict, golden_path)
    by_key = {row_key(g): g for g in golden if only_keys is None or row_key(g) in only_keys}
    seen = set()
    rows = []
    for r in results:
        key = row_key(r)
        seen.add(key)
        rows.append(compare_row(r, by_key.get(key), tolerances))
    rows += [compare_row(None, g, tolerances) for key, g in by_key.items() if key not in seen]
    return Comparison(rows, strict, golden_path)


# ----- reading and writing golden files ----------------------------------------------------------
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
        key = _older_row_key(row, present) if absent else row_key(row)
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
    unmigrated = {_older_row_key(g, older_columns): i for i, g in enumerate(existing)} if older_columns else {}
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
            i = unmigrated.pop(_older_row_key(r, older_columns), None)  # each old row takes one full key
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
