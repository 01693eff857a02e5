"""Megatron Bridge golden values (`scripts/performance/utils/evaluate.py`, `write_golden_values_to_disk`
and `_unwrap_golden_values`, Megatron-Bridge 067f987d): one JSON object, flat or wrapped in
`{"baseline": {...}}` / `{"current": {...}}`, with 0-indexed step keys
`{"0": {"lm loss": 10.9, "elapsed time per iteration (ms)": 2034.1, "GPU utilization": 710.2}, ...}`
and the run's memory in GB (1e9 bytes): `alloc` and `max_alloc` are the first
`mem-allocated-gigabytes` / `mem-max-allocated-gigabytes` of the run's log and `max_reserved` the largest
`mem-max-reserved-gigabytes` of any rank (`get_metrics_from_logfiles`). The file names no model,
layout or GPU: a preset (`--workload`, flags) says what ran.
"""

from __future__ import annotations

from pathlib import Path

from recompute_bench.ingest.parsed import ParsedRun, Step, bad

FORMAT = "bridge-golden"
SCALARS = ("alloc", "max_alloc", "max_reserved", "job_id")
GB = 1e9


def unwrap(data):
    """The step mapping of a flat or snapshot-wrapped golden (Bridge prefers `baseline`)."""
    for key in ("baseline", "current"):
        if isinstance(data, dict) and isinstance(data.get(key), dict):
            return data[key]
    return data


def detect_json(data) -> bool:
    """Whether parsed JSON is Bridge golden values (step keys "0", "1", ... holding per-step dicts)."""
    data = unwrap(data)
    return isinstance(data, dict) and any(k.isdigit() and isinstance(v, dict) for k, v in data.items())


def _value(entry: dict, key: str, path: Path, step: str) -> float | None:
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(path, None, f"step {step} has {key} {value!r}, not a number; restore the golden file")
    return float(value)


def read(path: Path, data: dict) -> ParsedRun:
    """Read Bridge golden values (already parsed JSON)."""
    path = Path(path)
    data = unwrap(data)
    run = ParsedRun(FORMAT, path, timing="bridge", complete=False,
                    memory_rule="Bridge's golden memory: max_alloc is the first mem-max-allocated-gigabytes line of the "
                                "run's log (rank not recorded), max_reserved the largest over all ranks (GB = 1e9 bytes)")
    for key in sorted((k for k in data if k.isdigit()), key=int):
        entry = data[key]
        if not isinstance(entry, dict):
            raise bad(path, None, f"step {key} is {entry!r}, not an object of metrics; restore the golden file")
        ms = _value(entry, "elapsed time per iteration (ms)", path, key)
        run.steps.append(Step(int(key), 0, step_time_s=None if ms is None else ms / 1e3,
                              tflops_per_gpu=_value(entry, "GPU utilization", path, key),
                              loss=_value(entry, "lm loss", path, key)))
    if not run.steps:
        raise bad(path, None, "has no step entries (\"0\": {...}); pass a Bridge golden-values file")
    for key in ("alloc", "max_alloc", "max_reserved"):
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise bad(path, None, f"{key} is {value!r}, not a number of GB; restore the golden file")
    gb = lambda key: None if data.get(key) is None else float(data[key]) * GB  # noqa: E731
    run.peaks = {"allocated_bytes": gb("alloc"), "peak_allocated_bytes": gb("max_alloc"),
                 "peak_reserved_bytes": gb("max_reserved")}
    return run
