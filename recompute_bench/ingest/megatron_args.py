"""Megatron-LM's arguments -> this product's Config (framework megatron).

Megatron's own argument names are this product's field names (`spec/fields.py`), so most arguments
map one to one; the rest are Megatron's spellings of a field (`--swiglu` is `activation swiglu`,
`--untie-embeddings-and-output-weights` is `share_embeddings_and_output_weights false`, `--bf16` is
`precision bf16`, the tokenizer names the vocabulary). Three shapes of input are read alike:

- a `model_config.yaml`'s MODEL_ARGS or a command line: `{"--num-layers": 12, "--bf16": True}`, or
  `read_argv(["--num-layers", "12", "--bf16"])`;
- the argument dump at the start of a Megatron log (`megatron/training/arguments.py` `_print_args`:
  `num_layers ........ 12`): every argument, as text (`None`, `True`, `AttnBackend.flash`), derived
  ones included (`ffn_hidden_size`, `virtual_pipeline_model_parallel_size`, `padded_vocab_size`).

An argument that changes what a rank holds but that the estimate cannot express (context parallel,
FP8, FSDP, MoE, ...) raises `CannotExpress` naming it, unless it holds Megatron's
neutral value (`context_parallel_size 1`, `fp8 None`): a log's dump lists them all. Every other
argument (data, logging, checkpointing, learning rate, timers) changes nothing the estimate holds and
is not read. Pure Python.
"""

from __future__ import annotations

import ast
from typing import Any, Iterable, Mapping

from recompute_bench.spec.config import SECTIONS, Config, BadInput, canonical_modules
from recompute_bench.spec.rules import validate


class CannotExpress(BadInput):
    """A Megatron argument the estimate cannot express; `argument` is its name (`--context-parallel-size`),
    `value` its value and `why` the reason, where they are known."""

    def __init__(self, argument: str, message: str, value: Any = None, why: str | None = None) -> None:
        self.argument, self.value, self.why = argument, value, why
        super().__init__(message)


# Vocabulary of a tokenizer that the arguments alone determine (megatron/core/tokenizers):
# GPT-2's BPE vocab.json has 50257 entries (pretrain_gpt.py's default tokenizer_type);
# TikTokenizer defaults to DEFAULT_TIKTOKEN_MAX_VOCAB = 2**17 (tiktoken_tokenizer.py).
GPT2_BPE_VOCAB = 50257
TIKTOKEN_DEFAULT_VOCAB = 2**17
DEFAULT_TOKENIZER = "GPT2BPETokenizer"  # pretrain_gpt.py: args_defaults={'tokenizer_type': 'GPT2BPETokenizer'}

# Arguments whose value is a field of the same name (Megatron's name is the field's key).
SAME_NAME = {
    "model": ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "normalization",
              "rotary_base", "hidden_dropout", "attention_dropout", "init_method_std", "make_vocab_size_divisible_by",
              "transformer_impl"),
    "training": ("seq_length", "micro_batch_size", "global_batch_size", "seed"),
    "parallel": ("tensor_model_parallel_size", "pipeline_model_parallel_size", "use_distributed_optimizer",
                 "expert_model_parallel_size"),
    "recompute": (),
}
# Long flags whose argparse destination has another name (TransformerConfig's `fp8` is set by
# --fp8-format: transformer_config.py, its field's argparse_meta arg_names).
ALIASES = {"microbatch_group_size_per_virtual_pipeline_stage": "microbatch_group_size_per_vp_stage",
           "fp8_format": "fp8"}

