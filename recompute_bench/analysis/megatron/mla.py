"""Multi-latent attention as Megatron runs it (megatron/core/transformer/multi_latent_attention.py
`MLASelfAttention`, built by gpt_layer_specs.py `get_gpt_layer_with_transformer_engine_submodules`
with multi_latent_attention): what one layer's attention block keeps for backward, one micro-batch
on one tensor-parallel rank, and its parameters.

The block, with n heads (n / t on a rank), qk = qk_head_dim, r = qk_pos_emb_head_dim, v = v_head_dim:

    input_layernorm (TENorm: MLA's spec does not fuse it into a linear)
    linear_q_down_proj  h -> q_lora_rank           TELinear, parallel_mode "duplicated": a whole copy
    linear_q_up_proj    q_lora_rank -> n (qk + r)  TEColumnParallelLinear     (or linear_q_proj h -> n (qk + r))
    linear_kv_down_proj h -> kv_lora_rank + r      TELinear "duplicated"; split into the latent and k_pos_emb
    linear_kv_up_proj   kv_lora_rank -> n (qk + v) TEColumnParallelLinear
    RoPE on q's last r dims and on k_pos_emb (shared by every head); query = [q_nope, q_pe],
    key = [k_nope, k_pe expanded], value contiguous; core attention; linear_proj n v -> h

No linear of the block has a bias (every build_module passes bias=False but linear_proj's). The latent
norms exist only with qk_layernorm (mla_qk_norm_config.py `QKNormConfigResolver`: IdentityOp
otherwise), fused into the up-projections (TELayerNormColumnParallelLinear). The duplicated down
projections run on the rank's sequence shard under sequence parallelism (no gather), the
column-parallel up projections gather it, so q, k and v cover the whole sequence for n / t heads.
Transformer Engine's modules only: the local spec's MLA (ColumnParallelLinear down projections
whose outputs are gathered and scattered again) is refused. Pure Python.
"""

from __future__ import annotations

from recompute_bench.analysis.megatron.attention import CoreAttentionInputs, core_attention_saved
from recompute_bench.analysis.megatron.context_parallel import rank_tokens
from recompute_bench.analysis.megatron.fp8 import linear_input_bytes, runs_fp8
from recompute_bench.analysis.megatron.gpu import MegatronRun
from recompute_bench.models import ELEMENT_BYTES, SavedBytes
from recompute_bench.models.dense.spec import norm_parameters
from recompute_bench.config.schema import Config


def mla_rope_fused(cfg: Config) -> bool:
    """Whether MLA's RoPE runs the fused yarn kernels (fused_mla_yarn_rope_apply.py): apply_rope_fusion,
    which validate_args turns off unless position_embedding_type is rope, with rope_type yarn
    (MLATransformerConfig's default; its __post_init__ refuses fusion with plain rope)."""
    m = cfg.model
    return m.apply_rope_fusion and m.position_embedding_type == "rope" and m.rope_type in (None, "yarn")


def mla_attention_parameters(cfg: Config) -> tuple[float, float]:
    """The attention block's parameters (input norm included): (sharded over the tensor-parallel
    group, before the split; replicated on every rank). The duplicated down projections are whole on
    every rank; with qk_layernorm the latent norms (or, without q_lora_rank, a norm over the hidden
    states fused into linear_q_proj) are the fused linears' replicated layer_norm weights."""
    m = cfg.model
    h, n, r = m.hidden_size, m.num_attention_heads, m.qk_pos_emb_head_dim
    q_width, kv_width = n * (m.qk_head_dim + r), n * (m.qk_head_dim + m.v_head_dim)
    sharded = kv_width * m.kv_lora_rank + n * m.v_head_dim * h
    replicated = norm_parameters(cfg, h) + h * (m.kv_lora_rank + r) + (h if m.add_bias_linear else 0)
    if m.q_lora_rank is None:
        sharded += h * q_width
        replicated += norm_parameters(cfg, h) if m.qk_layernorm else 0
    else:
        sharded += m.q_lora_rank * q_width
        replicated += h * m.q_lora_rank + (norm_parameters(cfg, m.q_lora_rank) if m.qk_layernorm else 0)
    replicated += norm_parameters(cfg, m.kv_lora_rank) if m.qk_layernorm else 0
    return sharded, replicated


