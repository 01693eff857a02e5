"""One Megatron GPT layer, one micro-batch on one tensor-parallel rank: what it keeps for backward
under a selective-recompute setting, and what its backward holds beyond that.

Under FP8 the linears' saved inputs come from `fp8.linear_input_bytes`; a layer Megatron keeps in bf16
(first_last_layers_bf16) is estimated with `fp8.layer_config`.

Sources: megatron/core/transformer/transformer_layer.py, mlp.py, fusions/fused_bias_dropout.py,
fused_bias_gelu.py, fused_bias_swiglu.py; transformer_engine/pytorch/module/layernorm_linear.py."""

from __future__ import annotations

from typing import Iterable

from recompute_bench.analysis.megatron.attention import attention_path, attention_saved, score_backward_bytes
from recompute_bench.analysis.megatron.context_parallel import (attention_backward_bytes, attention_forward_bytes,
                                                                layer_attention, rank_tokens)
from recompute_bench.analysis.megatron.fp8 import linear_input_bytes, runs_fp8
from recompute_bench.analysis.megatron.mla import mla_attention_saved, up_proj_rebuilt_bytes
from recompute_bench.analysis.megatron.moe import moe_backward_bytes, moe_saved_bytes
from recompute_bench.analysis.megatron.mtp import eh_proj_weight, is_mtp_layer
from recompute_bench.analysis.megatron.gpu import MegatronRun
from recompute_bench.models import ELEMENT_BYTES, MASK_BYTES, SavedBytes
from recompute_bench.config.schema import Config

def is_moe_layer(cfg: Config, layer: int, moe: bool | None = None) -> bool:
    """Whether layer `layer` (0-based) is a mixture-of-experts layer (moe_layer_freq), unless `moe`
    says which kind to count."""
    return cfg.model.is_moe_layer(layer) if moe is None else moe


