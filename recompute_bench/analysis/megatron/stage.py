"""One rank: a model chunk's activations under the recompute setting, and the peak of a pipeline
stage's rank, item by item, through Megatron's schedule.

Sources: megatron/core/pipeline_parallel/schedules.py, megatron/core/tensor_parallel/random.py
(CheckpointFunction)."""

from __future__ import annotations

from dataclasses import dataclass, field

from recompute_bench.analysis.layer import checkpoint_input_bytes
from recompute_bench.analysis.megatron.buffers import buffer_bytes
from recompute_bench.analysis.megatron.layer import layer_backward_bytes, layer_bytes, layer_saved_bytes
from recompute_bench.analysis.megatron.optimizer import bytes_per_parameter
from recompute_bench.analysis.megatron.outside import (batch_bytes, embedding_saved_bytes, loss_peak_bytes,
                                                       loss_saved_bytes, output_saved_bytes)
from recompute_bench.analysis.megatron.run import MegatronRun
from recompute_bench.analysis.schedule import schedule_peak
from recompute_bench.analysis.stage import stage_parameters
from recompute_bench.recompute.policy import chunks, layer_policies
from recompute_bench.spec.config import BadInput, Config

@dataclass(frozen=True)
class ChunkBytes:
    """One model chunk's activations for one micro-batch."""

    stored: float
    """Kept from its forward to its backward."""
    backward: float
    """The most held while its backward runs (full recompute rebuilds a checkpoint's layers)."""
    terms: dict[str, float] = field(default_factory=dict)
    """`stored`, tensor by tensor over the chunk's layers (layer_saved_bytes' names, and a
    full-recompute checkpoint's input)."""


CHECKPOINT_INPUT = "checkpoint input"
"""A full-recompute checkpoint's saved input (tensor_parallel/random.py CheckpointFunction)."""


def chunk_bytes(cfg: Config, run: MegatronRun, layers: int) -> ChunkBytes:
    """A model chunk of `layers` layers under cfg.recompute, unit by unit (recompute/policy.py
    `chunks`): a full-recompute checkpoint keeps its input and, rebuilt in backward, its layers'
    activations over what the earlier units keep; a layer keeps `layer_saved_bytes`. Backward adds
    `layer_backward_bytes` to the most of that."""
    policies = layer_policies(cfg.recompute, layers)
    # A full-recompute checkpoint keeps its [s, b, h] input, as this harness's does (Megatron's
    # tensor_parallel/random.py CheckpointFunction, or TE's checkpoint).
    ckpt, full = checkpoint_input_bytes(cfg), layer_bytes(cfg, run)
    stored = rebuilt = 0.0
    terms: dict[str, float] = {}
    for start, stop in chunks(policies):
        p = policies[start]
        if p.offload:
            raise BadInput("activation offload is not modelled for framework megatron; drop --activation-offload-layers")
        if p.chunk is not None:
            rebuilt = max(rebuilt, stored + (stop - start) * full)
            stored += ckpt
            terms[CHECKPOINT_INPUT] = terms.get(CHECKPOINT_INPUT, 0.0) + ckpt
        else:
            saved = layer_saved_bytes(cfg, run, p.modules)
            stored += sum(saved.values())
            for name, nbytes in saved.items():
                terms[name] = terms.get(name, 0.0) + nbytes
    return ChunkBytes(stored, max(stored, rebuilt) + layer_backward_bytes(cfg, run), terms)


@dataclass
class StagePeak:
    """The peak of one pipeline stage's rank, item by item (bytes), and where it happens."""

    stage: int
    parameters: float
    items: dict[str, float]
    phase: str
    gradient_copies_bytes: float = 0.0
    """fp16 runs' fp32 gradient copies: held from the optimizer step until the next step begins."""
    first_iteration_items: dict[str, float] = field(default_factory=dict)
    """The first iteration's peak, item by item: its passes run before the optimizer's first step
    creates the Adam moments (`first_iteration_peak`)."""
    first_iteration_phase: str = ""
    held_chunks: tuple[int, ...] = ()
    """The model chunk of every forward whose activations are held at the peak (SchedulePeak.held)."""
    peak_kind: str = ""
    """"F" or "B": whether the peak is in a forward or a backward ("" at the optimizer step)."""
    peak_chunk: int = 0

    @property
    def peak_allocated_bytes(self) -> float:
        """The steady-state peak: every iteration from the second on (the optimizer state exists)."""
        return sum(self.items.values())

    @property
    def first_iteration_peak_allocated_bytes(self) -> float:
        """The peak of the first iteration (what a memory line after iteration 1 reports)."""
        return sum(self.first_iteration_items.values()) if self.first_iteration_items else self.peak_allocated_bytes

    @property
    def static_bytes(self) -> float:
        """What a rank holds after the optimizer step (Megatron logs it as mem-allocated-bytes):
        parameters, gradients, optimizer state, buffers, fp16's fp32 gradient copies."""
        held = sum(v for k, v in self.items.items() if k not in ACTIVATION_ITEMS and k != "fp32 gradient copies")
        return held + self.gradient_copies_bytes


