"""Framework megatron: what Megatron-LM (and Megatron Bridge, which runs its models) allocates on one
rank, term by term, each named after the Megatron, Transformer Engine or torch code that allocates it.

The harness's own estimate (`memory.py`) counts the layers this package builds, exactly. Megatron's
layers keep other tensors (Transformer Engine's fused LayerNorm-linear keeps both the norm's input
and output, its fused bias-SwiGLU no SiLU output, its attention kernels their own copies), its
distributed data parallel and optimizers hold other bytes per parameter, and a rank holds buffers
outside the parameters (cuBLAS workspaces, the local attention's score buffer). Nothing here is fitted:
`tests/test_megatron_check.py` checks the sum against the memory Megatron-LM's functional tests
measured on DGX A100, H100 and GB200 (`tests/data/megatron/cases.json`). Pure Python.

Sources (Megatron-LM d98e8a6, TransformerEngine d0067d0, torch 2.13):
- megatron/core/distributed/param_and_grad_buffer.py, distributed_data_parallel.py (grad and param buffers)
- megatron/core/optimizer/optimizer.py, distrib_optimizer.py (master weights, Adam state, main-grad copies)
- megatron/core/pipeline_parallel/schedules.py (micro-batches in flight per stage)
- megatron/core/tensor_parallel/cross_entropy.py, megatron/core/fusions/fused_cross_entropy.py (the loss)
- megatron/core/transformer/dot_product_attention.py, attention.py, mlp.py, megatron/core/fusions/* (layers)
- transformer_engine/pytorch/module/layernorm_linear.py, linear.py, attention/dot_product_attention/*.py
- transformer_engine/pytorch/cpp_extensions/gemm.py (TE's cuBLAS workspace)
- aten/src/ATen/cuda/CublasHandlePool.cpp (torch's cuBLAS workspaces)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from recompute_bench.analysis.layer import checkpoint_input_bytes
from recompute_bench.analysis.paper import (built_minus_paper_bytes, paper_flops_per_step, paper_layer_bytes,
                                            paper_layer_differences)
from recompute_bench.analysis.planner import ESTIMATE_SCHEMA, with_setting, compute
from recompute_bench.analysis.rank import ALLOWANCE_BYTES, ALLOWANCE_FRACTION, device_bytes_needed
from recompute_bench.analysis.schedule import chunk_forwards_in_flight, schedule_peak
from recompute_bench.analysis.stage import stage_parameters
from recompute_bench.models import ELEMENT_BYTES, FP32_BYTES, INDEX_BYTES, MASK_BYTES, SavedBytes, vocab_rows
from recompute_bench.recompute.policy import chunks, layer_policies
from recompute_bench.recompute.settings import selective_settings
from recompute_bench.spec.config import Config, BadInput, RecomputeConfig
from recompute_bench.spec.rules import layers_per_model_chunk

MiB = 2**20

# Compute capability (major x 10 + minor) of the GPU kinds Megatron runs on; it picks Transformer
# Engine's attention kernel and workspace and torch's default cuBLAS workspace.
COMPUTE_CAPABILITY = {"v100": 70, "t4": 75, "a100": 80, "a10": 86, "a40": 86, "l4": 89, "l40s": 89,
                      "h100": 90, "h200": 90, "h20": 90, "gh200": 90, "b200": 100, "gb200": 100,
                      "b300": 103, "gb300": 103}
DEFAULT_GPU = "h100"


@dataclass(frozen=True)
class MegatronRun:
    """Where Megatron runs, beyond the Config: the GPU kind and torch's CUBLAS_WORKSPACE_CONFIG."""

    gpu: str = DEFAULT_GPU
    """A key of COMPUTE_CAPABILITY (h100, a100, gb200, ...)."""
    cublas_workspace_config: str | None = None
    """The CUBLAS_WORKSPACE_CONFIG environment variable of the run (":4096:8"); None: torch's default."""

    @property
    def compute_capability(self) -> int:
        if self.gpu not in COMPUTE_CAPABILITY:
            raise BadInput(f"unknown GPU kind {self.gpu!r} for framework megatron; pass --gpu with one of "
                              f"{', '.join(COMPUTE_CAPABILITY)}")
        return COMPUTE_CAPABILITY[self.gpu]


# ----- buffers outside the parameters ----------------------------------------------------------------

