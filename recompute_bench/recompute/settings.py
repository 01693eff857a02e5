"""The Megatron settings a sweep, `verify` and `estimate` enumerate, written once. Pure Python."""

from __future__ import annotations

from itertools import combinations
from typing import Iterable

from recompute_bench.config.schema import RecomputeConfig
from recompute_bench.config.choices import SUPPORTED_RECOMPUTE_MODULES
from recompute_bench.config.labels import canonical_modules


def selective_settings(modules: Iterable[str] = SUPPORTED_RECOMPUTE_MODULES) -> list[RecomputeConfig]:
    """Every non-empty subset of `modules` as a selective setting: smallest subsets first, modules
    in Megatron's order (a, b, c, a+b, a+c, b+c, a+b+c)."""
    named = canonical_modules(list(modules))
    return [RecomputeConfig("selective", list(c)) for k in range(1, len(named) + 1) for c in combinations(named, k)]


def full_settings(methods: Iterable[str], counts: Iterable[int]) -> list[RecomputeConfig]:
    """Every full setting method x N, method-major, duplicates dropped."""
    return [RecomputeConfig("full", method=m, num_layers=n) for m in dict.fromkeys(methods) for n in dict.fromkeys(counts)]


def all_settings(num_layers: int, modules: Iterable[str] = SUPPORTED_RECOMPUTE_MODULES) -> list[RecomputeConfig]:
    """What `verify` checks and a flagless sweep measures: each selective subset, and full uniform
    and block with N in {1, 2, L-1, L} (those within 1..L)."""
    counts = sorted({n for n in (1, 2, num_layers - 1, num_layers) if 1 <= n <= num_layers})
    return selective_settings(modules) + full_settings(("uniform", "block"), counts)
