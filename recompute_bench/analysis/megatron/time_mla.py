"""Multi-latent attention's ops for the time model (Transformer Engine's MLA spec,
megatron/core/transformer/multi_latent_attention.py `MLASelfAttention`; what it holds:
`analysis.megatron.mla`). With n / t heads on a rank, qk = qk_head_dim, r = qk_pos_emb_head_dim,
v = v_head_dim:

- input_layernorm: its own TENorm (not fused into a linear), re-run by `layernorm`;
- linear_q_down_proj h -> q_lora_rank and linear_kv_down_proj h -> kv_lora_rank + r: TELinear
  "duplicated", whole weights on every rank, on the rank's sequence shard (no gather); the rotary
  part of the kv latent (k_pos_emb) is all-gathered over the sequence under sequence parallel;
- `qkv_up_proj_and_rope_apply`, which `mla_up_proj` re-runs (CheckpointWithoutOutput): the
  column-parallel up projections (their latents all-gathered under sequence parallel; with
  qk_layernorm the latent norms fused into them), q_lora_rank -> n (qk + r) (or linear_q_proj from h
  without q_lora_rank) and kv_lora_rank -> n (qk + v), then RoPE on q's and k's rotary parts and the
  query, key and value tensors core attention takes (the fused yarn kernels write them directly;
  unfused: the rotations, two `torch.cat` and `value.contiguous()`);
- core attention over qk + r query/key dims and v value dims (`time_attention`), then linear_proj
  n v -> h, row-parallel.
Pure Python.
"""

from __future__ import annotations

from recompute_bench.analysis.megatron.gpu import MegatronRun
from recompute_bench.analysis.megatron.mla import mla_rope_fused
from recompute_bench.analysis.megatron.time_attention import Heads, attention_ops
from recompute_bench.analysis.megatron.time_ops import (LayerOps, Op, Shape, column_input, linear, linear_backward,
                                                        modules, norm, norm_backward, quantize, row_output)
from recompute_bench.config.schema import Config

UP = frozenset({"mla_up_proj"})


def mla_attention_ops(cfg: Config, run: MegatronRun, sh: Shape, layer: int) -> LayerOps:
    """One MLA block's forward ops (with the modules that re-run them) and backward ops."""
    m = cfg.model
    n, qk, r, v = m.num_attention_heads / sh.t, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    T, L, h, e = sh.tokens, sh.local_tokens, sh.h, sh.e
    latent_norm = "qk_layernorm" if m.qk_layernorm else None
    fwd: list[Op] = [norm("input_layernorm", sh, modules("layernorm"), quantized_output=False)]
    downs = []
    for name, width in (("linear_q_down_proj", m.q_lora_rank), ("linear_kv_down_proj", m.kv_lora_rank + r)):
        if width is None:
            continue
        fwd += quantize(name, L * h, sh, frozenset())
        down = linear(name, sh, L, h, width, frozenset())
        fwd.append(down)
        downs.append((down, width))
    if sh.sp:  # k_pos_emb gathered over the sequence before the up projections' checkpoint
        fwd.append(sh.tp_comm("k_pos_emb.all_gather", "all_gather", T * r, e))
    ups = []
    if m.q_lora_rank is not None:
        fwd += column_input("linear_q_up_proj", sh, UP, latent_norm and "linear_q_up_proj.q_layernorm", UP,
                            width=m.q_lora_rank)
        ups.append((linear("linear_q_up_proj", sh, T, m.q_lora_rank, n * (qk + r), UP), m.q_lora_rank))
    else:
        fwd += column_input("linear_q_proj", sh, UP, latent_norm and "linear_q_proj.q_layernorm", UP)
        ups.append((linear("linear_q_proj", sh, T, h, n * (qk + r), UP), h))
    fwd.append(ups[0][0])
    fwd += column_input("linear_kv_up_proj", sh, UP, latent_norm and "linear_kv_up_proj.kv_layernorm", UP,
                        width=m.kv_lora_rank)
    ups.append((linear("linear_kv_up_proj", sh, T, m.kv_lora_rank, n * (qk + v), UP), m.kv_lora_rank))
    fwd.append(ups[1][0])
    # RoPE and the attention inputs. Fused: read q, kv and k_pos_emb, write query, key and value.
    # Unfused: rotate q's and k's rotary parts (read and write), then each cat and the contiguous
    # value read their parts and write query [n, qk + r], key [n, qk + r], value [n, v].
    if mla_rope_fused(cfg):
        rope = e * T * (n * (qk + r) + n * (qk + v) + r + n * (2 * (qk + r) + v))
    else:
        rope = e * (2 * T * n * r + 2 * T * r + 2 * T * n * (qk + r) + 2 * T * n * (qk + r) + 2 * T * n * v)
    fwd.append(Op("rotary", "memory", bytes=rope, modules=UP))
    attention = attention_ops(cfg, run, sh, Heads(n, n, qk + r, v), layer)
    fwd += attention.forward
    fwd += quantize("linear_proj", T * n * v, sh, frozenset())
    proj = linear("linear_proj", sh, T, n * v, h, frozenset(), row=True)
    fwd.append(proj)
    fwd += row_output("linear_proj", sh, frozenset())

    bwd = linear_backward(proj, sh, T, n * v, h, row=True)
    bwd += attention.backward
    bwd.append(Op("rotary.backward", "memory", bytes=rope))
    for up, width in reversed(ups):
        bwd += linear_backward(up, sh, T, width, up.flops / (2 * T * width), column=True)
        if latent_norm:
            bwd.append(norm_backward(f"{up.name}.{'kv' if 'kv' in up.name else 'q'}_layernorm", sh, L, width))
    if sh.sp:
        bwd.append(sh.tp_comm("k_pos_emb.grad_reduce_scatter", "reduce_scatter", T * r, e))
    for down, width in reversed(downs):
        bwd += linear_backward(down, sh, L, h, width)
    bwd.append(norm_backward("input_layernorm", sh))
    return LayerOps(fwd, bwd)
