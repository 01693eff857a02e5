"""Megatron's token dropping as arithmetic (pure Python): how many routed rows one expert may run
under a capacity factor, and how many the experts run in all.

Both the torch model (`layers.py`, which drops the copies over capacity) and the spec (`spec.py`,
which counts what the experts keep) ask this module, so neither imports the other for it.
"""

from __future__ import annotations

import math

from recompute_bench.config.schema import ModelConfig


def expert_capacity(tokens: int, topk: int, experts: int, factor: float) -> int:
    """Routed rows one expert may run under a capacity factor: Megatron's get_capacity,
    ceil(tokens x top-k / experts x factor)."""
    return math.ceil(tokens * topk / experts * factor)


def routed_rows(m: ModelConfig, tokens: int) -> int:
    """Rows the experts run for `tokens` tokens: tokens x k dropless (any routing); with a capacity
    factor min(tokens x k, experts x capacity), which assumes every expert receives at least its
    capacity (uniform routing with a factor of at most 1; exact for any routing that fills them)."""
    rows = tokens * m.moe_router_topk
    if m.moe_expert_capacity_factor is None:
        return rows
    return min(rows, m.num_moe_experts * expert_capacity(tokens, m.moe_router_topk, m.num_moe_experts,
                                                         m.moe_expert_capacity_factor))
