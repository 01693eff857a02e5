"""Megatron's rules for its FP8, CUDA-graph and activation-offload settings (framework megatron), and
this harness's own for `--compile` (`validate_compile`).

`config.rules.validate` calls `validate_fp8`, `validate_cuda_graphs`, `validate_offload` and
`validate_compile`; each
raises BadInput with one line naming the problem and the fix, as Megatron's validation would refuse
the run (megatron/training/arguments.py `validate_args`, megatron/core/transformer/
transformer_config.py `__post_init__`, megatron/core/transformer/transformer_layer.py
`_set_offload_modules`). This harness runs none of them but FP8, through torchao
(`validate_harness_fp8`): with framework recompute-bench every other field keeps its default.
"""

from __future__ import annotations

from recompute_bench.config.choices import CUDA_GRAPH_IMPLS, CUDA_GRAPH_MODULES, HARNESS_FP8_RECIPES, OFFLOAD_MODULES
from recompute_bench.config.schema import BadInput, Config

MOE_OFFLOAD_MODULES = ("expert_fc1", "moe_act", "fused_group_mlp")
MOE_GRAPH_MODULES = ("moe", "moe_router", "moe_preprocess")


def _list(path: str, value: object, example: str) -> None:
    if not isinstance(value, (list, tuple)):
        raise BadInput(f"{path} must be a list, got {value!r}; pass it as a TOML list: --set '{path}=[\"{example}\"]'")


def validate_fp8(cfg: Config) -> None:
    """FP8 under framework megatron: TE's linears (transformer_impl transformer_engine), FP8 primary
    weights only with the distributed optimizer, no bf16 first/last layers under delayed scaling,
    no layernorm / moe_act recompute under delayed scaling."""
    t, m = cfg.training, cfg.model
    fp8_only = {"fp8_param_gather": False, "first_last_layers_bf16": False}
    if t.precision != "fp8":
        for name, default in fp8_only.items():
            if getattr(t, name) != default:
                raise BadInput(f"training.{name} applies to FP8 runs only; pass --precision fp8 or drop it")
        if t.framework != "megatron" and t.fp8_recipe != "delayed":
            raise BadInput(f"--fp8-recipe {t.fp8_recipe} applies to FP8 runs only; pass --precision fp8 or drop it")
        return
    if t.framework != "megatron":
        validate_harness_fp8(cfg)
        return
    if t.fp8_recipe == "rowwise":
        raise BadInput("rowwise is torchao's recipe, which this harness runs; Megatron's --fp8-recipe is delayed, "
                       "tensorwise, blockwise or mxfp8: pass one of those")
    if m.transformer_impl != "transformer_engine":
        raise BadInput("FP8 runs in Transformer Engine's linears; pass --transformer-impl transformer_engine or "
                       "--precision bf16")
    if not isinstance(t.fp8_amax_history_len, int) or t.fp8_amax_history_len < 1:
        raise BadInput(f"fp8_amax_history_len must be a positive integer, got {t.fp8_amax_history_len!r}; pass "
                       "--set training.fp8_amax_history_len=1")
    if t.fp8_param_gather and not cfg.parallel.use_distributed_optimizer:
        # arguments.py: '--fp8-param-gather only supported with distributed optimizer, ...'
        raise BadInput("fp8_param_gather is only supported with the distributed optimizer (Megatron's rule); pass "
                       "--set parallel.use_distributed_optimizer=true or drop fp8_param_gather")
    if t.first_last_layers_bf16:
        if t.fp8_recipe == "delayed":
            raise BadInput("Delayed scaling does not support first / last layer in BF16 (Megatron's rule); pass "
                           "--set training.fp8_recipe=tensorwise or drop first_last_layers_bf16")
        per_stage = m.num_layers // cfg.parallel.pipeline_model_parallel_size
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            value = getattr(t, name)
            if not isinstance(value, int) or not 0 <= value <= per_stage:
                raise BadInput(f"{name} ({value}) must be between 0 and number of layers per pipeline stage "
                               f"({per_stage}); pass --set training.{name}=N")
    r = cfg.recompute
    if t.fp8_recipe == "delayed" and r.granularity == "selective" and {"moe_act", "layernorm"} & set(r.modules):
        raise BadInput("Delayed scaling does not support moe_act and layernorm recompute for fp8 (Megatron's rule); "
                       "pass --set training.fp8_recipe=tensorwise or drop those recompute modules")