def te_cublas_workspace_bytes(run: MegatronRun) -> float:
    """Transformer Engine's cuBLAS workspace, one per device (cpp_extensions/gemm.py
    `get_cublas_workspace`, lru-cached): `get_cublas_workspace_size_bytes` is 32 MiB plus 1 KiB on
    sm90 and newer, 4 MiB before."""
    return 32 * MiB + 1024 if run.compute_capability >= 90 else 4 * MiB


def torch_cublas_workspace_bytes(run: MegatronRun) -> float:
    """One of torch's cuBLAS workspaces (CublasHandlePool.cpp `getChosenWorkspaceSize`, allocated
    through the caching allocator by `setWorkspaceForHandle`): the sum of SIZE KiB x COUNT over
    CUBLAS_WORKSPACE_CONFIG's ":SIZE:COUNT" pairs; unset, 32 MiB on Hopper and Blackwell (sm9x to
    sm12x) and :4096:2:16:8 before."""
    config = run.cublas_workspace_config
    pairs = re.findall(r":(\d+):(\d+)", config or "")
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return 4096 * 8 * 1024 if 90 <= run.compute_capability < 130 else 4096 * 1024 * 2 + 16 * 1024 * 8


TORCH_CUBLAS_HANDLES = 2
"""torch keeps one workspace per (cuBLAS handle, stream): the main thread's handle runs the forward,
and the autograd engine's device thread takes a second handle from the pool for the backward
(torch/csrc/autograd/engine.cpp runs CUDA backward on its own thread; handles are per thread)."""


def local_attention_buffer_bytes(cfg: Config) -> float:
    """Megatron's own attention (transformer_impl local): dot_product_attention.py
    `DotProductAttention.forward` takes `matmul_input_buffer` [b x a/t, s, s] in 16 bits from the
    global memory buffer (parallel_state.GlobalMemoryBuffer), which keeps it for the whole run."""
    if cfg.model.transformer_impl != "local":
        return 0.0
    tr, m = cfg.training, cfg.model
    return ELEMENT_BYTES[tr.precision] * tr.micro_batch_size * m.num_attention_heads / \
        cfg.parallel.tensor_model_parallel_size * tr.seq_length ** 2


def buffer_bytes(cfg: Config, run: MegatronRun) -> dict[str, float]:
    """The buffers a Megatron rank holds for the whole run besides parameters and optimizer state."""
    out = {"torch cuBLAS workspaces": TORCH_CUBLAS_HANDLES * torch_cublas_workspace_bytes(run)}
    if cfg.model.transformer_impl == "transformer_engine":
        out["Transformer Engine cuBLAS workspace"] = te_cublas_workspace_bytes(run)
    else:
        out["attention score buffer (local)"] = local_attention_buffer_bytes(cfg)
        if not softmax_fused(cfg, run):  # fused_softmax.py get_default_causal_mask is lru-cached
            out["causal mask (local softmax)"] = MASK_BYTES * cfg.training.seq_length ** 2
    return out


# ----- parameters, gradients and optimizer state -------------------------------------------------

def bytes_per_parameter(cfg: Config) -> dict[str, float]:
    """Megatron's bytes per parameter on a rank, item by item.

    - weights: params_dtype (arguments.py: bf16, fp16 or fp32). With the distributed optimizer they
      live in DDP's param buffer (param_and_grad_buffer.py `_ParamAndGradBuffer.__init__`,
      `param_data`) and the originals are freed.
    - main gradients: DDP's grad buffer (`grad_data`), fp32 for bf16 and fp32 runs (validate_args
      sets accumulate_allreduce_grads_in_fp32 for bf16), fp16 for fp16 runs.
    - master weights and Adam moments: fp32, sharded over dp by the distributed optimizer
      (distrib_optimizer.py), whole otherwise (optimizer.py Float16OptimizerWithFloat16Params); fp32
      runs step the weights themselves (FP32Optimizer).
    - fp32 gradient copies: `_copy_model_grads_to_main_grads` sets `main_param.grad =
      main_grad.float()`, a new fp32 tensor when the grad buffer is fp16, held until the next
      step's zero_grad (sharded with the distributed optimizer).
    DDP's padding (64-element parameter starts, bucket ends to lcm(dp, 128) with the distributed
    optimizer) adds under 0.01% here and is left out."""
    precision, par = cfg.training.precision, cfg.parallel
    shards = par.data_parallel_size if par.use_distributed_optimizer else 1
    weights = ELEMENT_BYTES[precision]
    grads = 2 if precision == "fp16" else FP32_BYTES
    if precision == "fp32":
        return {"weights": 4, "main gradients": 4, "master weights": 0, "Adam moments": 8 / shards,
                "fp32 gradient copies": 0}
    return {"weights": weights, "main gradients": grads, "master weights": 4 / shards, "Adam moments": 8 / shards,
            "fp32 gradient copies": (4 / shards) if precision == "fp16" else 0}