def layer_saved_bytes(cfg: Config, run: MegatronRun, modules: Iterable[str] = (), layer: int = 0,
                      routing: str = "balanced", moe: bool | None = None) -> dict[str, float]:
    """Bytes Megatron GPT layer `layer` (0-based; layers differ in their kind, dense or MoE, and
    their cp_comm_type) keeps for backward, one micro-batch on one tensor-parallel rank, storage by
    storage (names after the module that keeps each), when `modules` are recomputed selectively:
    core_attn (attention.py `_checkpointed_attention_forward`), mlp (transformer_layer.py
    checkpoints `self.mlp`, which with TE includes fc1's fused norm; a MoE layer's MLP is not
    recomputed by it), layernorm (transformer_layer.py `CheckpointWithoutOutput` around the local
    spec's norms, whose output is dropped once the next linear saved it; TE's norms are fused into the
    linear, its IdentityOp norms leave nothing to recompute). A MoE layer keeps the attention's terms
    and, in the MLP's place, its norm and MoE block (`moe.moe_saved_bytes`, under the `routing`
    assumption); `moe` overrides the layer's kind. Under context parallel every tensor holds the
    rank's s/cp tokens (`context_parallel.rank_tokens`)."""
    moe = is_moe_layer(cfg, layer, moe)
    m, tr = cfg.model, cfg.training
    e, tokens, h, f = ELEMENT_BYTES[tr.precision], rank_tokens(cfg), m.hidden_size, m.ffn_hidden_size
    mods = set(modules)
    saved = SavedBytes()
    te = m.transformer_impl == "transformer_engine"
    norms_kept = te or "layernorm" not in mods
    stats = cfg.spec.norm_stats_bytes(cfg, "cuda", tokens)  # mu and rsigma (LayerNorm) or rsigma, fp32
    # TE's _LayerNormLinear.forward saves `inputmat` and `ln_out` (and mu, rsigma); the local spec's
    # norm saves its input and statistics and ColumnParallelLinear saves the norm's output.
    mla = m.multi_latent_attention
    for block in ("linear_qkv",) if moe else ("linear_qkv", "linear_fc1"):
        name = block if te else {"linear_qkv": "input_layernorm", "linear_fc1": "pre_mlp_layernorm"}[block]
        # MLA's spec keeps input_layernorm a TENorm of its own (layernorm recompute applies to it):
        # TE's norm op saves its input and statistics, the down projections its output
        separate = mla and block == "linear_qkv"
        name = "input_layernorm" if separate else name
        saved.add(f"{name}.input", e * tokens * h, "sp")  # the mlp checkpoint's input too
        if block == "linear_fc1" and "mlp" in mods and te:
            continue  # recomputed inside the checkpoint with the rest of the MLP
        if norms_kept and not (separate and "layernorm" in mods):
            saved.add(f"{name}.norm_stats", stats, "sp")
            if separate and not runs_fp8(cfg):  # MLA's own norm: its 16-bit output, which the down projections keep
                saved.add(f"{name}.output", e * tokens * h, "sp")
            elif separate:
                # under FP8 each projection of the norm's output keeps its own quantized copy (TE
                # linear.py): the duplicated kv (and q) down projections the column-wise usage of the
                # local shard, a column-parallel linear_q_proj the row-wise shard it gathers in backward
                q_gathered = m.q_lora_rank is None and cfg.parallel.sequence_parallel
                saved.add("linear_q_down_proj.input" if m.q_lora_rank is not None else "linear_q_proj.input",
                          linear_input_bytes(cfg, tokens * h, h, gathered=q_gathered), "sp")
                saved.add("linear_kv_down_proj.input", linear_input_bytes(cfg, tokens * h, h), "sp")
            else:
                # TE's ln_out is the linear's saved input: FP8 under fp8 (quantized by the norm kernel,
                # layernorm_linear.py with_quantized_norm), gathered over tp under sequence parallel
                saved.add(f"{name}.ln_out" if te else f"{block}.input",
                          linear_input_bytes(cfg, tokens * h, h, gathered=cfg.parallel.sequence_parallel), "sp")
        if block == "linear_qkv":
            if mla:
                mla_attention_saved(saved, cfg, run, mods, layer)
            else:
                attention_saved(saved, cfg, run, mods, layer)
            if m.hidden_dropout > 0:  # fused_bias_dropout.py: the dropout mask of bias-dropout-add
                saved.add("self_attn_bda.dropout_mask", MASK_BYTES * tokens * h, "sp")
    if moe:
        for name, nbytes in moe_saved_bytes(cfg, mods, routing).items():
            saved.add(name, nbytes, "none")  # already one rank's
    elif "mlp" not in mods:
        # fused bias_swiglu (fused_bias_swiglu.py BiasSwiGLUFunction.forward) saves fc1's output only,
        # in 16 bits under FP8 too (FP8 only with activation_func_fp8_input_store, refused); bias_gelu
        # (GeLUFunction) saves fc1's output, and the activation's output is fc2's input. Megatron's
        # dense MLP is `MLP` over TE's LayerNormLinear and Linear (gpt_layer_specs.py
        # get_mlp_module_spec_for_backend), never TE's LayerNormMLP and its FP8 activation cast
        saved.add("linear_fc1.output", e * tokens * (2 * f if m.activation == "swiglu" else f), "tp")
        saved.add("linear_fc2.input", linear_input_bytes(cfg, tokens * f, f), "tp")  # row-parallel: not gathered
    if m.hidden_dropout > 0:
        saved.add("mlp_bda.dropout_mask", MASK_BYTES * tokens * h, "sp")
    par = cfg.parallel
    return saved.per_rank(par.tensor_model_parallel_size, par.sequence_parallel)


def layer_bytes(cfg: Config, run: MegatronRun, modules: Iterable[str] = (), layer: int = 0,
                routing: str = "balanced", moe: bool | None = None) -> float:
    """Sum of `layer_saved_bytes`."""
    return sum(layer_saved_bytes(cfg, run, modules, layer, routing, moe).values())


def layer_backward_bytes(cfg: Config, run: MegatronRun, layer: int = 0, routing: str = "balanced",
                         moe: bool | None = None) -> float:
    """What one layer's backward holds beyond the saved tensors, at its most: the MLP's, where the
    largest gradients meet (linear_fc2's data gradient [s, b, f] and the activation's backward
    output, the gradient of fc1's output, both in 16 bits; a MoE layer's experts',
    `moe.moe_backward_bytes`), or the attention's, whichever is more: the unfused and local paths'
    score gradients (`attention.score_backward_bytes`), under context parallel Transformer Engine's
    CP attention (`context_parallel.attention_backward_bytes`); under MLA's `mla_up_proj` recompute
    with the query, key and value it rebuilds for that backward (`mla.up_proj_rebuilt_bytes`)."""
    tr, m = cfg.training, cfg.model
    e, tokens, t = ELEMENT_BYTES[tr.precision], rank_tokens(cfg), cfg.parallel.tensor_model_parallel_size
    fc1 = 2 * m.ffn_hidden_size if m.activation == "swiglu" else m.ffn_hidden_size
    mlp = moe_backward_bytes(cfg, routing) if is_moe_layer(cfg, layer, moe) else e * tokens * (m.ffn_hidden_size + fc1) / t
    cp_attention = layer_attention(cfg, layer)
    rebuilt = up_proj_rebuilt_bytes(cfg)  # MLA's q, k, v, recomputed for core attention's backward
    if cp_attention is None:  # the unfused and local attention's score gradients, where they run
        return max(mlp, score_backward_bytes(cfg, run) + rebuilt)
    return max(mlp, sum(attention_backward_bytes(cfg, attention_path(cfg, run), cp_attention).values()) + rebuilt)


