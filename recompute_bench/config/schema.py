"""Settings of one measurement point.

Four dataclasses, one per TOML section of a workload preset: model shape, training, parallelism
and recompute. Field names are Megatron's, and they are the same word in the TOML file, the CLI
flag (`--<section>-<field>` for recompute, `--<field>` otherwise), the JSON record and the CSV
columns. `validate()` applies every rule before anything is built, so bad input fails with one
clear line (`BadInput`) instead of a traceback deep inside torch.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Optional

from recompute_bench.config.labels import recompute_label


class BadInput(ValueError):
    """Bad input of any kind (a setting, a flag, a file that is corrupt or not this product's, a run
    folder another sweep holds): the message is one line that names the problem and the fix, which
    the CLI prints before it exits 2."""


def check_choice(name: str, value: Any, choices: tuple, fix: str) -> None:
    """BadInput naming `name`, its `value`, the `choices` and the `fix` when value is not one of them."""
    if value not in choices:
        raise BadInput(f"{name} {value!r} is not one of {', '.join(map(str, choices))}; {fix}")


def parse_layer_pattern(text: Any) -> list[int]:
    """Megatron's string form of a per-layer pattern ("([0]*3+[1]*58)", "[0,1,1]"): lists of 0s and
    1s, repeated with `*` and joined with `+`. Read without eval: nothing else is accepted. Parsed
    once per text (the models ask for a layer's kind millions of times in a plan's search)."""
    return list(_parsed_pattern(str(text)))


@functools.lru_cache(maxsize=256)
def _parsed_pattern(text: str) -> tuple[int, ...]:
    import ast

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.List):
            items = [value(e) for e in node.elts]
            if all(i in (0, 1) and not isinstance(i, bool) for i in items):
                return items
        elif isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and isinstance(a, list) and isinstance(b, list):
                return a + b
            if isinstance(node.op, ast.Mult) and isinstance(a, list) and isinstance(b, int):
                return a * b
        raise ValueError
    try:
        pattern = value(ast.parse(str(text).strip(), mode="eval").body)
        if not isinstance(pattern, list):
            raise ValueError
    except (SyntaxError, ValueError):
        raise BadInput(f"moe_layer_freq {text!r} is neither an integer nor a pattern of 0s and 1s such as "
                          "\"([0]*3+[1]*58)\"; pass --set model.moe_layer_freq=N or a pattern") from None
    return tuple(pattern)


@dataclass
class ModelConfig:
    """Shape of the GPT."""

    num_layers: int
    """Transformer layers (L)."""
    hidden_size: int
    """Hidden size (h)."""
    num_attention_heads: int
    """Attention heads (a)."""
    ffn_hidden_size: int
    """MLP hidden size (4h for GPT-3; 3.5h for Llama 3 8B)."""
    vocab_size: int
    """Vocabulary size of the tokenizer; the model is built with `padded_vocab_size` rows."""
    max_position_embeddings: int
    """Longest sequence the position embedding covers."""
    num_query_groups: Optional[int] = None
    """Key/value heads for grouped-query attention; None means one per attention head."""
    kv_channels: Optional[int] = None
    """Head dimension (d); None: hidden_size / num_attention_heads (Qwen3 sets its own)."""
    normalization: str = "LayerNorm"
    """LayerNorm or RMSNorm."""
    activation: str = "gelu"
    """gelu (h -> f -> h) or swiglu (h -> 2f, gated, f -> h)."""
    position_embedding_type: str = "learned_absolute"
    """learned_absolute or rope."""
    rotary_base: float = 10000.0
    """RoPE base frequency."""
    hidden_dropout: float = 0.0
    """Dropout after the embedding, the attention projection and the MLP."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities."""
    add_bias_linear: bool = True
    """Bias on every linear layer (GPT-3 yes, Llama no)."""
    share_embeddings_and_output_weights: bool = True
    """Tie the output layer to the word embedding."""
    attention_backend: str = "sdpa"
    """This harness: sdpa (torch scaled_dot_product_attention) or math (explicit QK^T, softmax, dropout, V).
    Framework megatron: Megatron's flash, fused, unfused, local or auto (its default)."""
    transformer_impl: str = "local"
    """Megatron's --transformer-impl: local (plain torch modules, what this harness builds) or
    transformer_engine (framework megatron only; Megatron's default there)."""
    masked_softmax_fusion: bool = True
    """Framework megatron, transformer_impl local: Megatron's fused scale-mask-softmax kernel; off (or
    past its limits: s over 4096, b x heads/t not a multiple of 4) torch's softmax runs instead."""
    attention_softmax_in_fp32: bool = False
    """Framework megatron: torch's softmax (when the fused kernel does not run) works and keeps its
    output in fp32 (Megatron sets it with apply_query_key_layer_scaling)."""
    cross_entropy_loss_fusion: bool = False
    """Framework megatron: Megatron's fused cross-entropy (cross_entropy_fusion_impl native)."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of every norm."""
    init_method_std: float = 0.02
    """Standard deviation of the seeded weight initialisation."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times the tensor-parallel size."""
    num_moe_experts: Optional[int] = None
    """Routed experts of every mixture-of-experts layer; None: a dense model."""
    moe_router_topk: int = 2
    """Experts each token is routed to (k)."""
    moe_ffn_hidden_size: Optional[int] = None
    """Hidden size of one routed expert; None: ffn_hidden_size."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Hidden size of the shared-expert MLP (all shared experts together) every token runs; None: none."""
    moe_layer_freq: int | str = 1
    """A mixture-of-experts layer every this many layers from layer 0 (an int), or Megatron's per-layer
    pattern, 1 for MoE and 0 for dense, one entry per layer: "([0]*3+[1]*58)" or "[0,1]"."""
    moe_router_score_function: str = "softmax"
    """softmax (over the top-k logits, Mixtral and Qwen3) or sigmoid (normalised over the top k, DeepSeek-V3)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing auxiliary loss (Switch/GShard: experts x sum of each expert's routed share times
    its mean score over all experts), whose gradient joins the router's in backward; 0: none."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Scale the routing probabilities by this factor (DeepSeek-V3: 2.5); None: 1."""
    moe_router_enable_expert_bias: bool = False
    """A per-expert bias added to the scores for choosing the top k only (DeepSeek-V3's aux-loss-free balancing);
    held at its initial zero here (its load-based update is not run)."""
    moe_router_num_groups: Optional[int] = None
    """Group-limited routing: experts fall into this many groups (DeepSeek-V3: 8); None: no groups."""
    moe_router_group_topk: Optional[int] = None
    """Group-limited routing: each token's experts come from its best this-many groups (DeepSeek-V3: 4)."""
    moe_expert_capacity_factor: Optional[float] = None
    """Token dropping: each expert runs at most ceil(tokens x top-k / experts x this) routed rows (Megatron's
    get_capacity), the rest are dropped (the token keeps its residual); None: dropless."""
    moe_token_drop_policy: str = "probs"
    """Which rows an expert over capacity keeps: probs (its highest routing probabilities) or position (the first tokens)."""
    moe_grouped_gemm: bool = False
    """Run all experts as grouped matmuls (torch._grouped_mm); false: one matmul per expert."""
    moe_router_load_balancing_type: str = "aux_loss"
    """How the router balances the experts' load (Megatron's --moe-router-load-balancing-type): aux_loss
    (the Switch loss over the micro-batch, weighted by moe_aux_loss_coeff), seq_aux_loss (the same per
    sequence), global_aux_loss (over the global batch), sinkhorn (Sinkhorn-normalised scores pick the
    experts, no loss) or none. This harness runs aux_loss."""
    moe_z_loss_coeff: Optional[float] = None
    """Weight of the router's z-loss (ST-MoE: the mean squared log-sum-exp of the logits); None: none.
    Framework megatron only."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (Megatron's --moe-router-pre-softmax; needed with
    top-1 softmax routing); false: softmax over the top-k logits. Framework megatron only."""
    moe_router_dtype: Optional[str] = None
    """The router's logits and probabilities in fp32 or fp64 (Megatron's --moe-router-dtype); None: the
    activations' dtype. Framework megatron only."""
    moe_token_dispatcher_type: str = "alltoall"
    """How tokens reach their experts' ranks (Megatron's --moe-token-dispatcher-type): alltoall (this
    harness's), allgather (every rank gathers all tokens of its tensor x expert group; Megatron's
    default, taken under --framework megatron) or flex (DeepEP / HybridEP fused all-to-all)."""
    moe_pad_expert_input_to_capacity: bool = False
    """With a capacity factor, pad every expert's input to its capacity (Megatron's
    --moe-pad-expert-input-to-capacity). Framework megatron only."""
    moe_permute_fusion: bool = False
    """Transformer Engine's fused permute / unpermute kernels (Megatron's --moe-permute-fusion).
    Framework megatron only."""
    moe_shared_expert_gate: bool = False
    """A sigmoid gate on the shared experts' output (Megatron's --moe-shared-expert-gate). Framework
    megatron only."""
    moe_shared_expert_overlap: bool = False
    """Run the shared experts inside the token dispatcher, overlapped with its communication (Megatron's
    --moe-shared-expert-overlap). Framework megatron only."""
    multi_latent_attention: bool = False
    """Multi-latent attention (DeepSeek-V2/V3) in place of MHA/GQA: q and kv go through low-rank latents."""
    q_lora_rank: Optional[int] = None
    """MLA: rank of the query latent (down-projection, norm, up-projection); None: one plain q projection."""
    kv_lora_rank: int = 512
    """MLA: rank of the key/value latent."""
    qk_head_dim: int = 128
    """MLA: per-head query/key dimension without the rotary part."""
    qk_pos_emb_head_dim: int = 64
    """MLA: per-head rotary dimension of queries and keys (the decoupled RoPE; the key's is shared by all heads)."""
    v_head_dim: int = 128
    """MLA: per-head value dimension."""
    # Framework megatron only (MEGATRON_ONLY_SETTINGS): Megatron's arguments that change its layers.
    qk_layernorm: bool = False
    """Framework megatron: a norm over every query and key head before attention (Megatron's
    --qk-layernorm); with multi-latent attention, norms over the latents fused into the up-projections."""
    attention_output_gate: bool = False
    """Framework megatron: a sigmoid gate on the attention output, its weights a fourth part of
    linear_qkv (Megatron's --attention-output-gate)."""
    add_qkv_bias: bool = False
    """Framework megatron: a bias on linear_qkv even where the other linears have none (--add-qkv-bias)."""
    cross_entropy_fusion_impl: str = "native"
    """Framework megatron, with cross_entropy_loss_fusion: native (Megatron's fused cross-entropy) or
    te (Transformer Engine's parallel cross-entropy)."""
    rope_type: Optional[str] = None
    """Framework megatron, multi-latent attention: its RoPE, rope or yarn (None: MLA's default, yarn)."""
    apply_rope_fusion: bool = True
    """Framework megatron: the fused RoPE kernels (Megatron's default; --no-rope-fusion turns them off,
    and Megatron turns them off when position_embedding_type is not rope)."""
    mtp_num_layers: int = 0
    """Framework megatron: multi-token-prediction layers after the decoder (--mtp-num-layers), each an
    embedding of the next tokens, a projection, one transformer layer of the last decoder layer's kind
    and a second pass through the output layer and the loss; 0: none."""

    def decoder_layer_of(self, index: int) -> int:
        """The decoder layer whose kind (dense or MoE, its cp_comm_type) layer `index` takes: itself,
        or for a multi-token-prediction layer (index num_layers + k) the last decoder layer, whose
        spec Megatron's MTP layers use (gpt_builders.py: `decoder_layer_specs[-1]`)."""
        return min(index, self.num_layers - 1)

    @property
    def groups(self) -> int:
        """Key/value heads (g)."""
        return self.num_query_groups or self.num_attention_heads

    def padded_vocab_size(self, tensor_model_parallel_size: int = 1) -> int:
        """Megatron's padded vocabulary: the embedding and output layer have this many rows, and
        FLOPs and memory count them (tokens are drawn from the first `vocab_size` only)."""
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    @property
    def moe_ffn(self) -> int:
        """Hidden size of one routed expert."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def moe_layer_pattern(self) -> list[int]:
        """1 for each mixture-of-experts layer, 0 for each dense one, as Megatron reads moe_layer_freq
        (BadInput when it is neither an int nor a pattern of 0s and 1s)."""
        if not self.num_moe_experts:
            return [0] * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, int) and not isinstance(freq, bool):
            if freq < 1:
                raise BadInput(f"moe_layer_freq must be a positive integer or a pattern, got {freq}; "
                                  "pass --set model.moe_layer_freq=N")
            return [1 if i % freq == 0 else 0 for i in range(self.num_layers)]
        return parse_layer_pattern(freq)

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (from 0) is a mixture-of-experts layer (moe_layer_freq)."""
        return bool(self.moe_layer_pattern[self.decoder_layer_of(index)])

    @property
    def moe_layers(self) -> int:
        """How many of the layers are mixture-of-experts layers."""
        return sum(self.moe_layer_pattern[:self.num_layers])

    @property
    def head_dim(self) -> int:
        """Head dimension d: kv_channels, or h / a."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Dimensions RoPE rotates per head: the head dimension, or MLA's decoupled rotary part."""
        return self.qk_pos_emb_head_dim if self.multi_latent_attention else self.head_dim


