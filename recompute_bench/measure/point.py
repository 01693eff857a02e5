"""One point on one rank: build, apply recompute, probe, warm up, measure, and return the record.

The first step is the probe step (not timed): `FlopCounterMode` counts every FLOP of the whole
step, recompute included, and saved-tensor hooks around the first micro-batch's forward collect
the storages autograd keeps for backward. Then warm-up steps, a reset of the CUDA peak counters,
and the measured steps, each timed between device synchronisations.

A CUDA out-of-memory error becomes `status: "oom"` with the step and phase; any other exception
becomes `status: "error"`. Either way the record is complete, with what was not measured as None.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

from recompute_bench.analysis import flops
from recompute_bench.spec.config import Config
from recompute_bench.analysis.memory import record_estimate
from recompute_bench.models.dense.layers import GPT, build_model
from recompute_bench.recompute.apply import apply_recompute
from recompute_bench.measure.telemetry import NvmlSampler, cuda_memory, device_name, environment

SCHEMA = "recompute-bench/result/v1"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FAULT_ENV = "RECOMPUTE_BENCH_FAULT"
"""Fault injection for tests: "KIND:PHASE:STEP" with KIND oom, error or hang, e.g. "oom:backward:2"."""


class MixedPrecisionAdam:
    """Adam as Megatron runs it under bf16/fp16: 16-bit weights and gradients for compute, fp32 master
    weights, fp32 main gradients and fp32 moments (2 + 4 + 4 + 8 = 18 bytes per parameter held)."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float):
        self.params = params
        self.master = [p.detach().float().clone() for p in params]
        for m in self.master:
            m.grad = torch.zeros_like(m)
        self.adam = torch.optim.Adam(self.master, lr=lr)

    def step(self) -> None:
        for p, m in zip(self.params, self.master):
            m.grad.copy_(p.grad)
            p.grad = None
        self.adam.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)


def make_optimizer(model: GPT, precision: str, lr: float = 1e-4):
    params = [p for p in model.parameters() if p.requires_grad]
    if precision == "fp32":
        return torch.optim.Adam(params, lr=lr)
    return MixedPrecisionAdam(params, lr)


def synthetic_batches(cfg: Config, device: torch.device) -> torch.Tensor:
    """Seeded random tokens, [num_microbatches, micro_batch_size, seq_length + 1]."""
    g = torch.Generator().manual_seed(cfg.training.seed)
    shape = (cfg.num_microbatches, cfg.training.micro_batch_size, cfg.training.seq_length + 1)
    return torch.randint(0, cfg.model.vocab_size, shape, generator=g).to(device)


class SavedTensorProbe:
    """Counts the bytes autograd keeps for backward: storages, de-duplicated, parameters and buffers
    excluded, read when the forward is over (so storages freed in the meantime count as zero).

    Bytes are attributed to the transformer layers while the layer stack `model.layers` runs (a
    full-recompute chunk's checkpoint saves its input there, outside any one layer). An outer hook
    sees what a re-entrant checkpoint saves (its inputs), which is what it really holds; tensors
    saved inside a CPU-offloaded layer are packed by that layer's own hooks and are not on the device.
    """

    def __init__(self, model: GPT):
        self.model = model
        # Storages are keyed by their StorageImpl (`_cdata`), not their address: a storage freed
        # during the forward (layernorm recompute) may see its address reused by a later tensor.
        self.excluded = {t.untyped_storage()._cdata for t in list(model.parameters()) + list(model.buffers())}
        self.storages: dict[int, tuple[torch.UntypedStorage, bool]] = {}
        self.in_layers = False
        self.result: tuple[int, int] = (0, 0)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.excluded and key not in self.storages:
            self.storages[key] = (storage, self.in_layers)
        return t

    @contextmanager
    def watch(self) -> Iterator["SavedTensorProbe"]:
        def enter(*_):
            self.in_layers = True

        def leave(*_):
            self.in_layers = False

        stack = self.model.layers
        handles = [stack.register_forward_pre_hook(enter), stack.register_forward_hook(leave)]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            for h in handles:
                h.remove()

    def bytes(self) -> tuple[int, int]:
        """(all saved bytes, bytes saved inside the transformer layers)."""
        total = sum(s.nbytes() for s, _ in self.storages.values())
        layers = sum(s.nbytes() for s, in_layers in self.storages.values() if in_layers)
        return total, layers


