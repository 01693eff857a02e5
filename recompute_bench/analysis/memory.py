"""The analytical model: activation bytes per layer for every recompute setting, the whole-rank peak,
FLOPs and overhead per setting, and the planner that picks the fastest setting that fits. Pure
Python: what one layer keeps, computes and holds comes from the model's spec (`recompute_bench.models`),
and this module composes it over layers, model chunks, pipeline stages and micro-batches.

Two accountings of activation memory live here:

- "built" (`layer_saved_bytes`, `rank_memory`, ...): the storages the GPT of `models/dense/layers.py`
  really keeps for backward, named one by one, found with the saved-tensor probe and checked against
  it in the tests. A storage that several saved tensors share counts once, as the probe counts it.
- "paper" (`paper_layer_bytes`, ...): Table 2 of Korthikanti et al. 2022 exactly, for the paper's
  GPT-3 layer (math attention, dropout on, GeLU 4h MLP, LayerNorm, full heads, 16-bit).

For the paper's layer the two differ by the LayerNorm statistics only (mean and rstd, 2sb elements
per norm, fp32 on CUDA), which the paper leaves out as small. Under tensor parallelism t the built
terms are split the paper's way: what lies inside the column/row-parallel region (q, k, v, the
attention scores, the MLP's wide activations) divides by t; what lies outside (norm inputs and
outputs, dropout masks, norm statistics) divides by t only with sequence parallelism. The word
embedding, the output layer and the loss count Megatron's padded vocabulary (`vocab_rows`).

Bytes everywhere; a "token" is one of the s x b positions of a micro-batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable

from recompute_bench.analysis import flops
from recompute_bench.models import (ELEMENT_BYTES, FP32_BYTES, INDEX_BYTES, MASK_BYTES, device_kind,  # noqa: F401
                                    spec_for, vocab_rows)
from recompute_bench.recompute.policy import LayerPolicy, chunks, layer_kind, layer_policies
from recompute_bench.recompute.settings import selective_settings
from recompute_bench.spec.config import Config, RecomputeConfig
from recompute_bench.spec.rules import layers_per_model_chunk

ALLOWANCE_FRACTION = 0.10
"""Allocator allowance: reserved minus allocated (fragmentation of the caching allocator), as a
fraction of the estimated allocated peak."""
ALLOWANCE_BYTES = 2**30
"""Fixed allowance: CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers, which
`torch.cuda.max_memory_allocated` does not show but the device must hold."""

ESTIMATE_SCHEMA = "recompute-bench/estimate/v1"
PLAN_SCHEMA = "recompute-bench/plan/v1"


# ----- one layer (the model's spec names its storages) ------------------------------------------

def attention_kernel(cfg: Config, device: str = "cuda") -> str:
    """What the core attention runs on `device`: "math", "fused" or "sdpa_math" (see the spec)."""
    return spec_for(cfg.model).attention_kernel(cfg, device)


def layer_saved_bytes(cfg: Config, modules: Iterable[str] = (), device: str = "cuda") -> dict[str, float]:
    """Bytes one transformer layer keeps for backward for one micro-batch on one tensor-parallel
    rank, storage by storage, when the layer is not inside a full-recompute checkpoint and
    `modules` are recomputed selectively."""
    return spec_for(cfg.model).layer_saved_bytes(cfg, modules, device)


def _norm_stats_bytes(cfg: Config, device: str, tokens: int) -> float:
    return spec_for(cfg.model).norm_stats_bytes(cfg, device, tokens)


def layer_activation_bytes(cfg: Config, modules: Iterable[str] = (), device: str = "cuda") -> float:
    """Sum of `layer_saved_bytes`: one layer, one micro-batch, one tensor-parallel rank."""
    return sum(layer_saved_bytes(cfg, modules, device).values())


def checkpoint_input_bytes(cfg: Config) -> float:
    """What full recompute keeps per checkpoint: the chunk's [s, b, h] input, sharded over the
    tensor-parallel group with sequence parallelism or `distribute_saved_activations`."""
    tr, par = cfg.training, cfg.parallel
    nbytes = ELEMENT_BYTES[tr.precision] * tr.seq_length * tr.micro_batch_size * cfg.model.hidden_size
    if par.sequence_parallel or cfg.recompute.distribute_saved_activations:
        nbytes /= par.tensor_model_parallel_size
    return nbytes


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


def stage_activations(cfg: Config, device: str = "cuda", layers: int | None = None) -> StageActivations:
    """Stored and backward-peak activation bytes of `layers` layers (default: one pipeline stage)
    for one micro-batch, under cfg.recompute.

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
        return policy_activations(cfg, layer_policies(r, n_layers), device)
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