@dataclass
class TrainingConfig:
    """What one step is and how it is measured."""

    seq_length: int
    """Tokens per sample (s)."""
    micro_batch_size: int = 1
    """Samples per forward/backward pass (b)."""
    global_batch_size: int = 1
    """Samples per optimizer step, over all data-parallel ranks."""
    precision: str = "bf16"
    """bf16 or fp16 (16-bit weights and activations, fp32 master weights, grads and Adam), fp32, or
    fp8 (bf16 with FP8 matrix multiplies in the linears: Transformer Engine's under framework megatron,
    torchao's float8 training in this harness)."""
    fp8_recipe: str = "delayed"
    """With precision fp8: the scaling recipe (Megatron's --fp8-recipe): delayed, tensorwise (current
    scaling), blockwise or mxfp8; this harness (torchao) runs tensorwise or rowwise."""
    fp8_format: str = "hybrid"
    """With precision fp8: Megatron's --fp8-format, hybrid (E4M3 forward, E5M2 backward) or e4m3."""
    fp8_param_gather: bool = False
    """With precision fp8: keep the weights themselves in FP8 (Megatron's --fp8-param-gather, TE's
    fp8_model_init) instead of bf16 weights with FP8 copies."""
    fp8_amax_history_len: int = 1
    """With fp8_recipe delayed: the amax history each FP8 module keeps (Megatron's
    --fp8-amax-history-len)."""
    first_last_layers_bf16: bool = False
    """With precision fp8: run the first num_layers_at_start_in_bf16 and the last
    num_layers_at_end_in_bf16 layers in bf16 (Megatron's --first-last-layers-bf16)."""
    num_layers_at_start_in_bf16: int = 1
    """Layers at the start kept in bf16 under first_last_layers_bf16."""
    num_layers_at_end_in_bf16: int = 1
    """Layers at the end kept in bf16 under first_last_layers_bf16."""
    cuda_graph_impl: str = "none"
    """CUDA graphs (framework megatron): none, transformer_engine (TE make_graphed_callables, a
    graph per layer and micro-batch), local (Megatron's own per-layer graphs) or full_iteration
    (the whole forward-backward of a step); Megatron's --cuda-graph-impl."""
    cuda_graph_modules: list[str] = field(default_factory=list)
    """With per-layer CUDA graphs: what each layer's graph captures, any of attn, mlp, moe,
    moe_router, moe_preprocess; empty: the whole layer (Megatron's --cuda-graph-modules, formerly
    --cuda-graph-scope)."""
    cuda_graph_warmup_steps: int = 3
    """Steps Megatron runs eagerly before capturing the graphs (--cuda-graph-warmup-steps)."""
    compile: bool = False
    """This harness: torch.compile each transformer layer (torchtitan's per-layer compile, inductor),
    with the recompute setting applied inside and around the compiled layers."""
    warmup_steps: int = 2
    """Steps run before measuring."""
    measured_steps: int = 5
    """Steps timed; the median is reported."""
    seed: int = 1234
    """Seed of the weights, the data and dropout."""
    framework: str = "recompute-bench"
    """What runs the step: recompute-bench (this harness, which `run` measures) or megatron
    (Megatron-LM / Megatron Bridge as they run: `estimate` and imported records only)."""
    # Framework megatron only (MEGATRON_ONLY_SETTINGS): Megatron's training arguments that change
    # what a rank holds.
    create_attention_mask_in_dataloader: bool = True
    """Framework megatron: the data loader builds each micro-batch's [b, 1, s, s] causal mask
    (Megatron's default; --no-create-attention-mask-in-dataloader leaves it out)."""
    use_precision_aware_optimizer: bool = False
    """Framework megatron: Transformer Engine's FusedAdam keeps master weights, gradients and moments in
    the dtypes below (--use-precision-aware-optimizer)."""
    main_grads_dtype: str = "fp32"
    """Framework megatron, precision-aware optimizer: DDP's gradient buffer dtype (fp32 or bf16)."""
    main_params_dtype: str = "fp32"
    """Framework megatron, precision-aware optimizer: the master weights' dtype (fp32 or fp16)."""
    exp_avg_dtype: str = "fp32"
    """Framework megatron, precision-aware optimizer: Adam's first moment dtype (fp32, fp16, bf16, fp8)."""
    exp_avg_sq_dtype: str = "fp32"
    """Framework megatron, precision-aware optimizer: Adam's second moment dtype (fp32, fp16, bf16, fp8)."""
    grad_reduce_in_bf16: bool = False
    """Framework megatron, bf16: DDP's gradient buffer in bf16 instead of fp32 (--grad-reduce-in-bf16)."""
    defer_embedding_wgrad_compute: bool = False
    """Framework megatron, pipelined: the output layer's weight gradient waits for the pipeline flush,
    its input and output gradient kept per micro-batch until then (--defer-embedding-wgrad-compute)."""
    wgrad_deferral_limit: int = 0
    """Framework megatron, with defer_embedding_wgrad_compute: how many micro-batches defer (0: all)."""
    gradient_accumulation_fusion: bool = True
    """Framework megatron: the linears' weight-gradient GEMMs accumulate straight into DDP's main
    gradients (Megatron-LM's default; --no-gradient-accumulation-fusion turns it off)."""


