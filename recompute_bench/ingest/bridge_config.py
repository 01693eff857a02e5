"""Megatron Bridge's run configuration: the `ConfigContainer` YAML Bridge writes
(src/megatron/bridge/training/config.py `ConfigContainer`, serialised by Megatron-LM's
megatron/training/config/container.py `ConfigContainerBase.to_yaml`: `yaml.safe_dump` of `to_dict()`,
every dataclass with its `_target_`; the file `logger.save_config_filepath` names, the checkpoint's
`run_config.yaml`, or a perf script's `--dryrun` dump), read with PyYAML at Megatron-Bridge 067f987d.

Its sections hold Megatron Core's own config objects, so their fields are Megatron's names:

- `model`: the GPT model config, flat (`GPTModelProvider`: TransformerConfig's fields beside the
  model's `vocab_size`, `seq_length`, `position_embedding_type`, ...) or builder-backed
  (`BridgeGPTModelConfig`: the model's fields with TransformerConfig's under `transformer`);
- `mixed_precision`: a `MixedPrecisionConfig` or a recipe's name (`bf16_mixed`), which Bridge copies
  onto the model, optimizer and DDP configs at setup (training/mixed_precision.py
  `update_config_with_precision_overrides`: every field the target has);
- `comm_overlap`: `CommOverlapConfig` (tensor-parallel overlap, deferred embedding weight gradient,
  the data-parallel size once set), applied to the model at setup;
- `ddp` (DistributedDataParallelConfig), `optimizer` (OptimizerConfig), `train` (batch sizes),
  `dataset` (sequence length), `tokenizer` (vocabulary), `rng` (seed), `peft`, `env_vars`.

Values Megatron's YAML representers wrote as mappings (megatron/training/config/yaml_utils.py) are
read back as text: a torch dtype `{_target_: torch.bfloat16, _call_: false}` as `torch.bfloat16`,
an enum `{_target_: ...AttnBackend, _name_: auto, ...}` as `auto`, a function
`{_target_: torch.nn.functional.silu, _call_: false}` as `silu`. The result is Megatron-LM's
argument names (`megatron_args`): Bridge's own spellings are mapped where Megatron-LM's argument is
another word (`gated_linear_unit` is `--swiglu`, `num_moe_experts` is `--num-experts`, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recompute_bench.ingest.parsed import ParsedRun, bad

FORMAT = "bridge-config"
TARGET = "ConfigContainer"
# Bridge's (TransformerConfig's, GPTModelProvider's) field -> Megatron-LM's argument, where they differ
# (megatron/training/arguments.py core_transformer_config_from_args and Megatron-Bridge
# scripts/translate_mlm_to_bridge.py pair them).
SPELLINGS = {"gated_linear_unit": "swiglu", "layernorm_epsilon": "norm_epsilon", "num_moe_experts": "num_experts",
             "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
             "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
             "fp8_param": "fp8_param_gather", "fp4_param": "fp4_param_gather"}
# MixedPrecisionConfig fields Bridge copies onto the model, optimizer and DDP configs.
PRECISION_FIELDS = ("fp16", "bf16", "params_dtype", "fp8", "fp8_recipe", "fp8_param", "first_last_layers_bf16",
                    "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "fp8_dot_product_attention",
                    "fp8_multi_head_attention", "fp4", "fp4_recipe", "fp4_param", "grad_reduce_in_fp32")
# Bridge's registered mixed-precision recipes (training/mixed_precision.py, `@register`), by name,
# with the fields each sets: what `mixed_precision: bf16_mixed` means.
_BF16 = {"bf16": True, "params_dtype": "torch.bfloat16", "grad_reduce_in_fp32": True}
_FP16 = {"fp16": True, "params_dtype": "torch.float16", "grad_reduce_in_fp32": False}
PRECISION_RECIPES = {
    "bf16_mixed": _BF16,
    "fp16_mixed": _FP16,
    "bf16_with_fp8_delayed_scaling_mixed": {**_BF16, "fp8": "hybrid", "fp8_recipe": "delayed", "fp8_param": True},
    "fp16_with_fp8_delayed_scaling_mixed": {**_FP16, "fp8": "hybrid", "fp8_recipe": "delayed", "fp8_param": True},
    "bf16_with_mxfp8_mixed": {**_BF16, "fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param": True},
    "fp16_with_mxfp8_mixed": {**_FP16, "fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param": True},
    "bf16_with_fp8_current_scaling_mixed": {**_BF16, "fp8": "hybrid", "fp8_recipe": "tensorwise", "fp8_param": True,
                                            "first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 1,
                                            "num_layers_at_end_in_bf16": 1},
    "fp16_with_fp8_current_scaling_mixed": {**_FP16, "fp8": "hybrid", "fp8_recipe": "tensorwise", "fp8_param": True,
                                            "first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 1,
                                            "num_layers_at_end_in_bf16": 1},
    "bf16_with_fp8_subchannel_scaling_mixed": {**_BF16, "fp8": "hybrid", "fp8_recipe": "blockwise", "fp8_param": False},
    "fp16_with_fp8_subchannel_scaling_mixed": {**_FP16, "fp8": "hybrid", "fp8_recipe": "blockwise", "fp8_param": False},
}


def detect_yaml(data: Any) -> bool:
    """Whether parsed YAML is a ConfigContainer (its `_target_` names the class)."""
    return isinstance(data, dict) and str(data.get("_target_", "")).rsplit(".", 1)[-1] == TARGET


def plain(value: Any) -> Any:
    """A value as Megatron's YAML representers wrote it, as Megatron-LM's arguments hold it: a dtype,
    enum or function mapping becomes its name; lists and other values stay."""
    if isinstance(value, dict) and "_target_" in value:
        if "_name_" in value:  # an enum: _enum_representer
            return value["_name_"]
        target = str(value["_target_"])
        if target.startswith("torch.") and value.get("_call_") is False and target.count(".") == 1:
            return target  # a dtype: torch.bfloat16
        return target.rsplit(".", 1)[-1]  # a function: torch.nn.functional.silu -> silu
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def _lines(node, prefix: str = "") -> dict[str, int]:
    """"section.key.subkey" -> the line (from 1) of that key, for every mapping key of a composed document."""
    out: dict[str, int] = {}
    for key, value in getattr(node, "value", None) or []:
        if not hasattr(key, "value") or not isinstance(key.value, str):
            continue
        name = f"{prefix}{key.value}"
        out[name] = key.start_mark.line + 1
        if type(value).__name__ == "MappingNode":
            out.update(_lines(value, name + "."))
    return out


class _Arguments:
    """Megatron arguments being collected, each with the file's key it came from."""

    def __init__(self, lines: dict[str, int]) -> None:
        self.values: dict[str, Any] = {}
        self.keys: dict[str, str] = {}
        self.lines = lines

    def set(self, name: str, value: Any, key: str, said: Any = None) -> None:
        """Megatron argument `name` is `value`, read at the file's `key`, where the file says `said`
        (`value` when None). None is left out: a field Bridge leaves unset takes its default, as a
        Megatron-LM argument left out does."""
        if value is None:
            self.values.pop(name, None)
            self.keys.pop(name, None)
            return
        self.values[name] = plain(value)
        shown = plain(value if said is None else said)
        shown = str(shown).lower() if isinstance(shown, bool) else shown
        self.keys[name] = (key, f"{key}: {shown}")

    def where(self) -> dict[str, int]:
        return {name: self.lines[key] for name, (key, _) in self.keys.items() if key in self.lines}

    def words(self) -> dict[str, str]:
        """Each argument as the file says it: "model.transformer.num_layers: 80"."""
        return {name: said for name, (_, said) in self.keys.items()}