def kind_config(cfg: Config, kind: str) -> Config:
    """cfg as a model whose every layer is of `kind` ("dense" or "moe", `policy.layer_kind`), so that
    the spec's per-layer answers (a mean over the model's layers) are that kind's exactly."""
    m = cfg.model
    if not m.num_moe_experts or (kind == "moe" and m.moe_layers == m.num_layers):
        return cfg
    model = dataclasses.replace(m, moe_layer_freq=1) if kind == "moe" else dataclasses.replace(m, num_moe_experts=None)
    return dataclasses.replace(cfg, model=model)


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


# ----- outside the layers ---------------------------------------------------------------------

def embedding_saved_bytes(cfg: Config) -> dict[str, float]:
    """Per micro-batch, first pipeline stage: the embedding dropout's mask."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    if m.hidden_dropout <= 0:
        return {}
    t = par.tensor_model_parallel_size if par.sequence_parallel else 1
    return {"embedding.dropout_mask": MASK_BYTES * tr.seq_length * tr.micro_batch_size * m.hidden_size / t}


def loss_saved_bytes(cfg: Config, device: str = "cuda") -> dict[str, float]:
    """Per micro-batch, last pipeline stage: final norm, output layer and fp32 cross-entropy."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    e, t = ELEMENT_BYTES[tr.precision], par.tensor_model_parallel_size
    tokens = tr.seq_length * tr.micro_batch_size
    t_sp = t if par.sequence_parallel else 1
    out = {
        "final_layernorm.input": e * tokens * m.hidden_size / t_sp,
        "final_layernorm.stats": spec_for(m).norm_stats_bytes(cfg, device, tokens) / t_sp,
        "output_layer.input": e * tokens * m.hidden_size / t_sp,
        "loss.log_probs": FP32_BYTES * tokens * vocab_rows(cfg) / t,  # log-softmax output, fp32, vocab-parallel
        "loss.total_weight": FP32_BYTES,
    }
    if tr.micro_batch_size > 1:  # labels are a strided view of the token tensor; flattening copies them
        out["loss.labels"] = INDEX_BYTES * tokens
    return out


def token_bytes(cfg: Config) -> float:
    """The harness's token tensor: every micro-batch of the step, s + 1 ids each, on the device for
    the whole step (the embedding keeps a view of it, and labels are views of it)."""
    tr = cfg.training
    return INDEX_BYTES * cfg.num_microbatches * tr.micro_batch_size * (tr.seq_length + 1)


def loss_workspace_bytes(cfg: Config) -> float:
    """Transient in the loss's backward: the fp32 gradients of the log-probabilities and of the
    logits, [s, b, v/t] each (v padded), while the saved log-probabilities are still held."""
    tr = cfg.training
    return 2 * FP32_BYTES * tr.seq_length * tr.micro_batch_size * vocab_rows(cfg) / cfg.parallel.tensor_model_parallel_size


def layer_workspace_bytes(cfg: Config, device: str = "cuda") -> float:
    """Transient in one layer's backward: two gradients the size of the layer's largest saved
    tensor (e.g. of the attention probabilities and scores, or of the MLP's wide activations)."""
    return 2 * max(layer_saved_bytes(cfg, (), device).values())


# ----- one micro-batch on one rank, as the probe measures it ----------------------------------

def activation_bytes(cfg: Config, device: str = "cuda") -> dict[str, float]:
    """What `run` measures as `activation_bytes` and `activation_bytes_per_layer`: one micro-batch,
    the whole model on one rank, read at the end of the forward."""
    layers = stage_activations(cfg, device, layers=cfg.model.num_layers)
    outside = token_bytes(cfg) + sum(embedding_saved_bytes(cfg).values()) + sum(loss_saved_bytes(cfg, device).values())
    return {"activation_bytes": layers.stored_bytes + outside,
            "activation_bytes_per_layer": layers.per_layer_bytes}


