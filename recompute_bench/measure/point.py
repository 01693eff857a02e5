"""One point on one rank: build, apply recompute, probe, warm up, measure, and return the record.

The first step is the probe step (not timed): `FlopCounterMode` counts every FLOP of the whole
step, recompute included (a tensor-parallel DTensor op by its local shards: `LocalFlopCounter`),
and saved-tensor hooks around the first micro-batch's forward collect the storages autograd keeps
for backward (a DTensor's local shard). Then warm-up steps, a reset of the CUDA peak counters,
and the measured steps, each timed between device synchronisations on the measured device's stream,
started after a barrier over the ranks; a step's time is its slowest rank's (`SingleRank.slowest`).

A CUDA out-of-memory error becomes `status: "oom"` with the step and phase; any other exception
becomes `status: "error"`. Either way the record is complete, with what was not measured as None.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback
import weakref
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

from recompute_bench.analysis import flops
from recompute_bench.backends.pytorch import kernels_that_ran, local
from recompute_bench.spec.config import Config
from recompute_bench.models import DeviceKernels, spec_for
from recompute_bench.models.dense.layers import GPT, materialize
from recompute_bench.recompute.apply import apply_recompute
from recompute_bench.measure.record import (FAULT_ENV, SCHEMA, make_record, predicted_metrics, unmeasured_metrics,
                                            unmeasured_rank)
from recompute_bench.measure.telemetry import NvmlSampler, cuda_memory, device_name, environment, uses_tf32

__all__ = ["SCHEMA", "FAULT_ENV", "DTYPES", "MainGradAdam", "MainGrads", "SavedTensorProbe", "Stepper", "make_optimizer",
           "SingleRank", "make_record", "pick_device", "run_point", "synthetic_batches", "unmeasured_metrics", "unmeasured_rank"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of p's gradient, laid out as p is: a partial sum (the gradient of a replicated
    weight applied to a sequence-parallel shard) is all-reduced first."""
    g = p.grad
    if hasattr(g, "placements") and g.placements != p.placements:
        g = g.redistribute(p.device_mesh, p.placements)
    return local(g)


def make_adam(params: list[torch.Tensor], lr: float) -> torch.optim.Adam:
    """torch's Adam with its fused kernel where torch has one for the device (CUDA and CPU do),
    else the foreach implementation: one multi-tensor kernel per update, no Python loop over
    parameters, and (fused) no temporaries the size of the parameters."""
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except RuntimeError:  # "fused=True requires all the params to be floating point Tensors of supported devices"
        return torch.optim.Adam(params, lr=lr, foreach=True)


class MainGrads:
    """Megatron's gradient buffer: one flat fp32 tensor holding every parameter's main gradient
    (`p.main_grad`, a view of it, Megatron's name). As soon as autograd has accumulated a
    parameter's gradient, a post-accumulate-grad hook adds it into the main gradient and frees it
    (megatron/core/distributed/distributed_data_parallel.py, `DistributedDataParallel._make_backward_post_hook`),
    so micro-batches accumulate in fp32 and at most one parameter's own gradient exists at a time:
    4 bytes per parameter held, in every precision. A DTensor (tensor-parallel) parameter takes part
    through its local shard. One rank reduces nothing (`measure.distributed.BucketedGrads` reduces
    over the data-parallel ranks)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.data = torch.zeros(sum(local(p).numel() for p in params), dtype=torch.float32, device=params[0].device)
        offset = 0
        for p in params:
            mine = local(p)
            p.main_grad = self.data[offset:offset + mine.numel()].view_as(mine)
            p.register_post_accumulate_grad_hook(self._accumulate)
            offset += mine.numel()

    @torch.no_grad()
    def _accumulate(self, p: torch.nn.Parameter) -> None:
        p.main_grad.add_(local_grad(p))  # fp32 += 16-bit, computed in fp32
        p.grad = None  # the parameter's own gradient is not kept
        self.ready(p)

    def ready(self, p: torch.nn.Parameter) -> None:
        """p's gradient of this backward is in its main gradient."""

    def no_sync(self) -> AbstractContextManager:
        """Around the micro-batches whose gradients are only accumulated: all of them here."""
        return nullcontext()

    def finish(self) -> None:
        """Make the step's main gradients complete before the optimizer reads them: they are, on one rank."""