# ----- one layer, one micro-batch --------------------------------------------------------------

def attention_path(cfg: Config, run: MegatronRun) -> str:
    """The attention code a layer runs: "local" (Megatron's DotProductAttention, transformer_impl
    local), or Transformer Engine's "flash" (FlashAttention), "fused" (cuDNN FusedAttention) or
    "unfused" (UnfusedDotProductAttention). Megatron's --attention-backend sets NVTE_FLASH_ATTN /
    NVTE_FUSED_ATTN; auto leaves TE's choice (attention/dot_product_attention/utils.py
    `get_attention_backend`), which on sm90 and newer prefers FusedAttention and before sm90 under
    Megatron's deterministic mode disables the F16 fused kernel, leaving FlashAttention."""
    backend = cfg.model.attention_backend
    if cfg.model.transformer_impl == "local":
        return "local"
    if backend in ("flash", "fused", "unfused"):
        return backend
    return "fused" if run.compute_capability >= 90 else "flash"


def layer_saved_bytes(cfg: Config, run: MegatronRun, modules: Iterable[str] = ()) -> dict[str, float]:
    """Bytes one Megatron GPT layer keeps for backward, one micro-batch on one tensor-parallel rank,
    storage by storage (names after the module that keeps each), when `modules` are recomputed
    selectively: core_attn (attention.py `_checkpointed_attention_forward`), mlp
    (transformer_layer.py checkpoints `self.mlp`, which with TE includes fc1's fused norm), layernorm
    (transformer_layer.py `CheckpointWithoutOutput` around the local spec's norms, whose output is
    dropped once the next linear saved it; TE's norms are fused into the linear, its IdentityOp
    norms leave nothing to recompute)."""
    m, tr = cfg.model, cfg.training
    e, tokens, h, f = ELEMENT_BYTES[tr.precision], tr.seq_length * tr.micro_batch_size, m.hidden_size, m.ffn_hidden_size
    mods = set(modules)
    saved = SavedBytes()
    te = m.transformer_impl == "transformer_engine"
    norms_kept = te or "layernorm" not in mods
    stats = (2 if m.normalization == "LayerNorm" else 1) * FP32_BYTES * tokens  # mu and rsigma, fp32
    # TE's _LayerNormLinear.forward saves `inputmat` and `ln_out` (and mu, rsigma); the local spec's
    # norm saves its input and statistics and ColumnParallelLinear saves the norm's output.
    for block in ("linear_qkv", "linear_fc1"):
        name = block if te else {"linear_qkv": "input_layernorm", "linear_fc1": "pre_mlp_layernorm"}[block]
        saved.add(f"{name}.input", e * tokens * h, "sp")  # the mlp checkpoint's input too
        if block == "linear_fc1" and "mlp" in mods and te:
            continue  # recomputed inside the checkpoint with the rest of the MLP
        if norms_kept:
            saved.add(f"{name}.norm_stats", stats, "sp")
            saved.add(f"{name}.ln_out" if te else f"{block}.input", e * tokens * h, "sp")
        if block == "linear_qkv":
            _attention_saved(saved, cfg, run, mods)
            if m.hidden_dropout > 0:  # fused_bias_dropout.py: the dropout mask of bias-dropout-add
                saved.add("self_attn_bda.dropout_mask", MASK_BYTES * tokens * h, "sp")
    if "mlp" not in mods:
        # fused bias_swiglu (SwiGLUFunction) saves fc1's output only; bias_gelu (GeLUFunction) saves
        # fc1's output, and the activation's output is fc2's input
        saved.add("linear_fc1.output", e * tokens * (2 * f if m.activation == "swiglu" else f), "tp")
        saved.add("linear_fc2.input", e * tokens * f, "tp")
    if m.hidden_dropout > 0:
        saved.add("mlp_bda.dropout_mask", MASK_BYTES * tokens * h, "sp")
    par = cfg.parallel
    return saved.per_rank(par.tensor_model_parallel_size, par.sequence_parallel)