# ----- parameters and optimizer state ---------------------------------------------------------

def layer_parameters(cfg: Config) -> dict[str, float]:
    """Parameters of one layer on one tensor-parallel rank: "sharded" (QKV, projections, MLP
    weights and column-parallel biases) and "replicated" (norms, row-parallel biases)."""
    return spec_for(cfg.model).layer_parameters(cfg)


def stage_parameters(cfg: Config, stage: int) -> float:
    """Parameters held by one rank of pipeline stage `stage` (0-based)."""
    m, par = cfg.model, cfg.parallel
    p, t = par.pipeline_model_parallel_size, par.tensor_model_parallel_size
    per_layer = sum(layer_parameters(cfg).values())
    n = m.num_layers // p * per_layer
    vocab = vocab_rows(cfg) * m.hidden_size / t  # the padded vocabulary's rows, sharded over TP
    if stage == 0:
        n += vocab
        if m.position_embedding_type == "learned_absolute":
            n += m.max_position_embeddings * m.hidden_size
    if stage == p - 1:
        n += (2 if m.normalization == "LayerNorm" else 1) * m.hidden_size
        if not m.share_embeddings_and_output_weights or p > 1:
            n += vocab  # the output layer, or (tied, p > 1) the last stage's copy of the embedding
    return n


def optimizer_bytes_per_parameter(cfg: Config) -> dict[str, float]:
    """Bytes per parameter as `measure.point`'s optimizers hold them (tests/test_measure.py measures
    them). 16-bit (Megatron's layout): weights 2; no 16-bit gradient is kept (a hook adds each one
    into the fp32 main gradient as soon as autograd produced it and frees it, so only one
    parameter's exists at a time: a transient, not a per-parameter cost); fp32 main gradients 4,
    fp32 master weights 4, Adam moments 8: 18 held. fp32: plain Adam, weights 4, gradients 4,
    moments 8: 16. Step temporaries 0: Adam runs fused (torch's fused kernel on CUDA and CPU)
    and allocates nothing the size of the parameters. A distributed optimizer (Megatron's:
    6 + 12/dp held) shards master weights and moments over dp."""
    par = cfg.parallel
    shards = par.data_parallel_size if par.use_distributed_optimizer else 1
    if cfg.training.precision == "fp32":
        return {"weights": 4, "grads16": 0, "main_grads": 4, "master_weights": 0,
                "adam_moments": 8 / shards, "step_temporaries": 0}
    return {"weights": 2, "grads16": 0, "main_grads": 4, "master_weights": 4 / shards,
            "adam_moments": 8 / shards, "step_temporaries": 0}


# ----- the whole rank ---------------------------------------------------------------------------

def microbatches_in_flight(cfg: Config, stage: int = 0) -> float:
    """Micro-batches whose activations a pipeline stage holds at once. 1F1B: stage i holds p - i
    (at most the number of micro-batches). Interleaved with m chunks per rank, the first stage holds
    p (1 + (p - 1)/(p m)) micro-batches' worth of its layers (the paper's factor)."""
    par = cfg.parallel
    p, m = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    n = cfg.num_microbatches
    if p == 1:
        return 1.0
    if m > 1 and stage == 0:
        return min(float(n), p * (1 + (p - 1) / (p * m)))
    return float(min(p - stage, n))


@dataclass
class RankMemory:
    """The estimated peak of one pipeline stage's rank, item by item (bytes)."""

    stage: int
    parameters: float
    items: dict[str, float] = field(default_factory=dict)
    """Held at the backward peak, in print order."""
    optimizer_step_bytes: float = 0.0
    """Peak during the optimizer step (no activations then)."""

    @property
    def backward_peak_bytes(self) -> float:
        return sum(self.items.values())

    @property
    def peak_allocated_bytes(self) -> float:
        """What torch.cuda.max_memory_allocated should show."""
        return max(self.backward_peak_bytes, self.optimizer_step_bytes)

    @property
    def phase(self) -> str:
        return "backward" if self.backward_peak_bytes >= self.optimizer_step_bytes else "optimizer step"


