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

A layout (`layout_pasteable`, what `plan --search-layouts` prints beside the setting) in the same
four spellings: Megatron-LM's --tensor-model-parallel-size, --pipeline-model-parallel-size,
--num-virtual-stages-per-pipeline-rank, --context-parallel-size, --expert-model-parallel-size,
--micro-batch-size, --sequence-parallel, --use-distributed-optimizer (arguments.py); Bridge's model
provider fields, `cfg.train.micro_batch_size` and the distributed optimizer on `cfg.ddp` and
`cfg.optimizer` (Bridge checks that the two agree); its performance script's -ng, -tp, -pp, -vp,
-cp, -ep and -mb (scripts/performance/argument_parser.py), Hydra overrides for the rest; NeMo 2.0's
MegatronStrategy fields on `recipe.trainer.strategy`, `recipe.data.micro_batch_size` and
`recipe.optim.config.use_distributed_optimizer`. DDP's overlaps and bucket size, where set:
--overlap-grad-reduce, --overlap-param-gather, --ddp-bucket-size; `cfg.ddp` and `cfg.comm_overlap`
(`bucket_size`) for Bridge; `recipe.trainer.strategy.ddp` for NeMo 2.0. The interleaved schedule's
overlap_p2p_comm where turned off: --no-overlap-p2p-communication; `cfg.comm_overlap` for Bridge
(CommOverlapConfig.setup turns it on for virtual stages unless stated); the model config for NeMo 2.0
(a recipe's MegatronCommOverlapCallback takes overlap_p2p_comm=False instead).
"""

from __future__ import annotations

from typing import Any

from recompute_bench.config.schema import Config, RecomputeConfig
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


def _layout_fields(cfg: Config) -> dict[str, Any]:
    """The parallel fields of cfg's layout, in Megatron's names. Every one is written for Bridge,
    its performance script and NeMo, whose recipes set their own (a 70B recipe's context parallel,
    virtual stages); Megatron-LM's command line leaves out those at Megatron's default."""
    par = cfg.parallel
    return {"tensor_model_parallel_size": par.tensor_model_parallel_size,
            "pipeline_model_parallel_size": par.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": par.virtual_pipeline_model_parallel_size,
            "context_parallel_size": par.context_parallel_size,
            "expert_model_parallel_size": par.expert_model_parallel_size,
            "sequence_parallel": par.sequence_parallel}


MEGATRON_LAYOUT_DEFAULTS = {"virtual_pipeline_model_parallel_size": None, "context_parallel_size": 1,
                            "expert_model_parallel_size": 1, "sequence_parallel": False}
"""arguments.py's defaults of the layout's arguments, which a Megatron-LM command line leaves out."""


def layout_pasteable(cfg: Config) -> dict[str, list[str]]:
    """cfg's parallel layout, micro-batch size and distributed optimizer in each framework's words
    (the keys of `pasteable`); the GPU count is cfg's world size."""
    fields = _layout_fields(cfg)
    mbs, dist = cfg.training.micro_batch_size, cfg.parallel.use_distributed_optimizer
    lm_names = {"virtual_pipeline_model_parallel_size": "num_virtual_stages_per_pipeline_rank"}
    lm: list[str] = []
    for name, value in fields.items():
        if name in MEGATRON_LAYOUT_DEFAULTS and value == MEGATRON_LAYOUT_DEFAULTS[name]:
            continue
        flag = "--" + lm_names.get(name, name).replace("_", "-")
        lm += [flag] if value is True else [flag, str(value)]
    lm += ["--micro-batch-size", str(mbs)] + (["--use-distributed-optimizer"] if dist else [])
    bridge = [f"cfg.model.{k} = {_python(v)}" for k, v in fields.items()]
    bridge += [f"cfg.train.micro_batch_size = {mbs}", f"cfg.ddp.use_distributed_optimizer = {dist}",
               f"cfg.optimizer.use_distributed_optimizer = {dist}"]
    short = {"tensor_model_parallel_size": "-tp", "pipeline_model_parallel_size": "-pp",
             "virtual_pipeline_model_parallel_size": "-vp", "context_parallel_size": "-cp",
             "expert_model_parallel_size": "-ep"}
    perf = ["-ng", str(cfg.parallel.world_size)]
    for name, value in fields.items():  # -vp None: the script's own default (-1) keeps the recipe's
        perf += [short[name], str(value)] if name in short else [f"model.{name}={str(value).lower()}"]
    perf += ["-mb", str(mbs), f"ddp.use_distributed_optimizer={str(dist).lower()}",
             f"optimizer.use_distributed_optimizer={str(dist).lower()}"]
    nemo = [f"recipe.trainer.strategy.{k} = {_python(v)}" for k, v in fields.items()]
    nemo += [f"recipe.data.micro_batch_size = {mbs}", f"recipe.optim.config.use_distributed_optimizer = {dist}"]
    for name, value in _ddp_fields(cfg).items():
        lm += ["--" + name.replace("_", "-")] + ([] if value is True else [str(value)])
        key = "bucket_size" if name == "ddp_bucket_size" else name
        bridge += [f"cfg.ddp.{key} = {_python(value)}", f"cfg.comm_overlap.{key} = {_python(value)}"]
        perf += [f"ddp.{key}={str(value).lower()}", f"comm_overlap.{key}={str(value).lower()}"]
        nemo += [f"recipe.trainer.strategy.ddp.{key} = {_python(value)}"]
    if cfg.parallel.interleaved and cfg.parallel.overlap_p2p_comm is False:
        # Megatron-LM pairs batch_p2p_comm with it (argument_utils.py: not overlap_p2p_comm); Bridge's and
        # NeMo's comm-overlap setup would turn overlap on for virtual stages unless told (comm_overlap.py)
        lm += ["--no-overlap-p2p-communication"]
        bridge += ["cfg.comm_overlap.overlap_p2p_comm = False", "cfg.comm_overlap.batch_p2p_comm = True"]
        perf += ["comm_overlap.overlap_p2p_comm=false", "comm_overlap.batch_p2p_comm=true"]
        nemo += ["recipe.model.config.overlap_p2p_comm = False", "recipe.model.config.batch_p2p_comm = True"]
    return {"megatron_lm": lm, "bridge": bridge, "bridge_perf_script": perf, "nemo2": nemo}


def _ddp_fields(cfg: Config) -> dict[str, Any]:
    """DDP's overlap and bucket fields where set (Megatron-LM's names): --overlap-grad-reduce,
    --overlap-param-gather, --ddp-bucket-size. Bridge reads them from `cfg.ddp`, and under the
    distributed optimizer `CommOverlapConfig.setup` writes its own over them unless `cfg.comm_overlap`
    states them (comm_overlap.py `_get_optimizer_overlap_cfgs`, `_override_user_cfgs`): both are written."""
    par = cfg.parallel
    out: dict[str, Any] = {}
    if par.overlap_grad_reduce:
        out["overlap_grad_reduce"] = True
    if par.overlap_param_gather:
        out["overlap_param_gather"] = True
    if par.ddp_bucket_size is not None:
        out["ddp_bucket_size"] = par.ddp_bucket_size
    return out


def run_pasteable(cfg: Config) -> dict[str, list[str]]:
    """cfg's layout and its recompute setting together, by framework (`layout_pasteable` then `pasteable`)."""
    layout, setting = layout_pasteable(cfg), pasteable(cfg.recompute)
    return {key: layout[key] + setting[key] for key in layout}