# Arguments the estimate cannot express, each with Megatron's neutral values (what leaves the rank's
# bytes as the estimate counts them) and why. A value outside them raises CannotExpress.
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "context_parallel_size": ((1,), "context parallelism is not modelled"),
    "hierarchical_context_parallel_sizes": ((None,), "context parallelism is not modelled"),
    "fp8": ((None,), "FP8 training is not modelled"),
    "fp8_format": ((None,), "FP8 training is not modelled"),
    "fp8_param_gather": ((False,), "FP8 training is not modelled"),
    "fp4": ((None,), "FP4 training is not modelled"),
    "tp_comm_overlap": ((False,), "tensor-parallel communication overlap (userbuffers) is not modelled"),
    "use_torch_fsdp2": ((False,), "FSDP is not modelled for framework megatron"),
    "use_megatron_fsdp": ((False,), "FSDP is not modelled for framework megatron"),
    "use_custom_fsdp": ((False,), "FSDP is not modelled for framework megatron"),
    "num_distributed_optimizer_instances": ((1,), "several distributed-optimizer instances are not modelled"),
    "decoder_first_pipeline_num_layers": ((None,), "an uneven pipeline split is not modelled"),
    "decoder_last_pipeline_num_layers": ((None,), "an uneven pipeline split is not modelled"),
    "account_for_embedding_in_pipeline_split": ((False,), "an uneven pipeline split is not modelled"),
    "account_for_loss_in_pipeline_split": ((False,), "an uneven pipeline split is not modelled"),
    "pipeline_model_parallel_layout": ((None,), "a custom pipeline layout is not modelled"),
    "microbatch_group_size_per_virtual_pipeline_stage": ((None,), "a custom interleaving group is not modelled"),
    "experimental_attention_variant": ((None,), "attention variants (gated delta net, DSA) are not modelled"),
    "qk_layernorm": ((False,), "query/key norms are not modelled"),
    "squared_relu": ((False,), "the squared-ReLU MLP is not modelled (gelu and swiglu are)"),
    "attention_output_gate": ((False,), "the attention output gate is not modelled"),
    "add_qkv_bias": ((False,), "a QKV bias without the other linear biases is not modelled"),
    "apply_residual_connection_post_layernorm": ((False,), "post-norm residuals are not modelled"),
    "cuda_graph_impl": (("none", None), "CUDA graphs are not modelled"),
    "enable_cuda_graph": ((False,), "CUDA graphs are not modelled"),
    "external_cuda_graph": ((False,), "CUDA graphs are not modelled"),
    "cpu_offloading_weights": ((False,), "offloading weights is not modelled"),
    "optimizer": (("adam",), "optimizers other than Adam are not modelled"),
    "optimizer_cpu_offload": ((False,), "offloading the optimizer is not modelled"),
    "use_precision_aware_optimizer": ((False,), "the precision-aware optimizer is not modelled"),
    "main_grads_dtype": (("fp32", "torch.float32", None), "main gradients other than fp32 are not modelled"),
    "main_params_dtype": (("fp32", "torch.float32", None), "master weights other than fp32 are not modelled"),
    "exp_avg_dtype": (("fp32", "torch.float32", None), "Adam moments other than fp32 are not modelled"),
    "exp_avg_sq_dtype": (("fp32", "torch.float32", None), "Adam moments other than fp32 are not modelled"),
    "defer_embedding_wgrad_compute": ((False,), "deferring the embedding's weight gradient is not modelled"),
    "cross_entropy_fusion_impl": (("native", None), "Transformer Engine's fused cross-entropy is not modelled"),
    "bias_swiglu_fusion": ((True, None), "SwiGLU without Megatron's fused bias-SwiGLU is not modelled"),
    "fp16_lm_cross_entropy": ((False,), "a 16-bit cross-entropy is not modelled"),
    "mtp_num_layers": ((None, 0), "multi-token prediction is not modelled"),
    "use_legacy_models": ((False,), "Megatron's legacy models are not modelled (use_mcore_models is)"),
    "heterogeneous_layers_config_path": ((None,), "heterogeneous layers are not modelled"),
    "perform_rl_step": ((False,), "reinforcement-learning steps (generation and training) are not modelled"),
    "num_experts": ((None, 0), "mixture-of-experts layers are not modelled for framework megatron yet"),
    "multi_latent_attention": ((False,), "multi-latent attention is not modelled for framework megatron yet"),
    "export_kd_teacher_load": ((None,), "knowledge distillation (a teacher model beside the student) is not modelled"),
    "moe_shared_expert_gate": ((False,), "the shared experts' gate is not modelled"),
    "moe_router_dtype": ((None,), "a router in another dtype is not modelled"),
    "moe_router_load_balancing_type": (("aux_loss", "none"), "load balancing other than aux_loss is not modelled"),
    "moe_z_loss_coeff": ((None, 0, 0.0), "the router z-loss is not modelled"),
    "moe_token_dispatcher_type": (("allgather", "alltoall"), "the flex token dispatcher is not modelled"),
}

