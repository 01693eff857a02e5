"""Context parallel under Megatron: what a context-parallel rank holds when each sequence is split
over cp ranks and Transformer Engine's attention reaches the other ranks' keys and values.

- The sequence split (`models.context_parallel`): megatron/core/utils.py `get_batch_on_this_cp_rank`
  cuts every per-token tensor of the micro-batch into 2 x cp chunks and keeps chunks r and
  2cp - 1 - r, so every layer, the embedding, the output layer and the loss see s / cp tokens
  (`rank_tokens`); the attention mask keeps its s keys (`attention_mask_bytes`).
- The attention (transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py,
  one autograd function per cp_comm_type): what it keeps for backward (`attention_saved`), the
  working set of its forward (`attention_forward_bytes`) and of its backward
  (`attention_backward_bytes`), for the flash and fused kernels (backends.py `FlashAttention`,
  `FusedAttention`; TE disables the unfused one under context parallel).
- The optimizer: DDP reduces gradients, and the distributed optimizer shards its state, over the
  data-parallel group with context parallel (`optimizer_shards`).

Sizes below are per layer, one micro-batch, on one tensor-parallel rank: T tokens on the CP rank,
a / t query heads and g / t key-value groups of head_dim d, e bytes an element. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from recompute_bench.models import ELEMENT_BYTES, FP32_BYTES, MASK_BYTES, SavedBytes
from recompute_bench.config.cp_comm import comm_levels, layer_comm_types
from recompute_bench.models.context_parallel import rank_seq_length
from recompute_bench.config.schema import Config


def rank_tokens(cfg: Config) -> int:
    """Tokens of one micro-batch on a context-parallel rank: s / cp x b (get_batch_on_this_cp_rank
    keeps 2 of the 2cp chunks of every sequence)."""
    return rank_seq_length(cfg) * cfg.training.micro_batch_size


def attention_mask_bytes(cfg: Config) -> float:
    """The micro-batch's [b, 1, s, s] bool attention mask on a CP rank: get_batch_on_this_cp_rank
    slices its query dimension (seq_dim 2 for attention_mask) and keeps every key: b x s/cp x s."""
    return MASK_BYTES * rank_tokens(cfg) * cfg.training.seq_length


def optimizer_shards(cfg: Config) -> int:
    """Ranks the distributed optimizer shards its state over: dp x cp. DDP builds its buckets over
    the intra data-parallel group with context parallel (distributed_data_parallel.py
    `intra_dp_cp_group`), and every CP rank holds the same weights and gradients."""
    par = cfg.parallel
    return par.data_parallel_size * par.context_parallel_size


@dataclass(frozen=True)
class CpAttention:
    """What one layer's attention runs under context parallel (`models.context_parallel.comm_levels`)."""

    kind: str
    """p2p, all_gather, a2a or a2a+p2p, after Transformer Engine's fall-back when a level has one rank."""
    a2a: int
    """Ranks the all-to-all spreads the heads over (1 without one)."""
    kv_ranks: int
    """Ranks whose keys and values a rank visits: the ring (p2p) or the gather (all_gather)."""


def layer_attention(cfg: Config, layer: int) -> CpAttention | None:
    """The context-parallel attention of layer `layer` (0-based, over the whole model), or None
    without context parallel."""
    par = cfg.parallel
    if par.context_parallel_size == 1:
        return None
    # a multi-token-prediction layer k is numbered k + 1 (MultiTokenPredictionLayer.__init__), so
    # TransformerLayer takes the k-th cp_comm_type
    number = layer - cfg.model.num_layers if layer >= cfg.model.num_layers else layer
    kind = layer_comm_types(str(par.cp_comm_type), cfg.model.num_layers)[number]
    return CpAttention(*comm_levels(kind, par.context_parallel_size, par.hierarchical_context_parallel_sizes))


