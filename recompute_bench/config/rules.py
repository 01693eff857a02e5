"""Megatron Core's rules for a resolved point, and the model's own shape rules.

`validate()` applies every rule before anything is built, so bad input fails with one clear line
(`BadInput`: the problem and the fix) instead of a traceback deep inside torch.
"""

from __future__ import annotations

import dataclasses
import math

from recompute_bench.config.fields import defaults
from recompute_bench.config.pipeline_split import model_chunks, uneven, validate_split
from recompute_bench.config.megatron_rules import validate_megatron_settings
from recompute_bench.config.performance_rules import validate_compile, validate_cuda_graphs, validate_fp8, validate_offload
from recompute_bench.config.choices import (_MODULE_NEEDS, ACTIVATIONS, ATTENTION_BACKENDS, CP_COMM_TYPES, FP8_FORMATS,
                                            FP8_RECIPES, FRAMEWORKS, GRANULARITIES, HARNESS_COMM_TYPES,
                                            INTERLEAVED_SCHEDULES, LOAD_BALANCING_TYPES, MEGATRON_ACTIVATIONS,
                                            MEGATRON_ATTENTION_BACKENDS, MEGATRON_ONLY, MEGATRON_ONLY_SETTINGS,
                                            MEGATRON_SCHEDULES, METHODS, NORMALIZATIONS, PIPELINE_SCHEDULES,
                                            POSITION_EMBEDDINGS, PRECISIONS, RECOMPUTE_MODULES, ROUTER_DTYPES,
                                            ROUTER_SCORE_FUNCTIONS, TOKEN_DISPATCHER_TYPES, TOKEN_DROP_POLICIES,
                                            TRANSFORMER_IMPLS, V_SCHEDULES)
from recompute_bench.config.schema import SECTIONS, BadInput, check_choice, Config
from recompute_bench.config.cp_comm import comm_levels, layer_comm_types

VPP_FLAG = "--set parallel.virtual_pipeline_model_parallel_size"


def layers_per_model_chunk(cfg: Config) -> int:
    """Layers of one model chunk: a pipeline stage's layers, split over its virtual stages when the
    interleaved schedule is on. Megatron builds one TransformerBlock per chunk and applies full
    recompute's method and `recompute_num_layers` within each."""
    p = cfg.parallel
    if uneven(cfg):  # Megatron's uneven splits: the largest chunk of any rank bounds recompute_num_layers
        return max(c.layers for r in range(p.pipeline_model_parallel_size) for c in model_chunks(cfg, r))
    return cfg.model.num_layers // p.pipeline_model_parallel_size // (p.virtual_pipeline_model_parallel_size or 1)


def _chunk_words(cfg: Config) -> str:
    """Where the bound on recompute_num_layers comes from, for messages."""
    p = cfg.parallel
    stage = cfg.model.num_layers // p.pipeline_model_parallel_size
    if p.virtual_pipeline_model_parallel_size:
        return (f"layers per model chunk: {stage} per pipeline stage / virtual_pipeline_model_parallel_size "
                f"{p.virtual_pipeline_model_parallel_size}")
    return "layers per pipeline stage"