def rank_memory(cfg: Config, stage: int = 0, device: str = "cuda", acts: StageActivations | None = None) -> RankMemory:
    """Peak allocated bytes of one rank of pipeline stage `stage` under cfg (parameters, gradients,
    optimizer state, in-flight activations, embedding/loss buffers, transient workspaces); `acts`
    replaces the stage's activations under cfg.recompute (the planner's candidate policies)."""
    p = cfg.parallel.pipeline_model_parallel_size
    params = stage_parameters(cfg, stage)
    per = optimizer_bytes_per_parameter(cfg)
    acts = acts or stage_activations(cfg, device)
    in_flight = microbatches_in_flight(cfg, stage)
    first, last = stage == 0, stage == p - 1
    emb = sum(embedding_saved_bytes(cfg).values()) if first else 0.0
    loss = sum(loss_saved_bytes(cfg, device).values()) if last else 0.0
    # The micro-batch in backward: first the loss's backward (all its layers still stored), then
    # the layers' backward, where full recompute rebuilds a chunk.
    at_loss = acts.stored_bytes + emb + (loss + loss_workspace_bytes(cfg) if last else 0.0)
    in_layers = acts.peak_bytes + emb + layer_workspace_bytes(cfg, device)
    items = {
        "weights": per["weights"] * params,
        "gradients (16-bit, until the step)": per["grads16"] * params,
        "main gradients (fp32)": per["main_grads"] * params,
        "master weights (fp32)": per["master_weights"] * params,
        "Adam moments (fp32)": per["adam_moments"] * params,
        "token ids (all micro-batches of the step)": token_bytes(cfg) if first or last else 0.0,
        "activations of the other in-flight micro-batches": (in_flight - 1) * (acts.stored_bytes + emb + loss),
        "activations of the micro-batch in backward (stored)": acts.stored_bytes + emb + loss,
        "backward transient (recompute, loss, gradients)": max(at_loss, in_layers) - (acts.stored_bytes + emb + loss),
    }
    step = sum(per[k] for k in ("weights", "main_grads", "master_weights", "adam_moments", "step_temporaries")) * params
    step += items["token ids (all micro-batches of the step)"]
    return RankMemory(stage=stage, parameters=params, items=items, optimizer_step_bytes=step)


def peak_rank_memory(cfg: Config, device: str = "cuda", acts: StageActivations | None = None) -> RankMemory:
    """The most loaded rank: the first or the last pipeline stage (middle ones hold less than the
    first: the same layers, fewer micro-batches in flight, no embedding)."""
    p = cfg.parallel.pipeline_model_parallel_size
    ranks = [rank_memory(cfg, 0, device, acts)] + ([rank_memory(cfg, p - 1, device, acts)] if p > 1 else [])
    return max(ranks, key=lambda r: r.peak_allocated_bytes)


def device_bytes_needed(peak_allocated: float, allowance_fraction: float = ALLOWANCE_FRACTION,
                        allowance_bytes: float = ALLOWANCE_BYTES) -> float:
    """Device memory a rank needs: the allocated peak plus the stated allocator allowance."""
    return peak_allocated * (1 + allowance_fraction) + allowance_bytes


# ----- FLOPs ------------------------------------------------------------------------------------

def compute(cfg: Config, device: str = "cuda") -> dict[str, float]:
    """Model and hardware FLOPs per step, the recompute overhead, and the model TFLOP/s/GPU relative
    to no recompute, assuming the GPU sustains the same hardware FLOP/s (so time scales with
    hardware FLOPs; norm recompute, which adds no GEMM FLOPs, shows as free although it costs some
    memory-bound time)."""
    none = dataclasses.replace(cfg, recompute=RecomputeConfig())
    hw, hw_none = flops.hardware_flops_per_step(cfg, device), flops.hardware_flops_per_step(none, device)
    return {"model_flops_per_step": flops.model_flops_per_step(cfg), "hardware_flops_per_step": hw,
            "recompute_overhead": hw / hw_none - 1, "relative_tflops_per_gpu": hw_none / hw}


# ----- the paper ----------------------------------------------------------------------------------

