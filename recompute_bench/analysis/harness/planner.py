"""Settings compared side by side: each recompute setting's activations, whole-rank peak, FLOPs and
overhead (`setting_estimate`), everything `estimate` prints (`estimate_report`), and the planner
that picks the fastest setting fitting a memory budget or says what would fit (`plan`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from recompute_bench.analysis import ESTIMATE_SCHEMA, flops
from recompute_bench.analysis.allowance import ALLOWANCE_BYTES, ALLOWANCE_FRACTION, device_bytes_needed, gib_of
from recompute_bench.analysis.checkpoint import checkpoint_input_bytes
from recompute_bench.analysis.harness.layer import attention_kernel, layer_activation_bytes, layer_saved_bytes
from recompute_bench.analysis.harness.rank import (microbatches_in_flight, optimizer_bytes_per_parameter,
                                                   peak_rank_memory, stage_memories)
from recompute_bench.analysis.harness.stage import stage_activations
from recompute_bench.analysis.paper import (built_minus_paper_bytes, paper_flops_per_step, paper_layer_bytes,
                                            paper_layer_differences)
from recompute_bench.config.rules import layers_per_model_chunk
from recompute_bench.config.schema import Config, RecomputeConfig, with_setting
from recompute_bench.models import device_kind
from recompute_bench.models.context_parallel import rank_seq_length
from recompute_bench.recompute.policy import megatron_flags
from recompute_bench.recompute.settings import selective_settings

PLAN_SCHEMA = "recompute-bench/plan/v1"
"""The version of this harness's `plan --json` layout."""


def setting_estimate(cfg: Config, device: str = "cuda") -> dict[str, Any]:
    """One recompute setting: activation bytes per layer, stage activations, whole-rank peak, FLOPs."""
    acts = stage_activations(cfg, device)
    rank = peak_rank_memory(cfg, device)
    return {
        "label": cfg.recompute.label,
        "recompute": cfg.record_fields()["recompute"],
        "activation_bytes_per_layer": acts.per_layer_bytes,
        "stage_activation_bytes": acts.stored_bytes,
        "stage_activation_peak_bytes": acts.peak_bytes,
        "peak_allocated_bytes": rank.peak_allocated_bytes,
        "peak_stage": rank.stage,
        "peak_phase": rank.phase,
        **flops.setting_flops(cfg, device),
    }


