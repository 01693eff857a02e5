"""A comparison for people and for CI: the experiment table (rich and Markdown), per-metric
details, JUnit XML and JSON. Bytes and seconds come in; GiB and ms appear only here.

The table is the one performance engineers pass around:
Experiment | recompute setting | TFLOP/s/GPU | vs Golden | Peak Mem | Activations | Result.
On a CPU peak memory is not measured ("n/m"); the bytes saved for backward (activations) are, on
every device, so they stand beside it.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from typing import Any

from rich.markup import escape
from rich.table import Table

from recompute_bench.gate.verdicts import (EXPECTED_OOM, FAILED, NEW, PASS, UNEXPECTED_OOM, Comparison, MetricResult,
                                           RowResult, signed_percent)
from recompute_bench.render.tables import NOT_MEASURED, fmt_bytes, fmt_seconds
from recompute_bench.results.rows import KEY_COLUMNS

COLUMNS = ("Experiment", "recompute setting", "TFLOP/s/GPU", "vs Golden", "Peak Mem", "Activations", "Result")
STYLES = {"OK": "green", "Expected OOM": "green", "New": "yellow", "Unexpected improvement": "yellow",
          "Now fits": "yellow"}


def fmt_tflops(x: float | None) -> str:
    """Three significant digits below 100 (a CPU does thousandths), one decimal above."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return NOT_MEASURED
    return f"{x:,.1f}" if abs(x) >= 100 else f"{x:.3g}"


def fmt_metric(name: str, value: Any) -> str:
    """A metric value in its unit."""
    if value is None:
        return NOT_MEASURED
    if name.endswith("_bytes"):
        return fmt_bytes(value)
    if name.endswith("_s"):
        return fmt_seconds(value)
    if name == "tflops_per_gpu":
        return fmt_tflops(value)
    if name == "loss":
        return f"{value:.5g}"
    return f"{value:,}" if isinstance(value, int) else f"{value:.6g}"


def result_text(row: RowResult) -> str:
    """The Result column: OK, OOM rankN, Timeout, Killed, Error, or the verdict in words."""
    actual = row.actual or {}
    status = actual.get("status")
    rank = actual.get("failure_rank")
    oom = f"OOM rank{rank if rank is not None else '?'}"  # the seeds' form, as `rank_summary` writes it
    if status in ("timeout", "error", "killed") or row.verdict == FAILED:
        return {"timeout": "Timeout", "killed": "Killed"}.get(status, "Error")
    if row.verdict is None or row.verdict == PASS:
        return oom if status == "oom" else "OK"
    if row.verdict == EXPECTED_OOM:
        return f"Expected {oom}"
    if row.verdict == UNEXPECTED_OOM:
        return f"Unexpected {oom}"
    if row.verdict == NEW:
        return f"New ({oom})" if status == "oom" else "New"
    return row.verdict[0].upper() + row.verdict[1:]


def _with_diff(text: str, m: MetricResult | None) -> str:
    if m is None or m.rel_diff is None:
        return text
    return f"{text} ({signed_percent(m.rel_diff)})"


CPU_NOT_GATED = "not gated on cpu"
CPU_NOTE = ("TFLOP/s is not gated against a CPU golden: wall-clock on a shared CPU swings far beyond any tolerance, "
            "so FLOPs, bytes, parameters and loss carry the gate (docs/gate.md)")


def _cpu_wall_clock(row: RowResult, m: MetricResult | None) -> bool:
    """A wall-clock metric compared with a CPU golden row and left ungated for that reason."""
    return m is not None and m.tolerance is None and (row.golden or {}).get("device_name") == "cpu"