def paper_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                      recompute: str = "none") -> float:
    """Korthikanti et al. 2022, Table 2: activation bytes per layer of the GPT-3 layer.
    recompute: "none", "selective" (core attention) or "full"."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh
    core = 0.0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh / t * (34 + core)
    return sbh * (10 + 24 / t + core / t)


def paper_first_stage_bytes(cfg: Config, recompute: str = "none") -> float:
    """The paper's total on the first pipeline stage: Eq. 5/6 plus §4.3's embedding dropout sbhp/t,
    both times the interleave factor, and with p = 1 the final norm, output-layer input and fp32
    logits, 4sbh/t (1 + v/h)."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    # the paper's v, the tokenizer's vocabulary (its models' 51200 needs no padding)
    s, b, h, L, v = tr.seq_length, tr.micro_batch_size, m.hidden_size, m.num_layers, m.vocab_size
    t, p, vpp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    # The first stage's p micro-batches in flight hold L layers' worth, and p embedding dropout masks;
    # interleaving scales both (Megatron's theoretical memory does the same).
    in_flight = L * paper_layer_bytes(s, b, h, m.num_attention_heads, t, par.sequence_parallel, recompute) + s * b * h * p / t
    if vpp > 1:
        in_flight *= 1 + (p - 1) / (p * vpp)
    return in_flight + (4 * s * b * h / t * (1 + v / h) if p == 1 else 0.0)


def paper_flops_per_step(cfg: Config, recompute: str = "none") -> dict[str, float]:
    """The paper's FLOPs per step over the global batch B (Appendix A), full s^2 attention, GeLU 4h:
    model FLOPs (Eq. 7) 72 B L s h^2 (1 + s/6h + v/12hL); hardware FLOPs with selective recompute as
    published (Eq. 8, which Table 5's HFU uses) 72 B L s h^2 (1 + s/3h + v/12hL); the same from the
    text's "+4Bs^2h per layer" 72 B L s h^2 (1 + 2s/9h + v/12hL); full recompute (Narayanan et al.)
    96 B L s h^2 (1 + s/6h + v/16hL)."""
    m, tr = cfg.model, cfg.training
    B, L, s, h, v = tr.global_batch_size, m.num_layers, tr.seq_length, m.hidden_size, m.vocab_size
    base = 72 * B * L * s * h**2
    model = base * (1 + s / (6 * h) + v / (12 * h * L))
    hardware = {
        "none": model,
        "selective": base * (1 + s / (3 * h) + v / (12 * h * L)),
        "full": 96 * B * L * s * h**2 * (1 + s / (6 * h) + v / (16 * h * L)),
    }[recompute]
    text = base * (1 + 2 * s / (9 * h) + v / (12 * h * L)) if recompute == "selective" else hardware
    return {"model_flops_per_step": model, "hardware_flops_per_step": hardware,
            "hardware_flops_per_step_from_text": text}


def paper_layer_differences(cfg: Config, device: str = "cuda") -> list[str]:
    """How this layer differs from the paper's GPT-3 layer (empty when it is that layer, apart from
    the norm statistics, which `built_minus_paper_bytes` accounts for)."""
    m, tr = cfg.model, cfg.training
    diffs = []
    if attention_kernel(cfg, device) != "math":
        diffs.append(f"attention runs the {attention_kernel(cfg, device)} kernel, not the paper's explicit softmax path")
    if m.attention_dropout <= 0 or m.hidden_dropout <= 0:
        diffs.append("dropout is off (the paper keeps 1-byte masks)")
    if m.num_moe_experts:
        diffs.append(f"{m.moe_layers} of {m.num_layers} layers are mixture-of-experts ({m.num_moe_experts} experts, "
                     f"top-{m.moe_router_topk}), which the paper's formula does not describe; routing is dropless, so "
                     f"the experts keep tokens x top-k rows whatever the routing (the estimate assumes none)")
    if m.activation != "gelu" or m.ffn_hidden_size != 4 * m.hidden_size:
        diffs.append(f"MLP is {m.activation} with ffn {m.ffn_hidden_size}, not GeLU 4h")
    if m.normalization != "LayerNorm":
        diffs.append(f"{m.normalization}, not LayerNorm")
    if m.groups != m.num_attention_heads:
        diffs.append(f"grouped-query attention ({m.groups} groups)")
    if m.position_embedding_type == "rope":
        diffs.append("RoPE makes new q and k while v keeps the fused QKV output alive")
    if ELEMENT_BYTES[tr.precision] != 2:
        diffs.append(f"{tr.precision} activations, not 16-bit")
    return diffs


