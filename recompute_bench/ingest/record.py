"""A parsed run and its config -> a `recompute-bench/result/v1` record, as `run` writes for a point
it measured itself: the same keys, what the file did not give as None ("not measured"), never a
guess, and the analytical estimate (framework megatron for Megatron-LM and Bridge runs) beside
every measured figure, for the record and for each rank. `source` says where the figures came from:
the format, the file, the steps used and the rule that chose them, and what the memory figures are.
"""

from __future__ import annotations

from typing import Any, Callable

from recompute_bench.analysis import flops
from recompute_bench.analysis.harness.rank import rank_memory
from recompute_bench.analysis.megatron import COMPUTE_CAPABILITY, DEFAULT_GPU, MegatronRun, stage_peak
from recompute_bench.analysis.megatron import record_estimate as megatron_record_estimate
from recompute_bench.config.presets import gpu_type
from recompute_bench.config.schema import Config
from recompute_bench.ingest.parsed import ParsedRun
from recompute_bench.ingest.timing import window
from recompute_bench.measure.record import SCHEMA, rank_summary, unmeasured_metrics, unmeasured_rank
from recompute_bench.measure.telemetry import package_version


def rank_stage(cfg: Config, rank: int) -> int:
    """The pipeline stage of a global rank: Megatron orders ranks tp-cp-ep-dp-pp, pipeline outermost
    (megatron/core/parallel_state.py, `initialize_model_parallel`, order="tp-cp-ep-dp-pp"); torchtitan's
    device mesh puts pp first too."""
    par = cfg.parallel
    return rank // (par.world_size // par.pipeline_model_parallel_size)


def megatron_run(device_name: str | None, cublas_workspace_config: str | None = None) -> MegatronRun:
    """Where an imported Megatron run ran, for its estimate: the GPU kind its device names (h100 where
    it names none) and CUBLAS_WORKSPACE_CONFIG where the file's environment sets it (a model_config.yaml's
    ENV_VARS; a log does not show it: torch's default)."""
    kind = gpu_type(device_name or "")
    return MegatronRun(kind if kind in COMPUTE_CAPABILITY else DEFAULT_GPU, cublas_workspace_config)


FIRST_ITERATION = "the first iteration (before the optimizer's first step creates the Adam moments)"
STEADY = "the steady state (iteration 2 on)"


def before_capture(after_step: int) -> str:
    """What a memory line after iteration `after_step` describes when the CUDA graphs come later."""
    return f"iterations 1 to {after_step} (eager, before the CUDA graph capture)"


def stage_estimate(cfg: Config, device_name: str | None,
                   cublas_workspace_config: str | None = None) -> Callable[[int, int | None], tuple[float, str]]:
    """The estimated peak allocated bytes of a pipeline stage for the framework that ran (Megatron's
    own terms, `analysis.megatron`, else this harness's), as of the iteration a memory line was
    printed after: a Megatron line after iteration 1 reports the first iteration's peak, which the
    Adam moments do not yet weigh on (`stage.first_iteration_peak`); a later line the most of every
    phase run by then (`StagePeak.peak_after`: before a CUDA graph capture, the eager iterations'),
    else the steady state. Returns (bytes, what they describe)."""
    if cfg.training.framework == "megatron":
        run = megatron_run(device_name, cublas_workspace_config)

        def megatron(stage: int, after_step: int | None) -> tuple[float, str]:
            peak = stage_peak(cfg, stage, run)
            if after_step == 1:
                return peak.first_iteration_peak_allocated_bytes, FIRST_ITERATION
            if after_step is None or peak.peak_after(after_step) == peak.peak_allocated_bytes:
                return peak.peak_allocated_bytes, STEADY
            return peak.peak_after(after_step), before_capture(after_step)
        return megatron
    return lambda stage, after_step: (rank_memory(cfg, stage, "cuda").peak_allocated_bytes, STEADY)


def logged_memory(parsed: ParsedRun, cfg: Config, run: MegatronRun) -> list[dict[str, Any]]:
    """Each memory line of a Megatron or Bridge log beside the estimate of what it reports: the
    rank's stage's `StagePeak.peak_after` the iteration it was printed after (framework megatron)."""
    if not parsed.peaks_since_start or cfg.training.framework != "megatron":
        return []
    world, peaks, out = cfg.parallel.world_size, {}, []
    for m in parsed.memory_lines:
        rank = world - 1 if m.rank == -1 else m.rank
        stage = rank_stage(cfg, rank)
        if stage not in peaks:
            peaks[stage] = stage_peak(cfg, stage, run)
        after = m.after_step or 1
        estimated = peaks[stage].peak_after(after)
        describes = FIRST_ITERATION if after == 1 else \
            STEADY if estimated == peaks[stage].peak_allocated_bytes else before_capture(after)
        out.append({"rank": rank, "stage": stage, "after_iteration": after, "line": m.line,
                    "peak_allocated_bytes": m.peak_allocated_bytes, "estimated_peak_allocated_bytes": estimated,
                    "estimate_describes": describes})
    return out


def _workspace(run: ParsedRun) -> str | None:
    value = run.env.get("CUBLAS_WORKSPACE_CONFIG")
    return None if value is None else str(value)


