"""Framework recompute-bench: what this harness's own layers keep and a rank of it holds, exact
against its saved-tensor probe on CPU (`layer.py` one layer, `stage.py` a pipeline stage, `rank.py`
the whole rank), `estimate` and `plan` for it (`planner.py`), the per-layer policy solver of `plan
--auto` (`auto.py`) with its measured costs (`profile_costs.py`), and context parallel over a GPU
count (`cp_plan.py`). Pure Python; Megatron's counterpart is `analysis.megatron`."""