def _attention_saved(saved: SavedBytes, cfg: Config, run: MegatronRun, mods: set[str]) -> None:
    """What the attention block keeps after its norm: the QKV output, RoPE's q and k, the core
    attention's tensors, its output (linear_proj's input)."""
    m, tr = cfg.model, cfg.training
    e, b, s = ELEMENT_BYTES[tr.precision], tr.micro_batch_size, tr.seq_length
    tokens, d, a, g = s * b, m.head_dim, m.num_attention_heads, m.groups
    qkv = ("linear_qkv.output", e * tokens * (a + 2 * g) * d)
    rope = m.position_embedding_type == "rope"
    # attention.py get_query_key_value_tensors: q, k, v are views of the QKV output; query.reshape to
    # [s, b, heads, d] is a copy when several heads share a group (their columns are not adjacent).
    # RoPE (rope_utils.apply_rotary_pos_emb) makes new q and k; v stays a view of the QKV output.
    q = ("rotary.query", e * tokens * a * d) if rope else ("query.reshape", e * tokens * a * d) if g != a else qkv
    k = ("rotary.key", e * tokens * g * d) if rope else qkv
    out = ("core_attention.output", e * tokens * a * d)  # [s, b, h/t]: linear_proj's input
    path = attention_path(cfg, run)
    if "core_attn" in mods:  # tensor_parallel.checkpoint saves q, k, v and the output
        for name, nbytes in (q, k, qkv, out):
            saved.add(name, nbytes, "tp")
        return
    if path == "fused":  # FusedAttnFunc saves q, k, v as given, the output, the softmax statistics
        for name, nbytes in (q, k, qkv, out):
            saved.add(name, nbytes, "tp")
        saved.add("core_attention.softmax_stats", FP32_BYTES * b * a * s, "tp")
    elif path == "flash":  # FlashAttention.forward: contiguous [b, s, heads, d] copies of q, k, v;
        # flash-attn saves its own output; `output.contiguous()` is the [s, b, h] copy linear_proj keeps
        saved.add("core_attention.qkv_bshd", e * tokens * (a + 2 * g) * d, "tp")
        saved.add("core_attention.flash_output", e * tokens * a * d, "tp")
        saved.add(*out, "tp")
        saved.add("core_attention.softmax_lse", FP32_BYTES * b * a * s, "tp")
    else:  # unfused (TE) and local (Megatron): QK^T, softmax, dropout, times V, in 16 bits
        scores = b * a * s * s
        saved.add(*q, "tp")  # baddbmm saves q and k (GQA: repeat_interleave makes k and v anew)
        saved.add(*(("core_attention.key_repeated", e * tokens * a * d) if g != a else k), "tp")
        saved.add(*(("core_attention.value_repeated", e * tokens * a * d) if g != a else qkv), "tp")
        # The fused masked-softmax kernel keeps its 16-bit output; torch's softmax (softmax_fused
        # False) keeps an fp32 output when it works in fp32, and the probabilities go on cast back.
        probs = e if softmax_fused(cfg, run) or not _softmax_in_fp32(cfg) else FP32_BYTES
        saved.add("core_attention.softmax", probs * scores, "tp")
        if m.attention_dropout > 0:
            saved.add("core_attention.dropout_mask", MASK_BYTES * scores, "tp")
            saved.add("core_attention.dropout_output", e * scores, "tp")
        saved.add(*out, "tp")  # context.permute(...).contiguous()


def _batch_per_block(seq_length: int) -> int:
    """The masked-softmax kernels' batches per 128-thread block (scaled_masked_softmax.h
    `get_batch_per_block`, in Megatron's extension and TE's softmax.py): warps of min(2^k, 32)
    threads for k = ceil(log2 s), two batches per warp up to 128 keys."""
    pow2 = 1 << (seq_length - 1).bit_length()
    return 128 // min(pow2, 32) * (2 if pow2 <= 128 else 1)


