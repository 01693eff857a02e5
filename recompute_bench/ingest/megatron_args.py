"""Megatron-LM's arguments -> this product's Config (framework megatron).

Megatron's own argument names are this product's field names (`config/fields.py`), so most arguments
map one to one; the rest are Megatron's spellings of a field (`--swiglu` is `activation swiglu`,
`--untie-embeddings-and-output-weights` is `share_embeddings_and_output_weights false`, `--bf16` is
`precision bf16`, the tokenizer names the vocabulary). Three shapes of input are read alike:

- a `model_config.yaml`'s MODEL_ARGS or a command line: `{"--num-layers": 12, "--bf16": True}`, or
  `read_argv(["--num-layers", "12", "--bf16"])`;
- the argument dump at the start of a Megatron log (`megatron/training/arguments.py` `_print_args`:
  `num_layers ........ 12`): every argument, as text (`None`, `True`, `AttnBackend.flash`), derived
  ones included (`ffn_hidden_size`, `virtual_pipeline_model_parallel_size`, `padded_vocab_size`).

An argument that changes what a rank holds but that the estimate cannot express (FP8, FSDP, MoE,
...) raises `CannotExpress` naming it, unless it holds Megatron's neutral value (`fp8 None`): a
log's dump lists them all. Every other
argument (data, logging, checkpointing, learning rate, timers) changes nothing the estimate holds and
is not read. Pure Python.
"""

from __future__ import annotations

from typing import Any, Mapping

from recompute_bench.config.choices import MEGATRON_MOE_DEFAULTS
from recompute_bench.config.schema import SECTIONS, Config, BadInput, data_parallel_size
from recompute_bench.config.labels import canonical_modules
from recompute_bench.config.pipeline_split import layout_virtual_stages
from recompute_bench.config.rules import validate
from recompute_bench.ingest.megatron_argv import ALIASES, FLAG_NAMES, module_list, normalize
from recompute_bench.workload import resolved


class CannotExpress(BadInput):
    """A Megatron argument the estimate cannot express; `argument` is its flag (`--fp8-format`), `name`
    its normalized name (`fp8`, as `normalize` writes it), `value` its value and `why` the reason,
    where they are known."""

    def __init__(self, argument: str, message: str, value: Any = None, why: str | None = None, *,
                 name: str) -> None:
        self.argument, self.name, self.value, self.why = argument, name, value, why
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

