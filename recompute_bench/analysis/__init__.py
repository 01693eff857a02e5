"""The analytical model, pure Python (no torch): what a rank holds and how long a step takes,
predicted for a named framework.

Two frameworks side by side, one folder each:

- `harness/`: this harness's own layers, exact against its saved-tensor probe on CPU (`layer.py`,
  `stage.py`, `rank.py`), its `estimate` and `plan` (`planner.py`), the per-layer solver of `plan
  --auto` (`auto.py`), context parallel over a GPU count (`cp_plan.py`), measured costs
  (`profile_costs.py`);
- `megatron/`: Megatron-LM as it runs, term by term from its code (one module per concern), its
  `estimate`, its `plan` and the time model that prices it.

What both share lives here: the FLOPs (`flops.py`, Megatron's formula and the kernels' count), the
paper's formulas (`paper.py`), a full-recompute checkpoint's input (`checkpoint.py`), the allocator
allowance (`allowance.py`), the GPU kinds' rates (`gpu_rates.py`), and the pipeline schedules as a
stage's order of work: Megatron's (`megatron_schedule.py`, which both estimates follow for 1F1B and
the interleaved schedule) and torch.distributed.pipelining's (`pipelining_schedule.py`). A third
framework is one more folder beside the two.
"""

ESTIMATE_SCHEMA = "recompute-bench/estimate/v1"
"""The version of `estimate --json`'s layout, for both frameworks."""