def listed_settings(cfg: Config, device: str = "cuda") -> list[RecomputeConfig]:
    """The settings `estimate` tabulates: none, every selective subset, full uniform 1 and the
    uniform chunk with the lowest peak, and full block at a few layer counts (of a model chunk)."""
    n_layers = layers_per_model_chunk(cfg)
    out = [RecomputeConfig()] + selective_settings(cfg.spec.recompute_targets) + [RecomputeConfig("full", [], "uniform", 1)]
    best = _best_uniform(cfg, n_layers, device)
    if best != 1:
        out.append(RecomputeConfig("full", [], "uniform", best))
    for n in sorted({1, n_layers // 4, n_layers // 2, 3 * n_layers // 4, n_layers} - {0}):
        out.append(RecomputeConfig("full", [], "block", n))
    if cfg.recompute.label not in {r.label for r in out}:
        out.insert(0, cfg.recompute)
    return out


def _best_uniform(cfg: Config, n_layers: int, device: str = "cuda") -> int:
    """The uniform chunk size with the lowest backward peak (every chunk size costs the same FLOPs)."""
    return min(range(1, n_layers + 1),
               key=lambda n: (stage_activations(with_setting(cfg, RecomputeConfig("full", [], "uniform", n)), device).peak_bytes, n))


def estimate_report(cfg: Config, device: str = "cuda", allowance_fraction: float = ALLOWANCE_FRACTION,
                    allowance_bytes: float = ALLOWANCE_BYTES) -> dict[str, Any]:
    """Everything `estimate` prints: the settings table, the paper's Table 2 for this shape, the
    whole-rank breakdown of cfg's own setting on its peak stage, and every pipeline stage's peak."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    rank = peak_rank_memory(cfg, device)
    settings = [setting_estimate(with_setting(cfg, r), device) for r in listed_settings(cfg, device)]
    for row in settings:
        row["device_bytes_needed"] = device_bytes_needed(row["peak_allocated_bytes"], allowance_fraction, allowance_bytes)
    stats = built_minus_paper_bytes(cfg, device)
    paper_rows = []
    for name, built_modules, kind in (("none", None, "none"), ("selective", ["core_attn"], "selective"),
                                      ("full", "full", "full")):
        built = (checkpoint_input_bytes(cfg) if built_modules == "full"
                 else layer_activation_bytes(cfg, built_modules or (), device))
        paper_rows.append({"recompute": name,
                           "paper_bytes": paper_layer_bytes(rank_seq_length(cfg), tr.micro_batch_size, m.hidden_size,
                                                            m.num_attention_heads, par.tensor_model_parallel_size,
                                                            par.sequence_parallel, kind),
                           "built_bytes": built,
                           "paper_flops": paper_flops_per_step(cfg, kind)})
    return {
        "schema": ESTIMATE_SCHEMA,
        "workload": cfg.workload,
        "config": cfg.to_dict(),
        "recompute": cfg.record_fields()["recompute"],
        "device": device_kind(device),
        "attention_kernel": attention_kernel(cfg, device),
        "num_microbatches": cfg.num_microbatches,
        "microbatches_in_flight": microbatches_in_flight(cfg, 0),
        "allowance": {"fraction": allowance_fraction, "bytes": allowance_bytes},
        "setting": {**setting_estimate(cfg, device),
                    "device_bytes_needed": device_bytes_needed(rank.peak_allocated_bytes, allowance_fraction, allowance_bytes),
                    "layer_saved_bytes": layer_saved_bytes(cfg, cfg.recompute.modules if cfg.recompute.granularity == "selective" else (), device),
                    "breakdown": {**rank.items, "backward peak": rank.backward_peak_bytes,
                                  "optimizer step peak": rank.optimizer_step_bytes},
                    "parameters_on_rank": rank.parameters},
        "stages": [{"stage": r.stage, "peak_allocated_bytes": r.peak_allocated_bytes, "phase": r.phase,
                    "device_bytes_needed": device_bytes_needed(r.peak_allocated_bytes, allowance_fraction, allowance_bytes),
                    "microbatches_in_flight": microbatches_in_flight(cfg, r.stage), "parameters_on_rank": r.parameters,
                    "breakdown": {**r.items, "backward peak": r.backward_peak_bytes,
                                  "optimizer step peak": r.optimizer_step_bytes}}
                   for r in stage_memories(cfg, device)],
        "settings": settings,
        "paper": {"differences": paper_layer_differences(cfg, device), "norm_stats_bytes": stats, "rows": paper_rows},
        # The same setting with the other optimizer layout, where data parallelism makes it matter.
        "other_optimizer": None if par.data_parallel_size == 1 else {
            "use_distributed_optimizer": not par.use_distributed_optimizer,
            "peak_allocated_bytes": peak_rank_memory(
                with_setting(cfg, use_distributed_optimizer=not par.use_distributed_optimizer), device).peak_allocated_bytes},
    }


def setting_candidates(cfg: Config, device: str) -> list[dict[str, Any]]:
    """Every setting worth planning with: none, each selective subset, the best uniform chunk and
    every block count (uniform chunks all cost the same FLOPs; block trades FLOPs for memory)."""
    n_layers = layers_per_model_chunk(cfg)
    settings = [RecomputeConfig()] + selective_settings(cfg.spec.recompute_targets)
    settings.append(RecomputeConfig("full", [], "uniform", _best_uniform(cfg, n_layers, device)))
    settings += [RecomputeConfig("full", [], "block", n) for n in range(1, n_layers + 1)]
    return [setting_estimate(with_setting(cfg, r), device) for r in settings]


def _speed_key(row: dict[str, Any]) -> tuple:
    # Fastest first: hardware FLOPs; at equal FLOPs recompute less (norm recompute costs memory-bound
    # time the FLOPs do not show), then the lower peak.
    r = row["recompute"]
    work = len(r["modules"]) if r["granularity"] == "selective" else 0
    return row["hardware_flops_per_step"], work, row["peak_allocated_bytes"]


def plan(cfg: Config, budget_bytes: float, device: str = "cuda", allowance_fraction: float = ALLOWANCE_FRACTION,
         allowance_bytes: float = ALLOWANCE_BYTES) -> dict[str, Any]:
    """The settings that fit `budget_bytes` of device memory per GPU, fastest first (each with
    Megatron-LM's flags for it), a recommended one, and, when none fits, the changes of layout that
    would make one fit."""
    rows = setting_candidates(cfg, device)
    for row in rows:
        row["device_bytes_needed"] = device_bytes_needed(row["peak_allocated_bytes"], allowance_fraction, allowance_bytes)
        row["megatron_flags"] = megatron_flags(RecomputeConfig(**row["recompute"]))
    fitting = sorted((r for r in rows if r["device_bytes_needed"] <= budget_bytes), key=_speed_key)
    # Of the block counts that fit, only the smallest is worth listing: more layers recomputed is slower.
    shown, block_seen = [], False
    for row in fitting:
        if row["recompute"]["method"] == "block":
            if block_seen:
                continue
            block_seen = True
        shown.append(row)
    out: dict[str, Any] = {"schema": PLAN_SCHEMA, "workload": cfg.workload, "config": cfg.to_dict(),
                           "device": device_kind(device), "budget_bytes": budget_bytes,
                           "allowance": {"fraction": allowance_fraction, "bytes": allowance_bytes},
                           "fits": shown, "recommended": None, "reason": None, "would_fit": []}
    if shown:
        best = shown[0]
        out["recommended"] = best["label"]
        out["reason"] = (f"fastest setting that fits: {100 * best['recompute_overhead']:.1f}% recompute overhead, "
                         f"needs {gib_of(best['device_bytes_needed'], budget_bytes)}")
        return out
    smallest = min(rows, key=lambda r: r["device_bytes_needed"])
    out["reason"] = (f"nothing fits: the smallest setting ({smallest['label']}) needs "
                     f"{gib_of(smallest['device_bytes_needed'], budget_bytes)} (the allocated peak plus the allowance: "
                     f"{100 * allowance_fraction:g}% and {allowance_bytes / 2**30:g} GiB, --allowance-fraction, --allowance-gb)")
    out["would_fit"] = _what_would_fit(cfg, budget_bytes, device, allowance_fraction, allowance_bytes)
    return out


def _what_would_fit(cfg: Config, budget: float, device: str, fraction: float, fixed: float) -> list[dict[str, Any]]:
    """Changes of layout, each with the fastest setting that then fits (or the smallest need)."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    t, p = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    changes: list[tuple[str, Config | None]] = []
    nt = t * 2
    if m.num_attention_heads % nt == 0 and m.groups % nt == 0:  # Megatron shards whole heads and groups
        changes.append((f"--tp {nt} --sequence-parallel", with_setting(cfg, tensor_model_parallel_size=nt, sequence_parallel=True)))
    else:
        changes.append((f"more tensor parallel (--tp {nt} does not divide {m.num_attention_heads} heads, {m.groups} groups)", None))
    if t > 1 and not par.sequence_parallel:
        changes.append(("--sequence-parallel", with_setting(cfg, sequence_parallel=True)))
    cp = par.context_parallel_size
    if tr.seq_length % (4 * cp) == 0 and not (m.num_moe_experts or m.multi_latent_attention):
        # context parallel: every token's activations and the loss's logits over twice the ranks (`plan --gpus`)
        changes.append((f"--cp {2 * cp}", with_setting(cfg, context_parallel_size=2 * cp)))
    if tr.micro_batch_size > 1:
        smaller = dataclasses.replace(cfg, training=dataclasses.replace(tr, micro_batch_size=1))
        changes.append(("--micro-batch-size 1", smaller))
    for k in (2, 4):
        if m.num_layers % (p * k) == 0:
            changes.append((f"--pp {p * k}", with_setting(cfg, pipeline_model_parallel_size=p * k)))
            break
    if par.data_parallel_size > 1 and not par.use_distributed_optimizer:
        changes.append(("--set parallel.use_distributed_optimizer=true", with_setting(cfg, use_distributed_optimizer=True)))
    out = []
    for flag, changed in changes:
        if changed is None:
            out.append({"change": flag, "fits": False, "setting": "-", "device_bytes_needed": None, "recompute_overhead": None})
            continue
        rows = setting_candidates(changed, device)
        for row in rows:
            row["device_bytes_needed"] = device_bytes_needed(row["peak_allocated_bytes"], fraction, fixed)
        fit = sorted((r for r in rows if r["device_bytes_needed"] <= budget), key=_speed_key)
        best = fit[0] if fit else min(rows, key=lambda r: r["device_bytes_needed"])
        out.append({"change": flag, "fits": bool(fit), "setting": best["label"],
                    "device_bytes_needed": best["device_bytes_needed"], "recompute_overhead": best["recompute_overhead"]})
    # Offload: what the optimizer state and the activations cost, the two things host memory can take.
    rank = peak_rank_memory(with_setting(cfg, RecomputeConfig("full", [], "uniform", 1)), device)
    held = optimizer_bytes_per_parameter(cfg)

    def state(phase: str) -> float:
        return sum(h.per_parameter for h in held if h.state and getattr(h, phase)) * rank.parameters

    without = device_bytes_needed(max(rank.backward_peak_bytes - state("backward"),
                                      rank.optimizer_step_bytes - state("step")), fraction, fixed)
    out.append({"change": "offload the optimizer state to host memory (with full uniform 1)", "fits": without <= budget,
                "setting": "full uniform 1", "device_bytes_needed": without,
                "recompute_overhead": flops.setting_flops(with_setting(cfg, RecomputeConfig("full", [], "uniform", 1)), device)["recompute_overhead"]})
    return out
