"""Megatron's own rules for the arguments only framework megatron models (`MEGATRON_ONLY_SETTINGS`):
one clear line each, as megatron/training/arguments.py `validate_args`, TransformerConfig and
ModelParallelConfig `__post_init__` reject them. Pure Python."""

from __future__ import annotations

from recompute_bench.config.choices import CROSS_ENTROPY_FUSION_IMPLS, OPTIMIZER_DTYPES, ROPE_TYPES
from recompute_bench.config.schema import BadInput, Config, check_choice


def validate_megatron_settings(cfg: Config) -> None:
    """The settings of MEGATRON_ONLY_SETTINGS, by Megatron's rules."""
    m, t, p = cfg.model, cfg.training, cfg.parallel
    check_choice("cross_entropy_fusion_impl", m.cross_entropy_fusion_impl, CROSS_ENTROPY_FUSION_IMPLS,
                 "pass --set model.cross_entropy_fusion_impl=native")
    for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        check_choice(name, getattr(t, name), OPTIMIZER_DTYPES, f"pass --set training.{name}=fp32")
    if m.rope_type is not None:
        check_choice("rope_type", m.rope_type, ROPE_TYPES, "pass --set model.rope_type=rope, or leave it unset")
        # argument_utils.py: common attention only supports rope_type "rope"
        if m.rope_type != "rope" and not m.multi_latent_attention:
            raise BadInput(f"rope_type {m.rope_type} applies to multi-latent attention only; drop --set model.rope_type")
    # optimizer/__init__.py: "--use-precision-aware-optimizer only supported with distributed optimizer"
    if t.use_precision_aware_optimizer and not p.use_distributed_optimizer:
        raise BadInput("the precision-aware optimizer (Transformer Engine's FusedAdam) runs under the distributed "
                       "optimizer only; pass --use-distributed-optimizer")
    if t.grad_reduce_in_bf16 and t.precision not in ("bf16", "fp8"):
        raise BadInput("grad_reduce_in_bf16 applies to bf16 runs; pass --precision bf16 or drop it")
    instances = p.num_distributed_optimizer_instances
    if not isinstance(instances, int) or instances < 1 or p.data_parallel_size % instances:
        raise BadInput(f"num_distributed_optimizer_instances {instances!r} must divide the data-parallel size "
                       f"{p.data_parallel_size} (each instance shards over dp / instances ranks); pass a divisor")
    if instances > 1 and not p.use_distributed_optimizer:
        raise BadInput("several distributed-optimizer instances need the distributed optimizer; pass "
                       "--use-distributed-optimizer")
    # model_parallel_config.py __post_init__
    if t.defer_embedding_wgrad_compute and p.pipeline_model_parallel_size == 1:
        raise BadInput("Cannot defer embedding wgrad compute when pipeline model parallel is not used (Megatron's "
                       "rule); pass --pipeline-model-parallel-size 2 or more, or drop defer_embedding_wgrad_compute")
    if not isinstance(t.wgrad_deferral_limit, int) or t.wgrad_deferral_limit < 0:
        raise BadInput(f"wgrad_deferral_limit must be 0 (every micro-batch) or more, got {t.wgrad_deferral_limit!r}; "
                       "pass --set training.wgrad_deferral_limit=N")
    if not isinstance(m.mtp_num_layers, int) or isinstance(m.mtp_num_layers, bool) or m.mtp_num_layers < 0:
        raise BadInput(f"mtp_num_layers must be 0 (none) or more, got {m.mtp_num_layers!r}; pass "
                       "--set model.mtp_num_layers=N")
    if m.multi_latent_attention and m.transformer_impl != "transformer_engine":
        raise BadInput("multi-latent attention is modelled with Transformer Engine's modules (Megatron's default); "
                       "pass --transformer-impl transformer_engine")
    # arguments.py validate_args: "Tensor parallel communication/GEMM overlap can happen only when
    # sequence parallelism is enabled"; initialize.py _initialize_tp_communicators needs TE
    if p.tp_comm_overlap and not p.sequence_parallel:
        raise BadInput("tp_comm_overlap overlaps sequence parallel's communication; pass --sequence-parallel or drop "
                       "--set parallel.tp_comm_overlap")
    if p.tp_comm_overlap and m.transformer_impl != "transformer_engine":
        raise BadInput("tp_comm_overlap runs in Transformer Engine's linears; pass --transformer-impl "
                       "transformer_engine or drop --set parallel.tp_comm_overlap")
    # arguments.py validate_args: --overlap-param-gather needs the distributed optimizer and --overlap-grad-reduce
    if p.overlap_param_gather and not p.use_distributed_optimizer:
        raise BadInput("overlap_param_gather overlaps the distributed optimizer's parameter all-gather; pass "
                       "--use-distributed-optimizer or drop --set parallel.overlap_param_gather")
    if p.overlap_param_gather and not p.overlap_grad_reduce:
        raise BadInput("overlap_param_gather needs overlap_grad_reduce (Megatron's rule); pass "
                       "--set parallel.overlap_grad_reduce=true or drop --set parallel.overlap_param_gather")
    bucket = p.ddp_bucket_size
    if bucket is not None and (not isinstance(bucket, int) or isinstance(bucket, bool) or bucket < 1):
        raise BadInput(f"ddp_bucket_size must be a positive number of elements, got {bucket!r}; pass "
                       "--set parallel.ddp_bucket_size=N or leave it unset for Megatron's default")
    # arguments.py validate_args: without p2p overlap the interleaved schedule needs pp > 2, "to avoid
    # having multiple p2p sends and recvs between same 2 ranks per communication batch"
    if p.interleaved and p.overlap_p2p_comm is False and p.pipeline_model_parallel_size <= 2:
        raise BadInput(f"the interleaved schedule without overlap_p2p_comm needs pipeline_model_parallel_size over 2 "
                       f"(Megatron's rule), got {p.pipeline_model_parallel_size}; pass --pipeline-model-parallel-size 3 "
                       "or more, or drop --set parallel.overlap_p2p_comm=false")
    if p.microbatch_group_size_per_vp_stage is not None and not p.virtual_pipeline_model_parallel_size:
        raise BadInput("microbatch_group_size_per_vp_stage groups the interleaved schedule's micro-batches; set "
                       "virtual_pipeline_model_parallel_size or drop it")
