"""Core attention's ops for the time model (module `core_attn`): the kernel Megatron runs
(`attention.attention_path`) over `heads` query heads and `kv_heads` key/value heads on a rank, with
query/key head dim `qk_dim` and value head dim `v_dim` (GQA: both the head dim; MLA: qk_head_dim +
qk_pos_emb_head_dim and v_head_dim), and under context parallel the exchange of keys and values
each cp_comm_type runs. Pure Python.

Context parallel (transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py):
the rank holds s / cp queries (two of 2 cp chunks, Megatron's load balancing), so its causal work is
the sequence's s (s + 1) / 2 query-key pairs over cp, for every kind:

- p2p (`AttnFuncWithCPAndKVP2P`): cp steps, each the attention of the rank's queries against one
  rank's K/V chunk; while step i computes, the K/V of step i + 1 is sent and received (a ring over
  the cp ranks, `send_recv` on a separate stream), so the cp - 1 sends hide behind every step but
  the last. Each step's partial output is merged into the output by its softmax statistics
  (`flash_attn_fwd_out_correction`). Backward passes K/V and their gradients around the ring (two
  chunks a step), hidden the same way, and accumulates dq, dk, dv per step.
- all_gather (`AttnFuncWithCPAndKVAllGather`): K and V of the whole sequence are all-gathered over cp
  before the attention runs (reordered by `index_select`); backward gathers them again and
  reduce-scatters dK, dV. Nothing overlaps.
- a2a (`AttnFuncWithCPAndQKVOA2A`, Ulysses): q, k and v are all-to-all'ed over cp so that each rank
  holds the whole sequence for heads / cp (split into contiguous copies first), and the output goes
  back the same way; backward: the output gradient, then dq, dk, dv.
- a2a+p2p: the all-to-all over the first level of `hierarchical_context_parallel_sizes`, the ring
  over the second.

A ring's members are t ranks apart (Megatron's rank order puts tensor parallel inside context
parallel); the link that carries them is `GpuRates.comm_seconds`'.
"""

from __future__ import annotations

from dataclasses import dataclass

from recompute_bench.analysis.megatron.attention import attention_path, softmax_fused
from recompute_bench.analysis.megatron.context_parallel import layer_attention
from recompute_bench.analysis.megatron.gpu import MegatronRun
from recompute_bench.analysis.megatron.time_ops import LayerOps, Op, Shape
from recompute_bench.config.schema import BadInput, Config
from recompute_bench.models import FP32_BYTES, MASK_BYTES

CORE = frozenset({"core_attn"})


@dataclass(frozen=True)
class Heads:
    """What one rank's core attention computes over, one micro-batch (per tensor-parallel rank)."""

    heads: float
    kv_heads: float
    qk_dim: float
    v_dim: float

    def elements(self, tokens: float) -> tuple[float, float, float, float]:
        """(q, k, v, output) elements for `tokens` tokens."""
        return (tokens * self.heads * self.qk_dim, tokens * self.kv_heads * self.qk_dim,
                tokens * self.kv_heads * self.v_dim, tokens * self.heads * self.v_dim)


def attention_ops(cfg: Config, run: MegatronRun, sh: Shape, hd: Heads, layer: int) -> LayerOps:
    """Core attention's forward ops (re-run by core_attn) and backward ops of layer `layer`."""
    path = attention_path(cfg, run)
    att = layer_attention(cfg, layer)
    if path in ("fused", "flash"):
        return _fused(cfg, sh, hd, path, att)
    if att is not None:
        raise BadInput(f"Megatron runs context parallel attention in Transformer Engine's flash or fused kernels, not "
                       f"the {path} path; pass --set model.attention_backend=fused or --cp 1")
    return _explicit(cfg, run, sh, hd)