def validate(cfg: Config) -> None:
    """Apply Megatron Core's recompute rules and the model's own shape rules; raise BadInput."""
    m, t, p = cfg.model, cfg.training, cfg.parallel

    for name, value in (("num_layers", m.num_layers), ("hidden_size", m.hidden_size),
                        ("num_attention_heads", m.num_attention_heads), ("ffn_hidden_size", m.ffn_hidden_size),
                        ("vocab_size", m.vocab_size), ("make_vocab_size_divisible_by", m.make_vocab_size_divisible_by), ("seq_length", t.seq_length),
                        ("micro_batch_size", t.micro_batch_size), ("global_batch_size", t.global_batch_size),
                        ("measured_steps", t.measured_steps)):
        if not isinstance(value, int) or value < 1:
            raise BadInput(f"{name} must be a positive integer, got {value!r}; pass --{name.replace('_', '-')} N "
                              f"or --set {_section_of(name)}.{name}=N")
    if t.warmup_steps < 0:
        raise BadInput(f"warmup_steps must be 0 or more, got {t.warmup_steps}; pass --set training.warmup_steps=N")
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise BadInput(f"hidden_size {m.hidden_size} is not divisible by num_attention_heads "
                          f"{m.num_attention_heads}; change one with --set model.hidden_size=... or model.num_attention_heads=...")
    if m.num_attention_heads % m.groups:
        raise BadInput(f"num_attention_heads {m.num_attention_heads} is not divisible by num_query_groups "
                          f"{m.groups}; pass --set model.num_query_groups=G with G dividing the heads")
    check_choice("normalization", m.normalization, NORMALIZATIONS, "set model.normalization")
    megatron = t.framework == "megatron"
    check_choice("activation", m.activation, ACTIVATIONS + (MEGATRON_ACTIVATIONS if megatron else ()),
                 "set model.activation" + ("" if megatron else " (squared_relu goes with --framework megatron)"))
    check_choice("position_embedding_type", m.position_embedding_type, POSITION_EMBEDDINGS,
                 "set model.position_embedding_type")
    _validate_framework(cfg)
    check_choice("precision", t.precision, PRECISIONS, "pass --precision bf16, fp16, fp32 or fp8")
    check_choice("fp8_recipe", t.fp8_recipe, FP8_RECIPES, "pass --set training.fp8_recipe=tensorwise")
    check_choice("fp8_format", t.fp8_format, FP8_FORMATS, "pass --set training.fp8_format=hybrid")
    validate_fp8(cfg)
    validate_cuda_graphs(cfg)
    validate_compile(cfg)
    if m.position_embedding_type == "rope" and m.head_dim % 2:
        raise BadInput(f"RoPE needs an even head dimension, got {m.head_dim}; change hidden_size or num_attention_heads")
    if m.position_embedding_type == "rope" and t.framework == "recompute-bench" and t.seq_length > m.max_position_embeddings:
        # the harness's RoPE tables hold max_position_embeddings rows (models/dense/layers.py RotaryEmbedding)
        raise BadInput(f"seq_length {t.seq_length} is longer than the {m.max_position_embeddings} positions of the "
                       f"RoPE tables (max_position_embeddings); pass --set model.max_position_embeddings={t.seq_length} "
                       f"or more")
    if m.position_embedding_type == "learned_absolute" and t.seq_length > m.max_position_embeddings:
        raise BadInput(f"seq_length {t.seq_length} is longer than max_position_embeddings "
                          f"{m.max_position_embeddings}; lower --seq-length or --set model.max_position_embeddings=N")
    for name, value in (("hidden_dropout", m.hidden_dropout), ("attention_dropout", m.attention_dropout)):
        if not 0.0 <= value < 1.0:
            raise BadInput(f"{name} must lie in [0, 1), got {value}; pass --set model.{name}=0.1")

    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size"):
        if getattr(p, name) < 1:
            raise BadInput(f"{name} must be 1 or more, got {getattr(p, name)}")
    _validate_context_parallel(cfg)
    if p.sequence_parallel and p.tensor_model_parallel_size <= 1:
        raise BadInput("sequence parallelism needs tensor parallelism; pass --tensor-model-parallel-size 2 or more, "
                          "or drop --sequence-parallel")
    tp = p.tensor_model_parallel_size
    if m.num_attention_heads % tp or m.groups % tp:
        raise BadInput(f"tensor_model_parallel_size {tp} must divide num_attention_heads {m.num_attention_heads} and "
                          f"num_query_groups {m.groups} (Megatron shards whole heads); change --tensor-model-parallel-size")
    if m.ffn_hidden_size % tp:
        raise BadInput(f"tensor_model_parallel_size {tp} must divide ffn_hidden_size {m.ffn_hidden_size} (the MLP's "
                          f"columns are split over the ranks); change --tensor-model-parallel-size")
    if p.sequence_parallel and t.seq_length % tp:
        raise BadInput(f"sequence parallelism splits seq_length {t.seq_length} over tensor_model_parallel_size {tp}, "
                          f"which does not divide it; pass --seq-length as a multiple of {tp}")
    if uneven(cfg):
        pass  # Megatron's uneven splits: validate_split below
    elif m.num_layers % p.pipeline_model_parallel_size:
        raise BadInput(f"num_layers {m.num_layers} is not divisible by pipeline_model_parallel_size "
                          f"{p.pipeline_model_parallel_size}; change --num-layers or --pipeline-model-parallel-size")
    vpp, stage_layers = p.virtual_pipeline_model_parallel_size, m.num_layers // p.pipeline_model_parallel_size
    if vpp is not None and p.pipeline_model_parallel_size == 1:
        # Megatron: the interleaved schedule needs pipeline-model-parallel size greater than 1.
        raise BadInput(f"virtual_pipeline_model_parallel_size {vpp} needs pipeline parallelism (the interleaved "
                          f"schedule splits each pipeline stage into model chunks); pass --pipeline-model-parallel-size 2 "
                          f"or more, or drop {VPP_FLAG}")
    if vpp is not None and (not isinstance(vpp, int) or vpp < 1 or (stage_layers % vpp and not uneven(cfg))):
        raise BadInput(f"virtual_pipeline_model_parallel_size {vpp} must divide the {stage_layers} layers of each "
                          f"pipeline stage; pass {VPP_FLAG}=M with M dividing {stage_layers}")
    n = t.global_batch_size // (t.micro_batch_size * p.data_parallel_size)
    group = p.microbatch_group_size_per_vp_stage or p.pipeline_model_parallel_size
    if vpp and p.schedule in INTERLEAVED_SCHEDULES and p.microbatch_group_size_per_vp_stage is None \
            and n % p.pipeline_model_parallel_size:
        # Megatron: the micro-batches go through the virtual stages in groups of p (schedules.py,
        # forward_backward_pipelining_with_interleaving); a last group of fewer stalls the pipeline.
        raise BadInput(f"the interleaved schedule needs the number of micro-batches ({n}) to be a multiple of "
                          f"pipeline_model_parallel_size {p.pipeline_model_parallel_size}; pass --global-batch-size as "
                          f"a multiple of {p.pipeline_model_parallel_size * t.micro_batch_size * p.data_parallel_size}")
    if vpp and p.microbatch_group_size_per_vp_stage is not None and (
            not p.pipeline_model_parallel_size <= group <= n or 0 < n % group < p.pipeline_model_parallel_size):
        # forward_backward_pipelining_with_interleaving: the group lies in [p, n], and a last group
        # smaller than p would stall the pipeline
        raise BadInput(f"microbatch_group_size_per_vp_stage {group} must lie between pipeline_model_parallel_size "
                       f"{p.pipeline_model_parallel_size} and the {n} micro-batches, and leave a last group of 0 or at "
                       f"least {p.pipeline_model_parallel_size}; change it or --global-batch-size")
    if t.global_batch_size % (t.micro_batch_size * p.data_parallel_size):
        raise BadInput(f"global_batch_size {t.global_batch_size} is not divisible by micro_batch_size "
                          f"{t.micro_batch_size} x data_parallel_size {p.data_parallel_size}; "
                          f"pass --global-batch-size as a multiple of it")

    _validate_pipeline(cfg)
    if uneven(cfg):
        validate_split(cfg)
    if megatron:
        validate_megatron_settings(cfg)
    if m.multi_latent_attention:
        _validate_mla(cfg)
    if m.num_moe_experts is not None:
        _validate_moe(cfg)
    _validate_expert_parallel(cfg)
    _validate_recompute(cfg)
    validate_offload(cfg)


