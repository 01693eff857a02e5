"""A recompute setting as each framework that runs Megatron's models spells it, ready to paste:
Megatron-LM's command line, Megatron Bridge's config overrides and its performance script's flags,
and NeMo 2.0's recipe fields.

- Megatron-LM (megatron/training/arguments.py; the TransformerConfig fields as flags):
  `--recompute-granularity`, `--recompute-modules`, `--recompute-method`, `--recompute-num-layers`,
  `--distribute-saved-activations`, `--cpu-offloading --cpu-offloading-num-layers N`,
  `--fine-grained-activation-offloading --offload-modules a b` (`recompute.policy.megatron_flags`,
  which the harness's plans print too).
- Megatron Bridge: the same fields on the model provider, `cfg.model.<field>`. Its performance
  script (scripts/performance, utils/overrides.py `_set_recompute_overrides`) has three flags:
  `--recompute_modules a,b` (selective), `-rl N` (full, method hard-wired to block) and `-ol N`
  (CPU offload); everything else goes as Hydra overrides (`model.recompute_method=uniform`).
  Bridge's recipes leave `recompute_modules` unset and Megatron Core then reads ["core_attn"], so
  "no recompute" sets it to [] explicitly (Bridge PR #3470).
- NeMo 2.0: the fields of Megatron Core's TransformerConfig on the recipe's model config,
  `recipe.model.config.<field>` (NeMo 1.x's `activations_checkpoint_*` names are not written).
"""

from __future__ import annotations

from typing import Any

from recompute_bench.config.schema import RecomputeConfig
from recompute_bench.recompute.policy import megatron_flags


def _fields(r: RecomputeConfig) -> dict[str, Any]:
    """The TransformerConfig fields the setting sets, in Megatron's names (None: unset)."""
    if r.granularity == "selective":
        out: dict[str, Any] = {"recompute_granularity": "selective", "recompute_modules": list(r.modules)}
    elif r.granularity == "full":
        out = {"recompute_granularity": "full", "recompute_method": r.method, "recompute_num_layers": r.num_layers}
        if r.distribute_saved_activations:
            out["distribute_saved_activations"] = True
    else:
        out = {"recompute_granularity": None, "recompute_modules": []}
    if r.activation_offload_layers:
        out.update({"cpu_offloading": True, "cpu_offloading_num_layers": r.activation_offload_layers,
                    "cpu_offloading_activations": True, "cpu_offloading_weights": False})
    if r.fine_grained_activation_offloading:
        out.update({"fine_grained_activation_offloading": True, "offload_modules": list(r.offload_modules)})
    return out


def _python(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_python(v) for v in value) + "]"
    return repr(value)


def bridge_overrides(r: RecomputeConfig) -> list[str]:
    """Megatron Bridge's config overrides for `r`, one Python statement each."""
    return [f"cfg.model.{k} = {_python(v)}" for k, v in _fields(r).items()]


def bridge_perf_script(r: RecomputeConfig) -> list[str]:
    """Megatron Bridge's performance script (run_script.py / setup_experiment.py): its own flags
    where one exists, Hydra overrides for the rest (fine-grained offloading has no flag of its own)."""
    offload = (["model.fine_grained_activation_offloading=true",
                "model.offload_modules=[" + ",".join(r.offload_modules) + "]"]
               if r.fine_grained_activation_offloading else [])
    return _perf_recompute(r) + offload


def _perf_recompute(r: RecomputeConfig) -> list[str]:
    if r.granularity == "selective":
        return ["--recompute_modules", ",".join(r.modules)] if r.modules else \
            ["model.recompute_granularity=selective", "model.recompute_modules=[]"]
    if r.granularity == "full" and r.method == "block" and not r.distribute_saved_activations:
        return ["-rl", str(r.num_layers)]
    if r.granularity == "full":
        out = ["model.recompute_granularity=full", f"model.recompute_method={r.method}",
               f"model.recompute_num_layers={r.num_layers}"]
        return out + (["model.distribute_saved_activations=true"] if r.distribute_saved_activations else [])
    if r.activation_offload_layers:
        return ["-ol", str(r.activation_offload_layers)]
    return ["model.recompute_granularity=null", "model.recompute_modules=[]"]


def nemo2(r: RecomputeConfig) -> list[str]:
    """NeMo 2.0's recipe fields for `r`."""
    return [f"recipe.model.config.{k} = {_python(v)}" for k, v in _fields(r).items()]


def pasteable(r: RecomputeConfig) -> dict[str, list[str]]:
    """Every spelling of `r`, by framework (the keys `plan --json` carries)."""
    return {"megatron_lm": megatron_flags(r), "bridge": bridge_overrides(r), "bridge_perf_script": bridge_perf_script(r),
            "nemo2": nemo2(r)}