def mla_attention_saved(saved: SavedBytes, cfg: Config, run: MegatronRun, mods: set[str], layer: int = 0) -> None:
    """What the MLA block keeps after its input norm's output (which the down projections save), in
    `SavedBytes` splits: "sp" for the down projections' sequence shards, "tp" for the n / t heads over
    the whole sequence, "none" for what every rank holds whole.

    - linear_q_up_proj keeps its input, the q latent (TE linear.py `_Linear.forward` saves `inputmat`,
      the local shard under sequence parallelism); without q_lora_rank linear_q_proj keeps the
      norm's output, already counted.
    - linear_kv_up_proj's input is a strided view of the kv latent; TE's `prepare_forward` makes it
      contiguous, and that copy is what it keeps (the down projection's output is freed).
    - with qk_layernorm the up projections are TELayerNormColumnParallelLinear: each also keeps its
      norm's output and fp32 statistics (layernorm_linear.py).
    - under FP8 the up projections keep their inputs quantized (linear.py `_linear_forward_impl`:
      the row-wise local shard they gather again in backward under sequence parallel with per-tensor
      scaling, else the column-wise data), and the 16-bit latents are freed; a norm-fused one keeps
      its 16-bit input for the norm and an FP8 ln_out. The down projections' FP8 copies of the input
      norm's output are counted with that norm (layer.py).
    - unfused RoPE (rope_utils.py `_apply_rotary_pos_emb_bshd`): `t * cos_` and `rotate(t) * sin_`
      keep cos_ and sin_ ([s, 1, 1, r] in 16 bits), made anew for q and for k; the fused kernels
      keep cached cos and sin (no per-layer bytes). Both make query, key and value anew
      (cat / the fused kernel's outputs, `value.contiguous()`): core attention's inputs.
    - `mla_up_proj` (CheckpointWithoutOutput around `qkv_up_proj_and_rope_apply`): the up projections
      and RoPE run without grad and keep nothing; the checkpoint keeps its inputs (the q latent, the
      kv latent, a view of the down projection's whole output, and k_pos_emb, gathered over the
      sequence under sequence parallelism), and `discard_output_and_register_recompute` frees
      query, key and value once core attention has run: what core attention saved of them as they
      are is gone, the copies it made (FlashAttention's) stay."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    e, b, s = ELEMENT_BYTES[tr.precision], tr.micro_batch_size, tr.seq_length
    tokens, n, r = s * b, m.num_attention_heads, m.qk_pos_emb_head_dim
    qk, v = m.qk_head_dim + r, m.v_head_dim
    rows = cfg.spec.norm_stats_bytes(cfg, "cuda", tokens)  # mu and rsigma (LayerNorm) or rsigma per token
    up_proj = "mla_up_proj" in mods
    # Under FP8 a TE linear keeps its input quantized (`fp8.linear_input_bytes`); a norm-fused one
    # (qk_layernorm) keeps its 16-bit input for the norm and its FP8 ln_out, as linear_qkv does
    fp8, sp = runs_fp8(cfg), par.sequence_parallel
    quantized = fp8 and not up_proj and not m.qk_layernorm  # the checkpoint keeps the 16-bit latents
    if m.q_lora_rank is not None:
        saved.add("linear_q_down_proj.output", linear_input_bytes(cfg, tokens * m.q_lora_rank, m.q_lora_rank,
                                                                  gathered=sp) if quantized
                  else e * tokens * m.q_lora_rank, "sp")
    if up_proj:
        saved.add("linear_kv_down_proj.output", e * tokens * (m.kv_lora_rank + r), "sp")
        if par.sequence_parallel and par.tensor_model_parallel_size > 1:  # gather_from_sequence_parallel_region
            saved.add("k_pos_emb.gathered", e * tokens * r, "none")
    else:
        def ln_out(width: int) -> float:
            return linear_input_bytes(cfg, tokens * width, width, gathered=sp) if fp8 else e * tokens * width

        if m.q_lora_rank is not None:
            if m.qk_layernorm:
                saved.add("linear_q_up_proj.norm_stats", rows, "sp")
                saved.add("linear_q_up_proj.ln_out", ln_out(m.q_lora_rank), "sp")
        elif m.qk_layernorm:
            saved.add("linear_q_proj.norm_stats", rows, "sp")
            saved.add("linear_q_proj.ln_out", ln_out(m.hidden_size), "sp")
        saved.add("linear_kv_up_proj.input", ln_out(m.kv_lora_rank) if quantized else e * tokens * m.kv_lora_rank, "sp")
        if m.qk_layernorm:
            saved.add("linear_kv_up_proj.norm_stats", rows, "sp")
            saved.add("linear_kv_up_proj.ln_out", ln_out(m.kv_lora_rank), "sp")
        if not mla_rope_fused(cfg):
            saved.add("rotary.cos_sin", 4 * e * s * r, "none")
    kept = 0.0 if up_proj else 1.0  # discarded storages count nothing
    inputs = CoreAttentionInputs(("query", kept * e * tokens * n * qk), ("key", kept * e * tokens * n * qk),
                                 ("value", kept * e * tokens * n * v), n, n, qk, v)
    core_attention_saved(saved, cfg, run, mods, inputs, layer)


def up_proj_rebuilt_bytes(cfg: Config) -> float:
    """Under `mla_up_proj` recompute, what the backward rebuilds before core attention's backward and
    holds through it: query, key and value of the rank's n / t heads (multi_latent_attention.py
    `discard_output_and_register_recompute(core_attn_out)`: the recompute runs when the gradient
    reaches core attention's output). 0 without MLA or that recompute."""
    m, r = cfg.model, cfg.recompute
    if not m.multi_latent_attention or r.granularity != "selective" or "mla_up_proj" not in r.modules:
        return 0.0
    e, tokens, n = ELEMENT_BYTES[cfg.training.precision], rank_tokens(cfg), m.num_attention_heads
    qk = m.qk_head_dim + m.qk_pos_emb_head_dim
    return e * tokens * n * (2 * qk + m.v_head_dim) / cfg.parallel.tensor_model_parallel_size
