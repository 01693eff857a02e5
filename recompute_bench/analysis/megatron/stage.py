"""One rank: a model chunk's activations under the recompute setting, and the peak of a pipeline
stage's rank, item by item, through Megatron's schedule.

Sources: megatron/core/pipeline_parallel/schedules.py, megatron/core/tensor_parallel/random.py
(CheckpointFunction)."""

from __future__ import annotations

from dataclasses import dataclass, field

from recompute_bench.analysis.checkpoint import checkpoint_input_bytes
from recompute_bench.analysis.megatron.buffers import buffer_bytes, fp8_scaling_bytes, te_dummy_wgrad_bytes
from recompute_bench.analysis.megatron.cuda_graphs import (captured_parts, full_iteration_data_bytes, graphs,
                                                           pool_resident, static_buffer_bytes)
from recompute_bench.analysis.megatron.cuda_graphs import in_graph as graph_part
from recompute_bench.analysis.megatron.fp8 import check_supported, layer_config
from recompute_bench.analysis.megatron.gpu import MegatronRun
from recompute_bench.analysis.megatron.layer import (layer_backward_bytes, layer_bytes, layer_forward_bytes,
                                                     layer_saved_bytes)
from recompute_bench.analysis.megatron.mtp import chunk_layer_indices, mtp_index, mtp_saved_bytes
from recompute_bench.analysis.megatron.offload import fine_grained_offloaded, layer_offloaded
from recompute_bench.analysis.megatron.optimizer import bytes_per_parameter, fp8_weight_bytes
from recompute_bench.analysis.megatron.outside import (batch_bytes, deferred_wgrad_bytes, embedding_saved_bytes,
                                                       logits, loss_peak_bytes, loss_saved_bytes, output_saved_bytes)
from recompute_bench.analysis.megatron.parameters import stage_parameter_groups
from recompute_bench.analysis.megatron_schedule import SchedulePeak, schedule_peak
from recompute_bench.config.pipeline_split import ModelChunk, model_chunks
from recompute_bench.config.schema import Config
from recompute_bench.models import ELEMENT_BYTES
from recompute_bench.recompute.policy import chunks, layer_policies


@dataclass(frozen=True)
class ChunkBytes:
    """One model chunk's activations for one micro-batch."""

    stored: float
    """Kept on the device from its forward to its backward."""
    backward: float
    """The most held while its backward runs (full recompute rebuilds a checkpoint's layers;
    offloaded layers come back)."""
    forward: float = 0.0
    """The most its forward holds beyond what it keeps by then (the context-parallel attention's
    working set), taken at the chunk's end: an upper bound by the layers after that attention."""
    in_graph: float = 0.0
    """Of `stored`, what per-layer CUDA graphs' captures allocate (cuda_graphs.in_graph)."""
    pool: float = 0.0
    """Of `stored`, what lives in the CUDA graph pool during replay (cuda_graphs.pool_resident)."""
    last_layer_offloaded: float = 0.0
    """Fine-grained offloading: the chunk's last layer's offloaded bytes, which a chunk whose
    backward comes next keeps on the device."""
    terms: dict[str, float] = field(default_factory=dict)
    """`stored`, tensor by tensor over the chunk's layers (layer_saved_bytes' names, less what
    offloading moves to the host, and a full-recompute checkpoint's input)."""
    layer_backward: float = 0.0
    """The most one of the chunk's layers' backward holds beyond the saved tensors
    (`layer_backward_bytes` over its layers, multi-token-prediction layers included)."""


_FULL_ITERATION_INPUTS = "CUDA graph static inputs (every micro-batch's data)"
CHECKPOINT_INPUT = "checkpoint input"
"""A full-recompute checkpoint's saved input (tensor_parallel/random.py CheckpointFunction)."""


