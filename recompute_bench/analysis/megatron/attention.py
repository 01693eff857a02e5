"""The attention path a Megatron layer runs and what each path keeps for backward.

Attention itself stays 16-bit under FP8 (fp8_dot_product_attention off); only linear_proj's saved
input changes (fp8.py).

Sources: megatron/core/transformer/attention.py, dot_product_attention.py, fusions/fused_softmax.py;
transformer_engine/pytorch/attention/dot_product_attention/{backends,utils,softmax}.py."""

from __future__ import annotations

from dataclasses import dataclass

from recompute_bench.analysis.megatron import context_parallel
from recompute_bench.analysis.megatron.context_parallel import layer_attention, rank_tokens
from recompute_bench.analysis.megatron.fp8 import linear_input_bytes, proj_saves_original_input, runs_fp8
from recompute_bench.analysis.megatron.gpu import MegatronRun
from recompute_bench.models import ELEMENT_BYTES, FP32_BYTES, MASK_BYTES, SavedBytes
from recompute_bench.config.schema import Config

def attention_path(cfg: Config, run: MegatronRun) -> str:
    """The attention code a layer runs: "local" (Megatron's DotProductAttention, transformer_impl
    local), or Transformer Engine's "flash" (FlashAttention), "fused" (cuDNN FusedAttention) or
    "unfused" (UnfusedDotProductAttention). Megatron's --attention-backend sets NVTE_FLASH_ATTN /
    NVTE_FUSED_ATTN; auto leaves TE's choice (attention/dot_product_attention/utils.py
    `get_attention_backend`), which on sm90 and newer prefers FusedAttention and before sm90 under
    Megatron's deterministic mode disables the F16 fused kernel, leaving FlashAttention."""
    backend = cfg.model.attention_backend
    if cfg.model.transformer_impl == "local":
        return "local"
    if backend in ("flash", "fused", "unfused"):
        return backend
    return "fused" if run.compute_capability >= 90 else "flash"


@dataclass(frozen=True)
class CoreAttentionInputs:
    """What core attention is given, one micro-batch before the tensor-parallel split: q, k and v
    as (name, bytes) of the storage each is (a view of), and the shapes the kernels see."""

    q: tuple[str, float]
    k: tuple[str, float]
    v: tuple[str, float]
    heads: int
    """Query heads (a)."""
    kv_heads: int
    """Key/value heads (g)."""
    qk_dim: int
    """q and k's head dimension."""
    v_dim: int
    """v's (and the output's) head dimension."""


def attention_saved(saved: SavedBytes, cfg: Config, run: MegatronRun, mods: set[str], layer: int = 0) -> None:
    """What the attention block of layer `layer` (0-based) keeps after its norm: the QKV output,
    query/key norms, RoPE's q and k, the core attention's tensors, its output (linear_proj's input).
    Under context parallel every tensor holds the CP rank's s/cp tokens, and Transformer Engine's
    CP attention keeps its own set (`context_parallel.attention_saved`)."""
    m, tr = cfg.model, cfg.training
    e = ELEMENT_BYTES[tr.precision]
    tokens, d, a, g = rank_tokens(cfg), m.head_dim, m.num_attention_heads, m.groups
    gate = a * d if m.attention_output_gate else 0  # attention.py: linear_qkv grows by the gate's a x d
    qkv = ("linear_qkv.output", e * tokens * ((a + 2 * g) * d + gate))
    rope = m.position_embedding_type == "rope"
    # attention.py get_query_key_value_tensors: q, k, v are views of the QKV output; query.reshape to
    # [s, b, heads, d] is a copy when several heads share a group (their columns are not adjacent).
    # RoPE (rope_utils.apply_rotary_pos_emb) makes new q and k; v stays a view of the QKV output.
    q = ("query.reshape", e * tokens * a * d) if g != a else qkv
    k = qkv
    if m.qk_layernorm:
        # q_layernorm / k_layernorm (TENorm over one head; TE ops/basic/layer_norm.py and rmsnorm.py
        # `op_forward`) save `input_.contiguous()` (a copy of a view) and fp32 statistics per row, and
        # return new tensors, which RoPE (if any) replaces again.
        rows = cfg.spec.norm_stats_bytes(cfg, "cuda", tokens)
        saved.add("q_layernorm.input", e * tokens * a * d, "tp")
        saved.add("q_layernorm.norm_stats", rows * a, "tp")
        saved.add("k_layernorm.input", e * tokens * g * d, "tp")
        saved.add("k_layernorm.norm_stats", rows * g, "tp")
        q, k = ("q_layernorm.output", e * tokens * a * d), ("k_layernorm.output", e * tokens * g * d)
    if rope:
        q, k = ("rotary.query", e * tokens * a * d), ("rotary.key", e * tokens * g * d)
    core_attention_saved(saved, cfg, run, mods, CoreAttentionInputs(q, k, qkv, a, g, d, d), layer)
    if m.attention_output_gate:
        # attention.py `_apply_output_gate` (torch.compile): x * sigmoid(gate.float()) saves its
        # inputs, the core attention output and the gate (a view of linear_qkv's output), and returns
        # a new tensor, linear_proj's input
        saved.add("core_attention.output", e * tokens * a * d, "tp")
        saved.add("output_gate.output", e * tokens * a * d, "tp")


