"""Tolerances: the `--tolerance` and golden `tolerance` column syntax ("tflops_per_gpu:10%"), and
which tolerance is in force for a metric of a row."""

from __future__ import annotations

import math

from recompute_bench.gate.metrics import METRICS, Metric
from recompute_bench.config.schema import BadInput


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
