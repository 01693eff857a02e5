"""What `estimate --framework megatron` prints, and what a result record carries beside a Megatron
run's measured figures."""

from __future__ import annotations

from typing import Any

from recompute_bench.analysis import ESTIMATE_SCHEMA
from recompute_bench.analysis.allowance import ALLOWANCE_BYTES, ALLOWANCE_FRACTION, device_bytes_needed
from recompute_bench.analysis.checkpoint import checkpoint_input_bytes
from recompute_bench.analysis.flops import setting_flops
from recompute_bench.analysis.megatron.attention import attention_path
from recompute_bench.analysis.megatron.context_parallel import context_parallel_report, optimizer_shards
from recompute_bench.analysis.megatron.gpu import MegatronRun
from recompute_bench.analysis.megatron.layer import layer_bytes, layer_saved_bytes
from recompute_bench.analysis.megatron.moe import routing_spread
from recompute_bench.analysis.megatron.outside import embedding_saved_bytes, loss_saved_bytes, output_saved_bytes
from recompute_bench.analysis.megatron.stage import ChunkBytes, StagePeak, chunk_bytes, stage_peaks
from recompute_bench.analysis.megatron.terms import stage_terms
from recompute_bench.analysis.megatron_schedule import chunk_forwards_in_flight
from recompute_bench.analysis.paper import (built_minus_paper_bytes, paper_flops_per_step, paper_layer_bytes,
                                            paper_layer_differences)
from recompute_bench.config.pipeline_split import model_chunks
from recompute_bench.config.rules import layers_per_model_chunk
from recompute_bench.config.schema import BadInput, Config, RecomputeConfig, with_setting
from recompute_bench.config.cp_comm import layer_comm_types
from recompute_bench.models.context_parallel import rank_seq_length
from recompute_bench.recompute.settings import selective_settings


