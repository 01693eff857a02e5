"""The attention path a Megatron layer runs and what each path keeps for backward.

Attention itself stays 16-bit under FP8 (fp8_dot_product_attention off); only linear_proj's saved
input changes (fp8.py).

Sources: megatron/core/transformer/attention.py, dot_product_attention.py, fusions/fused_softmax.py;
transformer_engine/pytorch/attention/dot_product_attention/{backends,utils,softmax}.py."""

from __future__ import annotations

from recompute_bench.analysis.megatron.fp8 import linear_input_bytes, proj_saves_original_input, runs_fp8
from recompute_bench.analysis.megatron.run import MegatronRun
from recompute_bench.models import ELEMENT_BYTES, FP32_BYTES, MASK_BYTES, SavedBytes
from recompute_bench.spec.config import Config

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


def attention_saved(saved: SavedBytes, cfg: Config, run: MegatronRun, mods: set[str]) -> None:
    """What the attention block keeps after its norm: the QKV output, RoPE's q and k, the core
    attention's tensors, its output (linear_proj's input)."""
    m, tr = cfg.model, cfg.training
    e, b, s = ELEMENT_BYTES[tr.precision], tr.micro_batch_size, tr.seq_length
    tokens, d, a, g = s * b, m.head_dim, m.num_attention_heads, m.groups
    qkv = ("linear_qkv.output", e * tokens * (a + 2 * g) * d)
    rope = m.position_embedding_type == "rope"
    # attention.py get_query_key_value_tensors: q, k, v are views of the QKV output; query.reshape to
    # [s, b, heads, d] is a copy when several heads share a group (their columns are not adjacent).
    # RoPE (rope_utils.apply_rotary_pos_emb) makes new q and k; v stays a view of the QKV output.
    q = ("rotary.query", e * tokens * a * d) if rope else ("query.reshape", e * tokens * a * d) if g != a else qkv
    k = ("rotary.key", e * tokens * g * d) if rope else qkv
    out = ("core_attention.output", e * tokens * a * d)  # [s, b, h/t]: linear_proj's input
    # linear_proj keeps that output, or under FP8 delayed scaling its own FP8 copy (fp8.py
    # `proj_saves_original_input`), and the 16-bit output stays only where the kernel saves it.
    proj_copy = runs_fp8(cfg) and not proj_saves_original_input(cfg)
    proj = ("linear_proj.input", linear_input_bytes(cfg, tokens * a * d, a * d)) if proj_copy else out
    path = attention_path(cfg, run)
    if "core_attn" in mods:  # tensor_parallel.checkpoint saves q, k, v; linear_proj the output
        for name, nbytes in (q, k, qkv, proj):
            saved.add(name, nbytes, "tp")
        return
    if path == "fused":  # FusedAttnFunc saves q, k, v as given, the output, the softmax statistics
        for name, nbytes in (q, k, qkv, out, proj):
            saved.add(name, nbytes, "tp")
        saved.add("core_attention.softmax_stats", FP32_BYTES * b * a * s, "tp")
    elif path == "flash":  # FlashAttention.forward: contiguous [b, s, heads, d] copies of q, k, v;
        # flash-attn saves its own output; `output.contiguous()` is the [s, b, h] copy linear_proj keeps
        saved.add("core_attention.qkv_bshd", e * tokens * (a + 2 * g) * d, "tp")
        saved.add("core_attention.flash_output", e * tokens * a * d, "tp")
        saved.add(*proj, "tp")
        saved.add("core_attention.softmax_lse", FP32_BYTES * b * a * s, "tp")
    else:  # unfused (TE) and local (Megatron): QK^T, softmax, dropout, times V, in 16 bits
        scores = b * a * s * s
        saved.add(*q, "tp")  # baddbmm saves q and k (GQA: repeat_interleave makes k and v anew)
        saved.add(*(("core_attention.key_repeated", e * tokens * a * d) if g != a else k), "tp")
        saved.add(*(("core_attention.value_repeated", e * tokens * a * d) if g != a else qkv), "tp")
        # The fused masked-softmax kernel keeps its 16-bit output; torch's softmax (softmax_fused
        # False) keeps an fp32 output when it works in fp32, and the probabilities go on cast back.
        probs = e if softmax_fused(cfg, run) or not _softmax_in_fp32(cfg) else FP32_BYTES
        saved.add("core_attention.softmax", probs * scores, "tp")
        if m.attention_dropout > 0:
            saved.add("core_attention.dropout_mask", MASK_BYTES * scores, "tp")
            saved.add("core_attention.dropout_output", e * scores, "tp")
        saved.add(*proj, "tp")  # context.permute(...).contiguous(), or linear_proj's FP8 copy of it


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
