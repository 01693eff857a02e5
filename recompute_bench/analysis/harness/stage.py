"""One pipeline stage and one micro-batch: the activations of a stage's layers under a recompute
setting (stored until backward, and the peak while the micro-batch runs its backward), what lies
outside the layers (token ids, embedding, final norm, output layer, loss), what `run`'s probe measures
for one micro-batch, and the parameters a stage holds. Composes `analysis.harness.layer` over layers and model
chunks; the embedding, the output layer and the loss count Megatron's padded vocabulary (`vocab_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

from recompute_bench.analysis.checkpoint import checkpoint_input_bytes
from recompute_bench.analysis.harness.layer import layer_activation_bytes, layer_parameters
from recompute_bench.analysis.pipelining_schedule import rank_stages
from recompute_bench.config.rules import layers_per_model_chunk
from recompute_bench.config.schema import Config
from recompute_bench.models import ELEMENT_BYTES, FP32_BYTES, INDEX_BYTES, MASK_BYTES, kind_config, loss_chunk_rows
from recompute_bench.models.context_parallel import rank_seq_length
from recompute_bench.recompute.policy import LayerPolicy, chunks, layer_kind, layer_policies


@dataclass(frozen=True)


class StageActivations:
    """Activations of one micro-batch in the layers of one pipeline stage."""

    layers: int
    stored_bytes: float
    """Kept from forward until backward."""
    peak_bytes: float
    """The most held while this micro-batch runs its backward (full recompute rebuilds a chunk's
    activations then); equals stored_bytes when nothing is recomputed layer-wise."""

    @property
    def per_layer_bytes(self) -> float:
        """stored_bytes / layers, as the record's `activation_bytes_per_layer`."""
        return self.stored_bytes / self.layers


def stage_activations(cfg: Config, device: str = "cuda", layers: int | None = None, first: int = 0) -> StageActivations:
    """Stored and backward-peak activation bytes of `layers` layers from model layer `first`
    (default: one pipeline stage from layer 0) for one micro-batch, under cfg.recompute.

    Megatron applies full recompute within each model chunk (the stage, or each of its virtual
    stages). Full uniform N keeps every chunk of N layers' input; while chunk c is recomputed in
    backward, it holds the inputs of the c earlier chunks plus chunk c's full activations. Full
    block N keeps N inputs plus the full activations of the model chunk's other layers; rebuilding
    checkpointed layer c holds c inputs and one layer's full activations. A stage of several model
    chunks holds all of them and rebuilds one at a time. Offloaded layers keep nothing on the device
    and bring one layer back at a time in backward. A model of dense and MoE layers is counted layer
    by layer (`policy_activations`): a chunk being rebuilt holds its own layers' bytes, not a mean."""
    r = cfg.recompute
    n_layers = layers if layers is not None else cfg.model.num_layers // cfg.parallel.pipeline_model_parallel_size
    mixed = 0 < cfg.model.moe_layers < cfg.model.num_layers  # dense and MoE layers keep different bytes
    if r.layer_policy or (mixed and not cfg.parallel.virtual_pipeline_model_parallel_size):
        return policy_activations(cfg, layer_policies(r, n_layers, first), device, first)
    full = layer_activation_bytes(cfg, (), device)
    ckpt = checkpoint_input_bytes(cfg)
    if r.granularity == "full":
        per_chunk = min(layers_per_model_chunk(cfg), n_layers)
        chunks = n_layers // per_chunk
        n = min(r.num_layers, per_chunk)
        if r.method == "uniform":
            sizes = [min(n, per_chunk - i) for i in range(0, per_chunk, n)]
            stored = len(sizes) * ckpt
            peak = max(c * ckpt + size * full for c, size in enumerate(sizes))
        else:
            stored = n * ckpt + (per_chunk - n) * full
            peak = max(stored, (n - 1) * ckpt + full)
        return StageActivations(n_layers, chunks * stored, (chunks - 1) * stored + peak)
    if r.granularity == "selective":
        per_layer = layer_activation_bytes(cfg, r.modules, device)
        return StageActivations(n_layers, n_layers * per_layer, n_layers * per_layer)
    offloaded = min(r.activation_offload_layers, n_layers)
    stored = (n_layers - offloaded) * full
    return StageActivations(n_layers, stored, stored + (full if offloaded else 0.0))


def policy_activations(cfg: Config, policies: list[LayerPolicy], device: str = "cuda", first: int = 0) -> StageActivations:
    """`stage_activations` of any per-layer policy list (one model chunk whose first layer is model
    layer `first`), one unit at a time (`chunks`): a full chunk keeps its input, a layer keeps
    `layer_activation_bytes` of its kind (dense or MoE) and selective modules, an offloaded layer
    keeps nothing. Backward runs the units last to first, so rebuilding full chunk u holds what the
    units before u keep plus the chunk's full activations; an offloaded layer brought back adds its
    full activations to all that is kept (as the closed forms count it). Equals the closed forms for
    every Megatron setting on a model of one layer kind (tested)."""
    ckpt = checkpoint_input_bytes(cfg)
    cache: dict[tuple[str, frozenset[str]], float] = {}

    def layer(i: int, modules: frozenset[str] = frozenset()) -> float:
        key = (layer_kind(cfg.model, first + i), modules)
        if key not in cache:
            cache[key] = layer_activation_bytes(kind_config(cfg, key[0]), modules, device)
        return cache[key]

    stored, peak, brought = 0.0, 0.0, 0.0
    for start, stop in chunks(policies):
        p = policies[start]
        if p.chunk is not None:
            peak = max(peak, stored + sum(layer(i) for i in range(start, stop)))
            stored += ckpt
        elif p.offload:
            brought = max(brought, layer(start))
        else:
            stored += layer(start, p.modules)
    return StageActivations(len(policies), stored, max(peak, stored + brought))