def chunk_bytes(cfg: Config, run: MegatronRun, layers: int, first_layer: int = 0,
                routing: str = "balanced", mtp: int = 0) -> ChunkBytes:
    """A model chunk of `layers` layers from global layer `first_layer` on, under cfg.recompute,
    unit by unit (recompute/policy.py `chunks`): a full-recompute checkpoint keeps its input and,
    rebuilt in backward, its layers' activations over what the earlier units keep; a layer keeps
    `layer_saved_bytes` (a MoE layer its MoE block's under the `routing` assumption; a layer FP8
    keeps in bf16 as one: fp8.layer_config), less what offloading moves to the host (offload.py).
    Backward adds the most a layer's backward holds beyond that (`layer_backward_bytes`), or, where
    it re-runs the attention (full recompute, selective core_attn), the attention forward's working
    set if that is more (`layer_forward_bytes`), and under fine-grained offloading the reloaded
    groups of one layer. `mtp` multi-token-prediction layers follow the decoder layers (mtp.py: each
    its transformer layer and `mtp_saved_bytes`; under full recompute its own checkpoint)."""
    if layers == 0 and not mtp:  # a chunk that holds only the embedding or the loss (uneven splits)
        return ChunkBytes(0.0, 0.0)
    policies = layer_policies(cfg.recompute, layers)
    fine = cfg.recompute.fine_grained_activation_offloading
    stored = rebuilt = in_graph = pool = last = reload = 0.0
    reruns_attention = False
    terms: dict[str, float] = {}
    for start, stop in chunks(policies):
        p = policies[start]
        if p.chunk is not None:
            # A full-recompute checkpoint keeps its [s, b, h] input, as this harness's does
            # (Megatron's tensor_parallel/random.py CheckpointFunction, or TE's checkpoint).
            rebuilt = max(rebuilt, stored + sum(layer_bytes(layer_config(cfg, first_layer + i), run, (), first_layer + i,
                                                            routing) for i in range(start, stop)))
            stored += checkpoint_input_bytes(cfg)
            terms[CHECKPOINT_INPUT] = terms.get(CHECKPOINT_INPUT, 0.0) + checkpoint_input_bytes(cfg)
            reruns_attention = True
            continue
        index = first_layer + start  # a unit of anything but full recompute is one layer
        lcfg = layer_config(cfg, index)
        saved = layer_saved_bytes(lcfg, run, p.modules, index, routing)
        reruns_attention = reruns_attention or "core_attn" in p.modules
        moved: dict[str, float] = {}
        if p.offload:
            moved = layer_offloaded(lcfg, saved)
        elif fine:
            moved = fine_grained_offloaded(lcfg, saved)
        away = sum(moved.values())
        if fine and not p.offload:
            reload = max(reload, away)
            if start == layers - 1:
                last = away
        stored += sum(saved.values()) - away
        for name, nbytes in saved.items():
            if nbytes - moved.get(name, 0.0):
                terms[name] = terms.get(name, 0.0) + nbytes - moved.get(name, 0.0)
        in_graph += sum(graph_part(lcfg, saved).values())
        pool += sum(pool_resident(lcfg, saved, first_in_chunk=start == 0).values())
    indices = chunk_layer_indices(cfg, first_layer, layers, mtp)
    full = cfg.recompute.granularity == "full"
    modules = frozenset(cfg.recompute.modules) if cfg.recompute.granularity == "selective" else frozenset()
    for k in range(mtp):
        index = mtp_index(cfg, k)
        lcfg = layer_config(cfg, index)
        inner = layer_saved_bytes(lcfg, run, () if full else modules, index, routing)
        extras = mtp_saved_bytes(lcfg, k)
        if full:  # `_checkpointed_forward`: rebuilt in backward over what the chunk keeps
            rebuilt = max(rebuilt, stored + sum(inner.values()) + sum(extras.values()))
            inner, extras = {}, mtp_saved_bytes(lcfg, k, checkpointed=True)
            reruns_attention = True
        reruns_attention = reruns_attention or "core_attn" in modules
        for name, nbytes in {**inner, **{n: b for n, b in extras.items() if n not in inner}}.items():
            stored += nbytes
            terms[name] = terms.get(name, 0.0) + nbytes
        in_graph += sum(graph_part(lcfg, inner).values())
        pool += sum(pool_resident(lcfg, inner, first_in_chunk=False).values())
    forward = max(layer_forward_bytes(cfg, run, i) for i in indices)
    layer_backward = max(layer_backward_bytes(cfg, run, i, routing) for i in indices)
    backward = max(layer_backward, forward) if reruns_attention else layer_backward
    return ChunkBytes(stored, max(stored, rebuilt) + backward + reload, forward, in_graph, pool, last, terms,
                      layer_backward)


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
    first_iteration_items: dict[str, float] = field(default_factory=dict)
    """The first iteration's peak, item by item: its passes run before the optimizer's first step
    creates the Adam moments (`first_iteration_peak`)."""
    first_iteration_phase: str = ""
    held_chunks: tuple[int, ...] = ()
    """The model chunk of every forward whose activations are held at the peak (SchedulePeak.held)."""
    peak_kind: str = ""
    """"F" or "B": whether the peak is in a forward or a backward ("" at the optimizer step)."""
    peak_chunk: int = 0
    chunks: list[ChunkBytes] = field(default_factory=list)
    """The activations of each model chunk this rank builds (`chunk_bytes`), by chunk."""
    iteration_peaks: tuple[tuple[int, float, str], ...] = ()
    """(the first iteration it happens in, bytes, where) of each phase of the run in iteration order:
    iteration 1 (before the Adam moments), the eager iterations after it (with CUDA graphs, until the
    capture), the steady state; `peak_after` reads them as a memory line does."""

    def peak_after(self, iteration: int) -> float:
        """What Megatron's and Bridge's memory line printed after iteration `iteration` reports as
        max allocated (`torch.cuda.memory_stats()["allocated_bytes.all.peak"]`, never reset:
        training.py `training_log` / Bridge train_utils.py `training_log` with `report_memory`): the
        most of every phase that has run by the end of that iteration."""
        if not self.iteration_peaks:
            return self.first_iteration_peak_allocated_bytes if iteration <= 1 else self.peak_allocated_bytes
        return max(b for first, b, _ in self.iteration_peaks if first <= max(iteration, 1))

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
        return (held if self.held_bytes is None else self.held_bytes) + self.gradient_copies_bytes