@dataclass(frozen=True)
class _Sizes:
    """One layer's attention tensors on a CP rank (before the split over tp)."""

    q: float
    """Queries, and the attention output: e x T x a x d."""
    kv: float
    """Keys and values together: e x T x 2g x d."""
    k: float
    """Keys alone (and values alone): e x T x g x d."""
    qkv: float
    """linear_qkv's output: e x T x (a + 2g) x d."""
    lse: float
    """Softmax statistics in fp32: 4 x T x a."""


def _sizes(cfg: Config) -> _Sizes:
    m = cfg.model
    e, tokens, d, a, g = ELEMENT_BYTES[cfg.training.precision], rank_tokens(cfg), m.head_dim, m.num_attention_heads, m.groups
    return _Sizes(e * tokens * a * d, e * tokens * 2 * g * d, e * tokens * g * d, e * tokens * (a + 2 * g) * d,
                  FP32_BYTES * tokens * a)


def _inputs(cfg: Config, path: str) -> dict[str, tuple[str, float]]:
    """The tensors alive as a layer's core attention starts, by role: Megatron's attention.py holds
    linear_qkv's output (q, k, v are views of it; a query reshape under GQA is a copy) and RoPE's
    new q and k until core_attention returns; FlashAttention (backends.py) hands TE's CP function
    contiguous [b, s, heads, d] copies of q, k, v, FusedAttention `x.contiguous()`: a copy of a
    QKV view, RoPE's q and k (or GQA's reshaped query) as they are."""
    z, m = _sizes(cfg), cfg.model
    rope, gqa = m.position_embedding_type == "rope", m.groups != m.num_attention_heads
    held = {"qkv": ("linear_qkv.output", z.qkv)}
    if rope:
        held["rope_q"], held["rope_k"] = ("rotary.query", z.q), ("rotary.key", z.k)
    elif gqa:
        held["reshape_q"] = ("query.reshape", z.q)
    if path == "flash":
        held.update(q=("core_attention.query_bshd", z.q), k=("core_attention.key_bshd", z.k),
                    v=("core_attention.value_bshd", z.k))
    else:
        held["q"] = held.get("rope_q") or held.get("reshape_q") or ("core_attention.query_contiguous", z.q)
        held["k"] = held.get("rope_k") or ("core_attention.key_contiguous", z.k)
        held["v"] = ("core_attention.value_contiguous", z.k)
    return held


def _kept(cfg: Config, path: str, att: CpAttention) -> list[tuple[str, float]]:
    z, inputs, flash = _sizes(cfg), _inputs(cfg, path), path == "flash"
    output = ("core_attention.output", z.q)  # linear_proj's input: flash's [s, b, h] copy, fused's view
    lse = ("core_attention.softmax_lse", z.lse)
    if att.kind == "p2p":
        return [inputs["q"], ("core_attention.kv_received", z.kv), lse, output] + \
            ([("core_attention.output_bshd", z.q)] if flash else [])
    if att.kind == "a2a+p2p":
        return [("core_attention.query_a2a", z.q), ("core_attention.kv_received", z.kv), lse, output,
                ("core_attention.output_a2a", z.q)]
    if att.kind == "all_gather":
        if flash:  # k and v move from [b, s, ...] to [s, b, ...]: new tensors
            return [inputs["q"], ("core_attention.key_sbhd", z.k), ("core_attention.value_sbhd", z.k), lse, output,
                    ("core_attention.output_bshd", z.q)]
        return [inputs["q"], inputs["k"], inputs["v"], lse, output]
    return [("core_attention.qkv_a2a", z.qkv), ("core_attention.output_a2a", z.q), lse, output]  # a2a