def _fused(cfg: Config, sh: Shape, hd: Heads, path: str, att) -> LayerOps:
    """Transformer Engine's flash or fused kernel: the causal half of the square (the kernels skip
    masked tiles), QK^T and x V forward (2 FLOPs a multiply-add), QK^T again and four gradient GEMMs
    backward (2.5x the forward's FLOPs); bytes: q, k, v read and the output and softmax statistics
    written per step, backward reading q, k, v, the output and its gradient and writing dq, dk, dv."""
    e, T = sh.e, sh.tokens
    q, k, v, o = hd.elements(T)
    lse = FP32_BYTES * sh.b * hd.heads * (sh.s / sh.cp)
    pairs = sh.s * (sh.s + 1) / 2 / sh.cp  # the sequence's causal pairs, even over the cp ranks
    flops = sh.b * hd.heads * pairs * 2 * (hd.qk_dim + hd.v_dim)
    steps = att.kv_ranks if att is not None and att.kind in ("p2p", "a2a+p2p") else 1
    fwd: list[Op] = []
    bwd: list[Op] = []
    if path == "flash":  # TE's FlashAttention makes contiguous [b, s, heads, d] copies of q, k, v
        fwd.append(Op("core_attention.qkv_copy", "memory", bytes=2 * e * (q + k + v), modules=CORE))
    if att is not None and att.a2a > 1:
        fwd += _a2a(sh, att, "core_attention.qkv_all_to_all", q + k + v)
    if att is not None and att.kind == "all_gather":
        fwd += _gather(sh, att, "core_attention.kv", k + v)
    kernel = Op("core_attention", "attention", flops=flops, bytes=steps * (e * (q + k + v + o) + lse), modules=CORE)
    fwd.append(kernel)
    if steps > 1:
        fwd += _ring(sh, att, "core_attention.kv_ring", k + v, kernel.name)
        # each step's partial output merged into the output by the softmax statistics
        fwd.append(Op("core_attention.output_correction", "memory", bytes=steps * (3 * e * o + 2 * lse), modules=CORE))
    if att is not None and att.a2a > 1:
        fwd += _a2a(sh, att, "core_attention.output_all_to_all", o)
    if path == "flash":  # and `output.contiguous()` back to [s, b, h]
        fwd.append(Op("core_attention.output_copy", "memory", bytes=2 * e * o, modules=CORE))

    if path == "flash":
        bwd.append(Op("core_attention.output_copy.backward", "memory", bytes=2 * e * o))
    if att is not None and att.a2a > 1:
        bwd += _a2a(sh, att, "core_attention.output_all_to_all.backward", o, backward=True)
    if att is not None and att.kind == "all_gather":
        bwd += _gather(sh, att, "core_attention.kv.backward", k + v)
    bwd.append(Op("core_attention.backward_preprocess", "memory", bytes=2 * e * o))  # rowsum(dO * O)
    kernel_bwd = Op("core_attention.backward", "attention", flops=2.5 * flops, backward=True,
                    bytes=steps * (2 * e * (q + k + v + o) + lse))
    bwd.append(kernel_bwd)
    if steps > 1:  # K/V and their gradients pass around the ring; dq, dk, dv accumulate per step
        bwd += _ring(sh, att, "core_attention.backward.kv_dkv_ring", 2 * (k + v), kernel_bwd.name)
        bwd.append(Op("core_attention.backward.accumulate", "memory", bytes=steps * 2 * e * (q + k + v)))
    if att is not None and att.kind == "all_gather":  # dK, dV of the whole sequence reduce-scattered
        bwd.append(Op("core_attention.dkv_reduce_scatter", "comm", bytes=(att.kv_ranks - 1) * e * (k + v),
                      group=att.kv_ranks, stride=sh.t))
    if att is not None and att.a2a > 1:
        bwd += _a2a(sh, att, "core_attention.qkv_all_to_all.backward", q + k + v, backward=True)
    if path == "flash":
        bwd.append(Op("core_attention.qkv_copy.backward", "memory", bytes=2 * e * (q + k + v)))
    return LayerOps(fwd, bwd)


