"""The words a setting may take: each choice field's allowed values, as Megatron spells them, and
the names of the fields only framework megatron models. Pure data, read by `config/rules.py`
(which refuses a value outside them), the models and the estimate."""

GRANULARITIES = ("none", "selective", "full")
METHODS = ("uniform", "block")
PRECISIONS = ("bf16", "fp16", "fp32", "fp8")
"""fp8: bf16 weights, activations and gradients with the linears' matrix multiplies in FP8
(Megatron's --bf16 with --fp8-format; the scaling is `fp8_recipe`)."""
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "rowwise")
"""Megatron's --fp8-recipe (Transformer Engine's DelayedScaling, Float8CurrentScaling,
Float8BlockScaling, MXFP8BlockScaling); delayed is Megatron's default. rowwise is torchao's, which
this harness runs beside tensorwise (`measure.float8`)."""
HARNESS_FP8_RECIPES = ("tensorwise", "rowwise")
"""The recipes of torchao's float8 training this harness runs under --precision fp8."""
FP8_FORMATS = ("hybrid", "e4m3")
"""Megatron's --fp8-format: hybrid (E4M3 forward, E5M2 gradients) or e4m3 throughout."""
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine", "full_iteration")
"""Megatron's --cuda-graph-impl (TransformerConfig.cuda_graph_impl)."""
CUDA_GRAPH_MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess")
"""Megatron's --cuda-graph-modules (the older --cuda-graph-scope) of a per-layer graph; none: the
whole layer (megatron/core/transformer/enums.py CudaGraphModule, less mamba)."""
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act",
                   "fused_group_mlp")
"""Megatron's --offload-modules (TransformerConfig.offload_modules) of fine-grained activation
offloading, in Megatron's order."""
ATTENTION_BACKENDS = ("sdpa", "math")
# Megatron's `--attention-backend` (megatron/core/transformer/enums.py AttnBackend), which the estimate
# of `framework megatron` takes; this harness runs its own two above.
MEGATRON_ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")
# What runs the step: this harness (measured and estimated exactly), or Megatron-LM / Megatron Bridge
# as they run (estimated from Megatron's code, checked against its functional tests' memory).
FRAMEWORKS = ("recompute-bench", "megatron")
# Megatron's `--transformer-impl`: its own modules, or Transformer Engine's.
TRANSFORMER_IMPLS = ("local", "transformer_engine")
# Fields that describe how Megatron runs: framework recompute-bench takes their defaults only.
MEGATRON_ONLY = ("transformer_impl", "masked_softmax_fusion", "attention_softmax_in_fp32", "cross_entropy_loss_fusion")
# Megatron's arguments of the dense world and of multi-latent attention that only framework megatron
# models (section.attribute): framework recompute-bench takes their defaults only.
MEGATRON_ONLY_SETTINGS = (
    "model.qk_layernorm", "model.attention_output_gate", "model.add_qkv_bias", "model.cross_entropy_fusion_impl",
    "model.rope_type", "model.apply_rope_fusion", "model.mtp_num_layers",
    "training.create_attention_mask_in_dataloader", "training.use_precision_aware_optimizer",
    "training.main_grads_dtype", "training.main_params_dtype", "training.exp_avg_dtype", "training.exp_avg_sq_dtype",
    "training.grad_reduce_in_bf16", "training.defer_embedding_wgrad_compute", "training.wgrad_deferral_limit",
    "training.gradient_accumulation_fusion",
    "parallel.num_distributed_optimizer_instances", "parallel.decoder_first_pipeline_num_layers",
    "parallel.decoder_last_pipeline_num_layers", "parallel.account_for_embedding_in_pipeline_split",
    "parallel.account_for_loss_in_pipeline_split", "parallel.pipeline_model_parallel_layout",
    "parallel.microbatch_group_size_per_vp_stage", "parallel.tp_comm_overlap",
    "parallel.overlap_grad_reduce", "parallel.overlap_param_gather", "parallel.ddp_bucket_size",
    "parallel.overlap_p2p_comm", "parallel.scatter_gather_tensors_in_pipeline")