def core_attention_saved(saved: SavedBytes, cfg: Config, run: MegatronRun, mods: set[str],
                         inputs: CoreAttentionInputs, layer: int = 0) -> None:
    """What core attention keeps for backward on the path it runs, and its output (linear_proj's
    input, [s, b, heads x v_dim / t]); selective `core_attn` keeps q, k, v and the output."""
    tr, m = cfg.training, cfg.model
    e, b, s = ELEMENT_BYTES[tr.precision], tr.micro_batch_size, tr.seq_length
    tokens, a, g, dqk, dv = rank_tokens(cfg), inputs.heads, inputs.kv_heads, inputs.qk_dim, inputs.v_dim
    q, k, v = inputs.q, inputs.k, inputs.v
    out = ("core_attention.output", e * tokens * a * dv)  # [s, b, h/t]: linear_proj's input
    # linear_proj keeps that output, or under FP8 delayed scaling its own FP8 copy (fp8.py
    # `proj_saves_original_input`), and the 16-bit output stays only where the kernel saves it.
    proj_copy = runs_fp8(cfg) and not proj_saves_original_input(cfg)
    proj = ("linear_proj.input", linear_input_bytes(cfg, tokens * a * dv, a * dv)) if proj_copy else out
    path = attention_path(cfg, run)
    if "core_attn" in mods:  # tensor_parallel.checkpoint saves q, k, v; linear_proj the output
        for name, nbytes in (q, k, v, proj):
            saved.add(name, nbytes, "tp")
        return
    cp_attention = layer_attention(cfg, layer)
    if cp_attention is not None:  # validate: flash or fused under context parallel
        context_parallel.attention_saved(saved, cfg, path, cp_attention)
        if proj_copy:
            saved.add(*proj, "tp")
        return
    if path == "fused":  # FusedAttnFunc saves q, k, v as given, the output, the softmax statistics
        for name, nbytes in (q, k, v, out, proj):
            saved.add(name, nbytes, "tp")
        saved.add("core_attention.softmax_stats", FP32_BYTES * b * a * s, "tp")
    elif path == "flash":  # FlashAttention.forward: contiguous [b, s, heads, d] copies of q, k, v;
        # flash-attn saves its own output; `output.contiguous()` is the [s, b, h] copy linear_proj keeps
        saved.add("core_attention.qkv_bshd", e * tokens * (a * dqk + g * dqk + g * dv), "tp")
        saved.add("core_attention.flash_output", e * tokens * a * dv, "tp")
        saved.add(*proj, "tp")
        saved.add("core_attention.softmax_lse", FP32_BYTES * b * a * s, "tp")
    else:  # unfused (TE) and local (Megatron): QK^T, softmax, dropout, times V, in 16 bits
        scores = b * a * s * s
        saved.add(*q, "tp")  # baddbmm saves q and k (GQA: repeat_interleave makes k and v anew)
        saved.add(*(("core_attention.key_repeated", e * tokens * a * dqk) if g != a else k), "tp")
        saved.add(*(("core_attention.value_repeated", e * tokens * a * dv) if g != a else v), "tp")
        # The fused masked-softmax kernel keeps its 16-bit output; torch's softmax (softmax_fused
        # False) keeps an fp32 output when it works in fp32, and the probabilities go on cast back.
        probs = e if softmax_fused(cfg, run) or not _softmax_in_fp32(cfg) else FP32_BYTES
        saved.add("core_attention.softmax", probs * scores, "tp")
        if m.attention_dropout > 0:
            saved.add("core_attention.dropout_mask", MASK_BYTES * scores, "tp")
            saved.add("core_attention.dropout_output", e * scores, "tp")
        saved.add(*proj, "tp")  # context.permute(...).contiguous(), or linear_proj's FP8 copy of it


