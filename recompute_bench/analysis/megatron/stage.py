"""One rank: a model chunk's activations under the recompute setting, and the peak of a pipeline
stage's rank, item by item, through Megatron's schedule.

Sources: megatron/core/pipeline_parallel/schedules.py, megatron/core/tensor_parallel/random.py
(CheckpointFunction)."""

from __future__ import annotations

from dataclasses import dataclass

from recompute_bench.analysis.layer import checkpoint_input_bytes
from recompute_bench.analysis.megatron.buffers import buffer_bytes
from recompute_bench.analysis.megatron.layer import layer_backward_bytes, layer_bytes, layer_forward_bytes
from recompute_bench.analysis.megatron.optimizer import bytes_per_parameter
from recompute_bench.analysis.megatron.outside import (batch_bytes, deferred_wgrad_bytes, embedding_saved_bytes,
                                                       logits, loss_peak_bytes, loss_saved_bytes, output_saved_bytes)
from recompute_bench.analysis.megatron.run import MegatronRun
from recompute_bench.analysis.schedule import schedule_peak
from recompute_bench.analysis.megatron.parameters import stage_parameter_groups
from recompute_bench.models import ELEMENT_BYTES
from recompute_bench.recompute.policy import chunks, layer_policies
from recompute_bench.spec.config import BadInput, Config
from recompute_bench.spec.pipeline_split import model_chunks

@dataclass(frozen=True)
class ChunkBytes:
    """One model chunk's activations for one micro-batch."""

    stored: float
    """Kept from its forward to its backward."""
    backward: float
    """The most held while its backward runs (full recompute rebuilds a checkpoint's layers)."""
    forward: float = 0.0
    """The most its forward holds beyond what it keeps by then (the context-parallel attention's
    working set), taken at the chunk's end: an upper bound by the layers after that attention."""


def chunk_bytes(cfg: Config, run: MegatronRun, layers: int, first_layer: int = 0,
                routing: str = "balanced") -> ChunkBytes:
    """A model chunk of `layers` layers from layer `first_layer` under cfg.recompute, unit by unit
    (recompute/policy.py `chunks`): a full-recompute checkpoint keeps its input and, rebuilt in
    backward, its layers' activations over what the earlier units keep; a layer keeps
    `layer_saved_bytes` (a MoE layer its MoE block's under the `routing` assumption). Backward adds the most a layer's backward holds beyond that
    (`layer_backward_bytes`), or, where it re-runs the attention (full recompute, selective
    core_attn), the attention forward's working set if that is more (`layer_forward_bytes`)."""
    if layers == 0:  # a chunk that holds only the embedding or the loss (uneven splits)
        return ChunkBytes(0.0, 0.0)
    policies = layer_policies(cfg.recompute, layers)
    # A full-recompute checkpoint keeps its [s, b, h] input, as this harness's does (Megatron's
    # tensor_parallel/random.py CheckpointFunction, or TE's checkpoint).
    ckpt = checkpoint_input_bytes(cfg)
    stored = rebuilt = 0.0
    reruns_attention = False
    for start, stop in chunks(policies):
        p = policies[start]
        if p.offload:
            raise BadInput("activation offload is not modelled for framework megatron; drop --activation-offload-layers")
        if p.chunk is not None:
            rebuilt = max(rebuilt, stored + sum(layer_bytes(cfg, run, (), first_layer + i, routing) for i in range(start, stop)))
            stored += ckpt
            reruns_attention = True
        else:
            stored += sum(layer_bytes(cfg, run, p.modules, first_layer + i, routing) for i in range(start, stop))
            reruns_attention = reruns_attention or "core_attn" in p.modules
    forward = max(layer_forward_bytes(cfg, run, first_layer + i) for i in range(layers))
    backward = max(layer_backward_bytes(cfg, run, first_layer + i, routing) for i in range(layers))
    if reruns_attention:
        backward = max(backward, forward)
    return ChunkBytes(stored, max(stored, rebuilt) + backward, forward)


@dataclass
class StagePeak:
    """The peak of one pipeline stage's rank, item by item (bytes), and where it happens."""

    stage: int
    parameters: float
    items: dict[str, float]
    phase: str
    gradient_copies_bytes: float = 0.0
    """fp16 runs' fp32 gradient copies: held from the optimizer step until the next step begins."""

    @property
    def peak_allocated_bytes(self) -> float:
        return sum(self.items.values())

    @property
    def static_bytes(self) -> float:
        """What a rank holds after the optimizer step (Megatron logs it as mem-allocated-bytes):
        parameters, gradients, optimizer state, buffers, fp16's fp32 gradient copies."""
        held = sum(v for k, v in self.items.items() if k not in ACTIVATION_ITEMS and k != "fp32 gradient copies")
        return held + self.gradient_copies_bytes


DEFERRED_WGRAD_ITEM = "deferred output-layer weight-gradient buffers"
ACTIVATION_ITEMS = ("activations of the other micro-batches in flight", "activations of the pass at the peak",
                    "transient of the pass at the peak", DEFERRED_WGRAD_ITEM)


