"""One rank: a model chunk's activations under the recompute setting, and the peak of a pipeline
stage's rank, item by item, through Megatron's schedule.

Sources: megatron/core/pipeline_parallel/schedules.py, megatron/core/tensor_parallel/random.py
(CheckpointFunction)."""

from __future__ import annotations

from dataclasses import dataclass, field

from recompute_bench.analysis.layer import checkpoint_input_bytes
from recompute_bench.analysis.megatron.buffers import buffer_bytes, fp8_scaling_bytes
from recompute_bench.analysis.megatron.cuda_graphs import (captured_parts, full_iteration_data_bytes, graphs,
                                                           pool_resident, static_buffer_bytes)
from recompute_bench.analysis.megatron.cuda_graphs import in_graph as graph_part
from recompute_bench.analysis.megatron.fp8 import check_supported, layer_config
from recompute_bench.analysis.megatron.layer import layer_backward_bytes, layer_bytes, layer_saved_bytes
from recompute_bench.analysis.megatron.offload import fine_grained_offloaded, layer_offloaded
from recompute_bench.analysis.megatron.optimizer import bytes_per_parameter, fp8_weight_bytes
from recompute_bench.analysis.megatron.outside import (batch_bytes, embedding_saved_bytes, loss_peak_bytes,
                                                       loss_saved_bytes, output_saved_bytes)
from recompute_bench.analysis.megatron.run import MegatronRun
from recompute_bench.analysis.schedule import SchedulePeak, schedule_peak
from recompute_bench.analysis.schedules import rank_stages
from recompute_bench.analysis.stage import stage_parameters
from recompute_bench.recompute.policy import chunks, layer_policies
from recompute_bench.spec.config import Config
from recompute_bench.spec.rules import layers_per_model_chunk

@dataclass(frozen=True)
class ChunkBytes:
    """One model chunk's activations for one micro-batch."""

    stored: float
    """Kept on the device from its forward to its backward."""
    backward: float
    """The most held while its backward runs (full recompute rebuilds a checkpoint's layers;
    offloaded layers come back)."""
    in_graph: float = 0.0
    """Of `stored`, what per-layer CUDA graphs' captures allocate (cuda_graphs.in_graph)."""
    pool: float = 0.0
    """Of `stored`, what lives in the CUDA graph pool during replay (cuda_graphs.pool_resident)."""
    last_layer_offloaded: float = 0.0
    """Fine-grained offloading: the chunk's last layer's offloaded bytes, which a chunk whose
    backward comes next keeps on the device."""


def chunk_first_layers(cfg: Config, stage: int) -> list[int]:
    """The global index of the first layer of each model chunk a rank of pipeline stage `stage`
    holds, in chunk order: virtual stage v holds layers v x L to (v + 1) x L - 1, rank r holds
    virtual stages r, r + p, ... (Megatron's interleaved layout)."""
    par = cfg.parallel
    per = layers_per_model_chunk(cfg)
    return [v * per for v in rank_stages(par.schedule, par.pipeline_model_parallel_size,
                                         par.virtual_pipeline_model_parallel_size or 1, stage)]


def chunk_bytes(cfg: Config, run: MegatronRun, layers: int, first_layer: int = 0) -> ChunkBytes:
    """A model chunk of `layers` layers from global layer `first_layer` on, under cfg.recompute,
    unit by unit (recompute/policy.py `chunks`): a full-recompute checkpoint keeps its input and,
    rebuilt in backward, its layers' activations over what the earlier units keep; a layer keeps
    `layer_saved_bytes` (as a bf16 layer where FP8 keeps it in bf16: fp8.layer_config), less what
    offloading moves to the host (offload.py). Backward adds `layer_backward_bytes` to the most of
    that, and under fine-grained offloading the reloaded groups of one layer."""
    policies = layer_policies(cfg.recompute, layers)
    fine = cfg.recompute.fine_grained_activation_offloading
    stored = rebuilt = in_graph = pool = last = reload = 0.0
    for start, stop in chunks(policies):
        p = policies[start]
        if p.chunk is not None:
            # A full-recompute checkpoint keeps its [s, b, h] input, as this harness's does
            # (Megatron's tensor_parallel/random.py CheckpointFunction, or TE's checkpoint).
            rebuilt = max(rebuilt, stored + sum(layer_bytes(layer_config(cfg, first_layer + i), run)
                                                for i in range(start, stop)))
            stored += checkpoint_input_bytes(cfg)
            continue
        lcfg = layer_config(cfg, first_layer + start)
        saved = layer_saved_bytes(lcfg, run, p.modules)
        away = 0.0
        if p.offload:
            away = sum(layer_offloaded(lcfg, saved).values())
        elif fine:
            away = sum(fine_grained_offloaded(lcfg, saved).values())
            reload = max(reload, away)
            if start == layers - 1:
                last = away
        stored += sum(saved.values()) - away
        in_graph += sum(graph_part(lcfg, saved).values())
        pool += sum(pool_resident(lcfg, saved, first_in_chunk=start == 0).values())
    backward = max(stored, rebuilt) + layer_backward_bytes(cfg, run) + reload
    return ChunkBytes(stored, backward, in_graph, pool, last)