# Arguments the estimate cannot express, each with Megatron's neutral values (what leaves the rank's
# bytes as the estimate counts them) and why. A value outside them raises CannotExpress.
NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "fp4": ((None,), "FP4 training is not modelled"),
    "use_torch_fsdp2": ((False,), "FSDP is not modelled for framework megatron"),
    "use_megatron_fsdp": ((False,), "FSDP is not modelled for framework megatron"),
    "use_custom_fsdp": ((False,), "FSDP is not modelled for framework megatron"),
    "experimental_attention_variant": ((None,), "attention variants (gated delta net, DSA) are not modelled"),
    "apply_residual_connection_post_layernorm": ((False,), "post-norm residuals are not modelled"),
    "cpu_offloading_weights": ((False,), "offloading weights is not modelled"),
    "optimizer": (("adam",), "optimizers other than Adam are not modelled"),
    "optimizer_cpu_offload": ((False,), "offloading the optimizer is not modelled"),
    "bias_swiglu_fusion": ((True, None), "SwiGLU without Megatron's fused bias-SwiGLU is not modelled"),
    "fp16_lm_cross_entropy": ((False,), "a 16-bit cross-entropy is not modelled"),
    "use_legacy_models": ((False,), "Megatron's legacy models are not modelled (use_mcore_models is)"),
    "heterogeneous_layers_config_path": ((None,), "heterogeneous layers are not modelled"),
    "perform_rl_step": ((False,), "reinforcement-learning steps (generation and training) are not modelled"),
    "export_kd_teacher_load": ((None,), "knowledge distillation (a teacher model beside the student) is not modelled"),
    # Dense world and multi-latent attention: what stays refused beside the arguments DENSE_WORLD maps
    "qk_l2_norm": ((False,), "L2 query/key norms are not modelled (--qk-layernorm is)"),
    "mla_down_proj_fusion": ((False,), "MLA's fused down-projection (FusedMLASelfAttention) is not modelled"),
    "mtp_use_repeated_layer": ((False, None), "one multi-token-prediction layer repeated over the depths is not "
                                               "modelled"),
    "mtp_hsm": ((False, None), "multi-token prediction's hidden-state mixing is not modelled"),
    "mtp_detach_heads": ((False, None), "multi-token prediction with detached heads is not modelled"),
    # Mixture-of-experts: what the MoE model (analysis/megatron/moe.py) does not express.
    "moe_latent_size": ((None,), "MoE latent projections are not modelled"),
    "moe_use_grouped_tensor": ((False,), "Transformer Engine's grouped-tensor experts are not modelled"),
    "use_transformer_engine_op_fuser": ((False,), "Transformer Engine's op fuser (fused MLP operations) is not modelled"),
    "moe_router_padding_for_quantization": ((False,), "padding the routing map for quantized experts is not modelled"),
    "moe_router_padding_for_fp8": ((False,), "padding the routing map for quantized experts is not modelled"),
    "moe_apply_probs_on_input": ((False,), "weighting the experts' input by the probabilities is not modelled"),
    "moe_expert_rank_capacity_factor": ((None,), "an expert-rank capacity (HybridEP / NCCL-EP budget) is not modelled"),
    "moe_paged_stash": ((False,), "the paged MoE activation stash is not modelled"),
    "moe_use_upcycling": ((False,), "upcycling a dense checkpoint into experts is not modelled"),
    "moe_input_jitter_eps": ((None,), "router input jitter is not modelled"),
    "overlap_dispatch_backward_with_experts_wgrad": ((False,), "delaying the experts' weight gradients is not modelled"),
    "delay_wgrad_compute": ((False,), "delaying weight gradients is not modelled"),
}
# --tp-comm-overlap (parallel.tp_comm_overlap, read with the dense world below): TE's userbuffers
# themselves (initialize_ub -> comm_gemm_overlap.cpp, userbuffers-host.cpp
# `register_user_buffer_collective`: cuMemCreate / cudaMalloc) lie outside torch's caching allocator,
# which Megatron's memory figures and this estimate count, and TE's linears save the same local
# inputs with them (layernorm_linear.py: ln_out stays the local shard; the gathered input goes to the
# userbuffer instead of a torch tensor); what torch does count is the userbuffer GEMMs' own cuBLAS
# workspace (buffers.py `te_userbuffers_workspace_bytes`).

# Context parallel (context_parallel_size, cp_comm_type, hierarchical_context_parallel_sizes) is
# read by `_context_parallel`; what of it the estimate cannot express:
NEUTRAL.update({
    "hybrid_context_parallel": ((False,), "hybrid context parallel (a context-parallel size per micro-batch) is "
                                          "not modelled"),
})


# FP8, CUDA graphs and activation offload: what the estimate models is read in `_fp8_graphs_offload`;
# these variants of them it cannot express.
NEUTRAL.update({
    "fp8_dot_product_attention": ((False, None), "FP8 attention (fp8_dot_product_attention) is not modelled"),
    "fp8_multi_head_attention": ((False, None), "FP8 multi-head attention is not modelled"),
    "fp8_output_proj": ((False, None), "an FP8 output layer is not modelled"),
    "fp8_wgrad": ((True, None), "FP8 with 16-bit weight gradients (--no-fp8-wgrad) is not modelled"),
    "fp8_quantizer_factory": ((None,), "a custom FP8 recipe is not modelled"),
    "te_precision_config_file": ((None,), "per-module Transformer Engine precision configs are not modelled"),
    "activation_func_fp8_input_store": ((False, None), "storing the activation's input in FP8 is not modelled"),
    "cuda_graph_retain_backward_graph": ((False, None), "CUDA graphs that retain their backward graph are not modelled"),
    "min_offloaded_tensor_size": ((1024 * 1024, None), "a minimum offloaded tensor size other than Megatron's "
                                  "1048576 elements is not modelled"),
    "activation_offload_fraction": ((1.0, 1, None), "offloading a fraction of the offload groups is not modelled"),
    "delta_offload_bytes_across_pp_ranks": ((0, None), "balancing offload bytes across pipeline ranks is not modelled"),
})