def softmax_fused(cfg: Config, run: MegatronRun) -> bool:
    """Whether the unfused attention's softmax runs the fused scale-mask-softmax kernel, by its
    `is_kernel_available`: Megatron's (fusions/fused_softmax.py, masked_softmax_fusion, 16 < s <= 4096)
    for the local path, TE's (dot_product_attention/softmax.py, on unless NVTE_MASKED_SOFTMAX_FUSION=0,
    16 < s < 16384, s a multiple of 8) for TE's unfused path; both need 16-bit scores, s and
    b x heads/t multiples of 4 and the block's batches dividing the batches (causal)."""
    tr, m = cfg.training, cfg.model
    s, batches = tr.seq_length, tr.micro_batch_size * m.num_attention_heads // cfg.parallel.tensor_model_parallel_size
    if ELEMENT_BYTES[tr.precision] != 2 or s % 4 or batches % 4:
        return False
    if attention_path(cfg, run) == "local":
        return m.masked_softmax_fusion and 16 < s <= 4096 and batches % _batch_per_block(s) == 0
    return 16 < s < 16384 and s % 8 == 0 and s % _batch_per_block(s) == 0


def _softmax_in_fp32(cfg: Config) -> bool:
    """torch's softmax path upcasts to fp32: Megatron's with attention_softmax_in_fp32, TE's always
    (UnfusedDotProductAttention builds FusedScaleMaskSoftmax with softmax_in_fp32's default True)."""
    return cfg.model.attention_softmax_in_fp32 or cfg.model.transformer_impl == "transformer_engine"


def layer_bytes(cfg: Config, run: MegatronRun, modules: Iterable[str] = ()) -> float:
    """Sum of `layer_saved_bytes`."""
    return sum(layer_saved_bytes(cfg, run, modules).values())


def layer_backward_bytes(cfg: Config, run: MegatronRun) -> float:
    """What one layer's backward holds beyond the saved tensors: the MLP's, where the largest
    gradients meet: linear_fc2's data gradient [s, b, f] and the activation's backward output
    (the gradient of fc1's output), both in 16 bits."""
    tr, m = cfg.training, cfg.model
    e, tokens, t = ELEMENT_BYTES[tr.precision], tr.seq_length * tr.micro_batch_size, cfg.parallel.tensor_model_parallel_size
    fc1 = 2 * m.ffn_hidden_size if m.activation == "swiglu" else m.ffn_hidden_size
    return e * tokens * (m.ffn_hidden_size + fc1) / t


# ----- outside the layers ----------------------------------------------------------------------

def embedding_saved_bytes(cfg: Config) -> float:
    """First stage, per micro-batch: the embedding dropout's mask (LanguageModelEmbedding.forward)."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    if m.hidden_dropout <= 0:
        return 0.0
    t = par.tensor_model_parallel_size if par.sequence_parallel else 1
    return MASK_BYTES * tr.seq_length * tr.micro_batch_size * m.hidden_size / t


def output_saved_bytes(cfg: Config) -> float:
    """Last stage, per micro-batch: the final norm's input and statistics (TENorm / FusedLayerNorm)
    and its output, which the output layer (ColumnParallelLinear) keeps for its weight gradient."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    tokens = tr.seq_length * tr.micro_batch_size
    t = par.tensor_model_parallel_size if par.sequence_parallel else 1
    stats = (2 if m.normalization == "LayerNorm" else 1) * FP32_BYTES * tokens
    return (2 * ELEMENT_BYTES[tr.precision] * tokens * m.hidden_size + stats) / t


def logits(cfg: Config) -> float:
    """Logits on one tensor-parallel rank: s x b x padded vocabulary / t."""
    tr = cfg.training
    return tr.seq_length * tr.micro_batch_size * vocab_rows(cfg) / cfg.parallel.tensor_model_parallel_size


def loss_saved_bytes(cfg: Config) -> float:
    """Kept from the loss's forward to its backward: cross_entropy.py `_VocabParallelCrossEntropy`
    saves `exp_logits`, its fp32 working copy of the logits turned into the softmax in place."""
    return FP32_BYTES * logits(cfg)


def loss_peak_bytes(cfg: Config) -> float:
    """The most the loss holds at once. cross_entropy.py `_VocabParallelCrossEntropy.forward`: the
    16-bit logits and their fp32 copy (`calculate_logits_max`: `.float()`), everything after in place;
    backward: the gradient is computed in place in the saved fp32 buffer and autograd casts it to the
    logits' 16 bits (engine.cpp validate_outputs) while it is alive: 2 + 4 bytes per logit either way.
    The fused cross-entropy (fused_cross_entropy.py, its steps under jit_fuser = torch.compile) holds
    one more fp32 buffer: the compiled `calculate_predicted_logits` writes exp(logits) anew before
    copying it back into the input it mutates, and `calculate_gradients` likewise: 2 + 4 + 4."""
    e = ELEMENT_BYTES[cfg.training.precision]
    held = (e + FP32_BYTES) if e < FP32_BYTES else FP32_BYTES
    if cfg.model.cross_entropy_loss_fusion:
        held += FP32_BYTES
    return held * logits(cfg)