def layer_forward_bytes(cfg: Config, run: MegatronRun, layer: int = 0) -> float:
    """What one layer's forward holds beyond what it keeps, at its most: under context parallel the
    working set of Transformer Engine's CP attention (`context_parallel.attention_forward_bytes`);
    nothing is counted without it (no golden peaks inside a layer's forward)."""
    cp_attention = layer_attention(cfg, layer)
    if cp_attention is None:
        return 0.0
    return sum(attention_forward_bytes(cfg, attention_path(cfg, run), cp_attention).values())


def layer_linear_weights(cfg: Config, layer: int = 0) -> dict[str, tuple[int, int]]:
    """The weights of layer `layer`'s Transformer Engine linears on one rank, as [out, in] (what
    FP8 quantizes: fp8.weight_bytes), by the layer's kind:

    - attention: linear_qkv (TELayerNormColumnParallelLinear, the output gate's columns included)
      and linear_proj (TERowParallelLinear); under multi-latent attention its projections instead
      (multi_latent_attention.py `MLASelfAttention.__init__`: the down projections TELinear
      "duplicated", whole on every rank; the up projections column-parallel; linear_proj
      row-parallel);
    - a dense layer's MLP: linear_fc1 (column-parallel, with its fused norm) and linear_fc2;
    - a MoE layer's MLP (moe_layer_freq): the shared experts' linear_fc1 and linear_fc2 over tp
      (shared_experts.py, TE linears), and each of the rank's E / ep routed experts' fc1 and fc2
      over etp: TE's GroupedLinear keeps one weight tensor per expert (`weight{i}`), each
      quantized on its own (grouped_linear.py). The router's [E, h] gating weight is no TE
      linear (moe_utils.py `router_gating_linear`): it stays 16-bit."""
    m, par = cfg.model, cfg.parallel
    t = par.tensor_model_parallel_size
    h, d = m.hidden_size, m.head_dim
    gated = 2 if m.activation == "swiglu" else 1
    out: dict[str, tuple[int, int]] = {}
    if m.multi_latent_attention:
        n, r = m.num_attention_heads, m.qk_pos_emb_head_dim
        if m.q_lora_rank is None:
            out["linear_q_proj"] = (n * (m.qk_head_dim + r) // t, h)
        else:
            out["linear_q_down_proj"] = (m.q_lora_rank, h)
            out["linear_q_up_proj"] = (n * (m.qk_head_dim + r) // t, m.q_lora_rank)
        out["linear_kv_down_proj"] = (m.kv_lora_rank + r, h)
        out["linear_kv_up_proj"] = (n * (m.qk_head_dim + m.v_head_dim) // t, m.kv_lora_rank)
        out["linear_proj"] = (h, n * m.v_head_dim // t)
    else:
        gate = m.num_attention_heads * d if m.attention_output_gate else 0
        out["linear_qkv"] = (((m.num_attention_heads + 2 * m.groups) * d + gate) // t, h)
        out["linear_proj"] = (h, m.num_attention_heads * d // t)
    if is_mtp_layer(cfg, layer):  # a multi-token-prediction layer's projection, then its layer
        out["eh_proj"] = eh_proj_weight(cfg)
    if not is_moe_layer(cfg, layer):
        out["linear_fc1"] = (gated * m.ffn_hidden_size // t, h)
        out["linear_fc2"] = (h, m.ffn_hidden_size // t)
        return out
    shared = m.moe_shared_expert_intermediate_size
    if shared:
        out["shared_experts.linear_fc1"] = (gated * shared // t, h)
        out["shared_experts.linear_fc2"] = (h, shared // t)
    etp = par.expert_tensor_parallel
    for i in range(m.num_moe_experts // par.expert_model_parallel_size):
        out[f"experts.linear_fc1.weight{i}"] = (gated * m.moe_ffn // etp, h)
        out[f"experts.linear_fc2.weight{i}"] = (h, m.moe_ffn // etp)
    return out