# Megatron's neutral values (TransformerConfig and arguments.py defaults) of the arguments read
# below, where they differ from this product's defaults; a yaml or a command line gives only the
# arguments that differ from Megatron's.
MEGATRON_DEFAULTS = {"hidden_dropout": 0.1, "attention_dropout": 0.1, "transformer_impl": "transformer_engine",
                     "attention_backend": "auto"}


def _cannot(name: str, value: Any, why: str) -> CannotExpress:
    flag = "--" + FLAG_NAMES.get(name, name).replace("_", "-")
    return CannotExpress(flag, f"Megatron argument {flag} {value} cannot be expressed: {why}", value, why,
                         name=ALIASES.get(name, name))


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
    fp8 = args.get("fp8_format") or args.get("fp8")
    if fp8 and not args.get("bf16"):
        out.append(_cannot("fp8_format", fp8, "FP8 is modelled on bf16 runs (--bf16), not on fp16 or fp32 ones"))
    if args.get("fp16") and args.get("accumulate_allreduce_grads_in_fp32"):
        out.append(_cannot("accumulate_allreduce_grads_in_fp32", True, "an fp32 grad buffer for fp16 runs is not modelled"))
    if args.get("cpu_offloading") and args.get("cpu_offloading_activations") is False:
        out.append(_cannot("cpu_offloading_activations", False, "offloading without activations is not modelled"))
    if args.get("overlap_moe_expert_parallel_comm") and args.get("num_experts") and \
            (args.get("pipeline_model_parallel_size") or 1) > 1:
        # schedules.py runs the combined forward-backward chunks inside the interleaved schedule
        out.append(_cannot("overlap_moe_expert_parallel_comm", True, "the combined 1F1B schedule is modelled without "
                           "pipeline parallelism only"))
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
    return normalized_overrides(normalize(args), world_size, refused)


def normalized_overrides(args: Mapping[str, Any], world_size: int | None = None,
                         refused: list[CannotExpress] | None = None) -> dict[str, dict[str, Any]]:
    """`megatron_overrides` of arguments already normalized (`normalize`)."""
    a = {**MEGATRON_DEFAULTS, **args}
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

    # Layout: arguments.py validate_args derives the data-parallel and virtual-pipeline sizes:
    # data_parallel_size = world_size // (tp x pp x cp).
    tp, pp = a.get("tensor_model_parallel_size") or 1, a.get("pipeline_model_parallel_size") or 1
    cp = _context_parallel(a, par)
    world = a.get("world_size") or world_size
    if a.get("data_parallel_size"):
        par["data_parallel_size"] = a["data_parallel_size"]
    elif world:
        par["data_parallel_size"] = data_parallel_size(world, tp, pp, cp, "--world-size")
    par["sequence_parallel"] = bool(a.get("sequence_parallel")) and tp > 1  # validate_args: no SP when tp == 1
    vpp = _virtual_stages(a, m["num_layers"], pp)
    if vpp:
        par["virtual_pipeline_model_parallel_size"] = vpp
        # --no-overlap-p2p-communication (a log's dump: overlap_p2p_comm False); validate_args forces it
        # False without virtual stages, where the field means nothing, so it is kept for interleaving only
        if a.get("overlap_p2p_comm") is False:
            par["overlap_p2p_comm"] = False
    tr.setdefault("micro_batch_size", 1)
    tr.setdefault("global_batch_size", tr["micro_batch_size"] * par.get("data_parallel_size", 1))

    _moe_overrides(a, m, par)

    # Recompute: --recompute-activations means selective (validate_args); selective defaults to core_attn.
    # The deprecated --moe-layer-recompute adds moe to selective recompute (transformer_config.py).
    moe_layer_recompute = bool(a.get("moe_layer_recompute")) and bool(a.get("num_experts"))
    granularity = a.get("recompute_granularity") or ("selective" if a.get("recompute_activations") or
                                                      moe_layer_recompute else None)
    if granularity:
        r["granularity"] = granularity
        if granularity == "full":
            r["method"], r["num_layers"] = a.get("recompute_method"), a.get("recompute_num_layers")
        else:
            modules = a.get("recompute_modules") or ["core_attn"]
            modules = [modules] if isinstance(modules, str) else list(modules)
            r["modules"] = canonical_modules(modules + (["moe"] if moe_layer_recompute else []))
    if a.get("distribute_saved_activations"):
        r["distribute_saved_activations"] = True
    if a.get("cpu_offloading"):
        r["activation_offload_layers"] = a.get("cpu_offloading_num_layers") or 0
    _dense_world(a, tables)
    _fp8_graphs_offload(a, tables)
    return tables


