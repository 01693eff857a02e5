"""One point on one rank: pick the device, build under the layout, probe, warm up, measure, and return
the record. Each step has its module: the layout (`layout.py`, `data_parallel.py`, `pipeline.py`)
builds the model, its optimizer (`optimizer.py`) and its stepper (`step.py`); the probe step's
instruments (`probe.py`); the timed window (`timing.py`); the memory window (`memory.py`).

The first step is the probe step (not timed): it counts every FLOP of the whole step and the bytes
autograd keeps for the first micro-batch's backward (`probe.py`). Then warm-up steps, the start of
the memory window (the CUDA peak counters reset), and the measured steps, each timed between device
synchronisations on the measured device's stream, started after a barrier over the ranks; a step's
time is its slowest rank's (`SingleRank.slowest`).

A CUDA out-of-memory error becomes `status: "oom"` with the step and phase; any other exception
becomes `status: "error"`. Either way the record is complete, with what was not measured as None.
"""

from __future__ import annotations

import os
import statistics
import traceback
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from recompute_bench.analysis import flops
from recompute_bench.backends.pytorch import kernels_that_ran
from recompute_bench.backends.te_layers import implementation
from recompute_bench.models.cp_check import checked_splits
from recompute_bench.measure import memory
from recompute_bench.measure.compile import compiled
from recompute_bench.measure.float8 import float8_env
from recompute_bench.measure.layout import SingleRank
from recompute_bench.measure.probe import LocalFlopCounter, tokens_per_expert
from recompute_bench.measure.record import make_record, predicted_metrics, unmeasured_metrics, unmeasured_rank
from recompute_bench.measure.step import Stepper
from recompute_bench.measure.telemetry import device_name, environment, uses_tf32
from recompute_bench.measure.timing import timed
from recompute_bench.models import DeviceKernels
from recompute_bench.config.schema import Config


@contextmanager
def float32_matmul_precision(device: torch.device, precision: str) -> Iterator[bool]:
    """Run the block with TF32 on where `telemetry.uses_tf32` says so (fp32 on CUDA), restoring the
    previous setting afterwards; yields whether fp32 matmuls run on TF32 inside (False on a CPU)."""
    before = torch.get_float32_matmul_precision()
    if uses_tf32(device.type, precision):
        torch.set_float32_matmul_precision("high")  # TF32 tensor cores for fp32 matmuls
    try:
        yield device.type == "cuda" and torch.get_float32_matmul_precision() != "highest"
    finally:
        torch.set_float32_matmul_precision(before)


def pick_device(requested: str | torch.device | None = None) -> torch.device:
    """The device this process measures on, made the current CUDA device: `requested` ("cuda" is the
    current GPU, "cuda:1" the second), else CUDA when torch sees a GPU, else the CPU.

    Making it current matters beyond the model's tensors: streams, events, cuBLAS handles and
    every kernel launched without an explicit device go to the current device, which is GPU 0
    until it is set (a stray context there, and events that time nothing of the work on GPU N)."""
    if requested is None:
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def run_point(cfg: Config, *, device: torch.device | None = None, peak_tflops: float | None = None,
              layout=None, progress: Callable[[dict, dict], None] | None = None) -> dict:
    """Measure `cfg` on this process's device and return the full result record (never raises for
    an OOM or a failing step; those become the record's status). `layout` places the model and
    batch over ranks (default one rank); `progress(metrics, rank_entry)` is called after every step
    and at the end, so a rank can leave what it has measured before a later step kills it."""
    device = pick_device(device)
    ran: dict[str, str] = {}  # the kernels the probe step ran (`kernels_that_ran`)
    with float32_matmul_precision(device, cfg.training.precision) as tf32:
        metrics, rank_entry = _measure(cfg, device, peak_tflops, layout or SingleRank(), progress or (lambda *_: None),
                                       ran)
    return make_record(cfg, {**environment(device, tf32), **ran}, rank_entry, metrics)