def _rank_entries(run: ParsedRun, cfg: Config, device_name: str, failure: dict | None) -> list[dict]:
    world = cfg.parallel.world_size
    memory = {(world - 1 if r == -1 else r): m for r, m in run.ranks.items()}  # -1: the last rank (Megatron golden)
    ranks = sorted(set(memory) | ({failure["rank"]} if failure and failure.get("rank") is not None else set()))
    estimate, estimates = stage_estimate(cfg, device_name, _workspace(run)), {}
    entries = []
    for r in ranks:
        stage = rank_stage(cfg, r)
        m = memory.get(r)
        # Megatron's peaks count since the process started: a line after iteration 1 holds the first
        # iteration's peak, a later one the steady state's (torchtitan resets them: always steady).
        after = m.after_step if m is not None and run.peaks_since_start else None
        if (stage, after == 1) not in estimates:
            estimates[stage, after == 1] = estimate(stage, after)
        mine = failure if failure and failure.get("rank") == r else None
        entry = unmeasured_rank(r, device_name, "oom" if mine else "ok",
                                None if mine is None else {k: mine[k] for k in ("step", "phase", "message")})
        if m is not None:
            entry.update(peak_allocated_bytes=m.peak_allocated_bytes, peak_reserved_bytes=m.peak_reserved_bytes,
                         alloc_retries=m.alloc_retries, after_step=m.after_step)
            if run.peaks_since_start:  # the whole run's peak and, for lack of a reset after warm-up, the record's
                entry.update(run_peak_allocated_bytes=m.peak_allocated_bytes, run_peak_reserved_bytes=m.peak_reserved_bytes)
        estimated, describes = estimates[stage, after == 1]
        entry.update(stage=stage, estimated_peak_allocated_bytes=estimated, estimate_describes=describes,
                     nvml_total_bytes=run.failure.device_total_bytes if run.failure else None)
        entries.append(entry)
    return entries


def import_record(run: ParsedRun, cfg: Config, *, device_name: str | None = None) -> dict[str, Any]:
    """The result record of an imported run. `device_name` stands where the file names no device."""
    device = run.device_name or device_name
    tr, world = cfg.training, cfg.parallel.world_size
    metrics = unmeasured_metrics(cfg, "cuda")
    if cfg.training.framework == "megatron":  # the estimate of the framework that ran
        metrics.update(megatron_record_estimate(cfg, megatron_run(device, _workspace(run))))
    chosen = window(run.timing, run.steps) if run.steps else None
    step_time = chosen.value("step_time_s") if chosen else None
    tflops = chosen.value("tflops_per_gpu") if chosen else None
    tps = chosen.value("tokens_per_s_per_gpu") if chosen else None
    reported = {}
    if run.format == "torchtitan" and tps:
        # torchtitan's tflops counts its own FLOPs per token; the record's is Megatron's model FLOPs
        # formula over the step time its tokens per second give.
        reported = {"tflops_per_gpu": tflops, "tokens_per_s_per_gpu": tps}
        step_time = tr.global_batch_size * tr.seq_length / (tps * world)
        tflops = None
    if tflops is None and step_time:
        tflops = metrics["model_flops_per_step"] / step_time / world / 1e12
    source, peak = flops.peak(device or "", tr.precision) or (None, None)  # the exact CUDA name, else none
    metrics.update(
        peak_tflops=peak / 1e12 if peak else None, peak_source=source,
        step_time_s=step_time, step_times_s=[s.step_time_s for s in chosen.steps] if chosen else [],
        tflops_per_gpu=tflops,
        tokens_per_s_per_gpu=tr.global_batch_size * tr.seq_length / step_time / world if step_time else None,
        mfu=metrics["model_flops_per_step"] / step_time / world / peak if step_time and peak else None,
        hfu=metrics["hardware_flops_per_step"] / step_time / world / peak if step_time and peak else None,
        loss=next((s.loss for s in run.steps if s.loss is not None), None),
    )
    failure = None
    if run.failure is not None:
        last = max((s.step for s in run.steps), default=None)
        failure = {"rank": run.failure.rank, "step": None if last is None else last + 1, "phase": None,
                   "message": run.failure.message}
    # What ran is the source's; of this machine only the importing package is recorded.
    env = {"device": "cuda", "device_name": device, "cpu": None, "torch_version": None, "cuda_version": None,
           "package_version": package_version(), "git_sha": None, "hostname": None, "time": run.time, "tf32": None}
    record = {
        "schema": SCHEMA,
        **cfg.record_fields(),
        "env": env,
        "status": "oom" if failure else "ok",
        "failure": failure,
        "point": {"name": run.path.stem, "run_id": None},
        "launch": {"world_size": world, "nnodes": None, "data_parallel": "ddp"},
        "ranks": _rank_entries(run, cfg, device or "", failure),
        "metrics": metrics,
        "source": {
            "format": run.format, "file": str(run.path), "config_file": str(run.config_file) if run.config_file else None,
            "steps": [s.step for s in chosen.steps] if chosen else [], "timing": chosen.rule if chosen else None,
            "memory": run.memory_rule, "reported": reported or None,
        },
    }
    measured = [e for e in record["ranks"] if e["peak_allocated_bytes"] is not None]
    if measured and all(e.get("estimate_describes") == FIRST_ITERATION for e in measured):
        # every figure the file gives is iteration 1's: the record's estimate is that iteration's too
        metrics["estimated_peak_allocated_bytes"] = max(e["estimated_peak_allocated_bytes"] for e in measured)
        record["source"]["memory"] += "; after iteration 1 only, so beside the first iteration's estimated peak"
    peaks = [e["peak_allocated_bytes"] for e in record["ranks"] if e["peak_allocated_bytes"] is not None]
    reserved = [e["peak_reserved_bytes"] for e in record["ranks"] if e["peak_reserved_bytes"] is not None]
    metrics["peak_allocated_bytes"] = max(peaks) if peaks else run.peaks.get("peak_allocated_bytes")
    metrics["peak_reserved_bytes"] = max(reserved) if reserved else run.peaks.get("peak_reserved_bytes")
    metrics["peak_allocated_spread_bytes"] = max(peaks) - min(peaks) if len(peaks) > 1 else None
    if failure is not None:
        failure["summary"] = rank_summary(record)
    return record