MEGATRON_ACTIVATIONS = ("squared_relu",)
"""Activations framework megatron models beyond ACTIVATIONS (Megatron's --squared-relu)."""
CROSS_ENTROPY_FUSION_IMPLS = ("native", "te")
"""Megatron's --cross-entropy-fusion-impl: its own fused cross-entropy or Transformer Engine's."""
OPTIMIZER_DTYPES = ("fp32", "fp16", "bf16", "fp8")
"""The precision-aware optimizer's dtypes (--main-grads-dtype, --main-params-dtype, --exp-avg-dtype,
--exp-avg-sq-dtype), as Megatron spells them."""
ROPE_TYPES = ("rope", "yarn")
"""Megatron's --rope-type for multi-latent attention (None: MLA's default, yarn)."""
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("gelu", "swiglu")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
ROUTER_SCORE_FUNCTIONS = ("softmax", "sigmoid")
TOKEN_DROP_POLICIES = ("probs", "position")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
"""Megatron's --moe-router-load-balancing-type values (router.py TopKRouter.routing)."""
TOKEN_DISPATCHER_TYPES = ("allgather", "alltoall", "flex")
"""Megatron's --moe-token-dispatcher-type values (moe_layer.py MoELayer.__init__)."""
ROUTER_DTYPES = ("fp32", "fp64")
"""Megatron's --moe-router-dtype values (router.py Router.gating); None: the input's dtype."""
MEGATRON_MOE_DEFAULTS = {"moe_token_dispatcher_type": "allgather"}
"""Framework megatron: Megatron's defaults of the MoE fields whose default here is what this harness
runs (transformer_config.py: moe_token_dispatcher_type "allgather"; the harness dispatches by
all-to-all)."""
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
"""Megatron's --cp-comm-type values (TransformerConfig.cp_comm_type)."""
HARNESS_COMM_TYPES = ("p2p", "all_gather")
"""The cp_comm_type values this harness runs (`models.cp_attention`); a2a and a2a+p2p are Megatron's too."""
PIPELINE_SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""torch.distributed.pipelining's schedule names (its `get_schedule_class`), as torchtitan's
`pipeline_parallel_schedule` takes them."""
MEGATRON_SCHEDULES = ("1F1B", "Interleaved1F1B")
"""The schedules framework megatron runs (Megatron's schedules.py: 1F1B, interleaved 1F1B with virtual stages)."""
INTERLEAVED_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")
"""Schedules over virtual stages r, r + p, r + 2p, ... on rank r (Megatron's interleaving)."""
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""Schedules whose rank r holds virtual stages r and 2p - 1 - r (the "V"): exactly two per rank."""
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""Schedules that split a backward into an input-gradient and a weight-gradient pass (torch's
`stage_backward_input`: `autograd.grad` with `inputs`), which a re-entrant checkpoint refuses."""

# Every module name Megatron accepts, in Megatron's order; the order is also the canonical
# order of a module list in records and golden keys.
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts", "mla_up_proj")
# The modules every dense layer offers (what sweeps and verify enumerate by default); the rest need
# MoE or MLA layers (a model's own list: `Config.spec.recompute_targets`).
SUPPORTED_RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")
# What each module other than core_attn and layernorm needs of the model, for the refusal's message.
_MODULE_NEEDS = {
    "mlp": "dense MLP layers (with moe_layer_freq 1 every layer is a mixture-of-experts layer; use moe)",
    "moe": "mixture-of-experts layers",
    "moe_act": "mixture-of-experts layers with grouped GEMM (--set model.moe_grouped_gemm=true)",
    "shared_experts": "mixture-of-experts layers with shared experts",
    "mla_up_proj": "multi-latent attention",
}