def score_backward_bytes(cfg: Config, run: MegatronRun) -> float:
    """What the backward of the unfused (TE) or local (Megatron) attention holds at once beyond what
    it saved, one micro-batch on one tensor-parallel rank: the gradient of the probabilities,
    [b, heads/t, s, s] in 16 bits (`torch.bmm`'s backward), and
    - with attention dropout, the dropout's backward writes the gradient before it anew beside it;
    - the fused masked-softmax kernel writes its input gradient in place over the output gradient
      (TE csrc/extensions/softmax.cpp `scaled_upper_triang_masked_softmax_backward` returns
      `output_grads` before TransformerEngine 0c8cf2c, July 2026, which the goldens predate; Megatron's
      megatron/core/fusions/fused_softmax.py kernels alike);
    - torch's softmax backward (`_softmax_backward_data`) writes a new gradient in the softmax's
      dtype, after autograd casts the incoming one to it: 2 x 4 bytes a score where it runs in fp32,
      2 x 2 where in 16 bits.
    Beside them `baddbmm`'s and `bmm`'s backward write the gradients of q, k and v (k and v at
    every query head's: the path repeats them for grouped queries). The flash and fused kernels
    recompute the scores tile by tile: nothing of that size."""
    path = attention_path(cfg, run)
    if path not in ("unfused", "local"):
        return 0.0
    tr, m, t = cfg.training, cfg.model, cfg.parallel.tensor_model_parallel_size
    e = ELEMENT_BYTES[tr.precision]
    scores = tr.micro_batch_size * m.num_attention_heads / t * tr.seq_length ** 2
    per_score = 2 * e if m.attention_dropout > 0 else e
    if not softmax_fused(cfg, run):
        probs = FP32_BYTES if _softmax_in_fp32(cfg) else e
        per_score = max(per_score, e + probs, 2 * probs)
    if m.multi_latent_attention:
        qk, v = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
    else:
        qk = v = m.head_dim
    gradients = e * rank_tokens(cfg) * m.num_attention_heads * (2 * qk + v) / t
    return per_score * scores + gradients


def _batch_per_block(seq_length: int) -> int:
    """The masked-softmax kernels' batches per 128-thread block (scaled_masked_softmax.h
    `get_batch_per_block`, in Megatron's extension and TE's softmax.py): warps of min(2^k, 32)
    threads for k = ceil(log2 s), two batches per warp up to 128 keys."""
    pow2 = 1 << (seq_length - 1).bit_length()
    return 128 // min(pow2, 32) * (2 if pow2 <= 128 else 1)


def softmax_fused(cfg: Config, run: MegatronRun) -> bool:
    """Whether the unfused attention's softmax runs the fused scale-mask-softmax kernel, by its
    `is_kernel_available`: Megatron's (fusions/fused_softmax.py, masked_softmax_fusion, 16 < s <= 4096)
    for the local path, TE's (dot_product_attention/softmax.py, on unless NVTE_MASKED_SOFTMAX_FUSION=0,
    16 < s < 16384, s a multiple of 8) for TE's unfused path; both need 16-bit scores, s and
    b x heads/t multiples of 4 and the block's batches dividing the batches (causal)."""
    tr, m = cfg.training, cfg.model
    s, batches = tr.seq_length, tr.micro_batch_size * m.num_attention_heads // cfg.parallel.tensor_model_parallel_size
    if ELEMENT_BYTES[tr.precision] != 2 or s % 4 or batches % 4:
        return False
    if attention_path(cfg, run) == "local":
        return m.masked_softmax_fusion and 16 < s <= 4096 and batches % _batch_per_block(s) == 0
    return 16 < s < 16384 and s % 8 == 0 and s % _batch_per_block(s) == 0


def _softmax_in_fp32(cfg: Config) -> bool:
    """torch's softmax path upcasts to fp32: Megatron's with attention_softmax_in_fp32, TE's always
    (UnfusedDotProductAttention builds FusedScaleMaskSoftmax with softmax_in_fp32's default True)."""
    return cfg.model.attention_softmax_in_fp32 or cfg.model.transformer_impl == "transformer_engine"