def table_cells(row: RowResult) -> list[str]:
    """The cells of one row of the experiment table, as plain text. Against a CPU golden the
    "vs Golden" cell says the TFLOP/s is not gated instead of a difference nobody acts on."""
    actual = row.actual or {}
    tflops = row.metric("tflops_per_gpu")
    peak = actual.get("peak_allocated_bytes")
    vs_golden = "" if tflops is None else CPU_NOT_GATED if _cpu_wall_clock(row, tflops) else signed_percent(tflops.rel_diff)
    return [
        row.experiment,
        row.setting,
        fmt_tflops(actual.get("tflops_per_gpu")) if row.actual is not None else "",
        vs_golden,
        _with_diff(fmt_bytes(peak), row.metric("peak_allocated_bytes")) if row.actual is not None else "",
        _with_diff(fmt_bytes(actual.get("activation_bytes")), row.metric("activation_bytes")) if row.actual is not None else "",
        result_text(row),
    ]


def cpu_note(comparison: Comparison) -> str | None:
    """The line under the table that says why TFLOP/s is not compared, when a row is a CPU one."""
    return CPU_NOTE if any(_cpu_wall_clock(r, r.metric("tflops_per_gpu")) for r in comparison.rows) else None


def experiment_table(comparison: Comparison, title: str) -> Table:
    """The rich experiment table (with `cpu_note` as its caption where it applies)."""
    note = cpu_note(comparison)
    table = Table(title=escape(title), header_style="bold", caption=escape(note) if note else None, caption_justify="left")
    for col in COLUMNS:
        table.add_column(col, justify="right" if col in ("TFLOP/s/GPU", "vs Golden", "Peak Mem", "Activations") else "left")
    for row in comparison.rows:
        cells = table_cells(row)
        style = STYLES.get(cells[-1].split(" (")[0], "green" if cells[-1] == "OK" else
                           ("red" if row.failing(comparison.strict) else "yellow"))
        table.add_row(*map(escape, cells[:-1]), f"[{style}]{escape(cells[-1])}[/]")
    return table


def details_table(comparison: Comparison, everything: bool = False) -> Table | None:
    """Every compared metric of the rows that did not pass (of all rows with `everything`)."""
    rows = [r for r in comparison.rows if everything or r.verdict not in (PASS, EXPECTED_OOM, None)]
    if not rows:
        return None
    table = Table(title="details", header_style="bold")
    for col in ("Experiment", "metric / reason", "golden", "measured", "diff", "tolerance", "outcome"):
        table.add_column(col, justify="right" if col in ("golden", "measured", "diff", "tolerance") else "left")
    for row in rows:
        shown = [m for m in row.metrics if everything or m.outcome not in ("pass", "n/m", "info")]
        for m in shown:
            tol = "not gated" if m.tolerance is None else f"{100 * m.tolerance:g}%"
            table.add_row(escape(row.experiment), m.name, escape(fmt_metric(m.name, m.golden)),
                          escape(fmt_metric(m.name, m.actual)), signed_percent(m.rel_diff), tol, m.outcome)
        if not shown:
            for reason in row.reasons or [row.verdict or ""]:
                table.add_row(escape(row.experiment), escape(reason), "", "", "", "", row.verdict or "")
    return table