class MainGradAdam:
    """Adam on the main gradients (`MainGrads`), as Megatron's optimizers read them. Under bf16/fp16:
    16-bit weights for compute, fp32 master weights in one flat buffer that Adam (fused where
    available) updates with the flat main gradients as its `.grad`, then one foreach copy into the
    16-bit weights: 2 + 4 + 4 + 8 = 18 bytes held per parameter. In fp32 the weights are the master
    weights, updated in place with their main gradients: 4 + 4 + 8 = 16."""

    def __init__(self, grads: MainGrads, precision: str, lr: float = 1e-4):
        self.grads = grads
        self.master: torch.Tensor | None = None
        """The flat fp32 master weights (None in fp32: the weights themselves)."""
        if precision == "fp32":
            self.master_params = [local(p) for p in grads.params]
            self.adam = make_adam(self.master_params, lr)
            return
        self.master = torch.empty_like(grads.data)
        self.master_params = []
        """Each parameter's fp32 master weights (a view of `master`), in `grads.params` order."""
        offset = 0
        for p in grads.params:
            mine = local(p)
            master = self.master[offset:offset + mine.numel()].view_as(mine)
            master.copy_(mine.detach())
            self.master_params.append(master)
            offset += mine.numel()
        self.master.grad = grads.data  # Adam reads the main gradients where they are: no copy
        self.adam = make_adam([self.master], lr)

    def step(self) -> None:
        """Complete the main gradients (`grads.finish`), update the master weights from them, copy
        them into the 16-bit weights, and zero the main gradients for the next step."""
        self.grads.finish()
        if self.master is None:
            for mine, p in zip(self.master_params, self.grads.params):
                mine.grad = p.main_grad
            self.adam.step()
            for mine in self.master_params:
                mine.grad = None  # else the next backward would accumulate into the main gradient itself
        else:
            self.adam.step()
            with torch.no_grad():  # one multi-tensor copy, fp32 -> 16-bit
                torch._foreach_copy_([local(p) for p in self.grads.params], self.master_params)
        self.grads.data.zero_()


def make_optimizer(model: GPT, precision: str, lr: float = 1e-4) -> MainGradAdam:
    """The optimizer `run_point` steps on one rank: Adam on fp32 main gradients (18 bytes per
    parameter under bf16/fp16, 16 in fp32)."""
    return MainGradAdam(MainGrads([p for p in model.parameters() if p.requires_grad]), precision, lr)


def synthetic_batches(cfg: Config, device: torch.device) -> torch.Tensor:
    """Seeded random tokens, [num_microbatches, micro_batch_size, seq_length + 1]."""
    g = torch.Generator().manual_seed(cfg.training.seed)
    shape = (cfg.num_microbatches, cfg.training.micro_batch_size, cfg.training.seq_length + 1)
    return torch.randint(0, cfg.model.vocab_size, shape, generator=g).to(device)


class _GlobalOnly:
    """A module tracker that tracks nothing: every FLOP counts under "Global" alone."""

    parents = ("Global",)

    def __enter__(self) -> "_GlobalOnly":
        return self

    def __exit__(self, *_: Any) -> None:
        return None