def _section(data: dict, name: str) -> dict:
    value = data.get(name)
    return value if isinstance(value, dict) else {}


def _precision(path: Path, data: dict, lines: dict[str, int]) -> dict[str, Any]:
    """The fields `mixed_precision` sets (a MixedPrecisionConfig, or a registered recipe's name),
    fp8_param taken from fp8_param_gather where it is None (MixedPrecisionConfig.finalize)."""
    value = data.get("mixed_precision")
    if value is None:
        return {}
    if isinstance(value, str):
        recipe = PRECISION_RECIPES.get(value.replace("-", "_"))
        if recipe is None:
            raise bad(path, lines.get("mixed_precision"), f"mixed_precision {value!r} is none of Bridge's recipes "
                      f"({', '.join(PRECISION_RECIPES)}); write its MixedPrecisionConfig out in the file")
        return dict(recipe)
    if not isinstance(value, dict):
        raise bad(path, lines.get("mixed_precision"), "mixed_precision is neither a recipe name nor a "
                                                      "MixedPrecisionConfig; repair it")
    out = {k: value[k] for k in PRECISION_FIELDS if k in value}
    if out.get("fp8_param") is None and "fp8_param_gather" in value:
        out["fp8_param"] = value["fp8_param_gather"]
    return out


def read(path: Path, data: dict, node) -> ParsedRun:
    """Read a ConfigContainer (already parsed YAML, and its composed nodes for the lines)."""
    path = Path(path)
    lines = _lines(node)
    args = _Arguments(lines)
    model = _section(data, "model")
    if not model:
        raise bad(path, None, "is a ConfigContainer without a model section; pass the whole run config Bridge wrote")
    nested = _section(model, "transformer")
    # the activation is read with gated_linear_unit (_model_words); the rest by Megatron's names
    for key, value in model.items():
        if key not in ("transformer", "activation_func") and not key.startswith("_"):
            args.set(SPELLINGS.get(key, key), value, f"model.{key}")
    for key, value in nested.items():
        if key != "activation_func" and not key.startswith("_"):
            args.set(SPELLINGS.get(key, key), value, f"model.transformer.{key}")

    train, dataset, ddp, optimizer = (_section(data, s) for s in ("train", "dataset", "ddp", "optimizer"))
    for key in ("micro_batch_size", "global_batch_size"):
        if train.get(key) is not None:
            args.set(key, train[key], f"train.{key}")
    if args.values.get("seq_length") is None and dataset.get("seq_length") is not None:
        args.set("seq_length", dataset["seq_length"], "dataset.seq_length")
    for key in ("use_distributed_optimizer", "num_distributed_optimizer_instances", "use_megatron_fsdp",
                "use_custom_fsdp", "fp8_param_gather"):
        if key in ddp:
            args.set(key, ddp[key], f"ddp.{key}")
    for key in ("optimizer", "use_precision_aware_optimizer", "main_grads_dtype", "main_params_dtype", "exp_avg_dtype",
                "exp_avg_sq_dtype", "optimizer_cpu_offload"):
        if key in optimizer:
            args.set(key, optimizer[key], f"optimizer.{key}")
    # mixed_precision last: Bridge copies it over the model's, optimizer's and DDP's fields at setup
    precision = _precision(path, data, lines)
    for key, value in precision.items():
        if key != "grad_reduce_in_fp32":
            where = f"mixed_precision.{key}"
            args.set(SPELLINGS.get(key, key), value, where if where in lines else "mixed_precision")
    _model_words(path, args, model, nested)
    _grad_buffer(args, ddp, precision, lines)
    comm = _section(data, "comm_overlap")
    _data_parallel_overlap(args, ddp, comm, "comm_overlap" in data)
    _pipeline_overlap(args, comm, "comm_overlap" in data)
    for key in ("tp_comm_overlap", "defer_embedding_wgrad_compute", "wgrad_deferral_limit"):
        if comm.get(key) is not None:  # CommOverlapConfig.setup applies what it sets to the model
            args.set(key, comm[key], f"comm_overlap.{key}")
    rng = _section(data, "rng")
    if rng.get("seed") is not None:
        args.set("seed", rng["seed"], "rng.seed")
    args.set("peft", data.get("peft"), "peft")  # LoRA, DoRA: its _target_'s class name
    _vocabulary(args, model, _section(data, "tokenizer"))

    run = ParsedRun(FORMAT, path, timing="bridge", complete=True, arguments=args.values, argument_lines=args.where())
    run.argument_keys = args.words()
    run.env = {str(k): v for k, v in (data.get("env_vars") or {}).items()}
    parallel = (args.values.get(k) or 1 for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                   "context_parallel_size"))
    dp = comm.get("data_parallel_size")
    if isinstance(dp, int) and dp > 0:  # ConfigContainer.set_data_parallel_size, once the run has set it
        world = dp
        for size in parallel:
            world *= size
        run.world_size = world
    return run


