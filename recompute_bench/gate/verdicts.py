"""The verdict of every row: each metric against its golden within its tolerance, then the row's
verdict (the constants below, most severe first) and whether the whole comparison passes.
The verdicts and which of them fail are tabled in docs/gate.md."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recompute_bench.gate.metrics import METRICS, Metric
from recompute_bench.gate.tolerances import tolerance_for
from recompute_bench.results.rows import KEY_COLUMNS

PASS, PERF, MEMORY, IMPROVED, CHANGED = "pass", "perf regression", "memory regression", "unexpected improvement", "changed"
EXPECTED_OOM, UNEXPECTED_OOM, NOW_FITS = "expected OOM", "unexpected OOM", "now fits"
MISSING, NEW, NOT_COMPARABLE, FAILED = "missing", "new", "not comparable", "failed"
# Most severe first: a row shows the first of its verdicts in this order.
SEVERITY = (FAILED, NOT_COMPARABLE, MISSING, UNEXPECTED_OOM, CHANGED, PERF, MEMORY, IMPROVED, NOW_FITS, NEW,
            EXPECTED_OOM, PASS)
FAILING = frozenset({FAILED, NOT_COMPARABLE, MISSING, UNEXPECTED_OOM, CHANGED, PERF, MEMORY})
STRICT_FAILING = FAILING | {IMPROVED, NOW_FITS, NEW}
EDGE = 1e-9  # a difference exactly at a tolerance passes despite float rounding; tolerance 0 is equality


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


def older_row_key(row: dict, columns: tuple[str, ...]) -> tuple[str, ...]:
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