def headline(comparison: Comparison) -> str:
    """One line: PASS or FAIL, and the verdict counts."""
    counts = ", ".join(f"{n} {v}" for v, n in comparison.counts().items())
    failing = len(comparison.failing_rows)
    word = "PASS" if comparison.passed else "FAIL"
    strict = " (strict)" if comparison.strict else ""
    return f"{word}{strict}: {failing} of {len(comparison.rows)} rows failing; {counts}"


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(comparison: Comparison, title: str, update_command: str | None = None) -> str:
    """GitHub-flavoured Markdown: the verdict first, the table, the failures, the command that
    would update the golden, and every metric inside <details> (small enough for a step summary)."""
    lines = [f"## {_md(title)}", "", f"**{headline(comparison)}**", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_md(c) for c in table_cells(row)) + " |" for row in comparison.rows]
    if note := cpu_note(comparison):
        lines += ["", _md(note)]
    failing = comparison.failing_rows
    if failing:
        lines += ["", "### Failing rows", ""]
        lines += [f"- **{_md(r.experiment)}** `{r.setting}`: {r.verdict}; {_md('; '.join(r.reasons))}" for r in failing]
    if update_command:
        lines += ["", "If the change is intended, update the golden and review the diff:", "",
                  "```", update_command, "```"]
    lines += ["", "<details><summary>every metric</summary>", "",
              "| Experiment | metric | golden | measured | diff | tolerance | outcome |", "|---|---|---|---|---|---|---|"]
    for row in comparison.rows:
        for m in row.metrics:
            tol = "not gated" if m.tolerance is None else f"{100 * m.tolerance:g}%"
            lines.append(f"| {_md(row.experiment)} | {m.name} | {fmt_metric(m.name, m.golden)} | "
                         f"{fmt_metric(m.name, m.actual)} | {signed_percent(m.rel_diff)} | {tol} | {m.outcome} |")
    lines += ["", "</details>", ""]
    return "\n".join(lines)


def junit_xml(comparison: Comparison, suite: str = "recompute-bench compare") -> str:
    """JUnit XML: one test case per row and compared metric (a row without metrics, such as a
    missing or OOM row, is one test case); failures carry measured, golden, diff and tolerance."""
    root = ET.Element("testsuites")
    cases = []
    for row in comparison.rows:
        classname = f"{row.source.get('workload')}.{row.experiment}"
        if row.metrics:
            for m in row.metrics:
                case = ET.Element("testcase", classname=classname, name=f"{row.setting} :: {m.name}", time="0")
                failed = m.outcome in ("worse", "changed", "absent") or (comparison.strict and m.outcome == "better")
                if failed:
                    tol = "not gated" if m.tolerance is None else f"{100 * m.tolerance:g}%"
                    ET.SubElement(case, "failure", type=row.verdict or "", message=(
                        f"{m.name}: measured {m.actual}, golden {m.golden}, {signed_percent(m.rel_diff)}, tolerance {tol}"))
                elif m.outcome in ("n/m",):
                    ET.SubElement(case, "skipped", message="not measured on this device")
                cases.append(case)
        else:
            case = ET.Element("testcase", classname=classname, name=f"{row.setting} :: {row.verdict or 'status'}", time="0")
            message = "; ".join(row.reasons) or (row.verdict or "")
            if row.failing(comparison.strict):
                ET.SubElement(case, "failure", type=row.verdict or "failed", message=message)
            elif row.verdict == NEW:
                ET.SubElement(case, "skipped", message=message)
            cases.append(case)
    failures = sum(1 for c in cases if c.find("failure") is not None)
    skipped = sum(1 for c in cases if c.find("skipped") is not None)
    testsuite = ET.SubElement(root, "testsuite", name=suite, tests=str(len(cases)), failures=str(failures),
                              errors="0", skipped=str(skipped))
    testsuite.extend(cases)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def to_json(comparison: Comparison, **extra: Any) -> dict:
    """The comparison as one JSON document (`recompute-bench/compare/v1`)."""
    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and (math.isnan(v) or math.isinf(v)) else v

    return {
        "schema": "recompute-bench/compare/v1",
        **extra,
        "passed": comparison.passed,
        "strict": comparison.strict,
        "counts": comparison.counts(),
        "rows": [{
            "experiment": r.experiment, "setting": r.setting, "key": dict(zip(KEY_COLUMNS, r.key)),
            "verdict": r.verdict, "verdicts": r.verdicts, "failing": r.failing(comparison.strict),
            "status": (r.actual or {}).get("status"), "reasons": r.reasons,
            "metrics": [{"name": m.name, "golden": m.golden, "measured": m.actual, "rel_diff": clean(m.rel_diff),
                         "tolerance": m.tolerance, "outcome": m.outcome} for m in r.metrics],
        } for r in comparison.rows],
    }