def _model_words(path: Path, args: _Arguments, model: dict, nested: dict) -> None:
    """Bridge's model fields that Megatron-LM spells as other arguments: the activation
    (`activation_func` with `gated_linear_unit`), the tied output layer, the bias of the linears."""
    fields = {**model, **nested}
    where = "model.transformer" if "transformer" in model else "model"
    activation = plain(fields.get("activation_func"))
    gated = bool(fields.get("gated_linear_unit"))
    if activation is not None:
        name = str(activation).rsplit(".", 1)[-1]
        if name == "squared_relu":
            args.set("squared_relu", True, f"{where}.activation_func")
        elif (name, gated) not in (("silu", True), ("gelu", False)):
            # megatron_args expresses swiglu (gated silu) and gelu; say what else it is
            args.set("activation_func", f"{name}{' (gated)' if gated else ''}", f"{where}.activation_func")
    if "share_embeddings_and_output_weights" in fields:
        key = "model.share_embeddings_and_output_weights" if "share_embeddings_and_output_weights" in model else \
            f"{where}.share_embeddings_and_output_weights"
        share = fields["share_embeddings_and_output_weights"]
        args.set("untie_embeddings_and_output_weights", not share, key, said=share)
    if fields.get("num_query_groups") is not None:
        args.set("group_query_attention", True, f"{where}.num_query_groups", said=fields["num_query_groups"])