def validate_harness_fp8(cfg: Config) -> None:
    """`--precision fp8` in this harness (`measure.float8`): torchao's float8 training, tensorwise or
    rowwise, on dense layers, one rank or data parallel (DDP), every linear dimension and the
    micro-batch's tokens a multiple of 16 (`torch._scaled_mm`'s rule; torchao's `_auto_filter_for_recipe`
    skips such linears, this harness refuses instead of measuring a model half in FP8). Whether the
    device can run it is `measure.float8.float8_problem`'s question, asked at launch."""
    t, m, p = cfg.training, cfg.model, cfg.parallel
    if t.fp8_recipe not in HARNESS_FP8_RECIPES:
        raise BadInput(f"--precision fp8 runs torchao's float8 training here, tensorwise or rowwise, not "
                       f"{t.fp8_recipe} (Transformer Engine's); pass --fp8-recipe tensorwise or rowwise")
    for name in ("fp8_format", "fp8_amax_history_len"):
        if getattr(t, name) != getattr(type(t), name):
            raise BadInput(f"training.{name} is Transformer Engine's; torchao's recipe sets it (tensorwise: E4M3 "
                           "forward, E5M2 gradients; rowwise: E4M3 throughout, no history): drop it")
    split = [f"{name} {size}" for name, size in (("tensor_model_parallel_size", p.tensor_model_parallel_size),
                                                 ("context_parallel_size", p.context_parallel_size),
                                                 ("pipeline_model_parallel_size", p.pipeline_model_parallel_size))
             if size > 1]
    if p.use_distributed_optimizer and p.data_parallel_size > 1:
        split.append("FSDP (use_distributed_optimizer)")
    if split:
        raise BadInput(f"--precision fp8 is measured on one rank and under DDP, not with {', '.join(split)}; "
                       "drop --precision fp8 or that parallelism")
    if m.num_moe_experts or m.multi_latent_attention:
        raise BadInput("--precision fp8 runs dense layers' linears in FP8 here; mixture-of-experts and multi-latent "
                       "attention are not measured in FP8: estimate them with --framework megatron")
    q, kv = m.num_attention_heads * m.head_dim, m.groups * m.head_dim
    ffn = m.ffn_hidden_size * (2 if m.activation == "swiglu" else 1)
    sizes = {"hidden_size": m.hidden_size, "query width": q, "key/value width": kv, "linear_fc1 width": ffn,
             "ffn_hidden_size": m.ffn_hidden_size, "tokens per micro-batch": t.seq_length * t.micro_batch_size}
    odd = [f"{name} {size}" for name, size in sizes.items() if size % 16]
    if odd:
        raise BadInput(f"FP8 matrix multiplies need every dimension a multiple of 16, and {', '.join(odd)} is not; "
                       "change the shape with --set or pass --precision bf16")


def validate_cuda_graphs(cfg: Config) -> None:
    """CUDA graphs (transformer_config.py `__post_init__`): per-layer graphs (local, TE) capture the
    modules listed; full_iteration takes none; full recompute needs full_iteration; layer-level CPU
    offloading only with full_iteration; MoE modules need MoE layers; TE's graphs need TE."""
    t, m, r = cfg.training, cfg.model, cfg.recompute
    _list("training.cuda_graph_modules", t.cuda_graph_modules, "mlp")
    impl, modules = t.cuda_graph_impl, list(t.cuda_graph_modules)
    if impl not in CUDA_GRAPH_IMPLS:
        raise BadInput(f"cuda_graph_impl {impl!r} is not one of {', '.join(CUDA_GRAPH_IMPLS)}; pass "
                       "--set training.cuda_graph_impl=transformer_engine")
    unknown = [x for x in modules if x not in CUDA_GRAPH_MODULES]
    if unknown:
        raise BadInput(f"unknown cuda_graph_modules {', '.join(map(str, unknown))}; pass any of "
                       f"{', '.join(CUDA_GRAPH_MODULES)} (none: the whole layer)")
    if not isinstance(t.cuda_graph_warmup_steps, int) or t.cuda_graph_warmup_steps < 0:
        raise BadInput(f"cuda_graph_warmup_steps must be 0 or more, got {t.cuda_graph_warmup_steps!r}; pass "
                       "--set training.cuda_graph_warmup_steps=3")
    if impl == "none":
        if modules:
            raise BadInput("cuda_graph_modules has no effect without CUDA graphs; pass --set "
                           "training.cuda_graph_impl=transformer_engine or drop cuda_graph_modules")
        return
    if t.framework != "megatron":
        raise BadInput("this harness does not capture CUDA graphs; estimate Megatron's with --framework megatron, or "
                       "drop cuda_graph_impl")
    if impl == "full_iteration" and modules:
        raise BadInput('cuda_graph_modules must be empty when cuda_graph_impl="full_iteration" (Megatron\'s rule); '
                       "drop cuda_graph_modules")
    if impl == "transformer_engine" and m.transformer_impl != "transformer_engine":
        raise BadInput("CUDA Graphs are not supported without TE (Megatron's rule); pass --transformer-impl "
                       "transformer_engine or --set training.cuda_graph_impl=local")
    if r.activation_offload_layers and impl != "full_iteration":
        raise BadInput("CUDA graphs not supported with CPU offloading (Megatron's rule); drop "
                       "--activation-offload-layers or pass --set training.cuda_graph_impl=full_iteration")
    if r.granularity == "full" and impl != "full_iteration":
        raise BadInput("full recompute is only supported with full iteration CUDA graph (Megatron's rule); pass "
                       "--set training.cuda_graph_impl=full_iteration or a selective recompute")
    if any(x in MOE_GRAPH_MODULES for x in modules) and not m.num_moe_experts:
        raise BadInput("moe cuda graph is only supported for MoE (Megatron's rule); drop moe, moe_router and "
                       "moe_preprocess from cuda_graph_modules")
    if "moe_preprocess" in modules and "moe_router" not in modules:
        raise BadInput("moe_preprocess cuda graph is only supported with moe_router cuda graph (Megatron's rule); "
                       "add moe_router to cuda_graph_modules")
    if r.granularity == "selective":
        whole = impl == "full_iteration" or not modules
        if m.attention_dropout and "core_attn" in r.modules and (whole or "attn" in modules):
            raise BadInput("attention dropout is not supported with graphed attention recomputation (Megatron's rule); "
                           "drop core_attn from recompute_modules or pass --set model.attention_dropout=0")
        if m.hidden_dropout and "mlp" in r.modules and (whole or "mlp" in modules):
            raise BadInput("hidden dropout is not supported with graphed MLP/MoE recomputation (Megatron's rule); "
                           "drop mlp from recompute_modules or pass --set model.hidden_dropout=0")