def _context_parallel(a: Mapping[str, Any], par: dict[str, Any]) -> int:
    """Context parallel's arguments into `par`; returns context_parallel_size. --cp-comm-type takes
    one type or one per layer (arguments.py: nargs '+'; argument_utils.py passes a single one as a
    string, a list on to TransformerConfig); --hierarchical-context-parallel-sizes two integers, which
    a yaml may write as "2 2" or "[2 2]" and a log's dump as [2, 2]."""
    cp = a.get("context_parallel_size") or 1
    par["context_parallel_size"] = cp
    types = a.get("cp_comm_type")
    if types is not None:
        words = module_list(types)
        par["cp_comm_type"] = words[0] if len(set(words)) == 1 else " ".join(words)
    sizes = a.get("hierarchical_context_parallel_sizes")
    if sizes is not None:
        try:
            par["hierarchical_context_parallel_sizes"] = [int(n) for n in module_list(sizes)]
        except ValueError:
            raise BadInput(f"Megatron argument --hierarchical-context-parallel-sizes {sizes} is not a list of "
                           f"integers; write it as --hierarchical-context-parallel-sizes 2 2") from None
    return cp


# ---- The dense world and multi-latent attention (issue 24) -------------------------------------
# Megatron's name -> (section, Megatron's default): read as they are, each a field of the same name.
DENSE_WORLD = {
    "qk_layernorm": ("model", False), "attention_output_gate": ("model", False), "add_qkv_bias": ("model", False),
    "apply_rope_fusion": ("model", True), "rope_type": ("model", None), "mtp_num_layers": ("model", None),
    "create_attention_mask_in_dataloader": ("training", True),
    "use_precision_aware_optimizer": ("training", False), "grad_reduce_in_bf16": ("training", False),
    "defer_embedding_wgrad_compute": ("training", False), "wgrad_deferral_limit": ("training", 0),
    "gradient_accumulation_fusion": ("training", True),
    "num_distributed_optimizer_instances": ("parallel", 1), "decoder_first_pipeline_num_layers": ("parallel", None),
    "decoder_last_pipeline_num_layers": ("parallel", None), "account_for_embedding_in_pipeline_split": ("parallel", False),
    "account_for_loss_in_pipeline_split": ("parallel", False), "pipeline_model_parallel_layout": ("parallel", None),
    "microbatch_group_size_per_vp_stage": ("parallel", None), "tp_comm_overlap": ("parallel", False),
    "overlap_grad_reduce": ("parallel", False), "overlap_param_gather": ("parallel", False),
    "ddp_bucket_size": ("parallel", None),
}
# Megatron's MLA arguments and their argparse defaults (arguments.py _add_mla_args: --kv-lora-rank 32).
MLA_ARGUMENTS = {"q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128}
# The optimizer dtypes as arguments.py maps them to torch dtypes (a log's dump prints the torch names).
OPTIMIZER_DTYPE_NAMES = {"fp32": "fp32", "torch.float32": "fp32", "bf16": "bf16", "torch.bfloat16": "bf16",
                         "fp16": "fp16", "torch.float16": "fp16", "fp8": "fp8", "torch.uint8": "fp8", None: "fp32"}


def _dense_world(a: Mapping[str, Any], tables: dict[str, dict[str, Any]]) -> None:
    """The dense-world arguments (uneven pipeline splits and layouts, interleaving groups, the
    optimizer's instances and dtypes, deferred embedding gradients, query/key norms, squared ReLU,
    TE's cross-entropy, the attention mask) and multi-latent attention, into `tables`."""
    m, tr, par = tables["model"], tables["training"], tables["parallel"]
    for name, (section, default) in DENSE_WORLD.items():
        if a.get(name, default) != default and a.get(name) is not None:
            tables[section][name] = a[name]
    if not par.get("virtual_pipeline_model_parallel_size"):  # schedules.py reads the group when interleaving only
        par.pop("microbatch_group_size_per_vp_stage", None)
    if a.get("squared_relu"):  # arguments.py: --squared-relu sets activation_func squared_relu
        if a.get("swiglu"):
            raise _cannot("squared_relu", True, "--squared-relu and --swiglu are two activations; give one")
        m["activation"] = "squared_relu"
        m["ffn_hidden_size"] = a.get("ffn_hidden_size") or 4 * m["hidden_size"]
    if m.get("cross_entropy_loss_fusion") and a.get("cross_entropy_fusion_impl") == "te":
        m["cross_entropy_fusion_impl"] = "te"
    for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        value = a.get(name)
        if value not in OPTIMIZER_DTYPE_NAMES:
            raise _cannot(name, value, "Megatron takes fp32, bf16, fp16 or fp8 here")
        if OPTIMIZER_DTYPE_NAMES[value] != "fp32":
            tr[name] = OPTIMIZER_DTYPE_NAMES[value]
    if a.get("multi_latent_attention"):
        m["multi_latent_attention"] = True
        for name, default in MLA_ARGUMENTS.items():
            m[name] = a.get(name, default)
        m.pop("kv_channels", None)
        m.pop("num_query_groups", None)


# Mixture-of-experts arguments whose value is a model field of the same name (Megatron's args name the
# experts `num_experts`, TransformerConfig and this product `num_moe_experts`).
MOE_SAME_NAME = ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq",
                 "moe_router_score_function", "moe_aux_loss_coeff", "moe_router_topk_scaling_factor",
                 "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
                 "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_grouped_gemm",
                 "moe_router_load_balancing_type", "moe_z_loss_coeff", "moe_router_pre_softmax", "moe_router_dtype",
                 "moe_token_dispatcher_type", "moe_pad_expert_input_to_capacity", "moe_permute_fusion",
                 "moe_shared_expert_gate", "moe_shared_expert_overlap")