def batch_bytes(cfg: Config) -> float:
    """One micro-batch's inputs on the GPU on the first and last stages (pretrain_gpt.py get_batch):
    tokens, labels and position ids (int64), the loss mask (fp32) and, with
    create_attention_mask_in_dataloader (Megatron's default), the [b, 1, s, s] bool attention mask."""
    tr = cfg.training
    tokens = tr.seq_length * tr.micro_batch_size
    return (3 * INDEX_BYTES + FP32_BYTES) * tokens + MASK_BYTES * tr.micro_batch_size * tr.seq_length ** 2


# ----- one rank --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChunkBytes:
    """One model chunk's activations for one micro-batch."""

    stored: float
    """Kept from its forward to its backward."""
    backward: float
    """The most held while its backward runs (full recompute rebuilds a checkpoint's layers)."""


def chunk_bytes(cfg: Config, run: MegatronRun, layers: int) -> ChunkBytes:
    """A model chunk of `layers` layers under cfg.recompute, unit by unit (recompute/policy.py
    `chunks`): a full-recompute checkpoint keeps its input and, rebuilt in backward, its layers'
    activations over what the earlier units keep; a layer keeps `layer_saved_bytes`. Backward adds
    `layer_backward_bytes` to the most of that."""
    policies = layer_policies(cfg.recompute, layers)
    # A full-recompute checkpoint keeps its [s, b, h] input, as this harness's does (Megatron's
    # tensor_parallel/random.py CheckpointFunction, or TE's checkpoint).
    ckpt, full = checkpoint_input_bytes(cfg), layer_bytes(cfg, run)
    stored = rebuilt = 0.0
    for start, stop in chunks(policies):
        p = policies[start]
        if p.offload:
            raise BadInput("activation offload is not modelled for framework megatron; drop --activation-offload-layers")
        if p.chunk is not None:
            rebuilt = max(rebuilt, stored + (stop - start) * full)
            stored += ckpt
        else:
            stored += layer_bytes(cfg, run, p.modules)
    return ChunkBytes(stored, max(stored, rebuilt) + layer_backward_bytes(cfg, run))


@dataclass
class StagePeak:
    """The peak of one pipeline stage's rank, item by item (bytes), and where it happens."""

    stage: int
    parameters: float
    items: dict[str, float]
    phase: str
    gradient_copies_bytes: float = 0.0
    """fp16 runs' fp32 gradient copies: held from the optimizer step until the next step begins."""

    @property
    def peak_allocated_bytes(self) -> float:
        return sum(self.items.values())

    @property
    def static_bytes(self) -> float:
        """What a rank holds after the optimizer step (Megatron logs it as mem-allocated-bytes):
        parameters, gradients, optimizer state, buffers, fp16's fp32 gradient copies."""
        held = sum(v for k, v in self.items.items() if k not in ACTIVATION_ITEMS and k != "fp32 gradient copies")
        return held + self.gradient_copies_bytes


ACTIVATION_ITEMS = ("activations of the other micro-batches in flight", "activations of the pass at the peak",
                    "transient of the pass at the peak")