@dataclass
class ParallelConfig:
    """Parallel layout: `run` launches it (data, tensor, expert and pipeline parallel over torchrun
    ranks, docs/ranks.md); `estimate` and `plan` model every field."""

    tensor_model_parallel_size: int = 1
    """Tensor parallel size (t)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline parallel size (p)."""
    data_parallel_size: int = 1
    """Data parallel size."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank for the interleaved schedule (m); None for 1F1B."""
    overlap_p2p_comm: Optional[bool] = None
    """Framework megatron, interleaved schedule: the pipeline's sends run beside the next chunk instead of
    blocking between chunks (overlap_p2p_comm). None: Megatron-LM's default, on (arguments.py); without
    virtual stages it is off whatever is given (validate_args forces it False)."""
    scatter_gather_tensors_in_pipeline: bool = False
    """Framework megatron, Megatron-LM before Megatron Core's pipeline (2023): without sequence parallel each tensor-
    parallel rank sends 1/t of a pipeline activation and the receiver all-gathers it (p2p_communication.py)."""
    sequence_parallel: bool = False
    """Shard the non-tensor-parallel activations across the tensor-parallel group."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over the data-parallel group."""
    expert_model_parallel_size: int = 1
    """Expert parallel size (ep): the routed experts of every MoE layer are spread over ep
    data-parallel ranks, num_moe_experts / ep on each, tokens sent to them by all-to-all."""
    expert_tensor_parallel_size: Optional[int] = None
    """Tensor parallel size of the routed experts (Megatron's --expert-tensor-parallel-size, etp): each
    expert's fc1 columns and fc2 rows split over etp ranks; None: tensor_model_parallel_size, as Megatron
    fills it. Experts are laid out over etp x ep x expert-data-parallel ranks of the same world."""
    overlap_moe_expert_parallel_comm: bool = False
    """Hide the MoE dispatch and combine all-to-alls behind another micro-batch's computation
    (Megatron's --overlap-moe-expert-parallel-comm): the combined 1F1B schedule runs micro-batch i + 1's
    layer forwards beside micro-batch i's layer backwards. Framework megatron only."""
    context_parallel_size: int = 1
    """Context parallel size (cp): each sequence is split over cp ranks in 2 x cp chunks, rank r
    holding chunks r and 2cp - 1 - r so that causal attention's work is even (Megatron's load
    balancing; `models.context_parallel`). Gradients are reduced over dp x cp."""
    cp_comm_type: str = "p2p"
    """How attention reaches the other ranks' keys and values under context parallel (Megatron's
    --cp-comm-type): p2p (a ring passing K/V chunks), all_gather (K/V of the whole sequence gathered
    once), a2a (all-to-all over heads, Ulysses) or a2a+p2p (hierarchical); one type for every layer,
    or one per layer separated by spaces ("p2p p2p a2a a2a"), as Megatron's list form gives them."""
    hierarchical_context_parallel_sizes: Optional[list[int]] = None
    """a2a+p2p only: the two levels of context parallel, [a2a ranks, p2p ranks], whose product is
    context_parallel_size (Megatron's --hierarchical-context-parallel-sizes)."""
    pipeline_parallel_schedule: Optional[str] = None
    """The pipeline schedule, by torch's pipelining names: 1F1B, Interleaved1F1B (virtual stages),
    GPipe, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV (two stages per rank, the "V"); None:
    Megatron's, 1F1B, or Interleaved1F1B with virtual stages."""
    # Framework megatron only (MEGATRON_ONLY_SETTINGS): Megatron's layouts beyond an even split.
    num_distributed_optimizer_instances: int = 1
    """Framework megatron: distributed-optimizer instances, each sharding the state over
    data_parallel_size / instances ranks (--num-distributed-optimizer-instances)."""
    decoder_first_pipeline_num_layers: Optional[int] = None
    """Framework megatron: layers of the first pipeline stage when the split is uneven."""
    decoder_last_pipeline_num_layers: Optional[int] = None
    """Framework megatron: layers of the last pipeline stage when the split is uneven."""
    account_for_embedding_in_pipeline_split: bool = False
    """Framework megatron: the embedding counts as a layer of the first stage's split."""
    account_for_loss_in_pipeline_split: bool = False
    """Framework megatron: the loss counts as a layer of the last stage's split."""
    pipeline_model_parallel_layout: Optional[str] = None
    """Framework megatron: each virtual stage's layers (--pipeline-model-parallel-layout, "Et*3|(tt|)*6L":
    E embedding, t a layer, m a multi-token-prediction layer, L the loss, | between stages)."""
    microbatch_group_size_per_vp_stage: Optional[int] = None
    """Framework megatron, interleaved: micro-batches run through a model chunk before the next
    (--microbatch-group-size-per-virtual-pipeline-stage); None: pipeline_model_parallel_size."""
    tp_comm_overlap: bool = False
    """Framework megatron: Transformer Engine overlaps the tensor-parallel all-gathers and
    reduce-scatters with the linears' GEMMs through its userbuffers (--tp-comm-overlap; needs
    sequence parallel)."""
    overlap_grad_reduce: bool = False
    """Framework megatron: DDP reduces each bucket of gradients as backward fills it, beside the rest of
    backward, instead of all of them after it (--overlap-grad-reduce)."""
    overlap_param_gather: bool = False
    """Framework megatron, distributed optimizer: the parameters are all-gathered bucket by bucket beside the
    next step's forward, not after the optimizer step (--overlap-param-gather; needs overlap_grad_reduce)."""
    ddp_bucket_size: Optional[int] = None
    """Framework megatron, with overlap_grad_reduce: elements per DDP bucket (--ddp-bucket-size); None:
    Megatron's max(40M, 1M x data_parallel_size)."""

    @property
    def schedule(self) -> str:
        """The pipeline schedule that runs: the one given, else Megatron's choice."""
        if self.pipeline_parallel_schedule:
            return self.pipeline_parallel_schedule
        return "Interleaved1F1B" if self.virtual_pipeline_model_parallel_size else "1F1B"

    @property
    def interleaved(self) -> bool:
        """Megatron's interleaved schedule: over one model chunk a rank (validate_args makes a size of 1 None)."""
        return (self.virtual_pipeline_model_parallel_size or 1) > 1

    @property
    def p2p_overlapped(self) -> bool:
        """The pipeline's sends run beside compute: interleaved, overlap_p2p_comm on or at its default."""
        return self.interleaved and self.overlap_p2p_comm is not False

    @property
    def expert_tensor_parallel(self) -> int:
        """The routed experts' tensor parallel size: expert_tensor_parallel_size, or the tensor
        parallel size (Megatron's arguments.py fills it so)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks holding the same experts (Megatron's expert-data-parallel group): the ranks of a
        pipeline stage, tp x cp x dp, over etp x ep; at least 1."""
        shared = self.tensor_model_parallel_size * self.context_parallel_size * self.data_parallel_size
        return max(1, shared // (self.expert_tensor_parallel * self.expert_model_parallel_size))

    @property
    def world_size(self) -> int:
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
                * self.data_parallel_size)


