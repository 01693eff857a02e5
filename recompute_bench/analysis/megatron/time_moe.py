"""A mixture-of-experts layer's MLP part for the time model: pre_mlp_layernorm and `MoELayer`
(megatron/core/transformer/moe/moe_layer.py; what it holds: `analysis.megatron.moe`), one
micro-batch on one rank, op by op, with the recompute modules that re-run each:

- pre_mlp_layernorm: the MoE layer's own norm (TENorm, not fused into a linear): `layernorm`;
- the router (router.py TopKRouter): the gating GEMM [n, h] x [h, E] (moe_utils.py
  `RouterGatingLinearFunction`: bf16 operands through TE's GEMM, an fp32 output with
  moe_router_dtype fp32; fp64 runs torch.mm in fp64), the score function and top-k over [n, E], the
  aux loss's softmax and the z-loss's logsumexp where on;
- the token dispatcher (token_dispatcher.py), whose bytes cross the interconnect
  (`GpuRates.comm_seconds`: NVLink within the NVLink domain, the network beyond):
  allgather (`MoEAllGatherTokenDispatcher`): the tokens, probabilities and routing map all-gathered
  over the etp x ep ranks, the rows of this rank's experts picked out, and after the experts
  scattered back and reduce-scattered; alltoall (`MoEAlltoAllTokenDispatcher`): the n x k routed
  copies permuted, all-to-all over ep (members etp apart), all-gathered over etp, sorted by local
  expert, and the same back; flex (`MoEFlexTokenDispatcher`, DeepEP): one fused all-to-all over the
  etp x ep ranks sending each token once per rank that holds one of its experts;
- the routed experts (experts.py TEGroupedMLP, SequentialMLP): grouped GEMMs fc1 [T, h] x [h, f]
  (2f for SwiGLU) and fc2 [T, f] x [f, h] over the T rows this rank's E / ep experts run, at the
  matrix rate of the precision (FP8 under fp8: TE's GroupedLinear quantises its inputs), and the
  activation weighted by the probabilities between them (`moe_act` re-runs it; under FP8 fc2 then
  keeps its original input, `set_save_original_input`, and quantises it again);
- the shared experts (shared_experts.py SharedExpertMLP): a tensor-parallel MLP of width
  moe_shared_expert_intermediate_size on every token, its sigmoid gate where on: `shared_experts`;
  with moe_shared_expert_overlap they run beside the dispatcher's forward communication.

`moe` re-runs the whole MoELayer forward (router, dispatch, experts, combine, shared experts:
moe_layer.py checkpoints `custom_forward`). Rows: balanced routing, the memory model's assumption
(`moe.routed_rows`): every expert receives its share, k / E, of every rank's tokens. Pure Python.
"""

from __future__ import annotations

import dataclasses
from math import comb

from recompute_bench.analysis.megatron.moe import (dispatch_group, expert_probs_bytes, local_experts, local_tokens,
                                                   routed_rows, router_bytes, sent_rows)
from recompute_bench.analysis.megatron.time_ops import (LayerOps, Op, Shape, linear, linear_backward, mlp_ops,
                                                        modules, norm, norm_backward, quantize)
from recompute_bench.config.schema import Config
from recompute_bench.models import INDEX_BYTES, MASK_BYTES

MOE = frozenset({"moe"})
ACT = frozenset({"moe", "moe_act"})
SHARED = frozenset({"moe", "shared_experts"})


def moe_ops(cfg: Config, sh: Shape) -> LayerOps:
    """One MoE layer's MLP part: its norm, router, dispatch, experts, combine and shared experts."""
    m = cfg.model
    n = local_tokens(cfg)
    fwd = [norm("pre_mlp_layernorm", sh, modules("layernorm"), quantized_output=False)]
    router = _router(cfg, sh, n)
    fwd += router.forward
    shared = _shared(cfg, sh)
    dispatch, combine = _dispatcher(cfg, sh, n)
    experts = _experts(cfg, sh)
    if m.moe_shared_expert_overlap and shared.forward:
        # the shared experts run on their own stream beside the dispatch and combine collectives
        dispatch = _beside(dispatch, "shared_experts.linear_fc1")
        combine = _beside(combine, "shared_experts.linear_fc2")
    else:
        fwd += shared.forward
    fwd += dispatch.forward + experts.forward + combine.forward
    if m.moe_shared_expert_overlap:
        fwd += shared.forward
    bwd = combine.backward + experts.backward + dispatch.backward + shared.backward + router.backward
    bwd.append(norm_backward("pre_mlp_layernorm", sh))
    return LayerOps(fwd, bwd)


def _beside(ops: LayerOps, gemm: str) -> LayerOps:
    forward = [dataclasses.replace(op, overlaps=gemm) if op.kind == "comm" else op for op in ops.forward]
    return LayerOps(forward, ops.backward)