@dataclass
class StagePeak:
    """The peak of one pipeline stage's rank, item by item (bytes), and where it happens."""

    stage: int
    parameters: float
    items: dict[str, float]
    phase: str
    gradient_copies_bytes: float = 0.0
    """fp16 runs' fp32 gradient copies: held from the optimizer step until the next step begins."""
    held_bytes: float | None = None
    """What the rank holds all run once a step is done (`static_items`), where `items` leave part of
    it out: a peak before the first step (no Adam moments yet) or before the CUDA graph capture
    (no static buffers yet)."""
    phase_peaks: dict[str, float] = field(default_factory=dict)
    """With CUDA graphs: the peak of each phase (eager warm-up step, CUDA graph capture, CUDA graph
    replay); `items` are the highest's."""

    @property
    def peak_allocated_bytes(self) -> float:
        return sum(self.items.values())

    @property
    def static_bytes(self) -> float:
        """What a rank holds after the optimizer step (Megatron logs it as mem-allocated-bytes):
        parameters, gradients, optimizer state, buffers, fp16's fp32 gradient copies."""
        held = sum(v for k, v in self.items.items() if k not in ACTIVATION_ITEMS and k != "fp32 gradient copies")
        return (held if self.held_bytes is None else self.held_bytes) + self.gradient_copies_bytes


ACTIVATION_ITEMS = ("activations of the other micro-batches in flight", "activations of the pass at the peak",
                    "transient of the pass at the peak")


def static_items(cfg: Config, stage: int, run: MegatronRun) -> dict[str, float]:
    """What a rank of pipeline stage `stage` holds all run besides activations (the fp32 gradient
    copies of fp16 runs aside): parameters, gradients and optimizer state (`bytes_per_parameter`),
    FP8's weight copies or FP8 weights (`fp8_weight_bytes`), the buffers (`buffer_bytes`), FP8's
    scaling state, CUDA graphs' static buffers."""
    params = stage_parameters(cfg, stage)
    # The fp32 gradient copies live from the optimizer step to the next step's zero_grad, which
    # runs before the forward: they never meet the activations.
    static = {name: b * params for name, b in bytes_per_parameter(cfg).items() if b and name != "fp32 gradient copies"}
    per = layers_per_model_chunk(cfg)
    layers = [first + i for first in chunk_first_layers(cfg, stage) for i in range(per)]
    for item, nbytes in fp8_weight_bytes(cfg, run, layers).items():
        static[item] = static.get(item, 0.0) + nbytes
    static.update(buffer_bytes(cfg, run))
    scaling = fp8_scaling_bytes(cfg, layers)
    if scaling:
        static["FP8 scaling state"] = scaling
    static.update(static_buffer_bytes(cfg, stage, per))
    par = cfg.parallel
    if stage in (0, par.pipeline_model_parallel_size - 1) and graphs(cfg) == "full_iteration":
        static["CUDA graph static inputs (every micro-batch's data)"] = full_iteration_data_bytes(cfg, batch_bytes(cfg))
    return static