def _validate_pipeline(cfg: Config) -> None:
    """The pipeline schedule's own rules (Megatron's where it has the schedule, torch's otherwise);
    framework megatron runs Megatron's schedules only (MEGATRON_SCHEDULES)."""
    p = cfg.parallel
    pp, vpp, schedule, n = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size, p.schedule, cfg.num_microbatches
    if p.pipeline_parallel_schedule is None:
        return
    check_choice("pipeline_parallel_schedule", schedule, PIPELINE_SCHEDULES, "pass --pp-schedule 1F1B")
    if cfg.training.framework == "megatron" and schedule not in MEGATRON_SCHEDULES:
        raise BadInput(f"Megatron runs the 1F1B schedule (interleaved with virtual stages), not {schedule}; drop "
                       "--pp-schedule")
    if pp == 1:
        raise BadInput(f"pipeline_parallel_schedule {schedule} needs pipeline parallelism; pass --pp 2 or more, "
                          "or drop --pp-schedule")
    if schedule in V_SCHEDULES and vpp != 2:
        raise BadInput(f"{schedule} needs exactly two stages per rank (the V: rank r holds stages r and 2p - 1 - r); "
                          f"pass {VPP_FLAG}=2")
    if schedule in INTERLEAVED_SCHEDULES and not vpp:
        raise BadInput(f"{schedule} interleaves model chunks: pass {VPP_FLAG}=M (M >= 2 chunks per rank), "
                          "or --pp-schedule 1F1B")
    if schedule in ("1F1B", "GPipe") and vpp:
        raise BadInput(f"{schedule} runs one model chunk per rank; drop {VPP_FLAG} or pass --pp-schedule Interleaved1F1B")
    if schedule == "DualPipeV" and n < 2 * pp:
        raise BadInput(f"DualPipeV needs at least as many micro-batches as stages (2 x pp = {2 * pp}), got {n}; "
                          f"pass --global-batch-size {2 * pp * cfg.training.micro_batch_size * p.data_parallel_size} or more")