def _fault(phase: str, step: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    kind, want_phase, want_step = spec.split(":")
    if want_phase != phase or int(want_step) != step:
        return
    if kind == "oom":
        raise torch.OutOfMemoryError(f"CUDA out of memory (injected by {FAULT_ENV}={spec})")
    if kind == "hang":
        time.sleep(10**6)
    raise RuntimeError(f"injected failure ({FAULT_ENV}={spec})")


class Stepper:
    """Runs training steps and remembers where it is, so a failure can say so."""

    def __init__(self, cfg: Config, model: GPT, optimizer, batches: torch.Tensor):
        self.cfg, self.model, self.optimizer, self.batches = cfg, model, optimizer, batches
        self.step_index = 0
        self.phase = "setup"

    def step(self, probe: SavedTensorProbe | None = None) -> float:
        """One optimizer step over every micro-batch; returns the mean loss."""
        n = len(self.batches)
        total = 0.0
        for i, tokens in enumerate(self.batches):
            self.phase = "forward"
            _fault("forward", self.step_index)
            if probe is not None and i == 0:
                with probe.watch():
                    loss = self.model(tokens[:, :-1], tokens[:, 1:])
                probe.result = probe.bytes()
            else:
                loss = self.model(tokens[:, :-1], tokens[:, 1:])
            self.phase = "backward"
            _fault("backward", self.step_index)
            (loss / n).backward()
            total += loss.item()
        self.phase = "optimizer"
        _fault("optimizer", self.step_index)
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        self.step_index += 1
        return total / n


def _timed(device: torch.device, fn: Callable[[], Any]) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def pick_device(requested: str | None = None) -> torch.device:
    """CUDA when present (or asked for), else CPU."""
    if requested:
        return torch.device(requested)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def run_point(cfg: Config, *, device: torch.device | None = None, peak_tflops: float | None = None,
              rank: int = 0) -> dict:
    """Measure `cfg` on this process's device and return the full result record (never raises for
    an OOM or a failing step; those become the record's status)."""
    device = device or pick_device()
    m, t = cfg.model, cfg.training
    world_size = 1  # one rank; model parallelism is refused by validation before we get here
    metrics = unmeasured_metrics(cfg, device.type)
    rank_entry = {**unmeasured_rank(rank, device_name(device)), **cuda_memory(device)}
    stepper: Stepper | None = None
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model = apply_recompute(build_model(m, t.seed, device, DTYPES[t.precision]), cfg.recompute)
        model.train()
        metrics["num_parameters"] = sum(p.numel() for p in model.parameters())
        stepper = Stepper(cfg, model, make_optimizer(model, t.precision), synthetic_batches(cfg, device))
        torch.manual_seed(t.seed)  # dropout masks

        probe = SavedTensorProbe(model)
        with FlopCounterMode(display=False) as counter:
            metrics["loss"] = stepper.step(probe)
        metrics["measured_flops_per_step"] = counter.get_total_flops()
        total_bytes, layer_bytes = probe.result
        metrics["activation_bytes"] = total_bytes
        metrics["activation_bytes_per_layer"] = layer_bytes / m.num_layers

        for _ in range(t.warmup_steps):
            stepper.step()
        run_peak = cuda_memory(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with NvmlSampler(device) as nvml:
            times = [_timed(device, stepper.step) for _ in range(t.measured_steps)]
        window = cuda_memory(device)
        rank_entry.update(window)
        if device.type == "cuda":
            rank_entry["run_peak_allocated_bytes"] = max(run_peak["peak_allocated_bytes"], window["peak_allocated_bytes"])
            rank_entry["run_peak_reserved_bytes"] = max(run_peak["peak_reserved_bytes"], window["peak_reserved_bytes"])
        rank_entry["nvml_used_bytes"], rank_entry["nvml_total_bytes"] = nvml.peak, nvml.total

        step_time = statistics.median(times)
        peak = peak_tflops * 1e12 if peak_tflops else flops.peak_flops(device_name(device), t.precision)
        metrics.update({
            "step_time_s": step_time,
            "step_times_s": times,
            "tflops_per_gpu": metrics["model_flops_per_step"] / step_time / world_size / 1e12,
            "tokens_per_s_per_gpu": t.global_batch_size * t.seq_length / step_time / world_size,
            "mfu": metrics["model_flops_per_step"] / step_time / world_size / peak if peak else None,
            "hfu": metrics["hardware_flops_per_step"] / step_time / world_size / peak if peak else None,
        })
    except torch.OutOfMemoryError as e:
        rank_entry.update(status="oom", failure=_failure(stepper, e))
    except Exception as e:  # any other failure of the point is a result too
        rank_entry.update(status="error", failure=_failure(stepper, e, with_traceback=True))
    if rank_entry["status"] != "ok":
        rank_entry.update({k: v for k, v in cuda_memory(device).items() if v is not None})

    return make_record(cfg, environment(device), rank_entry, metrics)


def unmeasured_metrics(cfg: Config, device_type: str) -> dict[str, Any]:
    """A point's metrics before anything is measured: None (not measured), except what follows from
    the config alone: the formula FLOPs and the analytical estimate."""
    return {
        "step_time_s": None, "step_times_s": [], "tflops_per_gpu": None, "tokens_per_s_per_gpu": None,
        "mfu": None, "hfu": None,
        "model_flops_per_step": flops.model_flops_per_step(cfg),
        "hardware_flops_per_step": flops.hardware_flops_per_step(cfg, device_type),
        "measured_flops_per_step": None,
        "activation_bytes": None, "activation_bytes_per_layer": None,
        "num_parameters": None, "loss": None,
        **record_estimate(cfg, device_type),  # the analytical model's prediction beside each measurement
    }


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
        "workload": cfg.workload,
        "config": cfg.to_dict(),
        "recompute": cfg.recompute_dict(),
        "env": env,
        "status": rank_entry["status"],
        "failure": None if failure is None else {**failure, "rank": rank_entry["rank"]},
        "ranks": [rank_entry],
        "metrics": metrics,
    }


def _failure(stepper: Stepper | None, e: BaseException, with_traceback: bool = False) -> dict:
    message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    failure = {"step": stepper.step_index if stepper else None, "phase": stepper.phase if stepper else "setup",
               "message": f"{type(e).__name__}: {message}"}
    if with_traceback:
        failure["traceback"] = traceback.format_exc(limit=8)
    return failure