def stage_peak(cfg: Config, stage: int, run: MegatronRun) -> StagePeak:
    """Megatron's peak allocated bytes on a rank of pipeline stage `stage`: what it holds all run
    (`static_items`), and the most the step's passes hold at once (analysis/schedule.py): the chunk
    forwards waiting for their backward, plus the pass in flight (the loss on the last stage's last
    chunk, whose forward also holds the micro-batch's inputs; a layer's backward). With CUDA graphs
    the most of the eager warm-up steps, the capture and the replays (cuda_graphs.py)."""
    check_supported(cfg, run)
    par = cfg.parallel
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    per = layers_per_model_chunk(cfg)
    chunk = [chunk_bytes(cfg, run, per, first) for first in chunk_first_layers(cfg, stage)]
    first, last = stage == 0, stage == p - 1
    params = stage_parameters(cfg, stage)
    static = static_items(cfg, stage, run)
    impl, steps = graphs(cfg), cfg.training.cuda_graph_warmup_steps
    full_iteration = impl == "full_iteration"

    def embeds(c: int) -> bool:
        return first and c == 0

    def loses(c: int) -> bool:
        return last and c == vp - 1

    output, kept = output_saved_bytes(cfg), loss_saved_bytes(cfg)

    def outside(c: int) -> float:
        return (embedding_saved_bytes(cfg) if embeds(c) else 0.0) + ((output + kept) if loses(c) else 0.0)

    def stored(c: int) -> float:
        # fine-grained offloading keeps the last layer's groups of the chunk whose backward is next
        return chunk[c].stored + outside(c) + (chunk[c].last_layer_offloaded if loses(c) else 0.0)

    def forward(c: int) -> float:
        # full_iteration's inputs sit in static buffers: counted in `static`
        extra = batch_bytes(cfg) if (embeds(c) or loses(c)) and not full_iteration else 0.0
        return extra + (loss_peak_bytes(cfg) - kept if loses(c) else 0.0)

    def backward(c: int) -> float:
        layers = chunk[c].backward - chunk[c].stored
        if loses(c):  # the loss's backward first, then the layers' with the loss and output freed
            return max(loss_peak_bytes(cfg) - kept, layers - output - kept)
        return layers

    phases: list[tuple[str, dict[str, float], SchedulePeak]] = []

    def without(*names: str) -> dict[str, float]:
        return {k: v for k, v in static.items() if k not in names}

    if impl == "none" or steps >= 1:  # the eager steps (all of them without graphs)
        # TE's per-layer static buffers come with the capture (TECudaGraphHelper.create_cudagraphs)
        absent = (*static_buffer_bytes(cfg, stage, per), *(() if impl == "none" or steps >= 2 else ("Adam moments",)))
        phases.append(("" if impl == "none" else " (eager warm-up step)", without(*absent),
                       schedule_peak(cfg, stage, stored, backward, forward)))
    if impl != "none":
        at_capture = static if steps >= 1 else without("Adam moments")
        if full_iteration:  # the captured step allocates as an eager one does, into the pool
            phases.append((" (CUDA graph capture)", at_capture, schedule_peak(cfg, stage, stored, backward, forward)))
        else:
            mlp_graphed = "mlp" in captured_parts(cfg)
            transient = layer_backward_bytes(cfg, run)
            phases.append((" (CUDA graph capture)", at_capture, schedule_peak(
                cfg, stage, lambda c: chunk[c].in_graph, lambda c: transient if mlp_graphed else 0.0)))
            phases.append((" (CUDA graph replay)", static, schedule_peak(
                cfg, stage, lambda c: stored(c) - chunk[c].pool,
                lambda c: backward(c) - (transient if mlp_graphed and not loses(c) else 0.0), forward)))
    totals = {(label.strip(" ()") or "eager"): sum(held.values()) + peak.total for label, held, peak in phases}
    label, held, peak = max(phases, key=lambda ph: sum(ph[1].values()) + ph[2].total)
    items = {**held, "activations of the other micro-batches in flight": peak.others,
             "activations of the pass at the peak": peak.own, "transient of the pass at the peak": peak.transient}
    phase = ("the loss's " if loses(peak.chunk) and peak.total else "") + ("forward" if peak.kind == "F" else "backward") + \
        (f" of model chunk {peak.chunk}" if vp > 1 else "") + label
    copies = bytes_per_parameter(cfg)["fp32 gradient copies"] * params
    if copies > peak.total:  # the optimizer step holds the copies instead of activations
        items, phase = {**static, "fp32 gradient copies": copies}, "the optimizer step"
    return StagePeak(stage, params, items, phase, copies, sum(static.values()), totals if len(totals) > 1 else {})


def stage_peaks(cfg: Config, run: MegatronRun) -> list[StagePeak]:
    """`stage_peak` of every pipeline stage."""
    return [stage_peak(cfg, r, run) for r in range(cfg.parallel.pipeline_model_parallel_size)]