def built_minus_paper_bytes(cfg: Config, device: str = "cuda") -> float:
    """For the paper's layer, built minus Table 2: the two norms' statistics the paper leaves out."""
    par, tr = cfg.parallel, cfg.training
    t = par.tensor_model_parallel_size if par.sequence_parallel else 1
    return 2 * _norm_stats_bytes(cfg, device, tr.seq_length * tr.micro_batch_size) / t


# ----- settings and the planner ---------------------------------------------------------------------

def _with(cfg: Config, r: RecomputeConfig | None = None, **parallel: Any) -> Config:
    out = dataclasses.replace(cfg, recompute=r if r is not None else cfg.recompute)
    if parallel:
        out = dataclasses.replace(out, parallel=dataclasses.replace(cfg.parallel, **parallel))
    return out


def setting_estimate(cfg: Config, device: str = "cuda") -> dict[str, Any]:
    """One recompute setting: activation bytes per layer, stage activations, whole-rank peak, FLOPs."""
    acts = stage_activations(cfg, device)
    rank = peak_rank_memory(cfg, device)
    return {
        "label": cfg.recompute.label,
        "recompute": cfg.record_fields()["recompute"],
        "activation_bytes_per_layer": acts.per_layer_bytes,
        "stage_activation_bytes": acts.stored_bytes,
        "stage_activation_peak_bytes": acts.peak_bytes,
        "peak_allocated_bytes": rank.peak_allocated_bytes,
        "peak_stage": rank.stage,
        "peak_phase": rank.phase,
        **compute(cfg, device),
    }