def _validate_context_parallel(cfg: Config) -> None:
    """Megatron's context-parallel rules: the sequence splits into 2 x cp equal chunks
    (megatron/core/utils.py `get_batch_on_this_cp_rank` views it as [2cp, s / 2cp]), and sequence
    parallel splits each rank's s / cp tokens again over tp. cp_comm_type names one type or one per
    layer (transformer_config.py: a list must have num_layers entries); a2a+p2p needs two
    hierarchical levels whose product is cp (arguments.py validate_args, parallel_state.py, and
    Transformer Engine's `attn_forward_func_with_cp`: cp_group = [a2a group, p2p group])."""
    p, s, m = cfg.parallel, cfg.training.seq_length, cfg.model
    cp = p.context_parallel_size
    if not isinstance(cp, int) or cp < 1:
        raise BadInput(f"context_parallel_size must be a positive integer, got {cp!r}; pass --context-parallel-size N")
    types = layer_comm_types(str(p.cp_comm_type), m.num_layers)
    for kind in types:
        check_choice("cp_comm_type", kind, CP_COMM_TYPES, "pass --set parallel.cp_comm_type=p2p")
    if len(types) != m.num_layers:
        raise BadInput(f"cp_comm_type lists {len(types)} types for {m.num_layers} layers; pass one type for every "
                       f"layer (--set parallel.cp_comm_type=p2p) or {m.num_layers} separated by spaces")
    sizes = p.hierarchical_context_parallel_sizes
    if sizes is not None and (not isinstance(sizes, list) or len(sizes) != 2
                              or not all(isinstance(n, int) and n >= 1 for n in sizes) or sizes[0] * sizes[1] != cp):
        a2a = min(n for n in range(2, cp + 1) if cp % n == 0) if cp > 1 else 1
        raise BadInput(f"hierarchical_context_parallel_sizes {sizes!r} must be two sizes [a2a, p2p] whose product is "
                       f"context_parallel_size {cp}; pass --set parallel.hierarchical_context_parallel_sizes=[{a2a},{cp // a2a}]")
    if cp == 1:
        return
    if s % (2 * cp):
        raise BadInput(f"context parallel {cp} splits seq_length {s} into 2 x cp = {2 * cp} chunks, which do not "
                       f"divide it; pass --seq-length as a multiple of {2 * cp} or a smaller --context-parallel-size")
    if p.sequence_parallel and (s // cp) % p.tensor_model_parallel_size:
        raise BadInput(f"sequence parallelism splits each context-parallel rank's {s // cp} tokens over "
                       f"tensor_model_parallel_size {p.tensor_model_parallel_size}, which does not divide them; "
                       f"pass --seq-length as a multiple of {2 * cp * p.tensor_model_parallel_size}")
    if "a2a+p2p" in types and sizes is None:
        raise BadInput("cp_comm_type a2a+p2p needs the two levels of context parallel; pass --set "
                       f"parallel.hierarchical_context_parallel_sizes=[A2A,P2P] with A2A x P2P = {cp}")
    tp = p.tensor_model_parallel_size
    for kind in sorted(set(types)) if not (m.num_attention_heads % tp or m.groups % tp) else ():
        a2a = comm_levels(kind, cp, sizes)[1]
        # context_parallel.py AttnFuncWithCPAndQKVOA2A / flash_attn_a2a_communicate: the heads of
        # each tensor-parallel rank are split over the all-to-all's ranks
        if (m.num_attention_heads // tp) % a2a or (m.groups // tp) % a2a:
            raise BadInput(f"cp_comm_type {kind} splits each tensor-parallel rank's {m.num_attention_heads // tp} "
                           f"heads and {m.groups // tp} query groups over {a2a} ranks, which do not divide them; "
                           f"pass another --set parallel.cp_comm_type or --context-parallel-size")
    if cfg.training.framework == "recompute-bench":
        _validate_harness_context_parallel(cfg)
        return
    # megatron/core/transformer/dot_product_attention.py: "Context parallelism is only supported by
    # TEDotProductAttention"; Transformer Engine's get_attention_backend disables
    # UnfusedDotProductAttention under context parallel, leaving no kernel for --attention-backend unfused.
    if m.transformer_impl == "local":
        raise BadInput("Megatron runs context parallel only with Transformer Engine's attention; pass "
                       "--transformer-impl transformer_engine or drop --context-parallel-size")
    if m.attention_backend == "unfused":
        raise BadInput("Transformer Engine's unfused attention cannot split the sequence over context-parallel "
                       "ranks; pass --attention-backend flash, fused or auto, or drop --context-parallel-size")
    if m.multi_latent_attention:  # the CP attention terms are written for MHA/GQA's head shapes
        raise BadInput("context parallel with multi-latent attention is not modelled for framework megatron; drop "
                       "--context-parallel-size")


def _validate_harness_context_parallel(cfg: Config) -> None:
    """What this harness runs under context parallel (`models.cp_attention`): dense attention split
    by an all-gather of K and V or a ring of them, through sdpa's kernels."""
    m, p = cfg.model, cfg.parallel
    if p.cp_comm_type not in HARNESS_COMM_TYPES:
        raise BadInput(f"this harness splits attention over context-parallel ranks with p2p (a ring of K and V) or "
                       f"all_gather, not {p.cp_comm_type}; pass --set parallel.cp_comm_type=p2p or all_gather, or "
                       f"estimate Megatron's {p.cp_comm_type} with --framework megatron")
    if m.attention_backend != "sdpa":
        raise BadInput(f"attention backend {m.attention_backend} cannot split over context-parallel ranks (it keeps "
                       f"every score for backward; the split merges blocks by their log-sum-exp): pass "
                       f"--attention-backend sdpa with --context-parallel-size")
    if m.num_moe_experts or m.multi_latent_attention:
        raise BadInput("this harness runs context parallel on dense attention and MLP layers; mixture-of-experts and "
                       "multi-latent attention under it are not measured yet: drop --context-parallel-size")


def _validate_framework(cfg: Config) -> None:
    """The framework and the implementation fields: each framework takes its own names."""
    m, t = cfg.model, cfg.training
    check_choice("framework", t.framework, FRAMEWORKS, "pass --framework recompute-bench or megatron")
    check_choice("transformer_impl", m.transformer_impl, TRANSFORMER_IMPLS,
                 "pass --transformer-impl local or transformer_engine")
    if t.framework == "megatron":
        check_choice("attention_backend", m.attention_backend, MEGATRON_ATTENTION_BACKENDS,
                     "framework megatron takes Megatron's --attention-backend (auto is its default)")
        # megatron/training/arguments.py validate_args: '--attention-backend local is only supported with --spec local'
        if m.attention_backend == "local" and m.transformer_impl != "local":
            raise BadInput("Megatron runs --attention-backend local only with its local layers; pass "
                              "--transformer-impl local or another --attention-backend")
        return
    check_choice("attention_backend", m.attention_backend, ATTENTION_BACKENDS,
                 "pass --attention-backend sdpa or math (Megatron's names go with --framework megatron)")
    if m.transformer_impl != "local":  # transformer_engine: where it imports on CUDA, for what te_layers builds
        from recompute_bench.backends.transformer_engine import te_problem
        problem = te_problem(cfg)
        if problem:
            raise BadInput(problem)
    path = _non_default(cfg, [f"model.{name}" for name in MEGATRON_ONLY if name != "transformer_impl"])
    if path is not None:
        raise BadInput(f"{path} describes how Megatron runs; drop it, or estimate Megatron with --framework megatron")
    path = _non_default(cfg, MEGATRON_ONLY_SETTINGS)
    if path is not None:
        raise BadInput(f"{path} is a Megatron argument this harness does not run; drop it, or estimate "
                       "Megatron with --framework megatron")


def _non_default(cfg: Config, paths) -> str | None:
    """The first of `paths` ("section.attribute") whose value in cfg is not its field's default."""
    default = defaults()
    for path in paths:
        section, name = path.split(".")
        if getattr(getattr(cfg, section), name) != default[path]:
            return path
    return None


def _validate_expert_parallel(cfg: Config) -> None:
    """Megatron's expert-parallel rules. A data_parallel_size of 1 is the "not given" of a launch
    (it becomes the world): `check_expert_parallel_world` checks the world once it is known."""
    m, p = cfg.model, cfg.parallel
    ep = p.expert_model_parallel_size
    if not isinstance(ep, int) or ep < 1:
        raise BadInput(f"expert_model_parallel_size must be a positive integer, got {ep!r}; pass --ep N")
    if ep > 1 and m.num_moe_experts is None:
        raise BadInput(f"expert_model_parallel_size {ep} needs a mixture-of-experts model (num_moe_experts); "
                          "pass --ep 1 or a MoE workload such as -w tiny-moe")
    if m.num_moe_experts is None:
        return
    if m.num_moe_experts % ep:
        raise BadInput(f"num_moe_experts {m.num_moe_experts} is not divisible by expert_model_parallel_size {ep}; "
                          f"pass --ep N with N dividing {m.num_moe_experts}")
    if cfg.training.framework == "megatron":
        # parallel_state.py initialize_model_parallel: the world divides into etp x ep x pp
        # (x expert data parallel), the same ranks as tp x cp x dp x pp.
        shared, experts = p.tensor_model_parallel_size * p.context_parallel_size * p.data_parallel_size, \
            p.expert_tensor_parallel * ep
        if shared % experts:
            raise BadInput(f"expert_tensor_parallel_size {p.expert_tensor_parallel} x expert_model_parallel_size {ep} "
                           f"must divide the {shared} ranks of a pipeline stage (tp x cp x dp); pass --dp as a "
                           f"multiple of {experts // math.gcd(experts, p.tensor_model_parallel_size * p.context_parallel_size)}, "
                           f"or a smaller --ep or --set parallel.expert_tensor_parallel_size")
    elif ep > 1 and p.data_parallel_size > 1:
        check_expert_parallel_world(cfg)


def check_expert_parallel_world(cfg: Config) -> None:
    """Megatron: expert parallel spreads the experts over data-parallel ranks, so ep must divide
    data_parallel_size (tensor parallel is 1 with MoE here); BadInput otherwise."""
    p = cfg.parallel
    if cfg.training.framework == "megatron":
        return  # validate checks Megatron's expert layout over tp x cp x dp with the size given
    ep, dp = p.expert_model_parallel_size, p.data_parallel_size
    if dp % ep:
        raise BadInput(f"expert_model_parallel_size {ep} must divide the data-parallel size {dp} (the experts are "
                          f"spread over data-parallel ranks); pass --nproc-per-node (or --data-parallel-size) a "
                          f"multiple of {ep}, or a smaller --ep")


def _validate_moe(cfg: Config) -> None:
    """The mixture-of-experts fields, one clear line each."""
    m = cfg.model
    for name in ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                 "moe_router_num_groups", "moe_router_group_topk"):
        value = getattr(m, name)
        if (value is not None or name == "num_moe_experts") and (not isinstance(value, int) or value < 1):
            raise BadInput(f"{name} must be a positive integer, got {value!r}; pass --set model.{name}=N")
    pattern = m.moe_layer_pattern
    if len(pattern) != m.num_layers:
        raise BadInput(f"moe_layer_freq {m.moe_layer_freq!r} has {len(pattern)} entries for {m.num_layers} layers; pass "
                          f"one 0 (dense) or 1 (MoE) per layer, e.g. --set 'model.moe_layer_freq=([0]*1+[1]*{m.num_layers - 1})'")
    _validate_router(cfg)
    if m.moe_router_topk > m.num_moe_experts:
        raise BadInput(f"moe_router_topk {m.moe_router_topk} is more than num_moe_experts {m.num_moe_experts}; "
                          f"pass --set model.moe_router_topk=K with K at most {m.num_moe_experts}")
    check_choice("moe_router_score_function", m.moe_router_score_function, ROUTER_SCORE_FUNCTIONS,
                 "set model.moe_router_score_function")
    check_choice("moe_router_load_balancing_type", m.moe_router_load_balancing_type, LOAD_BALANCING_TYPES,
                 "set model.moe_router_load_balancing_type")
    check_choice("moe_token_dispatcher_type", m.moe_token_dispatcher_type, TOKEN_DISPATCHER_TYPES,
                 "set model.moe_token_dispatcher_type")
    if m.moe_router_dtype is not None:
        check_choice("moe_router_dtype", m.moe_router_dtype, ROUTER_DTYPES,
                     "set model.moe_router_dtype=fp32 or leave it unset")
    if m.add_bias_linear:
        raise BadInput("the experts of a mixture-of-experts layer have no biases here; pass --set model.add_bias_linear=false")
    if cfg.training.framework == "megatron":
        _validate_megatron_moe(cfg)
        return
    _validate_harness_moe(cfg)


def _validate_harness_moe(cfg: Config) -> None:
    """What this harness's MoE layers (models/moe) run: aux_loss routing, all-to-all dispatch, experts
    on one tensor-parallel rank; Megatron's other MoE settings go with --framework megatron."""
    m = cfg.model
    if m.moe_grouped_gemm and (m.hidden_size % 8 or m.moe_ffn % 8):
        raise BadInput(f"moe_grouped_gemm needs hidden_size {m.hidden_size} and moe_ffn_hidden_size {m.moe_ffn} to be "
                          f"multiples of 8 (torch._grouped_mm wants 16-byte rows); change them or pass "
                          f"--set model.moe_grouped_gemm=false")
    if cfg.parallel.tensor_model_parallel_size > 1:
        raise BadInput("tensor parallelism of mixture-of-experts layers (expert tensor parallel) is not modelled yet; "
                          "pass --tensor-model-parallel-size 1")
    if cfg.parallel.expert_tensor_parallel_size not in (None, 1):
        raise BadInput("this harness runs each expert on one rank; estimate Megatron's expert tensor parallel with "
                       "--framework megatron, or drop --set parallel.expert_tensor_parallel_size")
    if m.moe_token_dispatcher_type != "alltoall":
        raise BadInput(f"this harness dispatches tokens by all-to-all, not {m.moe_token_dispatcher_type}; estimate "
                       "Megatron's with --framework megatron, or drop --set model.moe_token_dispatcher_type")
    if m.moe_router_load_balancing_type != "aux_loss":
        raise BadInput(f"this harness balances the load with aux_loss only, not {m.moe_router_load_balancing_type}; "
                       "estimate Megatron's with --framework megatron, or drop --set model.moe_router_load_balancing_type")
    path = _non_default(cfg, [f"model.{name}" for name in (
        "moe_z_loss_coeff", "moe_router_pre_softmax", "moe_router_dtype", "moe_pad_expert_input_to_capacity",
        "moe_permute_fusion", "moe_shared_expert_gate", "moe_shared_expert_overlap")])
    if path is not None:
        raise BadInput(f"{path} is a setting of Megatron's MoE layers, which this harness does not run; "
                       "drop it, or estimate Megatron with --framework megatron")
    if cfg.parallel.overlap_moe_expert_parallel_comm:
        raise BadInput("parallel.overlap_moe_expert_parallel_comm is Megatron's combined 1F1B schedule, which this "
                       "harness does not run; drop it, or estimate Megatron with --framework megatron")


def _validate_megatron_moe(cfg: Config) -> None:
    """Megatron's own MoE rules (transformer_config.py __post_init__, moe_layer.py, router.py)."""
    m, p = cfg.model, cfg.parallel
    etp = p.expert_tensor_parallel_size
    if etp is not None and (not isinstance(etp, int) or etp < 1):
        raise BadInput(f"expert_tensor_parallel_size must be a positive integer, got {etp!r}; "
                       "pass --set parallel.expert_tensor_parallel_size=N or leave it unset (the tensor parallel size)")
    if m.moe_ffn % p.expert_tensor_parallel:
        raise BadInput(f"expert_tensor_parallel_size {p.expert_tensor_parallel} must divide moe_ffn_hidden_size "
                       f"{m.moe_ffn} (each expert's columns split over its ranks); change one of them")
    if p.tensor_model_parallel_size > 1 and not p.sequence_parallel:
        # moe_layer.py MoELayer.forward raises in training with tensor parallel and no sequence parallel
        raise BadInput("Megatron's MoE layers train with tensor parallelism only under sequence parallelism; "
                       "pass --sequence-parallel")
    balancing = m.moe_router_load_balancing_type
    if m.moe_router_topk == 1 and m.moe_router_score_function == "softmax" and not m.moe_router_pre_softmax \
            and balancing != "sinkhorn":
        raise BadInput("Megatron needs --moe-router-pre-softmax for top-1 softmax routing (a softmax over one "
                       "logit has no gradient); pass --set model.moe_router_pre_softmax=true")
    if balancing == "sinkhorn" and m.moe_aux_loss_coeff:
        raise BadInput("Megatron's sinkhorn routing takes no auxiliary loss; pass --set model.moe_aux_loss_coeff=0")
    if m.moe_expert_capacity_factor is not None and balancing == "sinkhorn":
        raise BadInput("moe_expert_capacity_factor works with aux_loss, seq_aux_loss, global_aux_loss or none load "
                       "balancing (Megatron's rule); change --set model.moe_router_load_balancing_type")
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        raise BadInput("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor; pass "
                       "--set model.moe_expert_capacity_factor=1.0")
    if m.moe_shared_expert_overlap and not m.moe_shared_expert_intermediate_size:
        raise BadInput("moe_shared_expert_overlap needs shared experts; pass "
                       "--set model.moe_shared_expert_intermediate_size=N or drop it")
    if p.overlap_moe_expert_parallel_comm:
        # transformer_config.py __post_init__: expert parallel, alltoall or flex, no full or moe recompute
        if p.expert_model_parallel_size == 1 or m.moe_token_dispatcher_type == "allgather":
            raise BadInput("overlap_moe_expert_parallel_comm needs expert parallelism and the alltoall or flex token "
                           "dispatcher; pass --ep 2 or more and --set model.moe_token_dispatcher_type=alltoall")
        if cfg.recompute.granularity == "full" or "moe" in cfg.recompute.modules:
            raise BadInput("overlap_moe_expert_parallel_comm does not work with full recompute or moe recompute "
                           "(Megatron's rule); drop one of them")
        if p.pipeline_model_parallel_size > 1:
            raise BadInput("the combined 1F1B schedule of overlap_moe_expert_parallel_comm is modelled without "
                           "pipelining only; pass --pp 1 or drop it")
    if m.moe_shared_expert_overlap and m.moe_token_dispatcher_type == "allgather":
        raise BadInput("moe_shared_expert_overlap only works with the alltoall or flex token dispatcher; pass "
                       "--set model.moe_token_dispatcher_type=alltoall")


def _validate_router(cfg: Config) -> None:
    """DeepSeek-V3's router options: group-limited routing and the scaling factor."""
    m = cfg.model
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise BadInput("group-limited routing needs both moe_router_num_groups and moe_router_group_topk; "
                          "pass --set model.moe_router_num_groups=G --set model.moe_router_group_topk=K, or neither")
    if groups is not None and (m.num_moe_experts % groups or group_topk > groups or m.moe_router_topk % group_topk):
        raise BadInput(f"moe_router_num_groups {groups} must divide num_moe_experts {m.num_moe_experts}, and "
                          f"moe_router_group_topk {group_topk} be at most the groups and divide moe_router_topk "
                          f"{m.moe_router_topk}; change them with --set model.moe_router_num_groups/moe_router_group_topk")
    if not m.moe_aux_loss_coeff >= 0:
        raise BadInput(f"moe_aux_loss_coeff must be 0 or more, got {m.moe_aux_loss_coeff}; pass --set model.moe_aux_loss_coeff=1e-3")
    factor = m.moe_router_topk_scaling_factor
    if factor is not None and not factor > 0:
        raise BadInput(f"moe_router_topk_scaling_factor must be positive, got {factor}; "
                          "pass --set model.moe_router_topk_scaling_factor=2.5 or leave it unset")
    capacity = m.moe_expert_capacity_factor
    if capacity is not None and not capacity > 0:
        raise BadInput(f"moe_expert_capacity_factor must be positive, got {capacity}; "
                          "pass --set model.moe_expert_capacity_factor=1.0 or leave it unset (dropless)")
    check_choice("moe_token_drop_policy", m.moe_token_drop_policy, TOKEN_DROP_POLICIES,
                 "set model.moe_token_drop_policy")
    if capacity is not None and cfg.parallel.expert_model_parallel_size > 1 and cfg.training.framework != "megatron":
        raise BadInput("token dropping (moe_expert_capacity_factor) under expert parallel is not modelled yet; "
                          "pass --ep 1 or leave moe_expert_capacity_factor unset")


def _validate_mla(cfg: Config) -> None:
    """The multi-latent attention fields, one clear line each."""
    m = cfg.model
    megatron = cfg.training.framework == "megatron"
    for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        value = getattr(m, name)
        if (value is not None or name != "q_lora_rank") and (not isinstance(value, int) or value < 1):
            raise BadInput(f"{name} must be a positive integer, got {value!r}; pass --set model.{name}=N")
    # Megatron's MLA applies its own RoPE (rope_type) whatever the model's position embedding
    if (m.position_embedding_type != "rope" and not megatron) or m.qk_pos_emb_head_dim % 2:
        raise BadInput(f"multi-latent attention needs RoPE on an even qk_pos_emb_head_dim (got "
                          f"{m.position_embedding_type}, {m.qk_pos_emb_head_dim}); pass --set model.position_embedding_type=rope "
                          f"and an even --set model.qk_pos_emb_head_dim=N")
    if m.num_query_groups not in (None, m.num_attention_heads):
        raise BadInput("multi-latent attention has one key/value head per attention head (num_query_groups does "
                          "not apply); drop --set model.num_query_groups")
    if cfg.parallel.tensor_model_parallel_size > 1 and not megatron:
        raise BadInput("tensor parallelism of multi-latent attention is not modelled yet; "
                          "pass --tensor-model-parallel-size 1")


def _validate_recompute(cfg: Config) -> None:
    m, p, r = cfg.model, cfg.parallel, cfg.recompute
    chunk, offered = layers_per_model_chunk(cfg), cfg.spec.recompute_targets
    check_choice("recompute_granularity", r.granularity, GRANULARITIES,
                 "pass --recompute-granularity none, selective or full")

    if r.layer_policy and (len(r.layer_policy) != m.num_layers or r.granularity != "none"
                           or r.activation_offload_layers):
        raise BadInput(f"layer_policy needs one entry per layer ({m.num_layers}) and replaces the recompute "
                          "setting; write it with `plan --auto` and pass it as --policy FILE alone")

    # CPU offloading is checked first, as Megatron does.
    if r.activation_offload_layers:
        if not 0 < r.activation_offload_layers < m.num_layers:
            raise BadInput(f"activation_offload_layers must lie between 1 and {m.num_layers - 1} "
                              f"(CPU offloading can be done only for layers less than num_layers), got "
                              f"{r.activation_offload_layers}; pass --activation-offload-layers N with N from 1 to "
                              f"{m.num_layers - 1}")
        if p.pipeline_model_parallel_size > 1:
            raise BadInput("Currently there is no support for Pipeline parallelism with CPU offloading (Megatron's "
                              "rule); drop --activation-offload-layers or pass --pipeline-model-parallel-size 1")
        if r.granularity != "none":
            raise BadInput("CPU offloading does not work when activation recomputation is enabled; "
                              "pass --recompute-granularity none or drop --activation-offload-layers")

    if r.method is not None:
        check_choice("recompute_method", r.method, METHODS, "pass --recompute-method uniform or block")
    unknown = [x for x in r.modules if x not in RECOMPUTE_MODULES]
    if unknown:
        lacking = [x for x in RECOMPUTE_MODULES if x not in offered]
        raise BadInput(f"unknown recompute module(s) {', '.join(unknown)}; pass --recompute-modules with any of "
                          f"{', '.join(offered)}" + (f" ({', '.join(lacking)} need MoE or MLA layers, which this "
                                                     f"workload's model does not have)" if lacking else ""))

    if r.granularity == "full":
        if r.method is None:
            raise BadInput('recompute_granularity full needs recompute_method "uniform" or "block"; pass --recompute-method uniform')
        if r.num_layers is None:
            raise BadInput(f"recompute_granularity full needs recompute_num_layers between 1 and {chunk} "
                              f"({_chunk_words(cfg)}); pass --recompute-num-layers N")
        if not 1 <= r.num_layers <= chunk:
            raise BadInput(f"recompute_num_layers {r.num_layers} must lie between 1 and {chunk} "
                              f"({_chunk_words(cfg)}); pass --recompute-num-layers N")
        if r.modules:
            raise BadInput("recompute_modules apply to selective recompute only; drop --recompute-modules "
                              "or pass --recompute-granularity selective")
    elif r.granularity == "selective":
        if r.num_layers is not None:
            raise BadInput("recompute_num_layers must be unset with recompute_granularity selective; "
                              "drop --recompute-num-layers or pass --recompute-granularity full")
        if r.method is not None:
            raise BadInput("recompute_method is not supported with recompute_granularity selective; "
                              "drop --recompute-method or pass --recompute-granularity full")
        for module in r.modules:
            if module not in offered:
                raise BadInput(f"recompute module {module} needs {_MODULE_NEEDS[module]}, which this workload's "
                                  f"model does not have; choose from {', '.join(offered)}")
    else:
        for name, value in (("recompute_method", r.method), ("recompute_num_layers", r.num_layers)):
            if value is not None:
                raise BadInput(f"{name} is set but recompute_granularity is none; pass --recompute-granularity full "
                                  f"or drop --{name.replace('_', '-')}")
        if r.modules:
            raise BadInput("recompute_modules are set but recompute_granularity is none; "
                              "pass --recompute-granularity selective or drop --recompute-modules")

    if r.distribute_saved_activations:
        if p.tensor_model_parallel_size <= 1:
            raise BadInput("distribute_saved_activations needs tensor parallelism (TP > 1); pass "
                              "--tensor-model-parallel-size 2 or more, or drop --set recompute.distribute_saved_activations=true")
        if r.granularity != "full":
            raise BadInput("distribute_saved_activations applies to full recompute only; pass --recompute-granularity full")
        if p.sequence_parallel:
            raise BadInput("distribute_saved_activations must be false when sequence parallelism is enabled; drop "
                              "--sequence-parallel or --set recompute.distribute_saved_activations=true")


def _section_of(name: str) -> str:
    for section, cls in SECTIONS.items():
        if name in {f.name for f in dataclasses.fields(cls)}:
            return section
    return "model"
