"""Per-rank memory for people: each rank's measured peak beside the estimate of its pipeline stage.
Imported records (Megatron-LM, Megatron Bridge, torchtitan) carry one entry per rank that reported
memory, each with `stage` and `estimated_peak_allocated_bytes`."""

from __future__ import annotations

from recompute_bench.render.tables import NOT_MEASURED, fmt_bytes
from recompute_bench.results.rows import setting_label


def _error(measured: float | None, estimate: float | None) -> str:
    if measured is None or estimate is None or not measured:
        return NOT_MEASURED
    return f"{100 * (estimate - measured) / measured:+.1f}%"


def rank_lines(records: list[dict]) -> list[str]:
    """Markdown lines: one table row per rank of every record whose ranks carry an estimate; [] when none does."""
    rows = []
    for record in records:
        label = (record.get("point") or {}).get("name") or setting_label(record)
        for entry in record.get("ranks") or []:
            if "estimated_peak_allocated_bytes" not in entry:
                continue
            measured, estimate = entry.get("peak_allocated_bytes"), entry.get("estimated_peak_allocated_bytes")
            status = "OOM" if entry.get("status") == "oom" else entry.get("status", "")
            rows.append(f"| {label} | `{setting_label(record)}` | {entry['rank']} | {entry.get('stage', '')} | {status} | "
                        f"{fmt_bytes(measured)} | {fmt_bytes(estimate)} | {_error(measured, estimate)} |")
    if not rows:
        return []
    sources = sorted({f"{r['source']['format']}" for r in records if r.get("source")})
    return ["## Memory per rank: measured and estimated", "",
            f"Measured: the peak each rank reported ({', '.join(sources) or 'this harness'}); estimated: "
            "`estimate` for that rank's pipeline stage (the framework that ran it).", "",
            "| Experiment | recompute setting | rank | stage | status | peak allocated | estimated | estimate error |",
            "|---|---|---|---|---|---|---|---|", *rows, ""]