class LocalFlopCounter(FlopCounterMode):
    """`FlopCounterMode` counting the FLOPs this rank runs: an op on DTensors (a tensor-parallel
    linear) is counted by the shapes of its local shards, not its global shapes (the mode sees
    DTensor ops before they are split into local ones). Plain tensors count as they are.

    Only the total is read, so no module is tracked: torch's module tracker hooks every module's
    inputs for backward (`register_multi_grad_hook`), which fails inside the `autograd.grad(inputs=)`
    of a zero-bubble pipeline schedule's input-gradient pass."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.mod_tracker = _GlobalOnly()

    def _count_flops(self, func_packet, out, args, kwargs):
        from torch.utils._pytree import tree_map

        super()._count_flops(func_packet, tree_map(local, out), tree_map(local, args), tree_map(local, kwargs))
        return out


class SavedTensorProbe:
    """Counts the bytes autograd keeps for backward: storages, de-duplicated, parameters and buffers
    excluded, read when the forward is over (so storages freed in the meantime count as zero).

    Bytes are attributed to the transformer layers while the layer stack `model.layers` runs (a
    full-recompute chunk's checkpoint saves its input there, outside any one layer). An outer hook
    sees what a re-entrant checkpoint saves (its inputs), which is what it really holds; tensors
    saved inside a CPU-offloaded layer are packed by that layer's own hooks and are not on the device.

    The probe holds no storage: it keeps weak references while the forward runs and only the two
    totals afterwards, so the micro-batch's activations are freed by its backward as in any other
    step (holding them would inflate the measured peak by about `activation_bytes`).
    """

    def __init__(self, model: GPT):
        self.model = model
        self.num_layers = len(model.layers)
        # Storages are keyed by their StorageImpl (`_cdata`), not their address. Parameters live
        # for the whole run, so their keys cannot be reused by another storage.
        self.excluded = self._storages_of_parameters()
        self.storages: dict[int, tuple[weakref.ref, bool]] = {}
        self.in_layers = False
        self.result: tuple[int, int] = (0, 0)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = local(t).untyped_storage()  # a DTensor holds this rank's shard: its local bytes count
        key = storage._cdata
        if key in self.excluded:
            return t
        seen = self.storages.get(key)
        # A storage freed during the forward (its saved tensor dropped) may hand its StorageImpl's
        # address to a later one: a dead reference under the same key is a different storage.
        if seen is None or seen[0]() is None:
            # torch keeps one Python object per live storage, so this reference dies with the storage.
            self.storages[key] = (weakref.ref(storage), self.in_layers)
        return t

    @contextmanager
    def watch(self) -> Iterator["SavedTensorProbe"]:
        """Count what the forward run inside saves; the totals are in `result` (and `bytes()`) once
        the block ends, and the probe lets go of every storage then."""
        def enter(*_):
            self.in_layers = True

        def leave(*_):
            self.in_layers = False

        self.storages.clear()
        stack = self.model.layers
        handles = [stack.register_forward_pre_hook(enter), stack.register_forward_hook(leave)]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            for h in handles:
                h.remove()
            self.result = self._count()
            self.storages.clear()

    def _storages_of_parameters(self) -> set[int]:
        # A sharded (DTensor) parameter is its local shard; FSDP2 swaps unsharded parameters in
        # for the forward, and the root module keeps them until its backward: weights, not activations.
        return {local(t).untyped_storage()._cdata
                for t in list(self.model.parameters()) + list(self.model.buffers())}

    def _count(self) -> tuple[int, int]:
        total = layers = 0
        weights = self._storages_of_parameters()
        for key, (ref, in_layers) in self.storages.items():
            storage = ref() if key not in weights else None
            nbytes = storage.nbytes() if storage is not None else 0  # freed: nothing held for backward
            total += nbytes
            layers += nbytes if in_layers else 0
        return total, layers

    def bytes(self) -> tuple[int, int]:
        """(all saved bytes, bytes saved inside the transformer layers) of the last watched forward,
        read when it ended."""
        return self.result

    def fields(self) -> dict[str, Any]:
        """Figures beyond `bytes()` for the rank's entry: none for one micro-batch's forward."""
        return {}


FAULT_DELAY_S = 3.0
"""How long a "delay" fault holds its rank."""


@dataclass(frozen=True)
class Fault:
    """A failure to inject, as RECOMPUTE_BENCH_FAULT says ("KIND:PHASE:STEP[@RANK]"; no "@RANK"
    means every rank, the rank being torchrun's RANK, 0 on a single-rank point). Phases: forward,
    backward, optimizer (inside a step) and write (after a step, before its piece is written). Read
    once per point (`from_env`), so the timed steps only ask whether there is one."""

    kind: str
    phase: str
    step: int
    rank: int | None
    spec: str

    @classmethod
    def from_env(cls) -> "Fault | None":
        spec = os.environ.get(FAULT_ENV)
        if not spec:
            return None
        where, _, rank = spec.partition("@")
        kind, phase, step = where.split(":")
        return cls(kind, phase, int(step), int(rank) if rank else None, spec)

    def at(self, phase: str, step: int) -> None:
        """Fail here if this is the phase, step and rank the fault names."""
        if phase != self.phase or step != self.step:
            return
        rank = int(os.environ.get("RANK", "0"))
        if self.rank is not None and self.rank != rank:
            return
        inject_fault(self.kind, self.spec, rank)


def inject_fault(kind: str, spec: str, rank: int) -> None:
    """Fail the way `kind` names: an OOM, a hang, a delay, the NCCL watchdog's abort, an error."""
    if kind == "oom":
        raise torch.OutOfMemoryError(f"CUDA out of memory (injected by {FAULT_ENV}={spec})")
    if kind == "hang":
        time.sleep(10**6)
    if kind == "delay":  # a slow rank, as a slow disk makes its piece write
        time.sleep(FAULT_DELAY_S)
        return
    if kind == "watchdog":
        # ProcessGroupNCCL's end under TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (its default): the watchdog
        # thread logs the timed-out work (`WorkNCCL::checkTimeout`, c10 LOG(ERROR) to stderr), then
        # rethrows from that thread (`WorkNCCL::handleException`): std::terminate, SIGABRT, no
        # Python exception on the main thread. Written here as torch writes it.
        sys.stderr.write(f"[rank{rank}]:[E1123 12:00:00.000000000 ProcessGroupNCCL.cpp:632] [PG ID 0 PG GUID 0(default_pg) "
                         f"Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, "
                         "NumelIn=1, NumelOut=1, Timeout(ms)=300000) ran for 300042 milliseconds before timing out.\n")
        sys.stderr.flush()
        os.abort()
    raise RuntimeError(f"injected failure ({FAULT_ENV}={spec})")


class Stepper:
    """Runs training steps and remembers where it is, so a failure can say so."""

    def __init__(self, cfg: Config, model: GPT, optimizer, batches: torch.Tensor,
                 no_sync: Callable[[], Any] | None = None):
        self.cfg, self.model, self.optimizer, self.batches = cfg, model, optimizer, batches
        self.no_sync = no_sync
        """Around each micro-batch but the last (`layout.no_sync`): its gradients accumulate on the
        rank, and only the last one's backward reduces them over the data-parallel ranks."""
        self.step_index = 0
        self.phase = "setup"
        self.fault = Fault.from_env()

    def check_fault(self, phase: str) -> None:
        """Inject the point's fault if it names this phase of this step (nothing when there is none)."""
        if self.fault is not None:
            self.fault.at(phase, self.step_index)

    def fields(self, step_times_s: list[float]) -> dict[str, Any]:
        """Figures of the measured steps beyond their times (a pipeline's: `measure.pipeline`); none here."""
        return {}

    def step(self, probe: SavedTensorProbe | None = None) -> torch.Tensor:
        """One optimizer step over every micro-batch; returns the mean loss as a 0-dim fp32 tensor
        on the device. Nothing in the step reads a value back to the host (that would wait for the
        device once per micro-batch inside the timed step): read the loss after the step."""
        n = len(self.batches)
        total = torch.zeros((), dtype=torch.float32, device=self.batches.device)
        for i, tokens in enumerate(self.batches):
            with self.no_sync() if self.no_sync and i < n - 1 else nullcontext():
                self.phase = "forward"
                self.check_fault("forward")
                if probe is not None and i == 0:
                    with probe.watch():
                        loss = self.model(tokens[:, :-1], tokens[:, 1:])
                else:
                    loss = self.model(tokens[:, :-1], tokens[:, 1:])
                self.phase = "backward"
                self.check_fault("backward")
                (loss / n).backward()
            total += loss.detach()
        self.phase = "optimizer"
        self.check_fault("optimizer")
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        self.step_index += 1
        return total / n


def cuda_event(device: torch.device) -> "torch.cuda.Event":
    """A timing event recorded now on `device`'s current stream. `Event.record()` without a stream
    records on the current device's stream, GPU 0's unless it was set: on `cuda:1` the event would
    time nothing of the work (torch/cuda/streams.py, `Event.record`)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def _timed(device: torch.device, fn: Callable[[], Any], barrier: Callable[[], None] = lambda: None) -> float:
    """Seconds `fn` takes on `device`, started when every rank has reached `barrier` (so one rank's
    late start, a slow piece write between steps, is not timed as another rank's wait)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        barrier()
        start = cuda_event(device)
        fn()
        end = cuda_event(device)
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


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


class SingleRank:
    """How a point is laid out over ranks: here one rank holding the whole model and batch.
    `measure.distributed` has the multi-rank layouts (DDP, FSDP2) with the same methods."""

    world_size = 1
    rank = 0
    tensor_group = None
    """The tensor-parallel process group (None: no tensor parallelism)."""
    splits = False
    """Whether this rank holds only part of the model's weights (tensor parallel, FSDP)."""

    def build(self, cfg: Config, device: torch.device, dtype: torch.dtype | None = None) -> GPT:
        """The model this rank trains, split over the tensor-parallel group (`split`), recompute
        installed, then sharded (`shard`); weights in `dtype` (default the training precision).

        A layout that `splits` the weights does it as torchtitan does: the model is built on the
        meta device, split, given its recompute and sharded there, and only then materialised, so a
        rank allocates and initialises its own shards (the whole model never exists on one rank),
        with the values one rank's build holds (`models.dense.layers.materialize`). On CUDA the cache
        the initialisation leaves (one whole parameter at a time) is handed back, so that the reserved
        peak measures the training, not the build."""
        dtype = dtype or DTYPES[cfg.training.precision]
        spec = spec_for(cfg.model)
        if self.splits:
            model = apply_recompute(self.split(spec.build(cfg, "meta", dtype)), cfg.recompute, self.tensor_group)
            model = materialize(self.shard(model, cfg), device, cfg.training.seed)
        else:
            model = apply_recompute(spec.build(cfg, device, dtype), cfg.recompute, self.tensor_group)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return model

    def split(self, model: GPT) -> GPT:
        """This rank's part of the whole model: all of it."""
        return model

    def shard(self, model: GPT, cfg: Config) -> GPT:
        """The model with its weights sharded over the data-parallel ranks: not at all here."""
        return model

    def optimizer(self, model: torch.nn.Module, precision: str):
        """The optimizer of `model`'s parameters on this rank."""
        return make_optimizer(model, precision)

    def no_sync(self, model: torch.nn.Module, optimizer) -> AbstractContextManager:
        """Around a micro-batch whose gradients are accumulated without being reduced: one rank
        reduces nothing."""
        return nullcontext()

    def batches(self, cfg: Config, device: torch.device) -> torch.Tensor:
        """This rank's micro-batches of the step."""
        return synthetic_batches(cfg, device)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """A per-rank value averaged over the ranks that hold different data."""
        return value

    def num_parameters(self, model: torch.nn.Module) -> int:
        """The whole model's parameter count (DTensors count their global size)."""
        return sum(p.numel() for p in model.parameters())

    def stepper(self, cfg: Config, model: torch.nn.Module, optimizer, batches: torch.Tensor) -> Stepper:
        """What runs this layout's training steps."""
        return Stepper(cfg, model, optimizer, batches, lambda: self.no_sync(model, optimizer))

    def probe(self, model: torch.nn.Module) -> SavedTensorProbe:
        """What measures the probe step's saved tensors: the first micro-batch's forward."""
        return SavedTensorProbe(model)

    def world_flops(self, local_flops: int) -> int:
        """The step's FLOPs over every rank from this rank's: each rank runs the same share."""
        return local_flops * self.world_size

    def place(self) -> dict[str, Any]:
        """Where this rank sits beyond its number, for its record entry (a pipeline's stage): nothing here."""
        return {}

    def barrier(self) -> None:
        """Wait until every rank gets here: one rank, nothing to wait for."""

    def slowest(self, times: list[float]) -> tuple[list[float], float | None]:
        """(each measured step's time on the slowest rank, the median spread between the slowest and
        the fastest rank): one rank is its own slowest, and has no spread."""
        return times, None


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


def _measure(cfg: Config, device: torch.device, peak_tflops: float | None, layout,
             progress: Callable[[dict, dict], None], ran: dict[str, str]) -> tuple[dict, dict]:
    """(metrics, rank entry) of one point: the probe step, warm-up, the measured window. `ran`
    receives the kernels the probe step ran, which the hardware FLOPs and the estimate then follow."""
    t = cfg.training
    world_size = layout.world_size  # FLOP rates are per GPU over the whole world
    metrics = unmeasured_metrics(cfg, device.type)
    rank_entry = {**unmeasured_rank(layout.rank, device_name(device)), **layout.place(), **cuda_memory(device),
                  "status": "running", "step": 0, "losses": [], "step_times_s": [], "activation_bytes": None}
    progress(metrics, rank_entry)  # started: a rank stopped from now on is known to have been running
    stepper: Stepper | None = None
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model = layout.build(cfg, device)
        model.train()
        metrics["num_parameters"] = layout.num_parameters(model)  # DTensors count their global size
        stepper = layout.stepper(cfg, model, layout.optimizer(model, t.precision), layout.batches(cfg, device))
        torch.manual_seed(t.seed)  # dropout masks

        def done(loss: torch.Tensor) -> None:
            rank_entry["losses"].append(layout.mean(loss).item())  # after the step, which is not timed
            rank_entry["step"] = stepper.step_index
            rank_entry.update({k: v for k, v in cuda_memory(device).items() if v is not None})
            stepper.check_fault("write")
            progress(metrics, rank_entry)

        probe = layout.probe(model)
        with LocalFlopCounter(display=False) as counter:
            loss = stepper.step(probe)
        ran.update(kernels_that_ran(getattr(model, "module", model)))  # DDP wraps the GPT
        metrics.update(predicted_metrics(cfg, DeviceKernels(device.type, ran.get("attention_kernel"))))
        done(loss)
        metrics["loss"] = rank_entry["losses"][0]
        metrics["measured_flops_per_step"] = layout.world_flops(counter.get_total_flops())
        total_bytes, layer_bytes = probe.bytes()
        metrics["activation_bytes"] = rank_entry["activation_bytes"] = total_bytes
        metrics["activation_bytes_per_layer"] = layer_bytes / probe.num_layers
        rank_entry.update(probe.fields())
        routed = _tokens_per_expert(model)
        metrics.update(routed)
        rank_entry.update(routed)  # under expert parallel each rank's experts receive their own share

        for _ in range(t.warmup_steps):
            done(stepper.step())
        run_peak = cuda_memory(device)
        if device.type == "cuda":
            # The window's figures from here: the peaks, and the allocator's retry and OOM counts,
            # which accumulate from the process's start (the build, probe and warm-up) until reset.
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.reset_accumulated_memory_stats(device)
        with NvmlSampler(device) as nvml:
            for _ in range(t.measured_steps):
                losses: list[torch.Tensor] = []
                rank_entry["step_times_s"].append(_timed(device, lambda: losses.append(stepper.step()), layout.barrier))
                done(losses[0])  # writes the piece: between steps, before the next step's barrier
        rank_entry.update(stepper.fields(rank_entry["step_times_s"]))
        times, spread = layout.slowest(rank_entry["step_times_s"])  # the slowest rank bounds each step
        window = cuda_memory(device)
        rank_entry.update(window)
        if device.type == "cuda":
            rank_entry["run_peak_allocated_bytes"] = max(run_peak["peak_allocated_bytes"], window["peak_allocated_bytes"])
            rank_entry["run_peak_reserved_bytes"] = max(run_peak["peak_reserved_bytes"], window["peak_reserved_bytes"])
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
        rank_entry.update({k: v for k, v in cuda_memory(device).items() if v is not None})
    progress(metrics, rank_entry)
    return metrics, rank_entry


def _tokens_per_expert(model: torch.nn.Module) -> dict[str, float]:
    """Routed rows per expert in the probe step's last micro-batch, over every MoE layer: the max
    (the busiest expert) and the mean (tokens x top-k / experts; what the experts ran, after any
    token dropping), and the routed rows dropped over capacity summed over the MoE layers; nothing
    for a dense model. Read
    once, after the probe step, never inside a timed one."""
    counts = [layer.mlp.tokens_per_expert for layer in model.layers
              if getattr(layer.mlp, "tokens_per_expert", None) is not None]
    if not counts:
        return {}
    stacked = torch.stack(counts).float()
    dropped = sum(int(layer.mlp.tokens_dropped) for layer in model.layers if getattr(layer.mlp, "tokens_dropped", None) is not None)
    return {"tokens_per_expert_max": stacked.max().item(), "tokens_per_expert_mean": stacked.mean().item(),
            "tokens_dropped": dropped}


def _failure(stepper: Stepper | None, e: BaseException, with_traceback: bool = False) -> dict:
    message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    failure = {"step": stepper.step_index if stepper else None, "phase": stepper.phase if stepper else "setup",
               "message": f"{type(e).__name__}: {message}"}
    if with_traceback:
        failure["traceback"] = traceback.format_exc(limit=8)
    return failure
