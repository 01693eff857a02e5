"""The `recompute-bench` command line."""

from recompute_bench.cli.app import main, run_performance_workload

__all__ = ["main", "run_performance_workload"]