def _router(cfg: Config, sh: Shape, n: float) -> LayerOps:
    """The gating GEMM and the passes over the [n, E] scores: score function, top-k, the aux loss's
    scores over all experts, the z-loss."""
    m = cfg.model
    experts, k, r, h = m.num_moe_experts, m.moe_router_topk, router_bytes(cfg), sh.h
    precision = "fp64" if m.moe_router_dtype == "fp64" else "bf16"
    gating = Op("router.gating", "matrix", flops=2 * n * h * experts,
                bytes=sh.e * (n * h + experts * h) + r * n * experts, precision=precision, modules=MOE)
    scores = 3 * r * n * experts + INDEX_BYTES * n * k  # read the logits, the score function's output, top-k
    if m.moe_aux_loss_coeff and m.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
        scores += 2 * 4 * n * experts  # compute_routing_scores_for_aux_loss: softmax over all experts in fp32
    if m.moe_z_loss_coeff:
        scores += r * n * experts
    fwd = [gating, Op("router.scores", "memory", bytes=scores, modules=MOE)]
    bwd = [Op("router.scores.backward", "memory", bytes=scores),
           Op("router.gating.dgrad", "matrix", flops=gating.flops, bytes=gating.bytes, precision=precision),
           Op("router.gating.wgrad", "matrix", flops=gating.flops, bytes=gating.bytes, precision=precision)]
    return LayerOps(fwd, bwd)


def _comm(name: str, nbytes: float, group: int, stride: int, pattern: str = "ring") -> list[Op]:
    return [Op(name, "comm", bytes=nbytes, modules=MOE, group=group, stride=stride, pattern=pattern)] if group > 1 else []


def destination_ranks(cfg: Config) -> float:
    """Ranks of the dispatch group a token goes to, expected under balanced (uniform) routing: the
    expert-parallel ranks its k experts lie on, ep (1 - C(E - E/ep, k) / C(E, k)) for E experts, E / ep
    on each, times the etp ranks that share each expert."""
    m, par = cfg.model, cfg.parallel
    experts, k, ep = m.num_moe_experts, m.moe_router_topk, par.expert_model_parallel_size
    per_rank = experts // ep
    return par.expert_tensor_parallel * ep * (1 - comb(experts - per_rank, k) / comb(experts, k))