BRIDGE_BUCKET_SIZE = 128 * 1024 * 1024
"""The DDP bucket Bridge sets where the data-parallel size is over 1 (comm_overlap.py
`CommOverlapConfig._get_optimizer_overlap_cfgs`)."""


def _data_parallel_overlap(args: _Arguments, ddp: dict, comm: dict, has_comm: bool) -> None:
    """DDP's overlap_grad_reduce, overlap_param_gather and bucket size as the run uses them. Under the
    distributed optimizer with a comm_overlap section, Bridge's `CommOverlapConfig.setup` writes over
    the ddp section's: with data-parallel size over 1 both overlaps on and buckets of 128 Mi elements,
    at 1 both off and Megatron's bucket; a value the comm_overlap section states wins
    (`_override_user_cfgs`). A config written before the run states no data-parallel size
    (comm_overlap.data_parallel_size null): the over-1 branch is read, which at 1 would price nothing
    anyway (no data-parallel traffic). Without them the ddp section's own values."""
    names = {"overlap_grad_reduce": "overlap_grad_reduce", "overlap_param_gather": "overlap_param_gather",
             "bucket_size": "ddp_bucket_size"}
    dp = comm.get("data_parallel_size")
    if has_comm and ddp.get("use_distributed_optimizer"):
        wide = not isinstance(dp, int) or dp > 1
        setup = {"overlap_grad_reduce": wide, "overlap_param_gather": wide, "bucket_size": BRIDGE_BUCKET_SIZE if wide else None}
        for key, name in names.items():
            if comm.get(key) is not None:
                args.set(name, comm[key], f"comm_overlap.{key}")
            else:
                args.set(name, setup[key], "comm_overlap.data_parallel_size",
                         said=f"{'null' if dp is None else dp}, so CommOverlapConfig.setup sets {key} {setup[key]}")
        return
    for key, name in names.items():
        if ddp.get(key) is not None:
            args.set(name, ddp[key], f"ddp.{key}")