def data_parallel_size(gpus: int, tp: int, pp: int, cp: int, flag: str = "--gpus") -> int:
    """The data-parallel size `gpus` GPUs leave to tensor, pipeline and context parallel (Megatron's
    arguments.py validate_args: world_size // (tp x pp x cp)); BadInput naming `flag`, where the GPU
    count is given, when it is not a positive multiple of tp x pp x cp."""
    model_parallel = tp * pp * cp
    if gpus < 1 or gpus % model_parallel:
        raise BadInput(f"{gpus} GPUs are not a positive multiple of tensor x pipeline x context parallel = "
                       f"{tp} x {pp} x {cp} = {model_parallel}; pass {flag} as a multiple of {model_parallel}")
    return gpus // model_parallel


@dataclass
class RecomputeConfig:
    """Activation recomputation, with Megatron Core's meaning."""

    granularity: str = "none"
    """none, selective (the modules below in every layer) or full (whole layers)."""
    modules: list[str] = field(default_factory=list)
    """Selective only: which sub-modules of every layer are recomputed."""
    method: Optional[str] = None
    """Full only: uniform (checkpoint every chunk of N layers) or block (checkpoint the first N layers)."""
    num_layers: Optional[int] = None
    """Full only: N, the chunk size (uniform) or the number of checkpointed layers (block)."""
    activation_offload_layers: int = 0
    """Keep the saved activations of the first N layers in host memory (CUDA only; Megatron's
    --cpu-offloading --cpu-offloading-num-layers N)."""
    fine_grained_activation_offloading: bool = False
    """Offload what the offload_modules of every layer save to host memory (framework megatron;
    Megatron's --fine-grained-activation-offloading)."""
    offload_modules: list[str] = field(default_factory=list)
    """With fine_grained_activation_offloading: the modules whose saved tensors leave the device,
    any of attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act,
    fused_group_mlp (Megatron's --offload-modules)."""
    distribute_saved_activations: bool = False
    """Shard checkpointed layer inputs across the tensor-parallel group (full only, TP > 1, no SP)."""
    layer_policy: list[str] = field(default_factory=list)
    """Per-layer policy (a policy file, `--policy`): one entry per layer, none, selective[modules],
    full:CHUNK or offload; replaces the uniform setting above (granularity stays none)."""

    @property
    def label(self) -> str:
        """The setting in a few words, as tables show it."""
        return recompute_label(self.granularity, self.modules, self.method, self.num_layers,
                               self.activation_offload_layers, layer_policy=self.layer_policy,
                               offload_modules=self.offload_modules,
                               distribute_saved_activations=self.distribute_saved_activations)

    @property
    def recomputes(self) -> bool:
        """Whether anything at all is recomputed."""
        return (self.granularity == "full" or (self.granularity == "selective" and bool(self.modules))
                or any(p not in ("none", "offload") for p in self.layer_policy))


