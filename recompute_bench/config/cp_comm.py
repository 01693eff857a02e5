"""cp_comm_type's words: the context-parallel exchange each layer's attention runs (Megatron's
--cp-comm-type, one type or one per layer, and --hierarchical-context-parallel-sizes)."""

from __future__ import annotations


def layer_comm_types(cp_comm_type: str, num_layers: int) -> list[str]:
    """The --cp-comm-type of each layer: one type for every layer, or one per layer written in
    order (Megatron's TransformerConfig.cp_comm_type list, which transformer_layer.py indexes by
    layer_number - 1). Words may be separated by spaces or commas."""
    types = cp_comm_type.replace(",", " ").split()
    return types * num_layers if len(types) == 1 else types


def comm_levels(comm_type: str, cp: int, hierarchical: list[int] | None) -> tuple[str, int, int]:
    """What a layer's attention runs under context parallel: (kind, a2a ranks, K/V ranks), the
    ranks over which the all-to-all spreads the heads and those whose keys and values a rank visits.

    a2a spreads the heads over all cp ranks (Transformer Engine's AttnFuncWithCPAndQKVOA2A); p2p
    passes K/V around a ring of cp ranks (AttnFuncWithCPAndKVP2P); all_gather gathers K/V from all
    (AttnFuncWithCPAndKVAllGather); a2a+p2p runs the all-to-all over the first level of
    `hierarchical` and the ring over the second (Megatron passes both groups), and
    `attn_forward_func_with_cp` runs plain p2p or a2a when one level has a single rank."""
    if comm_type == "a2a":
        return "a2a", cp, 1
    if comm_type != "a2a+p2p":
        return comm_type, 1, cp
    a2a, ring = hierarchical
    if a2a == 1:
        return "p2p", 1, ring
    if ring == 1:
        return "a2a", a2a, 1
    return "a2a+p2p", a2a, ring