def stage_peak(cfg: Config, stage: int, run: MegatronRun, routing: str = "balanced") -> StagePeak:
    """Megatron's peak allocated bytes on a rank of pipeline stage `stage`: parameters, gradients
    and optimizer state (`bytes_per_parameter` of each parameter group: the dense parameters over
    dp, the routed experts' over the expert-data-parallel group), the buffers (`buffer_bytes`), and
    the most the step's passes hold at once (analysis/schedule.py): the chunk forwards waiting for
    their backward, plus the pass in flight (the loss on the last stage's last chunk, whose forward
    also holds the micro-batch's inputs; a layer's backward). MoE layers' routed rows follow the
    `routing` assumption (moe.py)."""
    par = cfg.parallel
    vp = par.virtual_pipeline_model_parallel_size or 1
    # the model chunks this rank builds (spec/pipeline_split.py: even, uneven or by layout), each
    # from its own first layer (layers differ in their kind, dense or MoE, and their cp_comm_type)
    built = model_chunks(cfg, stage)
    chunk = [chunk_bytes(cfg, run, c.layers, c.first_layer, routing) for c in built]
    groups = stage_parameter_groups(cfg, stage)
    params = sum(groups.values())
    per = {group: bytes_per_parameter(cfg, expert=group == "expert") for group in groups}
    # The fp32 gradient copies live from the optimizer step to the next step's zero_grad, which
    # runs before the forward: they never meet the activations.
    static: dict[str, float] = {}
    for group, count in groups.items():
        for name, b in per[group].items():
            if b and count and name != "fp32 gradient copies":
                static[name] = static.get(name, 0.0) + b * count
    static.update(buffer_bytes(cfg, run))

    def embeds(c: int) -> bool:
        return built[c].embedding

    def loses(c: int) -> bool:
        return built[c].loss

    output, kept = output_saved_bytes(cfg), loss_saved_bytes(cfg)

    def stored(c: int) -> float:
        return chunk[c].stored + (embedding_saved_bytes(cfg) if embeds(c) else 0.0) + ((output + kept) if loses(c) else 0.0)

    def forward(c: int) -> float:
        extra = batch_bytes(cfg) if embeds(c) or loses(c) else 0.0
        # the layers' attention runs before the output layer and the loss, whose bytes stored(c) holds
        layers = chunk[c].forward - ((output + kept) if loses(c) else 0.0)
        return extra + max(loss_peak_bytes(cfg) - kept if loses(c) else 0.0, layers)

    def backward(c: int) -> float:
        layers = chunk[c].backward - chunk[c].stored
        if loses(c):  # the loss's backward first, then the layers' with the loss and output freed
            return max(loss_peak_bytes(cfg) - kept, layers - output - kept)
        return layers

    def retained(mb: int, c: int) -> float:
        return deferred_wgrad_bytes(cfg, mb) if loses(c) else 0.0

    peak = schedule_peak(cfg, stage, stored, backward, forward, retained)
    items = {**static, "activations of the other micro-batches in flight": peak.others,
             "activations of the pass at the peak": peak.own, "transient of the pass at the peak": peak.transient}
    if peak.retained:
        items[DEFERRED_WGRAD_ITEM] = peak.retained
    phase = ("the loss's " if loses(peak.chunk) else "") + ("forward" if peak.kind == "F" else "backward") + \
        (f" of model chunk {peak.chunk}" if vp > 1 else "")
    if par.overlap_moe_expert_parallel_comm:
        first = built[0]
        pair = combined_pair_bytes(cfg, run, chunk[0], first.first_layer, first.layers, routing)
        if sum(pair) > peak.total:
            items = {**static, "activations of the other micro-batches in flight": pair[0],
                     "activations of the pass at the peak": pair[1], "transient of the pass at the peak": pair[2]}
            phase = "a combined forward-backward layer pair"
    copies = sum(per[group]["fp32 gradient copies"] * count for group, count in groups.items())
    if copies > peak.total:  # the optimizer step holds the copies instead of activations
        items, phase = {**static, "fp32 gradient copies": copies}, "the optimizer step"
    return StagePeak(stage, params, items, phase, copies)


def combined_pair_bytes(cfg: Config, run: MegatronRun, chunk: ChunkBytes, first_layer: int, layers: int,
                        routing: str = "balanced") -> tuple[float, float, float]:
    """The most a layer pair of the combined 1F1B schedule holds (overlap_moe_expert_parallel_comm,
    no pipelining; combined_1f1b.py, model_chunk_schedule_plan.py `TransformerModelChunkSchedulePlan.run`):
    micro-batch i's loss and output layer ran their backward first, micro-batch i + 1's layer j runs
    beside micro-batch i's layer L - 1 - j, so L + 1 layers are stored at most, beside micro-batch i's
    16-bit logits (the loss node's inputs, released after the layers) and its inputs; then the loss
    of micro-batch i + 1 runs as in 1F1B. Returns (micro-batch i's part, the forward micro-batch's and
    the extra layer, the pair's transient)."""
    numbers = range(first_layer, first_layer + layers)
    layer = max(layer_bytes(cfg, run, (), i, routing) for i in numbers)
    e = ELEMENT_BYTES[cfg.training.precision]
    transient = max(layer_backward_bytes(cfg, run, i, routing) for i in numbers)
    return (chunk.stored + e * logits(cfg) + batch_bytes(cfg), layer + batch_bytes(cfg), transient)


def stage_peaks(cfg: Config, run: MegatronRun, routing: str = "balanced") -> list[StagePeak]:
    """`stage_peak` of every pipeline stage."""
    return [stage_peak(cfg, r, run, routing) for r in range(cfg.parallel.pipeline_model_parallel_size)]