def _moe_overrides(a: Mapping[str, Any], m: dict[str, Any], par: dict[str, Any]) -> None:
    """The mixture-of-experts arguments -> model and parallel fields (arguments.py validate_args:
    num_experts 0 is none, moe_ffn_hidden_size defaults to ffn_hidden_size, expert_tensor_parallel_size
    to the tensor-parallel size); nothing for a dense model."""
    if not a.get("num_experts"):
        return
    m["num_moe_experts"] = a["num_experts"]
    for name in MOE_SAME_NAME:
        value = a.get(name, MEGATRON_MOE_DEFAULTS.get(name))  # Megatron's default where this product's differs
        if value is not None:
            m[name] = value
    if a.get("moe_ffn_hidden_size") is None:
        m.pop("moe_ffn_hidden_size", None)
    if isinstance(m.get("moe_layer_freq"), str) and m["moe_layer_freq"].strip().isdigit():
        m["moe_layer_freq"] = int(m["moe_layer_freq"])
    if m.get("moe_aux_loss_coeff") is not None:
        m["moe_aux_loss_coeff"] = float(m["moe_aux_loss_coeff"])
    if a.get("moe_flex_dispatcher_backend") not in (None, "deepep") and m.get("moe_token_dispatcher_type") == "flex":
        raise _cannot("moe_flex_dispatcher_backend", a["moe_flex_dispatcher_backend"],
                      "the flex dispatcher is modelled with DeepEP, its default backend")
    if a.get("moe_enable_deepep"):  # deprecated spelling of the flex dispatcher with DeepEP
        m["moe_token_dispatcher_type"] = "flex"
    if a.get("expert_tensor_parallel_size") is not None:
        par["expert_tensor_parallel_size"] = a["expert_tensor_parallel_size"]
    if a.get("overlap_moe_expert_parallel_comm"):
        par["overlap_moe_expert_parallel_comm"] = True