# Megatron's neutral values (TransformerConfig and arguments.py defaults) of the arguments read
# below, where they differ from this product's defaults; a yaml or a command line gives only the
# arguments that differ from Megatron's.
MEGATRON_DEFAULTS = {"hidden_dropout": 0.1, "attention_dropout": 0.1, "transformer_impl": "transformer_engine",
                     "attention_backend": "auto"}


def read_argv(argv: Iterable[str]) -> dict[str, Any]:
    """A Megatron command line -> {name: value}: a flag without a value is True, a flag followed by
    several words is a list (`--recompute-modules core_attn mlp`), `--flag=value` is one value."""
    out: dict[str, Any] = {}
    name: str | None = None
    for token in argv:
        if token.startswith("--"):
            name, eq, value = token[2:].partition("=")
            out[name] = _value(value) if eq else True
            if eq:
                name = None
        elif name is not None:
            value = _value(token)
            held = out[name]
            out[name] = value if held is True else (held + [value] if isinstance(held, list) else [held, value])
        else:
            raise BadInput(f"Megatron argument value {token!r} follows no --flag; write --name value")
    return out


def normalize(args: Mapping[str, Any]) -> dict[str, Any]:
    """Names as Megatron's `args` holds them (`--num-layers` -> num_layers) and values as Python
    values: a log's text `None`, `True`, `12`, `0.1`, `['core_attn']`, `AttnBackend.flash` is read.
    A negative flag given as a flag (`--no-masked-softmax-fusion`) becomes its destination set to
    False (`masked_softmax_fusion`), as argparse stores it."""
    out = {}
    for key, value in args.items():
        name = str(key).lstrip("-").replace("-", "_")
        value = _value(value) if isinstance(value, str) else value
        if isinstance(value, list):  # a YAML list of words, ["mlp core_attn"] as Megatron's runner splits it
            value = [_value(w) if isinstance(w, str) else w for item in value
                     for w in (item.split() if isinstance(item, str) else [item])]
        name = ALIASES.get(name, name)
        if name.startswith("no_") and value is True:
            out.setdefault(name[3:], False)
        out[name] = value
    return out


def _value(text: str) -> Any:
    text = text.strip()
    if text in ("None", "null", ""):
        return None if text != "" else ""
    if text in ("True", "true"):
        return True
    if text in ("False", "false"):
        return False
    if text.startswith("AttnBackend."):  # the dump prints the enum
        return text.split(".", 1)[1]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return bracket_list(text)


def bracket_list(text: str) -> Any:
    """A list as recipes write one in a `model_config.yaml`: "[mlp core_attn]". Megatron-LM's test
    runner strips the brackets and passes the words as separate arguments
    (tests/functional_tests/shell_test_utils/_run_training.sh, "value is wrapped in [ ]"), so an
    nargs='+' argument gets a list of them. Other text is returned as it is."""
    if len(text) > 2 and text[0] == "[" and text[-1] == "]" and "[" not in text[1:-1]:
        words = text[1:-1].replace(",", " ").split()
        if words:
            return [_value(w) for w in words]
    return text


def _cannot(name: str, value: Any, why: str) -> CannotExpress:
    flag = "--" + {dest: long for long, dest in ALIASES.items()}.get(name, name).replace("_", "-")
    return CannotExpress(flag, f"Megatron argument {flag} {value} cannot be expressed: {why}", value, why)