ACTIVATION_ITEMS = ("activations of the other micro-batches in flight", "activations of the pass at the peak",
                    "transient of the pass at the peak")


def stage_peak(cfg: Config, stage: int, run: MegatronRun) -> StagePeak:
    """Megatron's peak allocated bytes on a rank of pipeline stage `stage`: parameters, gradients
    and optimizer state (`bytes_per_parameter`), the buffers (`buffer_bytes`), and the most the
    step's passes hold at once (analysis/schedule.py): the chunk forwards waiting for their
    backward, plus the pass in flight (the loss on the last stage's last chunk, whose forward also
    holds the micro-batch's inputs; a layer's backward)."""
    par = cfg.parallel
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    chunk = chunk_bytes(cfg, run, cfg.model.num_layers // p // vp)
    first, last = stage == 0, stage == p - 1
    params = stage_parameters(cfg, stage)
    per = bytes_per_parameter(cfg)
    # The fp32 gradient copies live from the optimizer step to the next step's zero_grad, which
    # runs before the forward: they never meet the activations.
    static = {name: b * params for name, b in per.items() if b and name != "fp32 gradient copies"}
    static.update(buffer_bytes(cfg, run))

    def embeds(c: int) -> bool:
        return first and c == 0

    def loses(c: int) -> bool:
        return last and c == vp - 1

    output, kept = output_saved_bytes(cfg), loss_saved_bytes(cfg)

    def stored(c: int) -> float:
        return chunk.stored + (embedding_saved_bytes(cfg) if embeds(c) else 0.0) + ((output + kept) if loses(c) else 0.0)

    def forward(c: int) -> float:
        extra = batch_bytes(cfg) if embeds(c) or loses(c) else 0.0
        return extra + (loss_peak_bytes(cfg) - kept if loses(c) else 0.0)

    def backward(c: int) -> float:
        layers = chunk.backward - chunk.stored
        if loses(c):  # the loss's backward first, then the layers' with the loss and output freed
            return max(loss_peak_bytes(cfg) - kept, layers - output - kept)
        return layers

    peak = schedule_peak(cfg, stage, stored, backward, forward)
    items = {**static, "activations of the other micro-batches in flight": peak.others,
             "activations of the pass at the peak": peak.own, "transient of the pass at the peak": peak.transient}
    phase = ("the loss's " if loses(peak.chunk) else "") + ("forward" if peak.kind == "F" else "backward") + \
        (f" of model chunk {peak.chunk}" if vp > 1 else "")
    copies = per["fp32 gradient copies"] * params
    step = {**static, "fp32 gradient copies": copies}
    if copies > peak.total:  # the optimizer step holds the copies instead of activations
        items, phase = step, "the optimizer step"
    first, first_phase = first_iteration_peak(static, items, phase, step)
    at_step = phase == "the optimizer step"
    return StagePeak(stage, params, items, phase, copies, first, first_phase, () if at_step else peak.held,
                     "" if at_step else peak.kind, peak.chunk)


def first_iteration_peak(static: dict[str, float], items: dict[str, float], phase: str,
                         step: dict[str, float]) -> tuple[dict[str, float], str]:
    """The first iteration's peak, item by item, and where it is. Megatron's optimizer holds its fp32
    master weights from construction (distrib_optimizer.py `_build_model_and_main_param_groups`:
    `shard_model_param.clone().float()`; optimizer.py Float16OptimizerWithFloat16Params.__init__), but
    Adam's moments only from its first step: Transformer Engine's FusedAdam.step (optimizers/fused_adam.py,
    `if len(state) == 0: self.initialize_state(...)`) and torch's Adam (`_init_group`) create exp_avg and
    exp_avg_sq when they first step a parameter; Megatron's `init_state_fn` runs only when a checkpoint
    with optimizer state is loaded (optimizer.py `state_dict(is_loading=True)`), where iteration 1 is
    steady already. So iteration 1's forward and backward passes hold everything but the moments,
    and its optimizer step holds the moments (and fp16's gradient copies) without activations."""
    if phase == "the optimizer step":
        return dict(items), phase  # the step holds the same in iteration 1: it creates the moments
    passes = {k: v for k, v in items.items() if k != "Adam moments"}
    at_step = {k: v for k, v in step.items() if v}
    if sum(at_step.values()) >= sum(passes.values()):
        return at_step, "the optimizer step (it creates the Adam moments)"
    return passes, phase + " (before the optimizer's first step creates the Adam moments)"


def stage_peaks(cfg: Config, run: MegatronRun) -> list[StagePeak]:
    """`stage_peak` of every pipeline stage."""
    return [stage_peak(cfg, r, run) for r in range(cfg.parallel.pipeline_model_parallel_size)]