def attention_saved(saved: SavedBytes, cfg: Config, path: str, att: CpAttention) -> None:
    """What the core attention keeps for backward under context parallel, per kernel path ("flash"
    or "fused") and kind, with the inputs as `_inputs` names them; none of the four keeps
    linear_qkv's output alive, which the attention without context parallel does.

    - p2p (AttnFuncWithCPAndKVP2P.forward, `ctx.save_for_backward`): q as given, the K/V buffer
      received at the ring's last step (`p2p_comm_buffers[-1]`, K and V concatenated), the merged
      output (bf16 `out`, which is also what it returns), the merged softmax_lse (fp32 [b, a, s/cp]),
      per-step rng states and cu_seqlens (bytes). Flash returns [b, s, ...] and copies it to [s, b, h]
      for linear_proj; fused hands linear_proj the output itself.
    - a2a+p2p: the same on the tensors after the all-to-all over heads (q, K/V and the output in the
      [b, s x a2a, heads / a2a, d] layout, same sizes); it returns a new tensor (the all-to-all back).
    - all_gather (AttnFuncWithCPAndKVAllGather.forward): q, k and v as given (`movedim(seq, 0)
      .contiguous()`: new k and v from flash's [b, s, ...] copies, the same tensors in fused's
      [s, b, ...]), its output (the one it returns), and two per-step softmax statistics of s/2cp
      queries each; the gathered K/V are gathered again in backward.
    - a2a (AttnFuncWithCPAndQKVOA2A.forward): q, k, v after the all-to-all (new tensors), its
      output before the all-to-all back, the softmax statistics; it returns the all-to-all back."""
    for name, nbytes in _kept(cfg, path, att):
        saved.add(name, nbytes, "tp")


def attention_forward_bytes(cfg: Config, path: str, att: CpAttention) -> dict[str, float]:
    """The working set of the CP attention's forward beyond what it keeps (`attention_saved`), on
    the CP rank that holds most: the inputs as `_inputs` names them, and

    - p2p (AttnFuncWithCPAndKVP2P.forward): every K/V buffer of the ring stays in
      `p2p_comm_buffers` until the forward returns (the first is `torch.cat` of its own K and V, the
      last is kept), every step's partial output and softmax_lse in `out_per_step` /
      `softmax_lse_per_step`. On the ring's last rank every step after the diagonal is a
      "lower-triangle" tile, whose output covers all s/cp queries: c - 1 buffers, c outputs and
      c statistics beside the kept ones.
    - a2a+p2p: the same over the ring, plus K and V after the all-to-all (inputs of the cat) and,
      with flash, the output it returns before FlashAttention's [s, b, h] copy.
    - all_gather (AttnFuncWithCPAndKVAllGather.forward): the gathered K and V of the whole sequence
      (cp x K/V, reordered by `index_select`), the step's `contiguous()` K/V range (rank 0's second
      chunk attends the whole sequence) and half of q, the two half outputs, and the zero-filled
      `out` it allocates (used for thd only).
    - a2a (flash_attn_a2a_communicate, before attention): the heads split into contiguous [cp, ...]
      copies of q, k, v beside the all-to-all's outputs."""
    z = _sizes(cfg)
    kept = {name for name, _ in _kept(cfg, path, att)}
    held = {name: nbytes for name, nbytes in _inputs(cfg, path).values() if name not in kept}
    c = att.kv_ranks
    if att.kind in ("p2p", "a2a+p2p"):
        held["core_attention.kv_ring_buffers"] = (c - 1) * z.kv
        held["core_attention.outputs_per_step"] = c * z.q
        held["core_attention.softmax_lse_per_step"] = c * z.lse
        if att.kind == "a2a+p2p":
            held["core_attention.kv_a2a"] = z.kv
            if path == "flash":
                held["core_attention.output_bshd"] = z.q
    elif att.kind == "all_gather":
        held["core_attention.kv_gathered"] = c * z.kv
        held["core_attention.kv_step_range"] = c * z.kv
        held["core_attention.query_step"] = z.q / 2
        held["core_attention.outputs_per_step"] = z.q
        held["core_attention.output_zeros"] = z.q
    else:  # a2a
        held["core_attention.qkv_heads_split"] = z.qkv
    return _per_rank(cfg, held)


