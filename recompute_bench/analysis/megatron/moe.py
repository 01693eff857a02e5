"""Framework megatron's mixture-of-experts layer, one micro-batch on one rank: what the router, the
token dispatcher, the routed experts and the shared experts keep for backward, what the MoE block
holds for the whole run, and how the expert weights are sharded.

A MoE layer is the dense layer's attention, then `pre_mlp_layernorm` (its own norm: TE's TENorm or
the local FusedLayerNorm, not fused into a linear) and `MoELayer` in the MLP's place. The tokens of one
rank are n = s x b / t under sequence parallelism (MoE with t > 1 trains only with it). Experts are laid
out over etp x ep ranks (etp: `expert_tensor_parallel_size`, each expert's fc1 columns and fc2 rows
split over etp ranks), E / ep experts on each; the dispatcher's group holds G = etp x ep ranks.

Routing. Which rows a rank's experts run depends on where the router sends the tokens, which no
argument says. The estimate takes **balanced routing**: every expert receives its share of every
rank's routed copies, so a rank's experts run T = n x etp x k rows (k = top-k), what Megatron's
dropless path allocates on average; `routing="bound"` gives the most Megatron's code lets a rank
receive, every token of its dispatch group routed to its experts, T = n x G x min(k, E / ep), the
worst case no buffer of Megatron's is sized for (dropless training allocates what arrives). With a
capacity factor each expert takes at most its capacity from every rank (token dropping), and padded to
capacity (`moe_pad_expert_input_to_capacity`) exactly that, whatever the routing.

Sources (Megatron-LM d98e8a6, TransformerEngine d0067d0):
- megatron/core/transformer/moe/moe_layer.py (MoELayer.forward, `moe` and `shared_experts` recompute)
- megatron/core/transformer/moe/router.py (TopKRouter: gating, routing, sinkhorn, aux losses, z-loss)
- megatron/core/transformer/moe/moe_utils.py (router_gating_linear, topk_routing_with_score_function,
  compute_routing_scores_for_aux_loss, apply_router_token_dropping, get_capacity, permute, unpermute,
  sort_chunks_by_idxs)
- megatron/core/transformer/moe/token_dispatcher.py (MoEAllGatherTokenDispatcher,
  MoEAlltoAllTokenDispatcher, MoEFlexTokenDispatcher)
- megatron/core/transformer/moe/experts.py (TEGroupedMLP with `moe_act` recompute, SequentialMLP)
- megatron/core/transformer/moe/shared_experts.py (SharedExpertMLP, its gate and overlap)
- megatron/core/tensor_parallel/mappings.py (`_gather_along_first_dim` into the global memory buffer)
- transformer_engine/pytorch/module/grouped_linear.py (_GroupedLinear saves its input's split views),
  transformer_engine/pytorch/permutation.py (the fused permute / unpermute's row_id_map),
  transformer_engine/pytorch/ops/basic/layer_norm.py, rmsnorm.py (the norm's saved input and statistics)
"""

from __future__ import annotations

import math

from recompute_bench.analysis.megatron.context_parallel import rank_tokens
from recompute_bench.analysis.megatron.fp8 import linear_input_bytes, runs_fp8
from recompute_bench.models import ELEMENT_BYTES, FP32_BYTES, INDEX_BYTES, MASK_BYTES
from recompute_bench.models.dense.spec import norm_parameters
from recompute_bench.config.schema import Config

ROUTINGS = ("balanced", "bound")
"""The routing assumptions: balanced (the estimate's) and bound (every token of the dispatch group
routed to this rank's experts)."""
INT32_BYTES = 4  # TE's fused permutation maps (row_id_map) are int32


def router_bytes(cfg: Config) -> int:
    """Bytes of one router logit or probability: --moe-router-dtype fp32 / fp64 (router.py
    Router.gating casts the logits; topk_routing_with_score_function returns probs `type_as(logits)`),
    else the activations'."""
    return {"fp32": FP32_BYTES, "fp64": 8}.get(cfg.model.moe_router_dtype or "", ELEMENT_BYTES[cfg.training.precision])


def expert_probs_bytes(cfg: Config) -> int:
    """Bytes of one probability the experts weight their rows by: the router's, except that DeepEP
    (the flex dispatcher) takes them in fp32 (`_DeepepManager.dispatch`: "DeepEP only supports float32
    probs") unless the router runs in fp64."""
    if cfg.model.moe_token_dispatcher_type == "flex" and cfg.model.moe_router_dtype != "fp64":
        return FP32_BYTES
    return router_bytes(cfg)