def _fp8_graphs_offload(a: Mapping[str, Any], tables: dict[str, dict[str, Any]]) -> None:
    """FP8, CUDA graphs and fine-grained offloading, by Megatron's names: --fp8-format (a log's
    `fp8`) makes precision fp8 (bf16 with FP8 linears), --fp8-recipe (Megatron's default delayed),
    --fp8-param-gather, --fp8-amax-history-len, --first-last-layers-bf16 and its layer counts;
    --cuda-graph-impl (--enable-cuda-graph is local, --external-cuda-graph transformer_engine, as
    validate_args rewrites them), --cuda-graph-modules or the older --cuda-graph-scope ("full" is
    the whole layer, "full_iteration" the full_iteration impl: cuda_graph_config.py),
    --cuda-graph-warmup-steps; --fine-grained-activation-offloading and --offload-modules."""
    tr, r = tables["training"], tables["recompute"]
    fp8 = a.get("fp8_format") or a.get("fp8")
    if fp8 and a.get("bf16"):  # FP8 on other runs: `inexpressible`
        recipe = a.get("fp8_recipe") or "delayed"
        if recipe not in ("delayed", "tensorwise", "blockwise", "mxfp8"):
            raise _cannot("fp8_recipe", recipe, "only the delayed, tensorwise, blockwise and mxfp8 recipes are modelled")
        tr.update(precision="fp8", fp8_format=str(fp8), fp8_recipe=recipe,
                  fp8_param_gather=bool(a.get("fp8_param_gather") or a.get("fp8_param")))
        for name in ("fp8_amax_history_len", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if a.get(name) is not None:
                tr[name] = a[name]
        tr["first_last_layers_bf16"] = bool(a.get("first_last_layers_bf16"))
    impl = a.get("cuda_graph_impl") or "none"
    if impl == "none" and a.get("enable_cuda_graph"):
        impl = "local"
    if impl == "none" and a.get("external_cuda_graph"):
        impl = "transformer_engine"
    modules = module_list(a.get("cuda_graph_modules") or a.get("cuda_graph_scope"))
    if "full_iteration" in modules:  # the deprecated scope value names the impl
        impl, modules = "full_iteration", [x for x in modules if x != "full_iteration"]
    if modules == ["full"]:
        modules = []
    if impl != "none":
        tr["cuda_graph_impl"] = str(impl).split(".")[-1]
        tr["cuda_graph_modules"] = [str(x).split(".")[-1] for x in modules]
        if a.get("cuda_graph_warmup_steps") is not None:
            tr["cuda_graph_warmup_steps"] = a["cuda_graph_warmup_steps"]
    if a.get("fine_grained_activation_offloading"):
        r["fine_grained_activation_offloading"] = True
        r["offload_modules"] = module_list(a.get("offload_modules"))


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
                        f"the tokenizer's file, not in the arguments; give the model's vocabulary as --padded-vocab-size N",
                        name="tokenizer_type")


def _virtual_stages(a: Mapping[str, Any], num_layers: int, pp: int) -> int | None:
    """Model chunks per pipeline rank, as validate_args derives virtual_pipeline_model_parallel_size
    (None for 1)."""
    if a.get("virtual_pipeline_model_parallel_size"):
        vpp = a["virtual_pipeline_model_parallel_size"]
    elif a.get("pipeline_model_parallel_layout"):  # validate_args: the layout's stages / pp
        vpp = layout_virtual_stages(a["pipeline_model_parallel_layout"], pp)
    elif a.get("num_virtual_stages_per_pipeline_rank"):
        vpp = a["num_virtual_stages_per_pipeline_rank"]
    elif a.get("num_layers_per_virtual_pipeline_stage"):
        # validate_args counts the embedding and the loss as layers where they are accounted for
        counted = num_layers + bool(a.get("account_for_embedding_in_pipeline_split")) + \
            bool(a.get("account_for_loss_in_pipeline_split"))
        per_stage, per_chunk = counted // pp, a["num_layers_per_virtual_pipeline_stage"]
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
        cfg = resolved(Config(workload, **{s: SECTIONS[s](**tables[s]) for s in SECTIONS}))
    except TypeError as e:
        raise BadInput(f"Megatron arguments do not make a config ({e})") from None
    validate(cfg)
    return cfg


def overrides_as_flags(tables: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The tables of `megatron_overrides` as this product's command-line options: a dedicated flag
    where the field has one (`--tensor-model-parallel-size 4`), `--set section.attribute=value`
    otherwise; what `estimate` takes to model the same run."""
    from recompute_bench.config.fields import fields

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