DEFERRED_WGRAD_ITEM = "deferred output-layer weight-gradient buffers"
DUMMY_WGRAD_ITEM = "Transformer Engine placeholder weight gradients"
ACTIVATION_ITEMS = ("activations of the other micro-batches in flight", "activations of the pass at the peak",
                    "transient of the pass at the peak", DEFERRED_WGRAD_ITEM)


def static_items(cfg: Config, stage: int, run: MegatronRun) -> dict[str, float]:
    """What a rank of pipeline stage `stage` holds all run besides activations (the fp32 gradient
    copies of fp16 runs aside): parameters, gradients and optimizer state (`bytes_per_parameter` of
    each parameter group: the dense parameters over dp x cp, the routed experts' over the
    expert-data-parallel group), FP8's weight copies or FP8 weights (`fp8_weight_bytes`), the
    buffers (`buffer_bytes`), TE's placeholder weight gradients under gradient-accumulation fusion
    (`te_dummy_wgrad_bytes`), FP8's scaling state, CUDA graphs' static buffers."""
    return _held_all_run(cfg, stage, run, model_chunks(cfg, stage))[0]


def _held_all_run(cfg: Config, stage: int, run: MegatronRun,
                  built: list[ModelChunk]) -> tuple[dict[str, float], dict[str, float]]:
    """`static_items` of the rank whose model chunks are `built`, and of them CUDA graphs' static
    buffers (`static_buffer_bytes`), which come only with the capture."""
    groups = stage_parameter_groups(cfg, stage)
    # The fp32 gradient copies live from the optimizer step to the next step's zero_grad, which
    # runs before the forward: they never meet the activations.
    static: dict[str, float] = {}
    for group, count in groups.items():
        for name, b in bytes_per_parameter(cfg, expert=group == "expert").items():
            if b and count and name != "fp32 gradient copies":
                static[name] = static.get(name, 0.0) + b * count
    # the MTP layers are built by the last chunk (the loss's): every decoder layer comes first
    layers = [i for c in built for i in chunk_layer_indices(cfg, c.first_layer, c.layers, c.mtp)]
    for item, nbytes in fp8_weight_bytes(cfg, run, layers).items():
        static[item] = static.get(item, 0.0) + nbytes
    static.update(buffer_bytes(cfg, run))
    dummies = te_dummy_wgrad_bytes(cfg, layers)
    if dummies:
        static[DUMMY_WGRAD_ITEM] = dummies
    scaling = fp8_scaling_bytes(cfg, layers)
    if scaling:
        static["FP8 scaling state"] = scaling
    graph_buffers = static_buffer_bytes(cfg, stage, max(c.layers + c.mtp for c in built))
    static.update(graph_buffers)
    if any(c.embedding or c.loss for c in built) and graphs(cfg) == "full_iteration":
        static[_FULL_ITERATION_INPUTS] = full_iteration_data_bytes(cfg, batch_bytes(cfg))
    return static, graph_buffers


