"""The result record of one point (schema recompute-bench/result/v1), without torch.

`measure.point.run_point` fills it from a measurement; `launch.process.failed_record` builds the
record of a point whose worker left none. The second runs in the sweep parent, which must not
import torch (a CUDA context held for the whole sweep), so nothing here imports it.
"""

from __future__ import annotations

from typing import Any

from recompute_bench.analysis import flops
from recompute_bench.analysis.harness.rank import record_estimate
from recompute_bench.config.schema import Config

SCHEMA = "recompute-bench/result/v1"
FAULT_ENV = "RECOMPUTE_BENCH_FAULT"
"""Fault injection for tests: "KIND:PHASE:STEP[@RANK]" with KIND oom, error, hang, delay (sleep
`measure.faults.FAULT_DELAY_S`) or watchdog (NCCL's watchdog verdict on stderr, then SIGABRT), and
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


def layout_label(world_size: int, data_parallel: str, tp: int = 1, sequence_parallel: bool = False, pp: int = 1,
                 cp: int = 1) -> str:
    """How the ranks share a point, in words: "ddp", "tp 2, sequence parallel", "fsdp 2 x tp 2",
    "pp 2", "fsdp 2 x tp 2 x pp 2", "cp 2 x tp 2"."""
    dp = world_size // (tp * pp * cp)
    if tp == pp == cp == 1:
        label = data_parallel
    else:
        parts = ([f"{data_parallel} {dp}"] * (dp > 1) + [f"cp {cp}"] * (cp > 1) + [f"tp {tp}"] * (tp > 1)
                 + [f"pp {pp}"] * (pp > 1))
        label = " x ".join(parts)
    return label + (", sequence parallel" if sequence_parallel else "")


def pipeline_summary(record: dict) -> dict[str, Any] | None:
    """Per pipeline stage, measured beside estimated: its ranks and model chunks, the micro-batches it
    held at its peak, the activation bytes one micro-batch saves through it and the bytes saved at
    its peak, its allocated peak (GPU), and its share of the step spent computing; the stage that
    bounds memory, in words ("stage 0 holds 4 micro-batches"); the schedule's theoretical bubble beside
    the measured one (the ranks' mean idle share of the step). None without pipeline stages."""
    par = record["config"]["parallel"]
    p = par["pipeline_model_parallel_size"]
    estimated = record["metrics"].get("estimated_stages")
    if p == 1 or not estimated:
        return None

    def largest(entries: list[dict], key: str) -> float | None:
        values = [e[key] for e in entries if e.get(key) is not None]
        return max(values) if values else None

    stages = []
    for est in estimated:
        k = est["pipeline_stage"]
        mine = [e for e in record["ranks"] if e.get("pipeline_stage") == k]
        bubbles = [e["bubble_fraction"] for e in mine if e.get("bubble_fraction") is not None]
        bubble = sum(bubbles) / len(bubbles) if bubbles else None
        stages.append({
            "pipeline_stage": k, "ranks": [e["rank"] for e in mine], "model_chunks": est["model_chunks"],
            "microbatches_in_flight": largest(mine, "microbatches_in_flight"),
            "estimated_microbatches_in_flight": est["microbatches_in_flight"],
            "activation_bytes": largest(mine, "activation_bytes"), "estimated_activation_bytes": est["activation_bytes"],
            "activation_peak_bytes": largest(mine, "activation_peak_bytes"),
            "estimated_activation_peak_bytes": est["activation_peak_bytes"],
            "peak_allocated_bytes": largest(mine, "peak_allocated_bytes"),
            "estimated_peak_allocated_bytes": est["peak_allocated_bytes"],
            "bubble_fraction": bubble, "step_share": None if bubble is None else 1 - bubble,
        })
    # The stage that bounds memory: by the measured allocated peak (GPU), else the measured saved
    # activations at the peak (CPU), else the estimate.
    for key in ("peak_allocated_bytes", "activation_peak_bytes", "estimated_peak_allocated_bytes"):
        if all(s[key] is not None for s in stages):
            bound = max(stages, key=lambda s: s[key])
            break
    held = bound["microbatches_in_flight"] or bound["estimated_microbatches_in_flight"]
    bubbles = [s["bubble_fraction"] for s in stages if s["bubble_fraction"] is not None]
    return {"schedule": par.get("pipeline_parallel_schedule") or ("Interleaved1F1B" if par.get("virtual_pipeline_model_parallel_size") else "1F1B"),
            "num_microbatches": record["config"]["training"]["global_batch_size"]
            // (record["config"]["training"]["micro_batch_size"] * par["data_parallel_size"]),
            "stages": stages, "bounding_stage": bound["pipeline_stage"],
            "summary": f"stage {bound['pipeline_stage']} holds {held:g} micro-batch{'es' if held != 1 else ''}",
            "bubble_fraction": sum(bubbles) / len(bubbles) if bubbles else None,
            "estimated_bubble_fraction": record["metrics"].get("estimated_bubble_fraction")}