def _dispatcher(cfg: Config, sh: Shape, n: float) -> tuple[LayerOps, LayerOps]:
    """(dispatch, combine): each one's forward ops, and its backward (the same bytes back)."""
    m, par, e, h = cfg.model, cfg.parallel, sh.e, sh.h
    rows, g, e_local = routed_rows(cfg), dispatch_group(cfg), local_experts(cfg)
    ep, etp = par.expert_model_parallel_size, par.expert_tensor_parallel
    kind = m.moe_token_dispatcher_type
    if kind == "allgather":
        gathered = n * g
        dispatch_f = _comm("moe.dispatch_all_gather", (g - 1) * n * (e * h + m.num_moe_experts * (router_bytes(cfg) + MASK_BYTES)),
                           g, 1)
        dispatch_f.append(Op("moe.permute", "memory", bytes=2 * e * rows * h + INDEX_BYTES * rows, modules=MOE))
        dispatch_b = [Op("moe.permute.backward", "memory", bytes=e * (gathered * h + 2 * rows * h))]
        dispatch_b += _comm("moe.dispatch_all_gather.backward", (g - 1) * n * e * h, g, 1)
        combine_f = [Op("moe.unpermute", "memory", bytes=e * (gathered * h + 2 * rows * h), modules=MOE)]
        combine_f += _comm("moe.combine_reduce_scatter", (g - 1) * n * e * h, g, 1)
        combine_b = _comm("moe.combine_reduce_scatter.backward", (g - 1) * n * e * h, g, 1)
        combine_b.append(Op("moe.unpermute.backward", "memory", bytes=2 * e * rows * h))
        return LayerOps(dispatch_f, dispatch_b), LayerOps(combine_f, combine_b)
    if kind == "flex":
        received = n * destination_ranks(cfg)
        sent = (g - 1) / g * e * received * h
        dispatch_f = _comm("moe.dispatch_all_to_all", sent, g, 1, "all_to_all")
        dispatch_f.append(Op("moe.permute", "memory", bytes=e * (received + rows) * h, modules=MOE))
        dispatch_b = [Op("moe.permute.backward", "memory", bytes=e * (received + rows) * h)]
        dispatch_b += _comm("moe.dispatch_all_to_all.backward", sent, g, 1, "all_to_all")
        combine_f = [Op("moe.unpermute", "memory", bytes=e * (received + rows) * h, modules=MOE)]
        combine_f += _comm("moe.combine_all_to_all", sent, g, 1, "all_to_all")
        combine_b = _comm("moe.combine_all_to_all.backward", sent, g, 1, "all_to_all")
        combine_b.append(Op("moe.unpermute.backward", "memory", bytes=e * (received + rows) * h))
        return LayerOps(dispatch_f, dispatch_b), LayerOps(combine_f, combine_b)
    # alltoall: the n x k routed copies (sent_rows) leave by all-to-all over ep; each rank of the
    # etp group then gathers the others' received rows
    copies = sent_rows(cfg)
    a2a = (ep - 1) / ep * e * copies * h
    gather = (etp - 1) * e * rows / etp * h
    sort = 2 * e * rows * h if e_local > 1 else 0.0
    dispatch_f = [Op("moe.permute", "memory", bytes=2 * e * copies * h + INDEX_BYTES * copies, modules=MOE)]
    dispatch_f += _comm("moe.dispatch_all_to_all", a2a, ep, etp, "all_to_all")
    dispatch_f += _comm("moe.dispatch_all_gather", gather, etp, 1)
    if sort:
        dispatch_f.append(Op("moe.sort_chunks", "memory", bytes=sort, modules=MOE))
    dispatch_b = ([Op("moe.sort_chunks.backward", "memory", bytes=sort)] if sort else []) + \
        _comm("moe.dispatch_all_gather.backward", gather, etp, 1) + \
        _comm("moe.dispatch_all_to_all.backward", a2a, ep, etp, "all_to_all") + \
        [Op("moe.permute.backward", "memory", bytes=2 * e * copies * h)]
    combine_f = ([Op("moe.unsort_chunks", "memory", bytes=sort, modules=MOE)] if sort else []) + \
        _comm("moe.combine_reduce_scatter", gather, etp, 1) + \
        _comm("moe.combine_all_to_all", a2a, ep, etp, "all_to_all") + \
        [Op("moe.unpermute", "memory", bytes=e * (copies + n) * h + router_bytes(cfg) * copies, modules=MOE)]
    combine_b = [Op("moe.unpermute.backward", "memory", bytes=e * (copies + n) * h)] + \
        _comm("moe.combine_all_to_all.backward", a2a, ep, etp, "all_to_all") + \
        _comm("moe.combine_reduce_scatter.backward", gather, etp, 1) + \
        ([Op("moe.unsort_chunks.backward", "memory", bytes=sort)] if sort else [])
    return LayerOps(dispatch_f, dispatch_b), LayerOps(combine_f, combine_b)


def _experts(cfg: Config, sh: Shape) -> LayerOps:
    """The local experts' grouped GEMMs over their T rows and the weighted activation between them."""
    m, par, e, h = cfg.model, cfg.parallel, sh.e, sh.h
    rows, e_local = routed_rows(cfg), local_experts(cfg)
    f = m.moe_ffn / par.expert_tensor_parallel
    fc1_width = (2 if m.activation == "swiglu" else 1) * f
    probs = expert_probs_bytes(cfg) * rows
    fwd = quantize("experts.linear_fc1", rows * h, sh, MOE)
    fc1 = linear("experts.linear_fc1", sh, rows, h, fc1_width, MOE, weights=e_local)
    fwd.append(fc1)
    fwd.append(Op("experts.activation", "memory", bytes=e * rows * (fc1_width + f) + probs, modules=ACT))
    fwd += quantize("experts.linear_fc2", rows * f, sh, ACT)
    fc2 = linear("experts.linear_fc2", sh, rows, f, h, MOE, weights=e_local)
    fwd.append(fc2)
    bwd = linear_backward(fc2, sh, rows, f, h, weights=e_local)
    bwd.append(Op("experts.activation.backward", "memory", bytes=e * rows * (2 * fc1_width + f) + 2 * probs))
    bwd += linear_backward(fc1, sh, rows, h, fc1_width, weights=e_local)
    return LayerOps(fwd, bwd)


def _shared(cfg: Config, sh: Shape) -> LayerOps:
    """The shared experts: a tensor-parallel MLP on every token, and the sigmoid gate on its output."""
    m = cfg.model
    width = m.moe_shared_expert_intermediate_size
    if not width:
        return LayerOps()
    ops = mlp_ops(cfg, sh, "shared_experts.", width, SHARED, None, frozenset())
    if m.moe_shared_expert_gate:  # a [h, 1] gate, its sigmoid, the product with the output
        gate = sh.e * 3 * sh.local
        ops.forward.append(Op("shared_experts.gate", "memory", bytes=gate, modules=SHARED))
        ops.backward.insert(0, Op("shared_experts.gate.backward", "memory", bytes=gate))
    return ops