def stage_peak(cfg: Config, stage: int, run: MegatronRun, routing: str = "balanced") -> StagePeak:
    """Megatron's peak allocated bytes on a rank of pipeline stage `stage`: what it holds all run
    (`static_items`), and the most the step's passes hold at once (analysis/megatron_schedule.py): the chunk
    forwards waiting for their backward, plus the pass in flight (the loss on the last stage's last
    chunk, whose forward also holds the micro-batch's inputs; a layer's backward). With CUDA graphs
    the most of the eager warm-up steps, the capture and the replays (cuda_graphs.py). MoE layers'
    routed rows follow the `routing` assumption (moe.py)."""
    check_supported(cfg, run)
    par = cfg.parallel
    vp = par.virtual_pipeline_model_parallel_size or 1
    # the model chunks this rank builds (config/pipeline_split.py: even, uneven or by layout), each
    # from its own first layer (layers differ in their kind, dense or MoE, their cp_comm_type, and
    # whether FP8 keeps them in bf16)
    built = model_chunks(cfg, stage)
    chunk = [chunk_bytes(cfg, run, c.layers, c.first_layer, routing, c.mtp) for c in built]
    groups = stage_parameter_groups(cfg, stage)
    params = sum(groups.values())
    static, graph_buffers = _held_all_run(cfg, stage, run, built)
    impl, steps = graphs(cfg), cfg.training.cuda_graph_warmup_steps
    full_iteration = impl == "full_iteration"

    def embeds(c: int) -> bool:
        return built[c].embedding

    def loses(c: int) -> bool:
        return built[c].loss

    output, kept = output_saved_bytes(cfg), loss_saved_bytes(cfg)
    embedding, inputs, loss_peak = embedding_saved_bytes(cfg), batch_bytes(cfg), loss_peak_bytes(cfg)
    # What each model chunk's passes hold, worked out once per chunk (the schedule asks per pass).
    stored_bytes: list[float] = []
    forward_bytes: list[float] = []
    backward_bytes: list[float] = []
    for c, ch in enumerate(chunk):
        outside = (embedding if embeds(c) else 0.0) + ((output + kept) if loses(c) else 0.0)
        # fine-grained offloading keeps the last layer's groups of the chunk whose backward is next
        stored_bytes.append(ch.stored + outside + (ch.last_layer_offloaded if loses(c) else 0.0))
        # full_iteration's inputs sit in static buffers: counted in `static`
        extra = inputs if (embeds(c) or loses(c)) and not full_iteration else 0.0
        # the layers' attention runs before the output layer and the loss, whose bytes stored(c) holds
        layers = ch.forward - ((output + kept) if loses(c) else 0.0)
        forward_bytes.append(extra + max(loss_peak - kept if loses(c) else 0.0, layers))
        layers = ch.backward - ch.stored
        if loses(c):  # the loss's backward first, then the layers' with the loss and output freed
            backward_bytes.append(max(loss_peak - kept, layers - output - kept))
        else:
            backward_bytes.append(layers)

    def stored(c: int) -> float:
        return stored_bytes[c]

    def forward(c: int) -> float:
        return forward_bytes[c]

    def backward(c: int) -> float:
        return backward_bytes[c]

    def retained(mb: int, c: int) -> float:
        return deferred_wgrad_bytes(cfg, mb) if loses(c) else 0.0

    def at_peak(held: dict[str, float], peak: SchedulePeak, label: str) -> tuple[dict[str, float], str]:
        """A phase's items at its schedule peak (what it holds all run, and the passes' activations
        and transient), and where that peak is."""
        items = {**held, "activations of the other micro-batches in flight": peak.others,
                 "activations of the pass at the peak": peak.own, "transient of the pass at the peak": peak.transient}
        phase = ("the loss's " if loses(peak.chunk) and peak.total else "") + \
            ("forward" if peak.kind == "F" else "backward") + (f" of model chunk {peak.chunk}" if vp > 1 else "") + label
        return items, phase

    phases: list[tuple[str, dict[str, float], SchedulePeak]] = []

    def without(*names: str) -> dict[str, float]:
        return {k: v for k, v in static.items() if k not in names}

    if impl == "none" or steps >= 1:  # the eager steps (all of them without graphs)
        # TE's per-layer static buffers come with the capture (TECudaGraphHelper.create_cudagraphs)
        absent = (*graph_buffers, *(() if impl == "none" or steps >= 2 else ("Adam moments",)))
        phases.append(("" if impl == "none" else " (eager warm-up step)", without(*absent),
                       schedule_peak(cfg, stage, stored, backward, forward, retained)))
    if impl != "none":
        at_capture = static if steps >= 1 else without("Adam moments")
        if full_iteration:  # the captured step allocates as an eager one does, into the pool
            phases.append((" (CUDA graph capture)", at_capture,
                           schedule_peak(cfg, stage, stored, backward, forward, retained)))
        else:
            mlp_graphed = "mlp" in captured_parts(cfg)
            transient = max((ch.layer_backward for ch in chunk), default=0.0)
            phases.append((" (CUDA graph capture)", at_capture, schedule_peak(
                cfg, stage, lambda c: chunk[c].in_graph, lambda c: transient if mlp_graphed else 0.0)))
            phases.append((" (CUDA graph replay)", static, schedule_peak(
                cfg, stage, lambda c: stored(c) - chunk[c].pool,
                lambda c: backward(c) - (transient if mlp_graphed and not loses(c) else 0.0), forward, retained)))
    totals = {(label.strip(" ()") or "eager"): sum(held.values()) + peak.total for label, held, peak in phases}
    label, held, peak = max(phases, key=lambda ph: sum(ph[1].values()) + ph[2].total)
    items, phase = at_peak(held, peak, label)
    if peak.retained:
        items[DEFERRED_WGRAD_ITEM] = peak.retained
    if par.overlap_moe_expert_parallel_comm:
        first = built[0]
        pair = combined_pair_bytes(cfg, run, chunk[0], first.first_layer, first.layers, routing)
        if sum(pair) > peak.total:
            items = {**static, "activations of the other micro-batches in flight": pair[0],
                     "activations of the pass at the peak": pair[1], "transient of the pass at the peak": pair[2]}
            phase = "a combined forward-backward layer pair"
    copies = sum(bytes_per_parameter(cfg, expert=group == "expert")["fp32 gradient copies"] * count
                 for group, count in groups.items())
    step = {**static, "fp32 gradient copies": copies}
    if sum(step.values()) > sum(items.values()):  # the optimizer step holds the copies instead of activations
        items, phase = step, "the optimizer step"
    if impl != "none" and steps >= 1:
        # iteration 1 runs eagerly: the graphs and their static buffers come with the capture, after
        # cuda_graph_warmup_steps iterations (training.py; Bridge train.py: `step - start_iteration
        # == cuda_graph_warmup_steps`)
        label, held, eager = phases[0]
        eager_items, eager_phase = at_peak(held, eager, label)
        captured = (*graph_buffers, _FULL_ITERATION_INPUTS)
        eager_step = {k: v for k, v in step.items() if k not in captured}
        if sum(eager_step.values()) > sum(eager_items.values()):
            eager_items, eager_phase = eager_step, "the optimizer step"
        first, first_phase = first_iteration_peak(eager_items, eager_phase, eager_step)
    else:
        first, first_phase = first_iteration_peak(items, phase, step)
    at_step = phase == "the optimizer step"
    iterations = [(1, sum(first.values()), first_phase)]
    if impl != "none" and steps >= 2:
        # iterations 2 to cuda_graph_warmup_steps: eager, with the Adam moments, before the capture
        # (which runs before iteration cuda_graph_warmup_steps + 1)
        label, held, eager = phases[0]
        passes = sum(held.values()) + eager.total
        eager_step = sum(v for k, v in step.items() if k not in (*graph_buffers, _FULL_ITERATION_INPUTS))
        iterations.append((2, max(passes, eager_step), "the optimizer step" if eager_step >= passes else
                           at_peak(held, eager, label)[1]))
        iterations.append((steps + 1, sum(items.values()), phase))
    else:
        iterations.append((2, sum(items.values()), phase))
    return StagePeak(stage, params, items, phase, copies, sum(static.values()), totals if len(totals) > 1 else {},
                     first, first_phase, () if at_step else peak.held, "" if at_step else peak.kind, peak.chunk,
                     chunk, tuple(iterations))


