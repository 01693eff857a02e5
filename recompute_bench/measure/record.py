"""The result record of one point (schema recompute-bench/result/v1), without torch.

`measure.point.run_point` fills it from a measurement; `launch.process.failed_record` builds the
record of a point whose worker left none. The second runs in the sweep parent, which must not
import torch (a CUDA context held for the whole sweep), so nothing here imports it.
"""

from __future__ import annotations

from typing import Any

from recompute_bench.analysis import flops
from recompute_bench.analysis.rank import record_estimate
from recompute_bench.spec.config import Config

SCHEMA = "recompute-bench/result/v1"
FAULT_ENV = "RECOMPUTE_BENCH_FAULT"
"""Fault injection for tests: "KIND:PHASE:STEP[@RANK]" with KIND oom, error, hang, delay (sleep
`measure.point.FAULT_DELAY_S`) or watchdog (NCCL's watchdog verdict on stderr, then SIGABRT), and
PHASE forward, backward, optimizer or write (the piece written after the step), e.g.
"oom:backward:2" (every rank) or "oom:backward:1@1" (rank 1 only)."""


def unmeasured_metrics(cfg: Config, device_type: str) -> dict[str, Any]:
    """A point's metrics before anything is measured: None (not measured), except what follows from
    the config alone: the formula FLOPs and the analytical estimate."""
    return {
        "step_time_s": None, "step_times_s": [], "step_time_spread_s": None, "tflops_per_gpu": None, "tokens_per_s_per_gpu": None,
        "mfu": None, "hfu": None, "peak_tflops": None, "peak_source": None,
        "model_flops_per_step": flops.model_flops_per_step(cfg),
        "measured_flops_per_step": None,
        "activation_bytes": None, "activation_bytes_per_layer": None,
        "num_parameters": None, "loss": None,
        **predicted_metrics(cfg, device_type),
    }


def predicted_metrics(cfg: Config, device: str) -> dict[str, Any]:
    """What the analysis predicts for the point on `device`: the hardware FLOPs (which HFU divides)
    and the estimate beside each measurement. `device` may carry the kernels the run measured
    (`models.DeviceKernels`), which the prediction then follows."""
    return {"hardware_flops_per_step": flops.hardware_flops_per_step(cfg, device), **record_estimate(cfg, device)}


def unmeasured_rank(rank: int, device_name: str, status: str = "ok", failure: dict | None = None) -> dict[str, Any]:
    """A rank entry with every memory figure not measured (None)."""
    return {"rank": rank, "status": status, "failure": failure, "device_name": device_name,
            "peak_allocated_bytes": None, "peak_reserved_bytes": None, "alloc_retries": None, "num_ooms": None,
            "run_peak_allocated_bytes": None, "run_peak_reserved_bytes": None,
            "nvml_used_bytes": None, "nvml_total_bytes": None}


def make_record(cfg: Config, env: dict, rank_entry: dict, metrics: dict) -> dict:
    """The result record of one single-rank point (schema recompute-bench/result/v1)."""
    for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
        metrics[key] = rank_entry[key]
    failure = rank_entry["failure"]
    return {
        "schema": SCHEMA,
        **cfg.record_fields(),
        "env": env,
        "status": rank_entry["status"],
        "failure": None if failure is None else {**failure, "rank": rank_entry["rank"]},
        "ranks": [rank_entry],
        "metrics": metrics,
    }


STATUS_ORDER = ("oom", "error", "killed", "timeout", "waiting")
"""A multi-rank point's status is its ranks' first in this order (else ok)."""


def rank_summary(record: dict) -> str:
    """Which ranks did not finish, as tables say it: "OOM rank0", "OOM ranks 2,5; waiting rank1";
    "" when every rank finished."""
    by_status: dict[str, list[int]] = {}
    for entry in record.get("ranks") or []:
        if entry["status"] != "ok":
            by_status.setdefault(entry["status"], []).append(entry["rank"])
    words = []
    for status, ranks in sorted(by_status.items(), key=lambda item: STATUS_ORDER.index(item[0])
                                if item[0] in STATUS_ORDER else len(STATUS_ORDER)):
        label = "OOM" if status == "oom" else status
        words.append(f"{label} rank{ranks[0]}" if len(ranks) == 1 else f"{label} ranks {','.join(map(str, ranks))}")
    return "; ".join(words)


def layout_label(world_size: int, data_parallel: str, tp: int = 1, sequence_parallel: bool = False) -> str:
    """How the ranks share a point, in words: "ddp", "tp 2, sequence parallel", "fsdp 2 x tp 2"."""
    dp = world_size // tp
    if tp == 1:
        label = data_parallel
    elif dp == 1:
        label = f"tp {tp}"
    else:
        label = f"{data_parallel} {dp} x tp {tp}"
    return label + (", sequence parallel" if sequence_parallel else "")