def _ring(sh: Shape, att, name: str, elements: float, beside: str) -> list[Op]:
    """The ring's cp - 1 sends of one rank's chunk (`elements`), hidden behind every step but the last."""
    c = att.kv_ranks
    return [Op(name, "comm", bytes=(c - 1) * sh.e * elements, modules=CORE, overlaps=beside,
               overlap_share=(c - 1) / c, group=c, stride=sh.t * att.a2a)]


def _gather(sh: Shape, att, name: str, elements: float) -> list[Op]:
    """K and V of every cp rank all-gathered (NCCL's all-gather), then reordered by chunk (`index_select`)."""
    c = att.kv_ranks
    return [Op(f"{name}_all_gather", "comm", bytes=(c - 1) * sh.e * elements, modules=CORE, group=c, stride=sh.t,
               collective="all_gather", nccl=True),
            Op(f"{name}_reorder", "memory", bytes=2 * sh.e * c * elements, modules=CORE)]


def _a2a(sh: Shape, att, name: str, elements: float, backward: bool = False) -> list[Op]:
    """An all-to-all over the a2a ranks of `elements` (each rank keeps 1 / a2a of them), with the
    contiguous head-split copies around it."""
    a = att.a2a
    mods = frozenset() if backward else CORE
    return [Op(f"{name}.copy", "memory", bytes=2 * sh.e * elements, modules=mods),
            Op(name, "comm", bytes=(a - 1) / a * sh.e * elements, modules=mods, group=a, stride=sh.t,
               pattern="all_to_all")]


def _explicit(cfg: Config, run: MegatronRun, sh: Shape, hd: Heads) -> LayerOps:
    """The unfused (TE) and local (Megatron) path: baddbmm QK^T over the whole square, softmax and
    dropout over the scores, times V; backward two GEMMs per forward GEMM and the softmax and
    dropout backward over the scores."""
    m, e = cfg.model, sh.e
    q, k, v, o = hd.elements(sh.tokens)
    scores = sh.b * hd.heads * sh.s * sh.s
    precision = cfg.training.precision if not sh.fp8 else "bf16"
    fwd = []
    if hd.kv_heads != hd.heads:  # GQA: k and v are repeated to every head
        fwd.append(Op("core_attention.repeat_kv", "memory", bytes=2 * e * (k + v) / 2 + 2 * e * q, modules=CORE))
    qk = Op("core_attention.qk", "matrix", flops=2 * scores * hd.qk_dim, bytes=e * (2 * q + scores),
            precision=precision, modules=CORE)
    fwd.append(qk)
    fused = softmax_fused(cfg, run)
    probs = e if fused or not (m.attention_softmax_in_fp32 or m.transformer_impl == "transformer_engine") else FP32_BYTES
    mask = 0 if fused else MASK_BYTES  # torch's path reads the causal mask
    fwd.append(Op("core_attention.softmax", "memory", bytes=(e + probs + mask) * scores, modules=CORE))
    if m.attention_dropout > 0:
        fwd.append(Op("core_attention.dropout", "memory", bytes=(probs + e + MASK_BYTES) * scores, modules=CORE))
    pv = Op("core_attention.pv", "matrix", flops=2 * scores * hd.v_dim, bytes=e * (scores + q + o), precision=precision,
            modules=CORE)
    fwd.append(pv)
    fwd.append(Op("core_attention.output_copy", "memory", bytes=2 * e * o, modules=CORE))
    bwd = []
    for op in reversed(fwd):
        if op.kind == "matrix":
            bwd.append(Op(op.name + ".backward", "matrix", flops=2 * op.flops, bytes=2 * op.bytes, precision=op.precision))
        elif op.name == "core_attention.softmax":
            bwd.append(Op(op.name + ".backward", "memory", bytes=(probs + 2 * e) * scores))
        elif op.name == "core_attention.dropout":
            bwd.append(Op(op.name + ".backward", "memory", bytes=(2 * e + MASK_BYTES) * scores))
        else:  # copies: the gradient goes back through the same copy
            bwd.append(Op(op.name + ".backward", "memory", bytes=op.bytes))
    return LayerOps(fwd, bwd)