def first_iteration_peak(items: dict[str, float], phase: str, step: dict[str, float]) -> tuple[dict[str, float], str]:
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


def combined_pair_bytes(cfg: Config, run: MegatronRun, chunk: ChunkBytes, first_layer: int, layers: int,
                        routing: str = "balanced") -> tuple[float, float, float]:
    """The most a layer pair of the combined 1F1B schedule holds (overlap_moe_expert_parallel_comm,
    no pipelining; combined_1f1b.py, model_chunk_schedule_plan.py `TransformerModelChunkSchedulePlan.run`):
    micro-batch i's loss and output layer ran their backward first, micro-batch i + 1's layer j runs
    beside micro-batch i's layer L - 1 - j, so L + 1 layers are stored at most, beside micro-batch i's
    16-bit logits (the loss node's inputs, released after the layers) and its inputs; then the loss
    of micro-batch i + 1 runs as in 1F1B. Returns (micro-batch i's part, the forward micro-batch's and
    the extra layer, the pair's transient: `chunk`'s layer backward, whose MTP layers, of the decoder
    layers' kinds, add nothing over the decoder layers this pipeline-less chunk holds)."""
    numbers = range(first_layer, first_layer + layers)
    layer = max(layer_bytes(cfg, run, (), i, routing) for i in numbers)
    e = ELEMENT_BYTES[cfg.training.precision]
    return (chunk.stored + e * logits(cfg) + batch_bytes(cfg), layer + batch_bytes(cfg), chunk.layer_backward)


def stage_peaks(cfg: Config, run: MegatronRun, routing: str = "balanced") -> list[StagePeak]:
    """`stage_peak` of every pipeline stage."""
    return [stage_peak(cfg, r, run, routing) for r in range(cfg.parallel.pipeline_model_parallel_size)]