def validate_offload(cfg: Config) -> None:
    """Fine-grained activation offloading (transformer_config.py `__post_init__`): a non-empty list
    of Megatron's offload modules, not with layer-level CPU offloading, attn_proj only with
    core_attn, MoE modules only with MoE layers, TE's modules (Megatron Bridge
    `_validate_fine_grained_activation_offloading`)."""
    t, m, r = cfg.training, cfg.model, cfg.recompute
    _list("recompute.offload_modules", r.offload_modules, "core_attn")
    modules = list(r.offload_modules)
    if not r.fine_grained_activation_offloading:
        if modules:
            raise BadInput("offload_modules needs fine_grained_activation_offloading; pass --set "
                           "recompute.fine_grained_activation_offloading=true or drop offload_modules")
        return
    if t.framework != "megatron":
        raise BadInput("this harness does not offload modules; estimate Megatron's fine-grained offloading with "
                       "--framework megatron, or drop fine_grained_activation_offloading")
    unknown = [x for x in modules if x not in OFFLOAD_MODULES]
    if not modules or unknown:
        raise BadInput(f"Invalid choices for offload_modules: {', '.join(map(str, unknown)) or 'none given'}; pass "
                       f"--set recompute.offload_modules=[...] with any of {', '.join(OFFLOAD_MODULES)}")
    if r.activation_offload_layers:
        raise BadInput("fine_grained_activation_offloading cannot be enabled with cpu_offloading (Megatron's rule); "
                       "drop --activation-offload-layers or fine_grained_activation_offloading")
    if "attn_proj" in modules and "core_attn" not in modules:
        raise BadInput("attn_proj cannot be set to offload_modules alone without core_attn (Megatron's rule: its "
                       "input is core_attn's output, which core_attn's backward needs); add core_attn")
    if any(x in MOE_OFFLOAD_MODULES for x in modules) and not m.num_moe_experts:
        raise BadInput(f"{', '.join(x for x in modules if x in MOE_OFFLOAD_MODULES)} offloading needs "
                       "mixture-of-experts layers; drop it from offload_modules")
    if m.transformer_impl != "transformer_engine":
        raise BadInput("fine-grained activation offloading needs Transformer Engine's layers; pass "
                       "--transformer-impl transformer_engine")


def validate_compile(cfg: Config) -> None:
    """`--compile` (torch.compile per layer, `measure.compile`): this harness's, on one rank or data
    parallel; the layouts that split a layer (tensor, context parallel), cut the model into stages
    (pipeline) or move its saved tensors (activation offload) are not measured compiled. Whether
    torch.compile can build kernels on the device is `launch.compiler`'s question, asked at launch."""
    if not cfg.training.compile:
        return
    if cfg.training.framework != "recompute-bench":
        raise BadInput("--compile is how this harness runs its layers; Megatron's estimate has no such setting: drop "
                       "--compile or --framework megatron")
    p, r = cfg.parallel, cfg.recompute
    split = [f"{name} {size}" for name, size in (("tensor_model_parallel_size", p.tensor_model_parallel_size),
                                                 ("context_parallel_size", p.context_parallel_size),
                                                 ("pipeline_model_parallel_size", p.pipeline_model_parallel_size))
             if size > 1]
    if split:
        raise BadInput(f"--compile is measured on one rank and under data parallel, not with {', '.join(split)}; "
                       "drop --compile or that parallelism")
    if r.activation_offload_layers or any("offload" in str(e) for e in r.layer_policy):
        raise BadInput("--compile is not measured with activation offload (its saved-tensor hooks run outside the "
                       "compiled graphs); drop --compile or the offload")