def embedding_saved_bytes(cfg: Config) -> dict[str, float]:
    """Per micro-batch, first pipeline stage: the embedding dropout's mask; under context parallel also
    the copy of this rank's token ids the embedding keeps (`models.cp_attention.SequenceSplit.select`;
    without it the embedding keeps a view of the step's token tensor, `saved_token_bytes`)."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    tokens = rank_seq_length(cfg) * tr.micro_batch_size
    out = {"embedding.token_ids": INDEX_BYTES * tokens} if par.context_parallel_size > 1 else {}
    if m.hidden_dropout > 0:
        t = par.tensor_model_parallel_size if par.sequence_parallel else 1
        out["embedding.dropout_mask"] = MASK_BYTES * tokens * m.hidden_size / t
    return out


def loss_saved_bytes(cfg: Config, device: str = "cuda") -> dict[str, float]:
    """Per micro-batch, last pipeline stage: final norm, output layer and the cross-entropy, which
    keeps (backends/pytorch.py `_VocabParallelCrossEntropy`, chunked over tokens) the gradient of
    the loss in the logits' own storage, in their dtype, for this rank's vocabulary shard."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    e, t = ELEMENT_BYTES[tr.precision], par.tensor_model_parallel_size
    tokens = rank_seq_length(cfg) * tr.micro_batch_size
    t_sp = t if par.sequence_parallel else 1
    return {
        "final_layernorm.input": e * tokens * m.hidden_size / t_sp,
        "final_layernorm.stats": cfg.spec.norm_stats_bytes(cfg, device, tokens) / t_sp,
        "output_layer.input": e * tokens * m.hidden_size / t_sp,
        "loss.logits_gradient": e * tokens * cfg.vocab_rows / t,  # written into the logits, vocab-parallel
    }


def token_bytes(cfg: Config) -> float:
    """The harness's token tensor: every micro-batch of the step, s + 1 ids each, on the device for
    the whole step (the embedding keeps a view of it, and labels are views of it)."""
    tr = cfg.training
    return INDEX_BYTES * cfg.num_microbatches * tr.micro_batch_size * (tr.seq_length + 1)


def loss_workspace_bytes(cfg: Config) -> float:
    """Transient at the loss: in its forward one chunk's fp32 working copy of 16-bit logits
    (`models.loss_chunk_rows` tokens of this rank's vocabulary shard); nothing for fp32 logits, worked
    in place, and nothing in its backward, which scales the kept gradient in place."""
    tr = cfg.training
    if ELEMENT_BYTES[tr.precision] >= FP32_BYTES:
        return 0.0
    vocab = cfg.vocab_rows // cfg.parallel.tensor_model_parallel_size
    return FP32_BYTES * loss_chunk_rows(rank_seq_length(cfg) * tr.micro_batch_size, vocab) * vocab


def activation_bytes(cfg: Config, device: str = "cuda") -> dict[str, float]:
    """What `run` measures as `activation_bytes` and `activation_bytes_per_layer`: one micro-batch,
    the whole model on one rank, read at the end of the forward."""
    layers = stage_activations(cfg, device, layers=cfg.model.num_layers)
    tokens = token_bytes(cfg) if cfg.parallel.context_parallel_size == 1 else 0.0  # the embedding's view of them
    outside = tokens + sum(embedding_saved_bytes(cfg).values()) + sum(loss_saved_bytes(cfg, device).values())
    return {"activation_bytes": layers.stored_bytes + outside,
            "activation_bytes_per_layer": layers.per_layer_bytes}


def stage_parameters(cfg: Config, stage: int) -> float:
    """Parameters held by one rank of pipeline stage `stage` (0-based)."""
    m, p = cfg.model, cfg.parallel.pipeline_model_parallel_size
    return m.num_layers // p * sum(layer_parameters(cfg).values()) + outside_parameters(cfg, stage)


def outside_parameters(cfg: Config, stage: int) -> float:
    """Parameters of one rank of pipeline stage `stage` outside its layers: the embeddings where it
    holds the first virtual stage, the final norm and the output layer where it holds the last (tied
    to the embedding: a copy of it, unless the same rank holds both, as a V schedule's first)."""
    m, par = cfg.model, cfg.parallel
    p, t = par.pipeline_model_parallel_size, par.tensor_model_parallel_size
    vp = par.virtual_pipeline_model_parallel_size or 1
    vocab = cfg.vocab_rows * m.hidden_size / t  # the padded vocabulary's rows, sharded over TP
    mine = set(rank_stages(par.schedule, p, vp, stage)) if p > 1 else {0, vp - 1}
    first, last = 0 in mine, p * vp - 1 in mine
    n = 0.0
    if first:
        n += vocab
        if m.position_embedding_type == "learned_absolute":
            n += m.max_position_embeddings * m.hidden_size
    if last:
        n += (2 if m.normalization == "LayerNorm" else 1) * m.hidden_size
        if not m.share_embeddings_and_output_weights or not first:
            n += vocab  # the output layer, or (tied, on another rank than the embedding) its copy of the embedding
    return n
