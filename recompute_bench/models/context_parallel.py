"""The sequence split of context parallel, shared by this harness (which runs it) and the estimates
of both frameworks (which count it). Pure Python.

Megatron splits each sequence into 2 x cp equal chunks and gives context-parallel rank r chunks r and
2cp - 1 - r (megatron/core/utils.py `get_batch_on_this_cp_rank`; Transformer Engine's
`get_cu_seqlens_on_cp_rank` assumes the same order). Under a causal mask chunk i attends to i + 1
chunks, so each rank's pair attends to (r + 1) + (2cp - r) = 2cp + 1 chunks: the work is even.
"""

from __future__ import annotations


def chunk_count(cp: int) -> int:
    """How many chunks a sequence is cut into: 2 x cp (one chunk when cp is 1)."""
    return 2 * cp if cp > 1 else 1


def chunk_length(seq_length: int, cp: int) -> int:
    """Tokens of one chunk: s / 2cp (s when cp is 1)."""
    return seq_length // chunk_count(cp)


def rank_chunks(cp_rank: int, cp: int) -> tuple[int, ...]:
    """The chunk indices context-parallel rank `cp_rank` holds, in sequence order: (r, 2cp - 1 - r)."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"context-parallel rank {cp_rank} outside 0..{cp - 1}")
    return (0,) if cp == 1 else (cp_rank, 2 * cp - 1 - cp_rank)


def rank_positions(seq_length: int, cp_rank: int, cp: int) -> list[int]:
    """The positions (token indices in the whole sequence) rank `cp_rank` holds, in order."""
    n = chunk_length(seq_length, cp)
    return [c * n + i for c in rank_chunks(cp_rank, cp) for i in range(n)]


def local_seq_length(seq_length: int, cp: int) -> int:
    """Tokens of a sequence on one context-parallel rank: s / cp."""
    return seq_length // cp


def causal_key_chunks(cp_rank: int, cp: int) -> int:
    """Key chunks the rank's queries attend to under a causal mask, summed over its two chunks:
    chunk i sees chunks 0..i, so (r + 1) + (2cp - r) = 2cp + 1 for every rank."""
    return sum(c + 1 for c in rank_chunks(cp_rank, cp))


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