def _pipeline_overlap(args: _Arguments, comm: dict, has_comm: bool) -> None:
    """The model's overlap_p2p_comm as the run uses it, where it interleaves (elsewhere Megatron turns it
    off). With a comm_overlap section `CommOverlapConfig.setup` writes it onto the model: on for virtual
    stages (comm_overlap.py `_get_model_comm_overlap_cfgs`, "PP overlap") unless the section states it
    (`_override_user_cfgs`); without one the model's own field, whose default is ModelParallelConfig's
    False (megatron/core/model_parallel_config.py), unlike Megatron-LM's arguments (on)."""
    vp = args.values.get("virtual_pipeline_model_parallel_size") or 1
    if vp <= 1 or (args.values.get("pipeline_model_parallel_size") or 1) <= 1:
        args.set("overlap_p2p_comm", None, "")
        return
    if has_comm and comm.get("overlap_p2p_comm") is not None:
        args.set("overlap_p2p_comm", comm["overlap_p2p_comm"], "comm_overlap.overlap_p2p_comm")
    elif has_comm:
        args.set("overlap_p2p_comm", True, "comm_overlap.overlap_p2p_comm",
                 said=f"null, so CommOverlapConfig.setup turns it on at vp {vp}")
    elif "overlap_p2p_comm" not in args.values:
        args.set("overlap_p2p_comm", False, "model", said="no overlap_p2p_comm and no comm_overlap section: "
                                                           "ModelParallelConfig's false")


def _grad_buffer(args: _Arguments, ddp: dict, precision: dict, lines: dict[str, int]) -> None:
    """DDP's grad_reduce_in_fp32 as Megatron-LM's arguments say it: with bf16 a 16-bit grad buffer
    is --grad-reduce-in-bf16, with fp16 an fp32 one is --accumulate-allreduce-grads-in-fp32
    (arguments.py validate_args)."""
    if "grad_reduce_in_fp32" in precision:
        fp32, key = precision["grad_reduce_in_fp32"], "mixed_precision.grad_reduce_in_fp32"
    elif "grad_reduce_in_fp32" in ddp:
        fp32, key = ddp["grad_reduce_in_fp32"], "ddp.grad_reduce_in_fp32"
    else:
        return
    if key not in lines:
        key = "ddp.grad_reduce_in_fp32" if "ddp.grad_reduce_in_fp32" in lines else "mixed_precision"
    if args.values.get("fp16"):
        args.set("accumulate_allreduce_grads_in_fp32", bool(fp32), key, said=fp32)
    elif args.values.get("bf16"):
        args.set("grad_reduce_in_bf16", not fp32, key, said=fp32)


def _vocabulary(args: _Arguments, model: dict, tokenizer: dict) -> None:
    """The embedding's rows as Bridge sets them up (training/setup.py `_validate_and_set_vocab_size`):
    a vocabulary set on the model (and use_tokenizer_vocab_size off) is used as it is, unpadded; else
    the tokenizer's is padded (Megatron's padding to make_vocab_size_divisible_by x tp). Unpadded is
    written as a padding multiple of 1: the rows stay the vocabulary (Megatron's vocab-parallel
    embedding needs tp to divide it, which Bridge checks)."""
    if model.get("vocab_size") is not None and not tokenizer.get("use_tokenizer_vocab_size"):
        args.set("vocab_size", model["vocab_size"], "model.vocab_size")
        args.set("make_vocab_size_divisible_by", 1, "model.vocab_size",
                 said=f"{model['vocab_size']}, set on the model: Bridge does not pad it")
    elif tokenizer.get("vocab_size") is not None:
        args.set("vocab_size", tokenizer["vocab_size"], "tokenizer.vocab_size")
    if "vocab_size" in args.values:
        args.set("tokenizer_type", "NullTokenizer", args.keys["vocab_size"][0],  # the size is stated, not a file's
                 said=args.values["vocab_size"])
    else:  # a tokenizer's file holds the vocabulary: megatron_args names what to pass
        args.set("tokenizer_type", tokenizer.get("tokenizer_type") or "HuggingFaceTokenizer", "tokenizer.tokenizer_type")