def stage_peak(cfg: Config, stage: int, run: MegatronRun) -> StagePeak:
    """Megatron's peak allocated bytes on a rank of pipeline stage `stage`: parameters, gradients
    and optimizer state (`bytes_per_parameter`), the buffers (`buffer_bytes`), and the most the
    step's passes hold at once (analysis/schedule.py): the chunk forwards waiting for their
    backward, plus the pass in flight (the loss on the last stage's last chunk, whose forward also
    holds the micro-batch's inputs; a layer's backward)."""
    par = cfg.parallel
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    chunk = chunk_bytes(cfg, run, cfg.model.num_layers // p // vp)
    first, last = stage == 0, stage == p - 1
    params = stage_parameters(cfg, stage)
    per = bytes_per_parameter(cfg)
    # The fp32 gradient copies live from the optimizer step to the next step's zero_grad, which
    # runs before the forward: they never meet the activations.
    static = {name: b * params for name, b in per.items() if b and name != "fp32 gradient copies"}
    static.update(buffer_bytes(cfg, run))

    def embeds(c: int) -> bool:
        return first and c == 0

    def loses(c: int) -> bool:
        return last and c == vp - 1

    output, kept = output_saved_bytes(cfg), loss_saved_bytes(cfg)

    def stored(c: int) -> float:
        return chunk.stored + (embedding_saved_bytes(cfg) if embeds(c) else 0.0) + ((output + kept) if loses(c) else 0.0)

    def forward(c: int) -> float:
        extra = batch_bytes(cfg) if embeds(c) or loses(c) else 0.0
        return extra + (loss_peak_bytes(cfg) - kept if loses(c) else 0.0)

    def backward(c: int) -> float:
        layers = chunk.backward - chunk.stored
        if loses(c):  # the loss's backward first, then the layers' with the loss and output freed
            return max(loss_peak_bytes(cfg) - kept, layers - output - kept)
        return layers

    peak = schedule_peak(cfg, stage, stored, backward, forward)
    items = {**static, "activations of the other micro-batches in flight": peak.others,
             "activations of the pass at the peak": peak.own, "transient of the pass at the peak": peak.transient}
    phase = ("the loss's " if loses(peak.chunk) else "") + ("forward" if peak.kind == "F" else "backward") + \
        (f" of model chunk {peak.chunk}" if vp > 1 else "")
    copies = per["fp32 gradient copies"] * params
    if copies > peak.total:  # the optimizer step holds the copies instead of activations
        items, phase = {**static, "fp32 gradient copies": copies}, "the optimizer step"
    return StagePeak(stage, params, items, phase, copies)


def stage_peaks(cfg: Config, run: MegatronRun) -> list[StagePeak]:
    """`stage_peak` of every pipeline stage."""
    return [stage_peak(cfg, r, run) for r in range(cfg.parallel.pipeline_model_parallel_size)]


# ----- what `estimate --framework megatron` prints -----------------------------------------------

def _settings(cfg: Config) -> list[RecomputeConfig]:
    """The settings tabulated: none, every selective subset, full uniform 1 and full block at a few
    layer counts of a model chunk, and cfg's own."""
    n = layers_per_model_chunk(cfg)
    out = [RecomputeConfig(), *selective_settings(("core_attn", "mlp", "layernorm")), RecomputeConfig("full", [], "uniform", 1)]
    out += [RecomputeConfig("full", [], "block", k) for k in sorted({1, n // 4, n // 2, 3 * n // 4, n} - {0})]
    if cfg.recompute.label not in {r.label for r in out}:
        out.insert(0, cfg.recompute)
    return out


def setting_estimate(cfg: Config, run: MegatronRun) -> dict[str, Any]:
    """One recompute setting: Megatron's bytes per layer and per stage, the peak rank, FLOPs."""
    par = cfg.parallel
    vp = par.virtual_pipeline_model_parallel_size or 1
    layers = layers_per_model_chunk(cfg)
    chunk = chunk_bytes(cfg, run, layers)
    peak = max(stage_peaks(cfg, run), key=lambda r: r.peak_allocated_bytes)
    return {
        "label": cfg.recompute.label,
        "recompute": cfg.record_fields()["recompute"],
        "activation_bytes_per_layer": chunk.stored / layers,
        "stage_activation_bytes": vp * chunk.stored,
        "stage_activation_peak_bytes": (vp - 1) * chunk.stored + chunk.backward - layer_backward_bytes(cfg, run),
        "peak_allocated_bytes": peak.peak_allocated_bytes,
        "peak_stage": peak.stage,
        "peak_phase": peak.phase,
        **compute(cfg, "cuda"),
    }


def _stage_row(r: StagePeak, fraction: float, fixed: float) -> dict[str, Any]:
    return {"stage": r.stage, "peak_allocated_bytes": r.peak_allocated_bytes, "phase": r.phase,
            "device_bytes_needed": device_bytes_needed(r.peak_allocated_bytes, fraction, fixed),
            "bytes_after_step": r.static_bytes, "parameters_on_rank": r.parameters, "breakdown": dict(r.items)}


def estimate_report(cfg: Config, run: MegatronRun, allowance_fraction: float = ALLOWANCE_FRACTION,
                    allowance_bytes: float = ALLOWANCE_BYTES) -> dict[str, Any]:
    """What `estimate --framework megatron` prints, in the layout of `planner.estimate_report`: the
    settings table, the paper's Table 2 beside Megatron's layer, the peak rank's breakdown of cfg's
    own setting, and every pipeline stage's peak and parts."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    stages = stage_peaks(cfg, run)
    peak = max(stages, key=lambda r: r.peak_allocated_bytes)
    settings = [setting_estimate(with_setting(cfg, r), run) for r in _settings(cfg)]
    for row in settings:
        row["device_bytes_needed"] = device_bytes_needed(row["peak_allocated_bytes"], allowance_fraction, allowance_bytes)
    paper_rows = []
    for name, modules, kind in (("none", (), "none"), ("selective", ("core_attn",), "selective"), ("full", None, "full")):
        paper_rows.append({"recompute": name,
                           "paper_bytes": paper_layer_bytes(tr.seq_length, tr.micro_batch_size, m.hidden_size,
                                                            m.num_attention_heads, par.tensor_model_parallel_size,
                                                            par.sequence_parallel, kind),
                           "built_bytes": checkpoint_input_bytes(cfg) if modules is None else layer_bytes(cfg, run, modules),
                           "paper_flops": paper_flops_per_step(cfg, kind)})
    path = attention_path(cfg, run)
    differences = [d for d in paper_layer_differences(cfg, "cuda") if not d.startswith("attention runs")]
    if path in ("flash", "fused"):
        differences.insert(0, f"attention runs Transformer Engine's {path} kernel, not the paper's explicit softmax path")
    if m.transformer_impl == "transformer_engine" or m.activation == "swiglu":
        differences.append("Megatron's layer keeps what its modules keep (TE's fused norm-linear, fused bias-activation)")
    modules = cfg.recompute.modules if cfg.recompute.granularity == "selective" else ()
    return {
        "schema": ESTIMATE_SCHEMA,
        "framework": "megatron",
        "workload": cfg.workload,
        "config": cfg.to_dict(),
        "recompute": cfg.record_fields()["recompute"],
        "device": "cuda",
        "gpu": run.gpu,
        "cublas_workspace_config": run.cublas_workspace_config,
        "attention_kernel": path,
        "num_microbatches": cfg.num_microbatches,
        "microbatches_in_flight": chunk_forwards_in_flight(cfg, 0) / (par.virtual_pipeline_model_parallel_size or 1),
        "allowance": {"fraction": allowance_fraction, "bytes": allowance_bytes},
        "setting": {**setting_estimate(cfg, run),
                    "device_bytes_needed": device_bytes_needed(peak.peak_allocated_bytes, allowance_fraction, allowance_bytes),
                    "layer_saved_bytes": layer_saved_bytes(cfg, run, modules),
                    "breakdown": dict(peak.items), "parameters_on_rank": peak.parameters},
        "stages": [_stage_row(r, allowance_fraction, allowance_bytes) for r in stages],
        "settings": settings,
        "paper": {"differences": differences, "norm_stats_bytes": built_minus_paper_bytes(cfg, "cuda"), "rows": paper_rows},
        "other_optimizer": None if par.data_parallel_size == 1 else {
            "use_distributed_optimizer": not par.use_distributed_optimizer,
            "peak_allocated_bytes": max(r.peak_allocated_bytes for r in stage_peaks(
                with_setting(cfg, use_distributed_optimizer=not par.use_distributed_optimizer), run))},
    }


def record_estimate(cfg: Config, run: MegatronRun) -> dict[str, float]:
    """What a result record carries beside a Megatron run's measured figures (the keys of
    `rank.record_estimate`): one micro-batch's activations over the whole model and per layer, as
    Megatron's layers keep them, the hardware FLOPs, and the peak of the most loaded stage."""
    layers = layers_per_model_chunk(cfg)
    per_layer = chunk_bytes(cfg, run, layers).stored / layers
    outside = embedding_saved_bytes(cfg) + output_saved_bytes(cfg) + loss_saved_bytes(cfg)
    return {
        "estimated_activation_bytes": per_layer * cfg.model.num_layers + outside,
        "estimated_activation_bytes_per_layer": per_layer,
        "estimated_hardware_flops_per_step": compute(cfg, "cuda")["hardware_flops_per_step"],
        "estimated_peak_allocated_bytes": max(r.peak_allocated_bytes for r in stage_peaks(cfg, run)),
    }