def listed_settings(cfg: Config, device: str = "cuda") -> list[RecomputeConfig]:
    """The settings `estimate` tabulates: none, every selective subset, full uniform 1 and the
    uniform chunk with the lowest peak, and full block at a few layer counts (of a model chunk)."""
    n_layers = layers_per_model_chunk(cfg)
    out = [RecomputeConfig()] + selective_settings(spec_for(cfg.model).recompute_targets) + [RecomputeConfig("full", [], "uniform", 1)]
    best = _best_uniform(cfg, n_layers, device)
    if best != 1:
        out.append(RecomputeConfig("full", [], "uniform", best))
    for n in sorted({1, n_layers // 4, n_layers // 2, 3 * n_layers // 4, n_layers} - {0}):
        out.append(RecomputeConfig("full", [], "block", n))
    if cfg.recompute.label not in {r.label for r in out}:
        out.insert(0, cfg.recompute)
    return out


def _best_uniform(cfg: Config, n_layers: int, device: str = "cuda") -> int:
    """The uniform chunk size with the lowest backward peak (every chunk size costs the same FLOPs)."""
    return min(range(1, n_layers + 1),
               key=lambda n: (stage_activations(_with(cfg, RecomputeConfig("full", [], "uniform", n)), device).peak_bytes, n))


def estimate_report(cfg: Config, device: str = "cuda", allowance_fraction: float = ALLOWANCE_FRACTION,
                    allowance_bytes: float = ALLOWANCE_BYTES) -> dict[str, Any]:
    """Everything `estimate` prints: the settings table, the paper's Table 2 for this shape, and the
    whole-rank breakdown of cfg's own setting."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    rank = peak_rank_memory(cfg, device)
    settings = [setting_estimate(_with(cfg, r), device) for r in listed_settings(cfg, device)]
    for row in settings:
        row["device_bytes_needed"] = device_bytes_needed(row["peak_allocated_bytes"], allowance_fraction, allowance_bytes)
    stats = built_minus_paper_bytes(cfg, device)
    paper_rows = []
    for name, built_modules, kind in (("none", None, "none"), ("selective", ["core_attn"], "selective"),
                                      ("full", "full", "full")):
        built = (checkpoint_input_bytes(cfg) if built_modules == "full"
                 else layer_activation_bytes(cfg, built_modules or (), device))
        paper_rows.append({"recompute": name,
                           "paper_bytes": paper_layer_bytes(tr.seq_length, tr.micro_batch_size, m.hidden_size,
                                                            m.num_attention_heads, par.tensor_model_parallel_size,
                                                            par.sequence_parallel, kind),
                           "built_bytes": built,
                           "paper_flops": paper_flops_per_step(cfg, kind)})
    return {
        "schema": ESTIMATE_SCHEMA,
        "workload": cfg.workload,
        "config": cfg.to_dict(),
        "recompute": cfg.record_fields()["recompute"],
        "device": device_kind(device),
        "attention_kernel": attention_kernel(cfg, device),
        "num_microbatches": cfg.num_microbatches,
        "microbatches_in_flight": microbatches_in_flight(cfg, 0),
        "allowance": {"fraction": allowance_fraction, "bytes": allowance_bytes},
        "setting": {**setting_estimate(cfg, device),
                    "device_bytes_needed": device_bytes_needed(rank.peak_allocated_bytes, allowance_fraction, allowance_bytes),
                    "layer_saved_bytes": layer_saved_bytes(cfg, cfg.recompute.modules if cfg.recompute.granularity == "selective" else (), device),
                    "breakdown": {**rank.items, "backward peak": rank.backward_peak_bytes,
                                  "optimizer step peak": rank.optimizer_step_bytes},
                    "parameters_on_rank": rank.parameters},
        "settings": settings,
        "paper": {"differences": paper_layer_differences(cfg, device), "norm_stats_bytes": stats, "rows": paper_rows},
        # The same setting with the other optimizer layout, where data parallelism makes it matter.
        "other_optimizer": None if par.data_parallel_size == 1 else {
            "use_distributed_optimizer": not par.use_distributed_optimizer,
            "peak_allocated_bytes": peak_rank_memory(
                _with(cfg, use_distributed_optimizer=not par.use_distributed_optimizer), device).peak_allocated_bytes},
    }


def _candidates(cfg: Config, device: str) -> list[dict[str, Any]]:
    """Every setting worth planning with: none, each selective subset, the best uniform chunk and
    every block count (uniform chunks all cost the same FLOPs; block trades FLOPs for memory)."""
    n_layers = layers_per_model_chunk(cfg)
    settings = [RecomputeConfig()] + selective_settings(spec_for(cfg.model).recompute_targets)
    settings.append(RecomputeConfig("full", [], "uniform", _best_uniform(cfg, n_layers, device)))
    settings += [RecomputeConfig("full", [], "block", n) for n in range(1, n_layers + 1)]
    return [setting_estimate(_with(cfg, r), device) for r in settings]


def _speed_key(row: dict[str, Any]) -> tuple:
    # Fastest first: hardware FLOPs; at equal FLOPs recompute less (norm recompute costs memory-bound
    # time the FLOPs do not show), then the lower peak.
    r = row["recompute"]
    work = len(r["modules"]) if r["granularity"] == "selective" else 0
    return row["hardware_flops_per_step"], work, row["peak_allocated_bytes"]


def plan(cfg: Config, budget_bytes: float, device: str = "cuda", allowance_fraction: float = ALLOWANCE_FRACTION,
         allowance_bytes: float = ALLOWANCE_BYTES) -> dict[str, Any]:
    """The settings that fit `budget_bytes` of device memory per GPU, fastest first, a recommended
    one, and, when none fits, the changes of layout that would make one fit."""
    rows = _candidates(cfg, device)
    for row in rows:
        row["device_bytes_needed"] = device_bytes_needed(row["peak_allocated_bytes"], allowance_fraction, allowance_bytes)
    fitting = sorted((r for r in rows if r["device_bytes_needed"] <= budget_bytes), key=_speed_key)
    # Of the block counts that fit, only the smallest is worth listing: more layers recomputed is slower.
    shown, block_seen = [], False
    for row in fitting:
        if row["recompute"]["method"] == "block":
            if block_seen:
                continue
            block_seen = True
        shown.append(row)
    out: dict[str, Any] = {"schema": PLAN_SCHEMA, "workload": cfg.workload, "config": cfg.to_dict(),
                           "device": device_kind(device), "budget_bytes": budget_bytes,
                           "allowance": {"fraction": allowance_fraction, "bytes": allowance_bytes},
                           "fits": shown, "recommended": None, "reason": None, "would_fit": []}
    if shown:
        best = shown[0]
        out["recommended"] = best["label"]
        out["reason"] = (f"fastest setting that fits: {100 * best['recompute_overhead']:.1f}% recompute overhead, "
                         f"needs {best['device_bytes_needed'] / 2**30:.1f} of {budget_bytes / 2**30:.1f} GiB")
        return out
    smallest = min(rows, key=lambda r: r["device_bytes_needed"])
    out["reason"] = (f"nothing fits: the smallest setting ({smallest['label']}) needs "
                     f"{smallest['device_bytes_needed'] / 2**30:.1f} GiB of {budget_bytes / 2**30:.1f} GiB")
    out["would_fit"] = _what_would_fit(cfg, budget_bytes, device, allowance_fraction, allowance_bytes)
    return out


def _what_would_fit(cfg: Config, budget: float, device: str, fraction: float, fixed: float) -> list[dict[str, Any]]:
    """Changes of layout, each with the fastest setting that then fits (or the smallest need)."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    t, p = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    changes: list[tuple[str, Config | None]] = []
    nt = t * 2
    if m.num_attention_heads % nt == 0 and m.groups % nt == 0:  # Megatron shards whole heads and groups
        changes.append((f"--tp {nt} --sequence-parallel", _with(cfg, tensor_model_parallel_size=nt, sequence_parallel=True)))
    else:
        changes.append((f"more tensor parallel (--tp {nt} does not divide {m.num_attention_heads} heads, {m.groups} groups)", None))
    if t > 1 and not par.sequence_parallel:
        changes.append(("--sequence-parallel", _with(cfg, sequence_parallel=True)))
    if tr.micro_batch_size > 1:
        smaller = dataclasses.replace(cfg, training=dataclasses.replace(tr, micro_batch_size=1))
        changes.append(("--micro-batch-size 1", smaller))
    for k in (2, 4):
        if m.num_layers % (p * k) == 0:
            changes.append((f"--pp {p * k}", _with(cfg, pipeline_model_parallel_size=p * k)))
            break
    if par.data_parallel_size > 1 and not par.use_distributed_optimizer:
        changes.append(("--set parallel.use_distributed_optimizer=true", _with(cfg, use_distributed_optimizer=True)))
    out = []
    for flag, changed in changes:
        if changed is None:
            out.append({"change": flag, "fits": False, "setting": "-", "device_bytes_needed": None, "recompute_overhead": None})
            continue
        rows = _candidates(changed, device)
        for row in rows:
            row["device_bytes_needed"] = device_bytes_needed(row["peak_allocated_bytes"], fraction, fixed)
        fit = sorted((r for r in rows if r["device_bytes_needed"] <= budget), key=_speed_key)
        best = fit[0] if fit else min(rows, key=lambda r: r["device_bytes_needed"])
        out.append({"change": flag, "fits": bool(fit), "setting": best["label"],
                    "device_bytes_needed": best["device_bytes_needed"], "recompute_overhead": best["recompute_overhead"]})
    # Offload: what the optimizer state and the activations cost, the two things host memory can take.
    rank = peak_rank_memory(_with(cfg, RecomputeConfig("full", [], "uniform", 1)), device)
    state = rank.items["master weights (fp32)"] + rank.items["Adam moments (fp32)"]
    without = device_bytes_needed(rank.peak_allocated_bytes - state, fraction, fixed)
    out.append({"change": "offload the optimizer state to host memory (with full uniform 1)", "fits": without <= budget,
                "setting": "full uniform 1", "device_bytes_needed": without,
                "recompute_overhead": compute(_with(cfg, RecomputeConfig("full", [], "uniform", 1)), device)["recompute_overhead"]})
    return out


def record_estimate(cfg: Config, device: str) -> dict[str, float]:
    """The estimate `run` stores next to each measurement (single rank, no model parallelism)."""
    acts = activation_bytes(cfg, device)
    return {
        "estimated_activation_bytes": acts["activation_bytes"],
        "estimated_activation_bytes_per_layer": acts["activation_bytes_per_layer"],
        "estimated_hardware_flops_per_step": flops.hardware_flops_per_step(cfg, device),
        "estimated_peak_allocated_bytes": peak_rank_memory(cfg, device).peak_allocated_bytes,
    }