def measured_device(device: torch.device, attention_kernel: str | None = None) -> DeviceKernels:
    """`device` as the analysis takes it, with what this process knows of it: the attention kernel the
    probe step ran and, on CUDA, the compute capability and CUBLAS_WORKSPACE_CONFIG that size torch's
    cuBLAS workspaces (`analysis.cuda_workspaces`)."""
    if device.type != "cuda":
        return DeviceKernels(device.type, attention_kernel)
    major, minor = torch.cuda.get_device_capability(device)
    return DeviceKernels(device.type, attention_kernel, 10 * major + minor, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


def _measure(cfg: Config, device: torch.device, peak_tflops: float | None, layout,
             progress: Callable[[dict, dict], None], ran: dict[str, str]) -> tuple[dict, dict]:
    """(metrics, rank entry) of one point: the probe step, warm-up, the measured window. `ran`
    receives the kernels the probe step ran, which the hardware FLOPs and the estimate then follow."""
    t = cfg.training
    world_size = layout.world_size  # FLOP rates are per GPU over the whole world
    metrics = unmeasured_metrics(cfg, measured_device(device))
    rank_entry = {**unmeasured_rank(layout.rank, device_name(device)), **layout.place(), **memory.cuda_memory(device),
                  "status": "running", "step": 0, "losses": [], "step_times_s": [], "activation_bytes": None}
    progress(metrics, rank_entry)  # started: a rank stopped from now on is known to have been running
    stepper: Stepper | None = None
    try:
        memory.reset_peaks(device)
        model = layout.build(cfg, device)
        model.train()
        metrics["num_parameters"] = layout.num_parameters(model)  # DTensors count their global size
        stepper = layout.stepper(cfg, model, layout.optimizer(model, t.precision), layout.batches(cfg, device))
        torch.manual_seed(t.seed)  # dropout masks

        def done(loss: torch.Tensor) -> None:
            rank_entry["losses"].append(layout.mean(loss).item())  # after the step, which is not timed
            rank_entry["step"] = stepper.step_index
            rank_entry.update(memory.current(device))
            stepper.check_fault("write")
            progress(metrics, rank_entry)

        probe = layout.probe(model)
        with LocalFlopCounter(display=False) as counter:
            loss = stepper.step(probe)
        gpt = getattr(model, "module", model)  # DDP wraps the GPT
        ran.update(kernels_that_ran(gpt))
        ran.update(compiled(gpt))
        ran.update(implementation(gpt))
        ran.update(float8_env(gpt, t.fp8_recipe))
        ran.update(checked_splits(model))  # a context-parallel kernel proved on this device, or the point fails
        metrics.update(predicted_metrics(cfg, measured_device(device, ran.get("attention_kernel"))))
        done(loss)
        metrics["loss"] = rank_entry["losses"][0]
        metrics["measured_flops_per_step"] = layout.world_flops(counter.get_total_flops())
        total_bytes, layer_bytes = probe.bytes()
        metrics["activation_bytes"] = rank_entry["activation_bytes"] = total_bytes
        metrics["activation_bytes_per_layer"] = layer_bytes / probe.num_layers
        rank_entry.update(probe.fields())
        routed = tokens_per_expert(model)
        metrics.update(routed)
        rank_entry.update(routed)  # under expert parallel each rank's experts receive their own share

        for _ in range(t.warmup_steps):
            done(stepper.step())
        run_peak = memory.open_window(device)  # the window's figures from here
        with memory.NvmlSampler(device) as nvml:
            for _ in range(t.measured_steps):
                losses: list[torch.Tensor] = []
                rank_entry["step_times_s"].append(timed(device, lambda: losses.append(stepper.step()), layout.barrier))
                done(losses[0])  # writes the piece: between steps, before the next step's barrier
        rank_entry.update(stepper.fields(rank_entry["step_times_s"]))
        times, spread = layout.slowest(rank_entry["step_times_s"])  # the slowest rank bounds each step
        rank_entry.update(memory.close_window(device, run_peak))
        rank_entry["nvml_used_bytes"], rank_entry["nvml_total_bytes"] = nvml.peak, nvml.total

        step_time = statistics.median(times)
        peak = peak_tflops * 1e12 if peak_tflops else None
        metrics["peak_source"] = "--peak-tflops" if peak_tflops else None
        if peak is None and (known := flops.peak(device_name(device), t.precision)):
            metrics["peak_source"], peak = known  # the datasheet figure of this exact product
        metrics["peak_tflops"] = peak / 1e12 if peak else None
        metrics.update({
            "step_time_s": step_time,
            "step_times_s": times,
            "step_time_spread_s": spread,
            "tflops_per_gpu": metrics["model_flops_per_step"] / step_time / world_size / 1e12,
            "tokens_per_s_per_gpu": t.global_batch_size * t.seq_length / step_time / world_size,
            "mfu": metrics["model_flops_per_step"] / step_time / world_size / peak if peak else None,
            "hfu": metrics["hardware_flops_per_step"] / step_time / world_size / peak if peak else None,
        })
        rank_entry["status"] = "ok"
    except torch.OutOfMemoryError as e:
        rank_entry.update(status="oom", failure=_failure(stepper, e))
    except Exception as e:  # any other failure of the point is a result too
        rank_entry.update(status="error", failure=_failure(stepper, e, with_traceback=True))
    if rank_entry["status"] != "ok":
        rank_entry.update(memory.current(device))
    progress(metrics, rank_entry)
    return metrics, rank_entry


def _failure(stepper: Stepper | None, e: BaseException, with_traceback: bool = False) -> dict:
    message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    failure = {"step": stepper.step_index if stepper else None, "phase": stepper.phase if stepper else "setup",
               "message": f"{type(e).__name__}: {message}"}
    if with_traceback:
        failure["traceback"] = traceback.format_exc(limit=8)
    return failure