def local_tokens(cfg: Config) -> int:
    """Tokens a rank routes per micro-batch: its s/cp x b (`context_parallel.rank_tokens`), split
    over t under sequence parallelism."""
    par = cfg.parallel
    tokens = rank_tokens(cfg)
    return tokens // par.tensor_model_parallel_size if par.sequence_parallel else tokens


def dispatch_group(cfg: Config) -> int:
    """Ranks one dispatch spans, G = etp x ep (token_dispatcher.py: the `tp_ep_group`, expert tensor
    parallel x expert parallel)."""
    par = cfg.parallel
    return par.expert_tensor_parallel * par.expert_model_parallel_size


def local_experts(cfg: Config) -> int:
    """Routed experts on one rank: num_moe_experts / ep (moe_layer.py BaseMoELayer)."""
    return cfg.model.num_moe_experts // cfg.parallel.expert_model_parallel_size


def capacity(cfg: Config) -> int | None:
    """Rows one expert takes from one rank under a capacity factor (moe_utils.py get_capacity on the
    router's n x k routed copies: ceil(n x k / E x factor)); None: dropless."""
    m = cfg.model
    if m.moe_expert_capacity_factor is None:
        return None
    return math.ceil(local_tokens(cfg) * m.moe_router_topk / m.num_moe_experts * m.moe_expert_capacity_factor)


def routed_rows(cfg: Config, routing: str = "balanced") -> float:
    """Rows this rank's experts run per micro-batch (T). Balanced: every expert gets k / E of every
    rank's tokens, n x etp x k in all (the n x G gathered tokens x k x (E / ep) / E); bound: every
    token of the dispatch group routed to this rank, n x G x min(k, E / ep). A capacity factor caps each
    expert at its capacity from each of the G ranks; padded to capacity, exactly that."""
    m, n, g, e_local = cfg.model, local_tokens(cfg), dispatch_group(cfg), local_experts(cfg)
    k, etp = m.moe_router_topk, cfg.parallel.expert_tensor_parallel
    rows = n * etp * k if routing == "balanced" else n * g * min(k, e_local)
    cap = capacity(cfg)
    if cap is None:
        return rows
    per_source = min(cap, n)  # apply_router_token_dropping keeps every token when the capacity exceeds them
    if m.moe_pad_expert_input_to_capacity:
        return e_local * g * per_source
    return min(rows, e_local * g * per_source)


def sent_rows(cfg: Config) -> float:
    """Routed copies a rank permutes before the all-to-all and gets back after it (the alltoall
    dispatcher's `num_out_tokens`): n x k dropless (static, whatever the routing), E x capacity padded,
    at most E x capacity dropping (balanced routing fills every expert's capacity alike)."""
    m, n = cfg.model, local_tokens(cfg)
    rows, cap = n * m.moe_router_topk, capacity(cfg)
    if cap is None:
        return rows
    if m.moe_pad_expert_input_to_capacity:
        return m.num_moe_experts * cap
    return min(rows, m.num_moe_experts * min(cap, n))


def _router_saved(cfg: Config) -> dict[str, float]:
    """What the router keeps of one micro-batch (router.py TopKRouter.routing): the gating linear
    keeps its input (the norm's output, counted with the norm) and the weight; the score function and
    the top-k keep their outputs and indices, the aux losses their scores, token dropping its mask."""
    m = cfg.model
    n, e_all, k, r = local_tokens(cfg), m.num_moe_experts, m.moe_router_topk, router_bytes(cfg)
    out: dict[str, float] = {}
    balancing = m.moe_router_load_balancing_type
    if m.moe_z_loss_coeff:  # z_loss_func: logsumexp keeps the logits and its [n] result, square the result
        out["router.z_loss_logits"] = r * n * e_all
        out["router.z_loss_logsumexp"] = 2 * r * n
    if balancing == "sinkhorn":
        # sinkhorn_load_balancing: top-1 takes sigmoid(logits) (kept, the logits' dtype), top-k>1
        # softmax in fp32 (kept) cast back; `logits * map` keeps the bool routing map.
        out["router.sinkhorn_scores"] = (r if k == 1 else FP32_BYTES) * n * e_all
        out["router.routing_map"] = MASK_BYTES * n * e_all
    elif m.moe_router_score_function == "sigmoid":
        # sigmoid(logits.float()) keeps its fp32 output; top-k its indices; k > 1 normalises the top-k
        # scores by their sum (the division keeps both)
        out["router.sigmoid_scores"] = FP32_BYTES * n * e_all
        out["router.topk_indices"] = INDEX_BYTES * n * k
        if k > 1:
            out["router.topk_scores"] = FP32_BYTES * n * k
            out["router.score_sum"] = FP32_BYTES * n
    elif m.moe_router_pre_softmax:  # softmax over all experts in fp32 (kept), then the top-k's indices
        out["router.softmax_scores"] = FP32_BYTES * n * e_all
        out["router.topk_indices"] = INDEX_BYTES * n * k
    else:  # top-k of the logits (indices kept), softmax over the k in fp32 (output kept)
        out["router.topk_indices"] = INDEX_BYTES * n * k
        out["router.topk_softmax"] = FP32_BYTES * n * k
    if m.moe_expert_capacity_factor is not None:  # apply_router_token_dropping: probs x final_map
        out["router.capacity_mask"] = MASK_BYTES * n * e_all
    if balancing in ("aux_loss", "seq_aux_loss", "global_aux_loss") and m.moe_aux_loss_coeff:
        # compute_routing_scores_for_aux_loss: softmax in fp32 over all experts (sigmoid: its fp32
        # output and the normalising sum); switch_load_balancing_loss_func keeps [E]-sized sums only
        out["router.aux_loss_scores"] = FP32_BYTES * n * e_all
        if m.moe_router_score_function == "sigmoid":
            out["router.aux_loss_score_sum"] = FP32_BYTES * n
    return out


