"""Long sequences on a number of GPUs: which context-parallel size, which recompute setting.

`plan_context_parallel` lays the GPUs out as dp x cp (times the tensor- and pipeline-parallel sizes
given) for every cp the sequence allows, and for each layout asks the planner (`planner.plan`) for
the fastest recompute setting that fits the budget, or the smallest need when none does. Context
parallel divides every token's activations and the loss's logits by cp; FSDP (use_distributed_optimizer)
shards the weights and optimizer state over dp x cp either way; with the global batch fixed, fewer
data-parallel replicas mean more micro-batches per rank.

The recommendation is the fitting layout with the least recompute overhead; at equal overhead the
smaller cp, whose attention exchanges fewer K/V blocks (the exchange is not priced here).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from recompute_bench.analysis.allowance import ALLOWANCE_BYTES, ALLOWANCE_FRACTION, gib_of
from recompute_bench.analysis.harness import planner
from recompute_bench.config.rules import validate
from recompute_bench.config.schema import BadInput, Config

CP_PLAN_SCHEMA = "recompute-bench/cp-plan/v1"


def cp_layouts(cfg: Config, gpus: int) -> list[tuple[int, int]]:
    """(cp, dp) for every context-parallel size that divides the GPUs left after tensor and pipeline
    parallel, smallest cp first."""
    par = cfg.parallel
    per = par.tensor_model_parallel_size * par.pipeline_model_parallel_size
    if gpus < 1 or gpus % per:
        raise BadInput(f"--gpus {gpus} is not a multiple of tensor x pipeline parallel ({per}); pass --gpus as a multiple "
                       f"of {per}")
    rest = gpus // per
    return [(cp, rest // cp) for cp in range(1, rest + 1) if rest % cp == 0]


def with_layout(cfg: Config, cp: int, dp: int) -> Config:
    """cfg on dp data-parallel replicas of cp context-parallel ranks (validated: BadInput when the
    sequence or the global batch does not split)."""
    out = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, context_parallel_size=cp,
                                                                 data_parallel_size=dp))
    validate(out)
    return out


def plan_context_parallel(cfg: Config, gpus: int, budget_bytes: float, device: str = "cuda",
                          allowance_fraction: float = ALLOWANCE_FRACTION,
                          allowance_bytes: float = ALLOWANCE_BYTES) -> dict[str, Any]:
    """One row per (cp, dp) layout of `gpus` (`cp_layouts`): the fastest recompute setting that fits
    `budget_bytes` per GPU and its need, or why none does; the recommended layout and setting."""
    rows = []
    for cp, dp in cp_layouts(cfg, gpus):
        row: dict[str, Any] = {"context_parallel_size": cp, "data_parallel_size": dp, "fits": False, "setting": None,
                               "device_bytes_needed": None, "recompute_overhead": None, "reason": None,
                               "megatron_flags": None}
        try:
            laid = with_layout(cfg, cp, dp)
        except BadInput as e:
            row["reason"] = str(e).split(";")[0]
            rows.append(row)
            continue
        result = planner.plan(laid, budget_bytes, device, allowance_fraction, allowance_bytes)
        row["num_microbatches"] = laid.num_microbatches
        if result["fits"]:
            best = result["fits"][0]
            row.update(fits=True, setting=best["label"], device_bytes_needed=best["device_bytes_needed"],
                       recompute_overhead=best["recompute_overhead"], megatron_flags=best["megatron_flags"],
                       fitting=[r["label"] for r in result["fits"]])
        else:
            smallest = min(planner.setting_candidates(laid, device), key=lambda r: r["peak_allocated_bytes"])
            need = planner.device_bytes_needed(smallest["peak_allocated_bytes"], allowance_fraction, allowance_bytes)
            row.update(setting=smallest["label"], device_bytes_needed=need, recompute_overhead=smallest["recompute_overhead"],
                       reason=f"nothing fits: the smallest ({smallest['label']}) needs {need / 2**30:.1f} GiB")
        rows.append(row)
    fitting = [r for r in rows if r["fits"]]
    best = min(fitting, key=lambda r: (r["recompute_overhead"], r["context_parallel_size"])) if fitting else None
    return {"schema": CP_PLAN_SCHEMA, "workload": cfg.workload, "config": cfg.to_dict(), "device": device, "gpus": gpus,
            "budget_bytes": budget_bytes, "allowance": {"fraction": allowance_fraction, "bytes": allowance_bytes},
            "layouts": rows,
            "recommended": None if best is None else {k: best[k] for k in ("context_parallel_size", "data_parallel_size",
                                                                            "setting", "megatron_flags")},
            "reason": (f"least recompute overhead that fits: cp {best['context_parallel_size']} x dp "
                       f"{best['data_parallel_size']} with {best['setting']} ({100 * best['recompute_overhead']:.1f}% "
                       f"overhead, {gib_of(best['device_bytes_needed'], budget_bytes)})"
                       if best else f"no context-parallel size fits {budget_bytes / 2**30:.1f} GiB on {gpus} GPUs")}