def attention_backward_bytes(cfg: Config, path: str, att: CpAttention) -> dict[str, float]:
    """The working set of the CP attention's backward: what TE's backward allocates.

    - p2p (AttnFuncWithCPAndKVP2P.backward, F16): `dq_buffer` (q's size), two ring buffers of
      [2, K/V] (K/V with its gradient, sent and received), a step's dq, dk, dv (the diagonal step's,
      full size: `empty_like` in cp_p2p_bwd_flash_attn, fused_attn_bwd's outputs).
    - a2a+p2p: the same, plus the output gradient after its all-to-all and the all-to-all back of
      dq, dk, dv (heads-split copies and outputs).
    - all_gather (AttnFuncWithCPAndKVAllGather.backward): dq, and dk, dv over the whole sequence
      (cp x K/V, zero-filled), the K/V gathered again, a step's `contiguous()` q, output and output
      gradient (half of s/cp each) and K/V range, its dq, dk, dv.
    - a2a (AttnFuncWithCPAndQKVOA2A.backward): the output gradient after its all-to-all, dq, dk, dv,
      and their all-to-all back (heads-split copies and outputs)."""
    z = _sizes(cfg)
    c = att.kv_ranks
    if att.kind in ("p2p", "a2a+p2p"):
        out: dict[str, float] = {"core_attention.dq_buffer": z.q, "core_attention.kv_dkv_ring_buffers": 4 * z.kv,
               "core_attention.dqkv_step": z.q + z.kv}
        if att.kind == "a2a+p2p":
            out["core_attention.dout_a2a"] = z.q
            out["core_attention.dqkv_a2a"] = 2 * z.qkv
        return _per_rank(cfg, out)
    if att.kind == "all_gather":
        return _per_rank(cfg, {"core_attention.dq": z.q, "core_attention.dkv_gathered": c * z.kv, "core_attention.kv_gathered": c * z.kv,
                "core_attention.step_inputs": 1.5 * z.q + c * z.kv, "core_attention.dqkv_step": z.q / 2 + c * z.kv})
    return _per_rank(cfg, {"core_attention.dout_a2a": z.q, "core_attention.dqkv": z.qkv,
                           "core_attention.dqkv_a2a": 2 * z.qkv})


def _per_rank(cfg: Config, held: dict[str, float]) -> dict[str, float]:
    """Attention's tensors on one tensor-parallel rank: the heads are split over t."""
    t = cfg.parallel.tensor_model_parallel_size
    return {name: nbytes / t for name, nbytes in held.items() if nbytes}


def context_parallel_report(cfg: Config, path: str) -> dict | None:
    """What `estimate --framework megatron --json` shows of context parallel (None without it): the
    rank's tokens and the optimizer's shards, and for each attention kind the layers run, what its
    attention keeps per layer and its forward and backward working sets, on one tensor-parallel rank."""
    par = cfg.parallel
    if par.context_parallel_size == 1:
        return None
    kinds: dict[CpAttention, int] = {}
    for layer in range(cfg.model.num_layers):
        att = layer_attention(cfg, layer)
        kinds[att] = kinds.get(att, 0) + 1
    rows = []
    for att, count in kinds.items():
        saved = SavedBytes()
        attention_saved(saved, cfg, path, att)
        rows.append({"cp_comm_type": att.kind, "a2a_ranks": att.a2a, "kv_ranks": att.kv_ranks, "layers": count,
                     "kept_bytes": saved.per_rank(par.tensor_model_parallel_size, par.sequence_parallel),
                     "forward_working_set_bytes": attention_forward_bytes(cfg, path, att),
                     "backward_working_set_bytes": attention_backward_bytes(cfg, path, att)})
    return {"context_parallel_size": par.context_parallel_size, "rank_tokens": rank_tokens(cfg),
            "optimizer_shards": optimizer_shards(cfg), "attention": rows}