def _dispatcher_saved(cfg: Config, routing: str) -> dict[str, float]:
    """What the token dispatcher keeps of one micro-batch beside the experts' input
    (token_dispatcher.py; the permutations in moe_utils.py `permute` / `unpermute`, TE's fused ones in
    permutation.py)."""
    m, e = cfg.model, ELEMENT_BYTES[cfg.training.precision]
    n, g, e_local, e_all, r = local_tokens(cfg), dispatch_group(cfg), local_experts(cfg), m.num_moe_experts, router_bytes(cfg)
    rows, fused = routed_rows(cfg, routing), m.moe_permute_fusion
    kind = m.moe_token_dispatcher_type
    if kind == "allgather":
        gathered = n * g
        # dispatch_postprocess: `local_probs.T.contiguous().masked_select(local_map.T.contiguous())`
        # keeps the bool mask of the gathered tokens x local experts
        out = {"dispatcher.local_map": MASK_BYTES * gathered * e_local}
        if fused:  # fused_permute: TE's row_id_map [tokens, 2 x experts + 1], int32
            out["dispatcher.row_id_map"] = INT32_BYTES * gathered * (2 * e_local + 1)
        else:  # permute: index_select keeps sorted_indices
            out["dispatcher.sorted_indices"] = INDEX_BYTES * rows
        return out
    if kind == "flex":
        # MoEFlexTokenDispatcher with DeepEP: the fused dispatch keeps its handle; the received tokens
        # (one row per token and destination rank, at most the n x G of the group, the count taken
        # here) are permuted by local expert with fp32 probabilities and unpermuted without them
        # (`_DeepepManager.setup_metadata`: the top-k of the probabilities keeps its indices)
        received = n * g
        out = {"dispatcher.topk_indices": INDEX_BYTES * n * m.moe_router_topk}
        if fused:
            out["dispatcher.row_id_map"] = INT32_BYTES * received * (2 * e_local + 1)
        else:
            out["dispatcher.argsort"] = INDEX_BYTES * received * e_local
            out["dispatcher.sorted_indices"] = INDEX_BYTES * rows
        return out
    sent = sent_rows(cfg)
    # the combine all-to-all's output, which unpermute weights by the probabilities and keeps
    out = {"dispatcher.combined_tokens": e * sent * m.hidden_size}
    if fused:
        # fused_permute_with_probs keeps row_id_map; fused_unpermute its input (above), the map and
        # the [n, E] merging probabilities; fused_sort_chunks_by_index_with_probs a map per received row
        out["dispatcher.row_id_map"] = INT32_BYTES * n * (2 * e_all + 1)
        out["dispatcher.merging_probs"] = r * n * e_all
        if e_local > 1:
            out["dispatcher.chunk_sort_maps"] = 2 * INT32_BYTES * rows
        return out
    if m.moe_pad_expert_input_to_capacity:
        # permute (drop_and_pad): index_select keeps sorted_indices [E x capacity] and the probs'
        # indices_1D; unpermute builds indices_1D anew for its own index_select
        out["dispatcher.sorted_indices"] = INDEX_BYTES * sent
        out["dispatcher.probs_indices"] = 2 * INDEX_BYTES * sent
    else:
        # permute: `probs.T.contiguous().reshape(-1)[flat_sorted]` keeps flat_sorted, a view of the
        # whole [E x n] argsort; index_select keeps sorted_indices; unpermute's masked_select the map
        out["dispatcher.argsort"] = INDEX_BYTES * n * e_all
        out["dispatcher.sorted_indices"] = INDEX_BYTES * sent
        out["dispatcher.routing_map"] = MASK_BYTES * n * e_all
    out["dispatcher.permuted_probs"] = r * sent  # `permuted_tokens * permuted_probs` keeps both
    return out


