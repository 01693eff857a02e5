"""Result records, the append-only store and the pandas frame."""

from recompute_bench.results.rows import load_results

__all__ = ["load_results"]