def _settings(cfg: Config) -> list[RecomputeConfig]:
    """The settings tabulated: none, every selective subset, full uniform 1 and full block at a few
    layer counts of a model chunk, and cfg's own."""
    n = layers_per_model_chunk(cfg)
    offered = list(cfg.spec.recompute_targets)
    if len(offered) <= 4:
        selective = selective_settings(offered)
    else:  # a MoE model offers up to seven modules: each alone and all of them
        selective = [*selective_settings(offered)[:len(offered)], RecomputeConfig("selective", list(offered))]
    out = [RecomputeConfig(), *selective, RecomputeConfig("full", [], "uniform", 1)]
    out += [RecomputeConfig("full", [], "block", k) for k in sorted({1, n // 4, n // 2, 3 * n // 4, n} - {0})]
    if cfg.recompute.label not in {r.label for r in out}:
        out.insert(0, cfg.recompute)
    return out


def setting_estimate(cfg: Config, run: MegatronRun, routing: str = "balanced") -> dict[str, Any]:
    """One recompute setting: Megatron's bytes per layer and per stage (the peak stage's model
    chunks; MoE layers under the `routing` assumption), the peak rank, FLOPs."""
    peak = max(stage_peaks(cfg, run, routing), key=lambda r: r.peak_allocated_bytes)
    built = model_chunks(cfg, peak.stage)
    chunks = decoder_chunks(cfg, run, peak, routing)
    transient = chunks[-1].layer_backward
    stored = sum(c.stored for c in chunks)
    return {
        "label": cfg.recompute.label,
        "recompute": cfg.record_fields()["recompute"],
        "activation_bytes_per_layer": stored / max(1, sum(c.layers for c in built)),
        "stage_activation_bytes": stored,
        "stage_activation_peak_bytes": stored - chunks[-1].stored + chunks[-1].backward - transient,
        "peak_allocated_bytes": peak.peak_allocated_bytes,
        "peak_stage": peak.stage,
        "peak_phase": peak.phase,
        **setting_flops(cfg, "cuda"),
        **setting_time(cfg, run),
    }


def setting_time(cfg: Config, run: MegatronRun) -> dict[str, Any]:
    """The setting's predicted step at the GPU kind's achieved rates, as the plan prices it
    (`plan.throughput`: step_seconds, tflops_per_gpu, tokens_per_s_per_gpu, mfu, step_parts); every
    field None where the kind has no rates or the time model cannot price the run."""
    from recompute_bench.analysis.gpu_rates import achieved_rates
    from recompute_bench.analysis.megatron.parameters import stage_parameter_groups
    from recompute_bench.analysis.megatron.plan import throughput
    from recompute_bench.analysis.megatron.time_model import step_time

    try:
        rates = achieved_rates(run.gpu)
        st = step_time(cfg, run, rates, [stage_parameter_groups(cfg, s) for s in range(cfg.parallel.pipeline_model_parallel_size)])
    except BadInput:
        return dict.fromkeys(("step_seconds", "tflops_per_gpu", "tokens_per_s_per_gpu", "mfu", "step_parts"))
    return {"step_seconds": st.step_seconds, **throughput(cfg, rates, st)}


def decoder_chunks(cfg: Config, run: MegatronRun, peak: StagePeak, routing: str = "balanced") -> list[ChunkBytes]:
    """The model chunks of `peak`'s stage without their multi-token-prediction layers (what the
    settings table and a record count per decoder layer): the stage's own chunks where they hold
    none, built again without them where they do."""
    return [ch if not c.mtp else chunk_bytes(cfg, run, c.layers, c.first_layer, routing)
            for c, ch in zip(model_chunks(cfg, peak.stage), peak.chunks)]


def _stage_row(cfg: Config, run: MegatronRun, r: StagePeak, fraction: float, fixed: float) -> dict[str, Any]:
    """One stage: its steady-state peak item by item and as Megatron's terms, its first iteration's
    peak (before the optimizer's first step creates the Adam moments), and what a memory line after
    iterations 1 and 2 reports (`StagePeak.peak_after`: with CUDA graphs the eager iterations only)."""
    return {"stage": r.stage, "peak_allocated_bytes": r.peak_allocated_bytes, "phase": r.phase,
            "device_bytes_needed": device_bytes_needed(r.peak_allocated_bytes, fraction, fixed),
            "first_iteration_peak_allocated_bytes": r.first_iteration_peak_allocated_bytes,
            "first_iteration_phase": r.first_iteration_phase,
            "first_iteration_breakdown": dict(r.first_iteration_items),
            # what a Megatron or Bridge memory line after iteration k reports (max allocated since start)
            "peak_after_iteration": {str(k): r.peak_after(k) for k in (1, 2)},
            "iteration_peaks": [{"from_iteration": i, "bytes": b, "phase": ph} for i, b, ph in r.iteration_peaks],
            "bytes_after_step": r.static_bytes, "parameters_on_rank": r.parameters, "breakdown": dict(r.items),
            "phase_peaks": dict(r.phase_peaks), "terms": stage_terms(cfg, r)}


def estimate_report(cfg: Config, run: MegatronRun, allowance_fraction: float = ALLOWANCE_FRACTION,
                    allowance_bytes: float = ALLOWANCE_BYTES) -> dict[str, Any]:
    """What `estimate --framework megatron` prints, in the layout of `planner.estimate_report`: the
    settings table, the paper's Table 2 beside Megatron's layer, the peak rank's breakdown of cfg's
    own setting, and every pipeline stage's peak and parts."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    stages = stage_peaks(cfg, run)
    peak = max(stages, key=lambda r: r.peak_allocated_bytes)
    settings = [setting_estimate(with_setting(cfg, r), run) for r in _settings(cfg)]
    for row in settings:
        row["device_bytes_needed"] = device_bytes_needed(row["peak_allocated_bytes"], allowance_fraction, allowance_bytes)
    # The paper has no context parallel: its formula is taken at a CP rank's s/cp tokens.
    cp, local = par.context_parallel_size, rank_seq_length(cfg)
    paper_rows = []
    for name, modules, kind in (("none", (), "none"), ("selective", ("core_attn",), "selective"), ("full", None, "full")):
        paper_rows.append({"recompute": name,
                           "paper_bytes": paper_layer_bytes(local, tr.micro_batch_size, m.hidden_size,
                                                            m.num_attention_heads, par.tensor_model_parallel_size,
                                                            par.sequence_parallel, kind),
                           "built_bytes": checkpoint_input_bytes(cfg) if modules is None else
                           layer_bytes(cfg, run, modules, moe=bool(m.num_moe_experts and m.moe_layers)),
                           "paper_flops": paper_flops_per_step(cfg, kind)})
    path = attention_path(cfg, run)
    differences = [d for d in paper_layer_differences(cfg, "cuda") if not d.startswith(("attention runs", "routing is"))
                   and not (cp > 1 and d.startswith("RoPE"))]
    if path in ("flash", "fused"):
        differences.insert(0, f"attention runs Transformer Engine's {path} kernel, not the paper's explicit softmax path")
    if cp > 1:
        kinds = " ".join(sorted(set(layer_comm_types(str(par.cp_comm_type), m.num_layers))))
        differences.insert(0, f"context parallel {cp} ({kinds}): a rank holds s/cp = {local} tokens of each sequence, "
                              f"the paper's formula is taken at s/cp (its s^2 scores term then counts s/cp x s/cp where "
                              f"a rank's queries meet all s keys), and Transformer Engine's CP attention keeps its own "
                              f"tensors (no QKV output)")
    if m.transformer_impl == "transformer_engine" or m.activation == "swiglu":
        differences.append("Megatron's layer keeps what its modules keep (TE's fused norm-linear, fused bias-activation)")
    modules = cfg.recompute.modules if cfg.recompute.granularity == "selective" else ()
    return {
        "schema": ESTIMATE_SCHEMA,
        "framework": "megatron",
        "workload": cfg.workload,
        "config": cfg.to_dict(),
        "recompute": cfg.record_fields()["recompute"],
        "device": "cuda",
        "gpu": run.gpu,
        "cublas_workspace_config": run.cublas_workspace_config,
        "attention_kernel": path,
        "context_parallel": context_parallel_report(cfg, path),
        "num_microbatches": cfg.num_microbatches,
        "microbatches_in_flight": chunk_forwards_in_flight(cfg, 0) / (par.virtual_pipeline_model_parallel_size or 1),
        "allowance": {"fraction": allowance_fraction, "bytes": allowance_bytes},
        "setting": {**setting_estimate(cfg, run),
                    "device_bytes_needed": device_bytes_needed(peak.peak_allocated_bytes, allowance_fraction, allowance_bytes),
                    "first_iteration_peak_allocated_bytes": max(r.first_iteration_peak_allocated_bytes for r in stages),
                    "peak_after_iteration": {str(k): max(r.peak_after(k) for r in stages) for k in (1, 2)},
                    "layer_saved_bytes": layer_saved_bytes(cfg, run, modules, moe=bool(m.num_moe_experts and m.moe_layers)),
                    "breakdown": dict(peak.items), "phase_peaks": dict(peak.phase_peaks),
                    "parameters_on_rank": peak.parameters},
        "stages": [_stage_row(cfg, run, r, allowance_fraction, allowance_bytes) for r in stages],
        "settings": settings,
        "paper": {"differences": differences, "norm_stats_bytes": built_minus_paper_bytes(cfg, "cuda") / cp,
                  "rows": paper_rows},
        "routing": _routing(cfg, run, peak),
        "other_optimizer": None if optimizer_shards(cfg) == 1 else {
            "use_distributed_optimizer": not par.use_distributed_optimizer,
            "peak_allocated_bytes": max(r.peak_allocated_bytes for r in stage_peaks(
                with_setting(cfg, use_distributed_optimizer=not par.use_distributed_optimizer), run))},
    }


def _routing(cfg: Config, run: MegatronRun, peak: StagePeak) -> dict[str, Any] | None:
    """The routing assumption of a MoE model's estimate and the spread it implies (moe.py): the rows
    a MoE layer's experts run on a rank per micro-batch and the whole-rank peak, balanced (the
    estimate) and at the bound (every token of the dispatch group routed to this rank's experts)."""
    if not cfg.model.num_moe_experts:
        return None
    bound = max(stage_peaks(cfg, run, "bound"), key=lambda r: r.peak_allocated_bytes)
    return {"assumption": "balanced", "routed_rows": routing_spread(cfg),
            "peak_allocated_bytes": {"balanced": peak.peak_allocated_bytes, "bound": bound.peak_allocated_bytes},
            "dispatcher": cfg.model.moe_token_dispatcher_type}


def record_estimate(cfg: Config, run: MegatronRun) -> dict[str, float]:
    """What a result record carries beside a Megatron run's measured figures (the keys of
    `rank.record_estimate`): one micro-batch's activations over the whole model and per layer, as
    Megatron's layers keep them, the hardware FLOPs, and the steady-state peak of the most loaded
    stage (iteration 2 on)."""
    stages = stage_peaks(cfg, run)
    # every model chunk of every stage (their layer kinds differ with moe_layer_freq)
    total = sum(c.stored for peak in stages for c in decoder_chunks(cfg, run, peak))
    per_layer = total / cfg.model.num_layers
    outside = embedding_saved_bytes(cfg) + output_saved_bytes(cfg) + loss_saved_bytes(cfg)
    return {
        "estimated_activation_bytes": total + outside,
        "estimated_activation_bytes_per_layer": per_layer,
        "estimated_hardware_flops_per_step": setting_flops(cfg, "cuda")["hardware_flops_per_step"],
        "estimated_peak_allocated_bytes": max(r.peak_allocated_bytes for r in stages),
    }