def _experts_saved(cfg: Config, routing: str, modules: set[str]) -> dict[str, float]:
    """What the routed experts keep (experts.py TEGroupedMLP.forward, SequentialMLP.forward, each
    expert an MLP): fc1 keeps its input (TE GroupedLinear saves split views of it), the activation fc1's
    output and the probabilities, fc2 its input. GeLU (unfused: TEGroupedMLP refuses the bias-GeLU
    fusion) keeps its output for the probabilities' product, whose result fc2 keeps; the fused weighted
    SwiGLU (WeightedSwiGLUFunction) keeps fc1's output and the probabilities. `moe_act` recompute
    (TEGroupedMLP, CheckpointWithoutOutput) keeps fc1's output and the probabilities and frees the rest."""
    m, e = cfg.model, ELEMENT_BYTES[cfg.training.precision]
    rows, f = routed_rows(cfg, routing), m.moe_ffn / cfg.parallel.expert_tensor_parallel
    swiglu = m.activation == "swiglu"
    # Under FP8 TE's GroupedLinear quantizes each expert's split of its input and keeps only the
    # column-wise data for the weight gradient (grouped_linear.py `_GroupedLinear.forward`:
    # `update_usage(rowwise_usage=False, columnwise_usage=True)`), as a Linear does: `linear_input_bytes`
    out = {"experts.linear_fc1.input": linear_input_bytes(cfg, rows * m.hidden_size, m.hidden_size),
           "experts.linear_fc1.output": e * rows * f * (2 if swiglu else 1),
           "experts.probs": expert_probs_bytes(cfg) * rows}
    if "moe_act" in modules and m.moe_grouped_gemm:
        # fc2 keeps the activation's output it was given (experts.py `set_save_original_input` under
        # FP8), which CheckpointWithoutOutput drops and rebuilds
        return out
    if not swiglu:
        out["experts.activation_output"] = e * rows * f
    out["experts.linear_fc2.input"] = linear_input_bytes(cfg, rows * f, int(f))
    return out