def inexpressible(args: Mapping[str, Any]) -> list[CannotExpress]:
    """Every argument (normalized) the estimate cannot express, in NEUTRAL's order, each as a
    CannotExpress naming it."""
    out = []
    experts = args.get("num_experts")
    for name, (neutral, why) in NEUTRAL.items():
        if name in args and args[name] not in neutral:
            if name.startswith("moe_") and not experts:
                continue  # MoE options of a dense model change nothing
            out.append(_cannot(name, args[name], why))
    if args.get("fp16") and args.get("accumulate_allreduce_grads_in_fp32"):
        out.append(_cannot("accumulate_allreduce_grads_in_fp32", True, "an fp32 grad buffer for fp16 runs is not modelled"))
    if args.get("bf16") and args.get("grad_reduce_in_bf16"):
        out.append(_cannot("grad_reduce_in_bf16", True, "a bf16 grad buffer is not modelled"))
    group = args.get("microbatch_group_size_per_vp_stage")
    if group not in (None, args.get("pipeline_model_parallel_size", 1)):
        out.append(_cannot("microbatch_group_size_per_vp_stage", group, "interleaving groups other than the "
                           "pipeline-parallel size are not modelled"))
    if args.get("cpu_offloading") and args.get("cpu_offloading_activations") is False:
        out.append(_cannot("cpu_offloading_activations", False, "offloading without activations is not modelled"))
    position = args.get("position_embedding_type")
    if position not in (None, "learned_absolute", "rope") and not args.get("use_rotary_position_embeddings"):
        out.append(_cannot("position_embedding_type", position, "only learned_absolute and rope are modelled"))
    return out


def check_expressible(args: Mapping[str, Any]) -> None:
    """Raise CannotExpress for the first argument (normalized) the estimate cannot express."""
    refused = inexpressible(args)
    if refused:
        raise refused[0]


