"""Hand-made result records and golden files for the comparison tests (no measurement)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import config
from recompute_bench.gate.golden import golden_row, write_golden
from recompute_bench.measure.point import SCHEMA
from recompute_bench.results.records import record_row

CPU = ("cpu", "2.13.0+cpu")
H100 = ("NVIDIA H100 80GB HBM3", "2.13.0+cu128")
BASE_METRICS = {"step_time_s": 0.5, "tflops_per_gpu": 100.0, "peak_allocated_bytes": 50 * 2**30,
                "peak_reserved_bytes": 60 * 2**30, "activation_bytes": 10**9, "measured_flops_per_step": 4 * 10**15,
                "hardware_flops_per_step": 4 * 10**15, "model_flops_per_step": 3 * 10**15,
                "num_parameters": 10**9, "loss": 6.0}


def record(modules=None, full=None, *, status="ok", device=H100, name=None, sets=(), failure_rank=0, **metrics):
    """A result record of tiny: selective `modules`, full `(method, N)`, or no recompute."""
    overrides = {}
    if modules:
        overrides = {"recompute__granularity": "selective", "recompute__modules": list(modules)}
    elif full:
        overrides = {"recompute__granularity": "full", "recompute__method": full[0], "recompute__num_layers": full[1]}
    cfg = config("tiny", sets=sets, **overrides)
    values = {**BASE_METRICS, **metrics}
    if device[0] == "cpu":
        values.update(peak_allocated_bytes=None, peak_reserved_bytes=None)
    failure = None
    if status != "ok":
        failure = {"rank": failure_rank, "step": 0, "phase": "backward", "message": f"{status} for the test"}
        for key in ("tflops_per_gpu", "step_time_s", "activation_bytes", "measured_flops_per_step", "loss"):
            values[key] = None
    return {"schema": SCHEMA, **cfg.record_fields(),
            "env": {"device": "cuda" if device[0] != "cpu" else "cpu", "device_name": device[0],
                    "torch_version": device[1], "package_version": "0.1.0", "git_sha": "abc", "hostname": "h",
                    "time": "2025-01-01T00:00:00+00:00"},
            "status": status, "failure": failure,
            "ranks": [{"rank": 0, "status": status, "failure": failure, "nvml_total_bytes": 80 * 2**30
                       if device[0] != "cpu" else None}],
            "metrics": values, "point": {"name": name, "index": 0, "run_id": "r1"} if name else None}


def write_results(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_golden_of(path: Path, records: list[dict], tolerance: dict[int, str] | None = None) -> Path:
    """A golden CSV holding these records (tolerance: row index -> tolerance column)."""
    rows = [golden_row(record_row(r), (tolerance or {}).get(i, "")) for i, r in enumerate(records)]
    write_golden(path, rows)
    return path