@dataclass
class Config:
    """A fully resolved measurement point: its four sections, and the model spec of its architecture
    (`spec`), resolved once where the config is made (`recompute_bench.workload.resolved`) and
    handed down with it."""

    workload: str
    model: ModelConfig
    training: TrainingConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    _resolved: Any = field(default=None, compare=False, repr=False)
    """(the ModelConfig, its model spec) as `workload.resolved` set them; a copy with another model
    must be resolved again."""

    @property
    def spec(self) -> Any:
        """The model spec (`models.ModelSpec`: FLOPs, saved bytes, parameters, recompute targets,
        `build`) of this config's model, resolved where the config was made."""
        if self._resolved is None or self._resolved[0] is not self.model:
            raise RuntimeError(f"config {self.workload!r} is used before its model spec is resolved: make it through "
                               "recompute_bench.workload (resolve, resolved)")
        return self._resolved[1]

    @property
    def vocab_rows(self) -> int:
        """Rows of the word embedding and the output layer: Megatron's padded vocabulary (a multiple
        of make_vocab_size_divisible_by x tensor-parallel size), which its FLOPs and memory count."""
        return self.model.padded_vocab_size(self.parallel.tensor_model_parallel_size)

    @property
    def num_microbatches(self) -> int:
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.parallel.data_parallel_size)

    def to_dict(self) -> dict[str, Any]:
        """The whole config as plain data: the workload name and one table per section. A sweep's
        plan and a worker's stdin hold exactly this; `from_dict` reads it back."""
        return {"workload": self.workload, **{s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Config":
        """The inverse of `to_dict` (not validated: pass it to `config.rules.validate`); BadInput
        when `data` is not one."""
        try:
            return cls(data["workload"], **{s: SECTIONS[s](**data[s]) for s in SECTIONS})
        except (KeyError, TypeError) as e:
            raise BadInput(f"not a resolved recompute-bench config ({e}); write it with Config.to_dict") from None

    def record_fields(self) -> dict[str, Any]:
        """The config as a result record holds it: `workload`, `config` (model, training and
        parallel) and, beside them, `recompute` (with `layer_policy` only where a policy ran and the
        fine-grained offload fields only where set, so records of uniform settings stay as they were)."""
        data = self.to_dict()
        # fields only some runs set stay out of the others' records, so those keep their shape
        for name in ("layer_policy", "fine_grained_activation_offloading", "offload_modules"):
            if not data["recompute"][name]:
                del data["recompute"][name]
        return {"workload": data.pop("workload"), "config": {s: data[s] for s in ("model", "training", "parallel")},
                "recompute": data["recompute"]}


SECTIONS = {"model": ModelConfig, "training": TrainingConfig, "parallel": ParallelConfig, "recompute": RecomputeConfig}


def with_setting(cfg: Config, r: RecomputeConfig | None = None, **parallel: Any) -> Config:
    """cfg with recompute setting `r` (kept when None) and the parallel fields given changed."""
    out = dataclasses.replace(cfg, recompute=r if r is not None else cfg.recompute)
    if parallel:
        out = dataclasses.replace(out, parallel=dataclasses.replace(cfg.parallel, **parallel))
    return out