def _shared_saved(cfg: Config, modules: set[str]) -> dict[str, float]:
    """What the shared experts keep (shared_experts.py SharedExpertMLP, a dense MLP of width
    moe_shared_expert_intermediate_size over the tensor-parallel group): fc1 keeps its sequence-parallel
    input, the norm's output the router keeps too, except under overlap, which gathers it first
    (`pre_forward_comm`); fc1's output and fc2's input as in a dense MLP; the gate keeps the output it
    scales and its sigmoid. `shared_experts` recompute keeps the input only. Under FP8 its TE linears
    keep their own quantized inputs (`fp8.linear_input_bytes`): fc1 an FP8 copy of the norm's output
    beside the router's 16-bit one."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    if not m.moe_shared_expert_intermediate_size or "shared_experts" in modules:
        return {}
    e, t = ELEMENT_BYTES[tr.precision], par.tensor_model_parallel_size
    tokens, width, h = rank_tokens(cfg), m.moe_shared_expert_intermediate_size, m.hidden_size
    fp8 = runs_fp8(cfg)
    out = {}
    if m.moe_shared_expert_overlap and par.sequence_parallel:
        # fc1 is handed the gathered input: in 16 bits it keeps it, under FP8 its quantized copy
        out["shared_experts.gathered_input"] = linear_input_bytes(cfg, tokens * h, h)
    elif fp8:
        # TE's Linear quantizes the norm's output (the router keeps the 16-bit one): under sequence
        # parallel with per-tensor FP8 its local shard's row-wise data, else column-wise (linear.py)
        out["shared_experts.linear_fc1.input"] = linear_input_bytes(cfg, local_tokens(cfg) * h, h,
                                                                    gathered=par.sequence_parallel)
    out["shared_experts.linear_fc1.output"] = e * tokens * width * (2 if m.activation == "swiglu" else 1) / t
    out["shared_experts.linear_fc2.input"] = linear_input_bytes(cfg, tokens * width / t, width // t)
    if m.moe_shared_expert_gate:
        out["shared_experts.gated_output"] = e * local_tokens(cfg) * m.hidden_size
        out["shared_experts.gate_score"] = e * local_tokens(cfg)
    return out


def moe_saved_bytes(cfg: Config, modules=(), routing: str = "balanced") -> dict[str, float]:
    """Bytes one MoE layer's MLP part keeps for backward, one micro-batch on one rank, storage by
    storage: pre_mlp_layernorm (its input and statistics, and its output, which the router's gating
    linear keeps), the router, the dispatcher, the routed and the shared experts. Selective recompute:
    `moe` (moe_layer.py checkpoints the whole block: its input, the norm's output, is all it keeps),
    `moe_act`, `shared_experts`, `layernorm` (transformer_layer.py recomputes the MoE layer's own
    pre_mlp_layernorm: input kept, statistics and output dropped)."""
    m, e = cfg.model, ELEMENT_BYTES[cfg.training.precision]
    mods = set(modules)
    n, h = local_tokens(cfg), m.hidden_size
    stats = cfg.spec.norm_stats_bytes(cfg, "cuda", n)
    out = {"pre_mlp_layernorm.input": e * n * h}
    if "layernorm" not in mods:
        out["pre_mlp_layernorm.norm_stats"] = stats
        out["pre_mlp_layernorm.output"] = e * n * h
    if "moe" in mods:  # the checkpoint keeps its input, the norm's output (dropped too under layernorm)
        return out
    out.update(_router_saved(cfg))
    out.update(_dispatcher_saved(cfg, routing))
    out.update(_experts_saved(cfg, routing, mods))
    out.update(_shared_saved(cfg, mods))
    return out


def moe_backward_bytes(cfg: Config, routing: str = "balanced") -> float:
    """What a MoE layer's backward holds beyond the saved tensors where its largest gradients meet:
    the routed experts' fc2 data gradient [T, f / etp] and the activation's gradient of fc1's output
    (2 x f / etp for SwiGLU), in 16 bits; the shared experts' pair where it is larger."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    e = ELEMENT_BYTES[tr.precision]
    width = 3 if m.activation == "swiglu" else 2
    routed = e * routed_rows(cfg, routing) * width * m.moe_ffn / par.expert_tensor_parallel
    shared = e * rank_tokens(cfg) * width * (m.moe_shared_expert_intermediate_size or 0) / \
        par.tensor_model_parallel_size
    return max(routed, shared)


def allgather_buffer_bytes(cfg: Config) -> float:
    """The allgather dispatcher's gathered tokens, [n x G, h] in 16 bits, taken from Megatron's global
    memory buffer (`gather_from_sequence_parallel_region(..., use_global_buffer=True)`, name "mpu"),
    which keeps it for the whole run; 0 for the other dispatchers or without communication."""
    m = cfg.model
    if not m.num_moe_experts or m.moe_token_dispatcher_type != "allgather" or dispatch_group(cfg) == 1:
        return 0.0
    return ELEMENT_BYTES[cfg.training.precision] * local_tokens(cfg) * dispatch_group(cfg) * m.hidden_size


def moe_layer_parameters(cfg: Config) -> dict[str, float]:
    """One MoE layer's MLP part on one rank, by the group that reduces and shards its gradients:
    "dense" (pre_mlp_layernorm, the router's [E, h] weight, the shared experts over tp and their gate,
    reduced over dp) and "expert" (E / ep routed experts, each fc1 [f (x2 SwiGLU) / etp, h] and fc2
    [h, f / etp], reduced and sharded over the expert-data-parallel group)."""
    m, par = cfg.model, cfg.parallel
    h, widths = m.hidden_size, (3 if m.activation == "swiglu" else 2)
    norm = norm_parameters(cfg, h)
    shared = widths * h * (m.moe_shared_expert_intermediate_size or 0) / par.tensor_model_parallel_size
    gate = h if m.moe_shared_expert_gate and m.moe_shared_expert_intermediate_size else 0
    experts = local_experts(cfg) * widths * h * m.moe_ffn / par.expert_tensor_parallel
    return {"dense": norm + m.num_moe_experts * h + shared + gate, "expert": experts}


def routing_spread(cfg: Config) -> dict[str, float]:
    """The experts' rows per micro-batch under each routing assumption, for the report."""
    return {routing: routed_rows(cfg, routing) for routing in ROUTINGS}