def megatron_overrides(args: Mapping[str, Any], world_size: int | None = None,
                       refused: list[CannotExpress] | None = None) -> dict[str, dict[str, Any]]:
    """Megatron's arguments -> one table per Config section (framework megatron), Megatron's defaults
    where an argument is absent; `world_size` (the GPU count) gives the data-parallel size when the
    arguments do not (a log's dump has `world_size` and `data_parallel_size`). CannotExpress (a
    BadInput) names an argument the estimate cannot express; given a list as `refused`, every such
    argument is appended to it instead and the tables hold the rest (what `estimate --from` reads)."""
    a = {**MEGATRON_DEFAULTS, **normalize(args)}
    if refused is None:
        check_expressible(a)
    else:
        refused.extend(inexpressible(a))
    tables: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for section, names in SAME_NAME.items():
        for name in names:
            if a.get(name) is not None:
                tables[section][name] = a[name]
    m, tr, par, r = tables["model"], tables["training"], tables["parallel"], tables["recompute"]
    tr["framework"] = "megatron"
    for required in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if a.get(required) is None and not (required == "seq_length" and a.get("encoder_seq_length")):
            raise BadInput(f"Megatron arguments lack --{required.replace('_', '-')}; every run sets it")
    tr.setdefault("seq_length", a.get("encoder_seq_length"))
    m.setdefault("max_position_embeddings", tr["seq_length"])

    # The model's shape: arguments.py validate_args fills ffn_hidden_size and kv_channels.
    h, heads = m["hidden_size"], m["num_attention_heads"]
    swiglu = bool(a.get("swiglu"))
    m["activation"] = "swiglu" if swiglu else "gelu"
    m["ffn_hidden_size"] = a.get("ffn_hidden_size") or (int((4 * h * 2 / 3) / 64) * 64 if swiglu else 4 * h)
    if a.get("kv_channels") not in (None, h // heads):
        m["kv_channels"] = a["kv_channels"]
    if a.get("group_query_attention") and a.get("num_query_groups") not in (None, heads):
        m["num_query_groups"] = a["num_query_groups"]
    if a.get("use_rotary_position_embeddings"):
        m["position_embedding_type"] = "rope"
    elif a.get("position_embedding_type") is not None:
        m["position_embedding_type"] = a["position_embedding_type"]
    if a.get("disable_bias_linear") or a.get("add_bias_linear") is False:
        m["add_bias_linear"] = False
    m["share_embeddings_and_output_weights"] = not a.get("untie_embeddings_and_output_weights", False)
    if a.get("norm_epsilon") is not None:
        m["layernorm_epsilon"] = a["norm_epsilon"]
    m["attention_backend"] = str(a["attention_backend"]).split(".")[-1]
    m["masked_softmax_fusion"] = a.get("masked_softmax_fusion", True) is not False
    # validate_args: apply_query_key_layer_scaling also sets attention_softmax_in_fp32
    m["attention_softmax_in_fp32"] = bool(a.get("attention_softmax_in_fp32") or a.get("apply_query_key_layer_scaling"))
    m["cross_entropy_loss_fusion"] = bool(a.get("cross_entropy_loss_fusion"))
    m["vocab_size"] = _vocabulary(a)

    tr["precision"] = "fp16" if a.get("fp16") else "bf16" if a.get("bf16") else "fp32"

    # Layout: arguments.py validate_args derives the data-parallel and virtual-pipeline sizes.
    tp, pp = a.get("tensor_model_parallel_size") or 1, a.get("pipeline_model_parallel_size") or 1
    world = a.get("world_size") or world_size
    if a.get("data_parallel_size"):
        par["data_parallel_size"] = a["data_parallel_size"]
    elif world:
        if world % (tp * pp):
            raise BadInput(f"world size {world} is not divisible by tensor x pipeline parallel {tp} x {pp}")
        par["data_parallel_size"] = world // (tp * pp)
    par["sequence_parallel"] = bool(a.get("sequence_parallel")) and tp > 1  # validate_args: no SP when tp == 1
    vpp = _virtual_stages(a, m["num_layers"], pp)
    if vpp:
        par["virtual_pipeline_model_parallel_size"] = vpp
    tr.setdefault("micro_batch_size", 1)
    tr.setdefault("global_batch_size", tr["micro_batch_size"] * par.get("data_parallel_size", 1))

    # Recompute: --recompute-activations means selective (validate_args); selective defaults to core_attn.
    granularity = a.get("recompute_granularity") or ("selective" if a.get("recompute_activations") else None)
    if granularity:
        r["granularity"] = granularity
        if granularity == "full":
            r["method"], r["num_layers"] = a.get("recompute_method"), a.get("recompute_num_layers")
        else:
            modules = a.get("recompute_modules") or ["core_attn"]
            r["modules"] = canonical_modules([modules] if isinstance(modules, str) else list(modules))
    if a.get("distribute_saved_activations"):
        r["distribute_saved_activations"] = True
    if a.get("cpu_offloading"):
        r["activation_offload_layers"] = a.get("cpu_offloading_num_layers") or 0
    return tables


def _vocabulary(a: Mapping[str, Any]) -> int:
    """The tokenizer's vocabulary (before Megatron pads it): a log's padded_vocab_size (padding it
    again changes nothing), --vocab-size, or what the tokenizer's name alone gives."""
    if a.get("padded_vocab_size"):
        return a["padded_vocab_size"]
    tokenizer = a.get("tokenizer_type") or DEFAULT_TOKENIZER
    if tokenizer == "GPT2BPETokenizer":
        return GPT2_BPE_VOCAB
    if tokenizer in ("NullTokenizer", "TikTokenizer") and a.get("vocab_size"):  # build_tokenizer.py passes it to these only
        return a["vocab_size"]
    if tokenizer == "TikTokenizer":
        return TIKTOKEN_DEFAULT_VOCAB
    raise CannotExpress("--tokenizer-type", f"Megatron argument --tokenizer-type {tokenizer}: its vocabulary size lies in "
                        f"the tokenizer's file, not in the arguments; give the model's vocabulary as --padded-vocab-size N")


def _virtual_stages(a: Mapping[str, Any], num_layers: int, pp: int) -> int | None:
    """Model chunks per pipeline rank, as validate_args derives virtual_pipeline_model_parallel_size
    (None for 1)."""
    if a.get("virtual_pipeline_model_parallel_size"):
        vpp = a["virtual_pipeline_model_parallel_size"]
    elif a.get("num_virtual_stages_per_pipeline_rank"):
        vpp = a["num_virtual_stages_per_pipeline_rank"]
    elif a.get("num_layers_per_virtual_pipeline_stage"):
        per_stage, per_chunk = num_layers // pp, a["num_layers_per_virtual_pipeline_stage"]
        if per_stage % per_chunk:
            raise BadInput(f"num_layers_per_virtual_pipeline_stage {per_chunk} does not divide the {per_stage} layers "
                              f"of a pipeline stage")
        vpp = per_stage // per_chunk
    else:
        return None
    return vpp if vpp > 1 else None


def config_from_megatron(args: Mapping[str, Any], world_size: int | None = None, workload: str = "megatron") -> Config:
    """The validated Config of a Megatron run (framework megatron) from its arguments (see
    `megatron_overrides`); BadInput (CannotExpress for an argument the estimate cannot express)."""
    tables = megatron_overrides(args, world_size)
    try:
        cfg = Config(workload, **{s: SECTIONS[s](**tables[s]) for s in SECTIONS})
    except TypeError as e:
        raise BadInput(f"Megatron arguments do not make a config ({e})") from None
    validate(cfg)
    return cfg


def overrides_as_flags(tables: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The tables of `megatron_overrides` as this product's command-line options: a dedicated flag
    where the field has one (`--tensor-model-parallel-size 4`), `--set section.attribute=value`
    otherwise; what `estimate` takes to model the same run."""
    from recompute_bench.spec.fields import fields

    by_path = {f.path: f for f in fields()}
    out: list[str] = []
    for section, values in tables.items():
        for attribute, value in values.items():
            f = by_path[f"{section}.{attribute}"]
            if f.flag is not None:
                if f.value_type is bool:
                    out.append(f.option if value else "--no-" + f.option[2:])
                elif f.is_list:
                    out += [f.option, ",".join(value) if value else "[]"]
                else:
                    out += [f.option, str(value)]
            else:
                text = str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, str) else str(value)
                out += ["--set", f"{f.path}={text}"]
    return out


# ----- Runs as users give them (estimate --from) ------------------------------------------------------

# What Megatron Bridge's run config states beyond Megatron-LM's arguments (ingest/bridge_config.py).
NEUTRAL.update({
    "peft": ((None,), "parameter-efficient fine-tuning (LoRA, DoRA: adapters beside frozen weights) is not modelled"),
    "activation_func": ((None,), "activations other than gelu and swiglu (gated silu) are not modelled"),
})


FIELD_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "model.ffn_hidden_size": ("ffn_hidden_size",),
    "model.vocab_size": ("padded_vocab_size", "vocab_size", "tokenizer_type"),
    "model.max_position_embeddings": ("max_position_embeddings", "seq_length"),
    "model.num_query_groups": ("num_query_groups", "group_query_attention"),
    "model.activation": ("swiglu",),
    "model.position_embedding_type": ("position_embedding_type", "use_rotary_position_embeddings"),
    "model.add_bias_linear": ("disable_bias_linear", "add_bias_linear"),
    "model.share_embeddings_and_output_weights": ("untie_embeddings_and_output_weights",),
    "model.layernorm_epsilon": ("norm_epsilon",),
    "model.attention_softmax_in_fp32": ("attention_softmax_in_fp32", "apply_query_key_layer_scaling"),
    "training.seq_length": ("seq_length", "encoder_seq_length"),
    "training.precision": ("bf16", "fp16", "fp8"),
    "training.fp8_format": ("fp8",),
    "training.global_batch_size": ("global_batch_size",),
    "parallel.data_parallel_size": ("data_parallel_size", "world_size"),
    "parallel.virtual_pipeline_model_parallel_size": ("virtual_pipeline_model_parallel_size",
                                                      "num_virtual_stages_per_pipeline_rank",
                                                      "num_layers_per_virtual_pipeline_stage"),
    "recompute.granularity": ("recompute_granularity", "recompute_activations"),
    "recompute.modules": ("recompute_modules",),
    "recompute.method": ("recompute_method",),
    "recompute.num_layers": ("recompute_num_layers",),
    "recompute.activation_offload_layers": ("cpu_offloading", "cpu_offloading_num_layers"),
}
"""The Megatron arguments (normalized names) each Config field is read from, where they are not the
field's own name (`megatron_overrides`); what `estimate --from` names as a value's source."""


def field_arguments(path: str) -> tuple[str, ...]:
    """The Megatron arguments the field at `path` ("section.attribute") is read from."""
    if path in FIELD_ARGUMENTS:
        return FIELD_ARGUMENTS[path]
    section, attribute = path.split(".", 1)
    return (f"recompute_{attribute}" if section == "recompute" else attribute,)
