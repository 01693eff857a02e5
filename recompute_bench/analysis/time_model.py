"""Step time of a Megatron run on a GPU kind, op by op: a roofline per op.

Each op a dense Megatron layer runs (and the embedding, output layer, loss and optimizer step
around the layers) is listed with the work it does on one tensor-parallel rank for one micro-batch:
its matrix FLOPs, the HBM bytes it reads and writes, or the bytes it sends over NVLink. Its time is

    matrix work (linears):         max(FLOPs / the precision's peak, bytes / HBM bandwidth)
    attention (the fused kernel):  max(FLOPs / the 16-bit peak, bytes / HBM bandwidth)
    memory-bound work:             bytes / HBM bandwidth
    tensor-parallel communication: ring bytes sent / NVLink bandwidth (one direction)

with every rate from `gpu_rates` (a datasheet, or a profile measured on the GPU). FP8 runs the
linears' three GEMMs (forward, data gradient, weight gradient) at FP8's peak and adds the
quantisation of their inputs and of the gradients that reach them; attention, the output layer and
everything memory-bound stay 16-bit. No rate is scaled by an efficiency.

A recompute setting re-runs forward ops in backward: `selective` the ops of its modules (which ops
each module covers depends on Megatron's layer spec, below), `full` every forward op of each
checkpointed layer. The step is the pipeline's: per micro-batch each stage runs its model chunks'
layers forward, backward and recompute (plus the embedding on the first stage and the loss on the
last), and Megatron's schedule takes (m + (p - 1) / vp) of the slowest stage's micro-batch
(Narayanan et al. 2021, the interleaved schedule's bubble), then the optimizer step.

Not priced (setting-independent, so they change absolute time, not which setting is faster by
how much): data-parallel gradient reduction and parameter all-gather (Megatron overlaps them with
backward and forward), kernel launch gaps, the weights' FP8 cast (once per step: TE caches it over
the micro-batches), pipeline send/receive. Mixture-of-experts, multi-latent attention and context
parallel layers are not priced yet (BadInput naming them). Pure Python.

Sources (Megatron-LM d98e8a6, TransformerEngine d0067d0):
- megatron/core/transformer/transformer_layer.py, attention.py, mlp.py (what each recompute module runs)
- megatron/core/tensor_parallel/layers.py `LinearWithGradAccumulationAndAsyncCommunication` (the
  all-reduce / reduce-scatter of a column-parallel linear's data gradient overlaps its weight
  gradient GEMM; forward collectives are waited for)
- transformer_engine/pytorch/module/layernorm_linear.py, linear.py (FP8: the norm's output
  quantised then all-gathered in FP8; rowwise and columnwise copies for the two GEMMs)
- transformer_engine/pytorch/csrc/extensions/normalization.cpp (delayed scaling writes FP8 from the
  norm kernel; current scaling computes the norm and its amax, then quantises)
- transformer_engine/pytorch/csrc/quantizer.cpp `Float8CurrentScalingQuantizer::quantize_impl`
  (an amax pass, then the cast)
- megatron/core/tensor_parallel/cross_entropy.py, megatron/core/fusions/fused_cross_entropy.py (the loss's passes)
- megatron/core/optimizer (fused Adam over the rank's shard)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from recompute_bench.analysis.gpu_rates import GpuRates
from recompute_bench.analysis.megatron.attention import attention_path, softmax_fused
from recompute_bench.analysis.megatron.run import MegatronRun
from recompute_bench.models import ELEMENT_BYTES, FP32_BYTES, MASK_BYTES, vocab_rows
from recompute_bench.recompute.policy import LayerPolicy, layer_policies
from recompute_bench.spec.config import BadInput, Config

FP8_BYTES = 1


@dataclass(frozen=True)
class Op:
    """One op on one tensor-parallel rank for one micro-batch."""

    name: str
    kind: str
    """matrix, attention, memory or comm."""
    flops: float = 0.0
    bytes: float = 0.0
    """HBM bytes read and written (matrix, attention, memory), or bytes sent over NVLink (comm)."""
    precision: str = "bf16"
    """The matrix rate it runs at (matrix and attention)."""
    module: str | None = None
    """The selective-recompute module whose forward re-runs this op (forward ops only); None: only
    full recompute re-runs it."""
    overlaps: str | None = None
    """comm in backward: the GEMM it runs beside; only what outlasts that GEMM adds time."""

    def seconds(self, rates: GpuRates) -> float:
        """The op's roofline time on `rates`."""
        if self.kind == "comm":
            return self.bytes / rates.link_bytes_per_s
        memory = self.bytes / rates.hbm_bytes_per_s
        if self.kind == "memory":
            return memory
        return max(self.flops / rates.matrix_rate(self.precision), memory)


def pass_seconds(ops: list[Op], rates: GpuRates) -> float:
    """A pass's time: its ops one after another, a comm op with `overlaps` hidden behind that op."""
    return sum(op_times(ops, rates).values())


def op_times(ops: list[Op], rates: GpuRates) -> dict[str, float]:
    """Each op's added time in a pass, by name (an overlapped comm op: only what outlasts its GEMM)."""
    own = {op.name: op.seconds(rates) for op in ops}
    return {op.name: max(0.0, own[op.name] - own.get(op.overlaps, 0.0)) if op.overlaps else own[op.name]
            for op in ops}


@dataclass
class LayerOps:
    """The ops of one layer (or of what lies outside the layers) in its forward and its backward."""

    forward: list[Op] = field(default_factory=list)
    backward: list[Op] = field(default_factory=list)


def check_priced(cfg: Config) -> None:
    """BadInput for what the time model does not price yet, naming it."""
    m, par = cfg.model, cfg.parallel
    if m.num_moe_experts:
        raise BadInput("the time model prices dense layers; mixture-of-experts layers are not priced yet: "
                       "plan a dense workload")
    if m.multi_latent_attention:
        raise BadInput("the time model prices dense layers; multi-latent attention is not priced yet: "
                       "plan a dense workload")
    if par.context_parallel_size > 1:
        raise BadInput("the time model does not price context parallel yet; drop --context-parallel-size")


# ----- one dense layer --------------------------------------------------------------------------


class _Shape:
    """The sizes one tensor-parallel rank works on for one micro-batch."""

    def __init__(self, cfg: Config):
        m, tr, par = cfg.model, cfg.training, cfg.parallel
        self.t = par.tensor_model_parallel_size
        self.sp = par.sequence_parallel and self.t > 1
        self.b, self.s = tr.micro_batch_size, tr.seq_length
        self.tokens = self.b * self.s
        self.h, self.f = m.hidden_size, m.ffn_hidden_size
        self.heads, self.groups, self.d = m.num_attention_heads // self.t, m.groups // self.t, m.head_dim
        self.e = ELEMENT_BYTES[tr.precision]
        self.fp8 = tr.precision == "fp8"
        self.recipe = tr.fp8_recipe
        # Elementwise work outside the tensor-parallel region runs on the rank's sequence shard.
        self.local = self.tokens * self.h / (self.t if self.sp else 1)
        self.gemm_precision = "fp8" if self.fp8 else tr.precision

    def hidden_comm(self, kind: str, elements: float, element_bytes: float) -> float:
        """Bytes one rank sends in a ring collective over the t ranks of the whole tensor of
        `elements`: all-gather and reduce-scatter (t - 1)/t of it, all-reduce twice that."""
        share = (self.t - 1) / self.t * elements * element_bytes
        return 2 * share if kind == "all_reduce" else share


def _quantize(name: str, elements: float, sh: _Shape, module: str | None, fused_with_norm: bool = False) -> list[Op]:
    """FP8: the cast of a GEMM operand of `elements` 16-bit values into its rowwise and columnwise
    FP8 copies (one for each GEMM that reads it). Current scaling (tensorwise) first reads the input
    for its amax unless the norm kernel computed it; delayed scaling casts inside the norm kernel."""
    if not sh.fp8:
        return []
    if fused_with_norm and sh.recipe == "delayed":
        return []  # the norm kernel writes FP8 itself (counted there)
    amax_pass = sh.recipe == "tensorwise" and not fused_with_norm
    reads = (2 if amax_pass else 1) * sh.e * elements
    return [Op(f"{name}.quantize", "memory", bytes=reads + 2 * FP8_BYTES * elements, module=module)]


def _norm(name: str, sh: _Shape, module: str | None, quantized_output: bool) -> Op:
    """A LayerNorm/RMSNorm forward over the rank's tokens: reads its input, writes its output (FP8
    directly when TE's delayed-scaling kernel fuses the cast)."""
    out = 2 * FP8_BYTES if quantized_output and sh.fp8 and sh.recipe == "delayed" else sh.e
    return Op(name, "memory", bytes=(sh.e + out) * sh.local, module=module)


def _linear(name: str, sh: _Shape, tokens: float, k: float, n: float, module: str | None) -> Op:
    """A linear's forward GEMM [tokens, k] x [k, n] on this rank: reads its input and weight, writes its output."""
    in_bytes = FP8_BYTES if sh.fp8 else sh.e
    return Op(name, "matrix", flops=2 * tokens * k * n, bytes=in_bytes * (tokens * k + k * n) + sh.e * tokens * n,
              precision=sh.gemm_precision, module=module)


def _column_input(name: str, sh: _Shape, module: str | None, norm: str | None, norm_module: str | None) -> list[Op]:
    """What precedes a column-parallel linear: its norm (fused in TE's LayerNormLinear), the FP8
    cast (before the all-gather: TE gathers FP8) and, with sequence parallel, the all-gather."""
    ops = [_norm(norm, sh, norm_module, quantized_output=True)] if norm else []
    ops += _quantize(name, sh.local, sh, module, fused_with_norm=norm is not None)
    if sh.sp:
        ops.append(Op(f"{name}.all_gather", "comm", bytes=sh.hidden_comm("all_gather", sh.tokens * sh.h,
                                                                          FP8_BYTES if sh.fp8 else sh.e), module=module))
    return ops


def _row_output(name: str, sh: _Shape, module: str | None) -> list[Op]:
    """What follows a row-parallel linear: the reduce-scatter (sequence parallel) or all-reduce of its output."""
    if sh.t == 1:
        return []
    kind = "reduce_scatter" if sh.sp else "all_reduce"
    return [Op(f"{name}.{kind}", "comm", bytes=sh.hidden_comm(kind, sh.tokens * sh.h, sh.e), module=module)]


def _bias_dropout_add(name: str, sh: _Shape, dropout: float, forward: bool) -> Op:
    """Megatron's fused bias-dropout-add on the rank's tokens: forward reads the branch and the
    residual and writes the sum (and the dropout mask); backward applies the mask to the gradient
    and adds the branch's gradient into the residual stream's."""
    mask = MASK_BYTES if dropout > 0 else 0
    if forward:
        return Op(name, "memory", bytes=(3 * sh.e + mask) * sh.local)
    return Op(name + ".backward", "memory", bytes=(3 * sh.e + (2 * sh.e + mask if dropout > 0 else 0)) * sh.local)


def _attention_forward(cfg: Config, run: MegatronRun, sh: _Shape) -> list[Op]:
    """Core attention's forward ops (module core_attn), by the path Megatron runs (`attention_path`)."""
    m = cfg.model
    path = attention_path(cfg, run)
    q_elems, kv_elems = sh.tokens * sh.heads * sh.d, sh.tokens * sh.groups * sh.d
    scores = sh.b * sh.heads * sh.s * sh.s
    if path in ("fused", "flash"):
        pairs = sh.s * (sh.s + 1) / 2  # causal: the kernels skip the masked tiles
        flops = sh.b * sh.heads * pairs * 4 * sh.d  # QK^T and times V, 2 FLOPs per multiply-add
        lse = FP32_BYTES * sh.b * sh.heads * sh.s
        ops = []
        if path == "flash":  # TE's FlashAttention makes contiguous [b, s, heads, d] copies of q, k, v
            ops.append(Op("core_attention.qkv_copy", "memory", bytes=2 * sh.e * (q_elems + 2 * kv_elems), module="core_attn"))
        ops.append(Op("core_attention", "attention", flops=flops, bytes=sh.e * (2 * q_elems + 2 * kv_elems) + lse,
                      module="core_attn"))
        if path == "flash":  # and `output.contiguous()` back to [s, b, h]
            ops.append(Op("core_attention.output_copy", "memory", bytes=2 * sh.e * q_elems, module="core_attn"))
        return ops
    # unfused (TE) and local (Megatron): baddbmm QK^T over the whole square, softmax, dropout, times V.
    ops = []
    if sh.groups != sh.heads:  # GQA: k and v are repeated to every head
        ops.append(Op("core_attention.repeat_kv", "memory", bytes=2 * sh.e * (kv_elems + q_elems), module="core_attn"))
    ops.append(Op("core_attention.qk", "matrix", flops=2 * scores * sh.d, bytes=sh.e * (2 * q_elems + scores),
                  precision=cfg.training.precision if not sh.fp8 else "bf16", module="core_attn"))
    fused = softmax_fused(cfg, run)
    probs = sh.e if fused or not (m.attention_softmax_in_fp32 or m.transformer_impl == "transformer_engine") else FP32_BYTES
    mask = 0 if fused else MASK_BYTES  # torch's path reads the causal mask
    ops.append(Op("core_attention.softmax", "memory", bytes=(sh.e + probs + mask) * scores, module="core_attn"))
    if m.attention_dropout > 0:
        ops.append(Op("core_attention.dropout", "memory", bytes=(probs + sh.e + MASK_BYTES) * scores, module="core_attn"))
    ops.append(Op("core_attention.pv", "matrix", flops=2 * scores * sh.d, bytes=sh.e * (scores + 2 * q_elems),
                  precision=cfg.training.precision if not sh.fp8 else "bf16", module="core_attn"))
    ops.append(Op("core_attention.output_copy", "memory", bytes=2 * sh.e * q_elems, module="core_attn"))
    return ops


def _attention_backward(forward: list[Op], cfg: Config, run: MegatronRun, sh: _Shape) -> list[Op]:
    """Core attention's backward: the fused kernels recompute QK^T and run four gradient GEMMs
    (5 matmuls where the forward ran 2) reading q, k, v, the output, its gradient and the softmax
    statistics and writing dq, dk, dv; the explicit path runs two GEMMs per forward GEMM and the
    softmax and dropout backward over the scores."""
    path = attention_path(cfg, run)
    q_elems, kv_elems = sh.tokens * sh.heads * sh.d, sh.tokens * sh.groups * sh.d
    scores = sh.b * sh.heads * sh.s * sh.s
    out = []
    for op in forward:
        if op.kind == "attention":
            lse = FP32_BYTES * sh.b * sh.heads * sh.s
            out.append(Op(op.name + ".backward", "attention", flops=2.5 * op.flops,
                          bytes=sh.e * (4 * q_elems + 4 * kv_elems) + lse))
        elif op.kind == "matrix":
            out.append(Op(op.name + ".backward", "matrix", flops=2 * op.flops, bytes=2 * op.bytes, precision=op.precision))
        elif op.name == "core_attention.softmax":
            probs = op.bytes / scores - sh.e - (0 if softmax_fused(cfg, run) else MASK_BYTES)
            out.append(Op(op.name + ".backward", "memory", bytes=(probs + 2 * sh.e) * scores))
        elif op.name == "core_attention.dropout":
            out.append(Op(op.name + ".backward", "memory", bytes=(2 * sh.e + MASK_BYTES) * scores))
        else:  # copies: the gradient goes back through the same copy
            out.append(Op(op.name + ".backward", "memory", bytes=op.bytes))
    if path in ("fused", "flash"):  # the kernels' preprocessing: rowsum(dO * O)
        out.insert(0, Op("core_attention.backward_preprocess", "memory", bytes=2 * sh.e * q_elems))
    return out


def _linear_backward(fwd: Op, sh: _Shape, tokens: float, k: float, n: float, column: bool) -> list[Op]:
    """A linear's backward: FP8 casts of the output gradient, the data-gradient and weight-gradient
    GEMMs (the weight gradient accumulated into Megatron's fp32 main gradient), and its collective:
    a column-parallel linear reduces its data gradient (reduce-scatter or all-reduce) beside the
    weight-gradient GEMM and, with sequence parallel, all-gathers its input again beside the data
    gradient; a row-parallel one all-gathers the output gradient first (sequence parallel)."""
    ops = []
    if not column and sh.sp:
        ops.append(Op(f"{fwd.name}.grad_all_gather", "comm", bytes=sh.hidden_comm("all_gather", sh.tokens * sh.h, sh.e)))
    if sh.fp8:
        reads = (2 if sh.recipe == "tensorwise" else 1) * sh.e * tokens * n
        ops.append(Op(f"{fwd.name}.grad_quantize", "memory", bytes=reads + 2 * FP8_BYTES * tokens * n))
    in_bytes = FP8_BYTES if sh.fp8 else sh.e
    dgrad = Op(f"{fwd.name}.dgrad", "matrix", flops=fwd.flops, bytes=in_bytes * (tokens * n + k * n) + sh.e * tokens * k,
               precision=fwd.precision)
    wgrad = Op(f"{fwd.name}.wgrad", "matrix", flops=fwd.flops,
               bytes=in_bytes * (tokens * n + tokens * k) + 2 * FP32_BYTES * k * n, precision=fwd.precision)
    ops += [dgrad, wgrad]
    if column and sh.t > 1:
        if sh.sp:
            ops.append(Op(f"{fwd.name}.input_all_gather", "comm", overlaps=dgrad.name,
                          bytes=sh.hidden_comm("all_gather", sh.tokens * sh.h, FP8_BYTES if sh.fp8 else sh.e)))
        kind = "reduce_scatter" if sh.sp else "all_reduce"
        ops.append(Op(f"{fwd.name}.dgrad_{kind}", "comm", overlaps=wgrad.name,
                      bytes=sh.hidden_comm(kind, sh.tokens * sh.h, sh.e)))
    return ops


def layer_ops(cfg: Config, run: MegatronRun) -> LayerOps:
    """The ops of one dense Megatron layer on one tensor-parallel rank for one micro-batch, and the
    recompute module each forward op belongs to. With Transformer Engine (the GPT layer spec with TE)
    the norms are fused into linear_qkv and linear_fc1 (`TELayerNormColumnParallelLinear`), so the
    pre-MLP norm sits inside the `mlp` checkpoint and `layernorm` re-runs nothing; with Megatron's
    local spec each norm is its own module, re-run by `layernorm`. `core_attn` re-runs the core
    attention only (RoPE runs before it, linear_proj after it, attention.py); `mlp` the whole MLP:
    its all-gather, fc1, activation, fc2 and the reduce of fc2's output (mlp.py)."""
    check_priced(cfg)
    m = cfg.model
    sh = _Shape(cfg)
    te = m.transformer_impl == "transformer_engine"
    q, kv = sh.heads * sh.d, sh.groups * sh.d
    fc1_width = (2 if m.activation == "swiglu" else 1) * sh.f // sh.t
    f_local = sh.f // sh.t
    T, h = sh.tokens, sh.h
    norm_module = None if te else "layernorm"

    fwd: list[Op] = []
    fwd += _column_input("linear_qkv", sh, None, "input_layernorm", norm_module)
    qkv = _linear("linear_qkv", sh, T, h, q + 2 * kv, None)
    fwd.append(qkv)
    if m.position_embedding_type == "rope":  # q and k rotated (read and written) before core attention
        fwd.append(Op("rotary", "memory", bytes=2 * sh.e * T * (q + kv)))
    attention = _attention_forward(cfg, run, sh)
    fwd += attention
    fwd += _quantize("linear_proj", T * q, sh, None)
    proj = _linear("linear_proj", sh, T, q, h, None)
    fwd.append(proj)
    fwd += _row_output("linear_proj", sh, None)
    fwd.append(_bias_dropout_add("self_attn_bda", sh, m.hidden_dropout, forward=True))
    fwd += _column_input("linear_fc1", sh, "mlp", "pre_mlp_layernorm", "mlp" if te else "layernorm")
    fc1 = _linear("linear_fc1", sh, T, h, fc1_width, "mlp")
    fwd.append(fc1)
    # Megatron's fused bias-GeLU / bias-SwiGLU reads fc1's output and writes fc2's input.
    fwd.append(Op("activation", "memory", bytes=sh.e * T * (fc1_width + f_local), module="mlp"))
    fwd += _quantize("linear_fc2", T * f_local, sh, "mlp")
    fc2 = _linear("linear_fc2", sh, T, f_local, h, "mlp")
    fwd.append(fc2)
    fwd += _row_output("linear_fc2", sh, "mlp")
    fwd.append(_bias_dropout_add("mlp_bda", sh, m.hidden_dropout, forward=True))

    bwd: list[Op] = [_bias_dropout_add("mlp_bda", sh, m.hidden_dropout, forward=False)]
    bwd += _linear_backward(fc2, sh, T, f_local, h, column=False)
    # GeLU backward reads its input and the gradient, writes the input's gradient; SwiGLU reads the
    # 2f-wide input and the f-wide gradient and writes a 2f-wide gradient.
    bwd.append(Op("activation.backward", "memory", bytes=sh.e * T * (2 * fc1_width + f_local)))
    bwd += _linear_backward(fc1, sh, T, h, fc1_width, column=True)
    bwd.append(Op("pre_mlp_layernorm.backward", "memory", bytes=3 * sh.e * sh.local))
    bwd.append(_bias_dropout_add("self_attn_bda", sh, m.hidden_dropout, forward=False))
    bwd += _linear_backward(proj, sh, T, q, h, column=False)
    bwd += _attention_backward(attention, cfg, run, sh)
    if m.position_embedding_type == "rope":
        bwd.append(Op("rotary.backward", "memory", bytes=2 * sh.e * T * (q + kv)))
    bwd += _linear_backward(qkv, sh, T, h, q + 2 * kv, column=True)
    bwd.append(Op("input_layernorm.backward", "memory", bytes=3 * sh.e * sh.local))
    return LayerOps(fwd, bwd)


def recompute_ops(layer: LayerOps, policy: LayerPolicy) -> list[Op]:
    """The forward ops a layer re-runs in its backward under `policy`: all of them inside a
    full-recompute checkpoint, the ops of its modules under selective recompute."""
    if policy.chunk is not None:
        return list(layer.forward)
    return [op for op in layer.forward if op.module is not None and op.module in policy.modules]


# ----- outside the layers -----------------------------------------------------------------------


def embedding_ops(cfg: Config) -> LayerOps:
    """The first stage's word (and learned position) embedding: the rows gathered and, under
    tensor parallel, reduced over the vocabulary shards (VocabParallelEmbedding: all-reduce, or
    reduce-scatter with sequence parallel); backward scatters the gradient into a dense gradient of
    the rank's vocabulary shard, which Megatron's DDP hook adds into the fp32 main gradient."""
    sh = _Shape(cfg)
    rows = vocab_rows(cfg) / sh.t
    fwd = [Op("embedding", "memory", bytes=2 * sh.e * sh.tokens * sh.h)]
    if sh.t > 1:
        kind = "reduce_scatter" if sh.sp else "all_reduce"
        fwd.append(Op(f"embedding.{kind}", "comm", bytes=sh.hidden_comm(kind, sh.tokens * sh.h, sh.e)))
    if cfg.model.hidden_dropout > 0:
        fwd.append(Op("embedding.dropout", "memory", bytes=(2 * sh.e + MASK_BYTES) * sh.local))
    bwd = [Op("embedding.backward", "memory",
              bytes=sh.e * sh.tokens * sh.h + sh.e * rows * sh.h + (sh.e + 2 * FP32_BYTES) * rows * sh.h)]
    if sh.sp:
        bwd.insert(0, Op("embedding.grad_all_gather", "comm", bytes=sh.hidden_comm("all_gather", sh.tokens * sh.h, sh.e)))
    return LayerOps(fwd, bwd)


def loss_ops(cfg: Config) -> LayerOps:
    """The last stage's final norm, output layer (Megatron's ColumnParallelLinear, in the training's
    16 bits even under FP8: the FP8 region is the transformer layers) and vocabulary-parallel
    cross-entropy. Its passes over the logits (cross_entropy.py): the fp32 copy and max, the in-place
    subtract, exp, sum and divide, and in backward the in-place scale and the cast back; the fused
    loss (fused_cross_entropy.py) runs its steps as three compiled kernels and one in backward."""
    sh = _Shape(cfg)
    precision = "bf16" if sh.fp8 else cfg.training.precision
    e = sh.e
    vocab = vocab_rows(cfg) / sh.t
    logits = sh.tokens * vocab
    fwd = [_norm("final_layernorm", sh, None, quantized_output=False)]
    if sh.sp:
        fwd.append(Op("output_layer.all_gather", "comm", bytes=sh.hidden_comm("all_gather", sh.tokens * sh.h, e)))
    out = Op("output_layer", "matrix", flops=2 * sh.tokens * sh.h * vocab,
             bytes=e * (sh.tokens * sh.h + sh.h * vocab + logits), precision=precision)
    fwd.append(out)
    if cfg.model.cross_entropy_loss_fusion:  # float+max; subtract, exp, sum; divide
        forward_bytes, backward_bytes = (e + FP32_BYTES) + 2 * FP32_BYTES + 2 * FP32_BYTES, FP32_BYTES + e
    else:  # float; max; subtract; exp; sum; divide   |   scale; cast
        forward_bytes = (e + FP32_BYTES) + FP32_BYTES + 2 * FP32_BYTES + 2 * FP32_BYTES + FP32_BYTES + 2 * FP32_BYTES
        backward_bytes = 2 * FP32_BYTES + FP32_BYTES + e
    fwd.append(Op("cross_entropy", "memory", bytes=forward_bytes * logits))
    bwd = [Op("cross_entropy.backward", "memory", bytes=backward_bytes * logits)]
    dgrad = Op("output_layer.dgrad", "matrix", flops=out.flops, bytes=e * (logits + sh.h * vocab + sh.tokens * sh.h),
               precision=precision)
    wgrad = Op("output_layer.wgrad", "matrix", flops=out.flops,
               bytes=e * (logits + sh.tokens * sh.h) + 2 * FP32_BYTES * sh.h * vocab, precision=precision)
    bwd += [dgrad, wgrad]
    if sh.t > 1:
        kind = "reduce_scatter" if sh.sp else "all_reduce"
        bwd.append(Op(f"output_layer.dgrad_{kind}", "comm", overlaps=wgrad.name,
                      bytes=sh.hidden_comm(kind, sh.tokens * sh.h, e)))
    bwd.append(Op("final_layernorm.backward", "memory", bytes=3 * e * sh.local))
    return LayerOps(fwd, bwd)


def optimizer_ops(cfg: Config, parameters: float) -> list[Op]:
    """The step after the micro-batches, on a rank holding `parameters`: zeroing the fp32 gradient
    buffer, the gradient norm (a read of the rank's gradient shard) and fused Adam over the shard
    (reads the fp32 gradient, reads and writes the fp32 master weight and both moments, writes the
    16-bit weight); the distributed optimizer steps parameters / dp per rank."""
    par = cfg.parallel
    shard = parameters / (par.data_parallel_size if par.use_distributed_optimizer else 1)
    e = ELEMENT_BYTES[cfg.training.precision]
    adam = FP32_BYTES + 6 * FP32_BYTES + (e if cfg.training.precision != "fp32" else 0)
    return [Op("optimizer.zero_grad", "memory", bytes=FP32_BYTES * parameters),
            Op("optimizer.grad_norm", "memory", bytes=FP32_BYTES * shard),
            Op("optimizer.adam", "memory", bytes=adam * shard)]


# ----- the step ---------------------------------------------------------------------------------


@dataclass
class StepTime:
    """The predicted step, its stages and its parts."""

    step_seconds: float
    microbatch_seconds: list[float]
    """Per pipeline stage: one micro-batch's forward, backward and recompute through its chunks."""
    pacing_stage: int
    bubble_seconds: float
    optimizer_seconds: float
    parts: list[dict[str, Any]]
    """The pacing stage's ops over the step: name, kind, module, pass, seconds."""

    @property
    def recompute_seconds(self) -> float:
        return sum(p["seconds"] for p in self.parts if p["pass"] == "recompute")


def _stage_chunks(cfg: Config, stage: int) -> list[int]:
    """The virtual stages rank `stage` holds (Megatron's interleaving: r, r + p, ...)."""
    par = cfg.parallel
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    return [stage + k * p for k in range(vp)]


def step_time(cfg: Config, run: MegatronRun, rates: GpuRates, parameters: list[float] | None = None) -> StepTime:
    """The predicted step time of cfg (its recompute setting included) on `rates`, with the pacing
    stage's ops. `parameters`: each stage's parameters on a rank (for the optimizer step); without
    them the step leaves the optimizer out."""
    par = cfg.parallel
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    per_chunk = cfg.model.num_layers // (p * vp)
    layer = layer_ops(cfg, run)
    times_f, times_b = op_times(layer.forward, rates), op_times(layer.backward, rates)
    policies = layer_policies(cfg.recompute, per_chunk)
    recompute = [recompute_ops(layer, policy) for policy in policies]
    checkpoints = checkpoint_ops(cfg, policies)
    times_r = {**times_f, **op_times(checkpoints, rates)}
    offload = offload_seconds(cfg, run, rates, policies, sum(times_f[o.name] for o in layer.forward),
                              pass_seconds(layer.backward, rates))
    outside = {"embedding": embedding_ops(cfg), "loss": loss_ops(cfg)}
    stages = []
    for stage in range(p):
        parts: dict[tuple[str, str, str | None, str], float] = defaultdict(float)
        kinds = {op.name: op for op in layer.forward + layer.backward}
        for v in _stage_chunks(cfg, stage):
            for name, sec in times_f.items():
                parts[(name, kinds[name].kind, kinds[name].module, "forward")] += sec * per_chunk
            for name, sec in times_b.items():
                parts[(name, kinds[name].kind, None, "backward")] += sec * per_chunk
            for ops in recompute + [checkpoints]:
                for op in ops:
                    parts[(op.name, op.kind, op.module, "recompute")] += times_r[op.name]
            if offload:
                parts[("cpu_offloading", "comm", None, "offload")] += offload
            ends = (["embedding"] if v == 0 else []) + (["loss"] if v == p * vp - 1 else [])
            for end in ends:
                for pass_name, ops in (("forward", outside[end].forward), ("backward", outside[end].backward)):
                    for name, sec in op_times(ops, rates).items():
                        op = next(o for o in ops if o.name == name)
                        parts[(name, op.kind, None, pass_name)] += sec
        stages.append(parts)
    micro = [sum(parts.values()) for parts in stages]
    pacing = max(range(p), key=lambda s: micro[s])
    m = cfg.num_microbatches
    bubble = (p - 1) / vp * micro[pacing]
    optimizer = 0.0
    if parameters is not None:
        optimizer = max(pass_seconds(optimizer_ops(cfg, params), rates) for params in parameters)
    listed = [{"op": name, "kind": kind, "module": module, "pass": pass_name, "seconds": m * sec}
              for (name, kind, module, pass_name), sec in stages[pacing].items() if sec]
    listed.sort(key=lambda r: -r["seconds"])
    return StepTime(m * micro[pacing] + bubble + optimizer, micro, pacing, bubble, optimizer, listed)


def checkpoint_ops(cfg: Config, policies: list[LayerPolicy]) -> list[Op]:
    """What each full-recompute checkpoint of a model chunk adds beyond re-running its layers:
    with distribute_saved_activations, Megatron's CheckpointFunction (tensor_parallel/random.py)
    keeps 1/t of the checkpoint's input (a copy in forward) and all-gathers it before the recompute."""
    if not cfg.recompute.distribute_saved_activations:
        return []
    sh = _Shape(cfg)
    checkpoints = len({p.chunk for p in policies if p.chunk is not None})
    return [Op("checkpoint.split", "memory", bytes=checkpoints * sh.e * sh.tokens * sh.h * (1 + 1 / sh.t)),
            Op("checkpoint.all_gather", "comm", bytes=checkpoints * sh.hidden_comm("all_gather", sh.tokens * sh.h, sh.e))]


def offload_seconds(cfg: Config, run: MegatronRun, rates: GpuRates, policies: list[LayerPolicy],
                    forward: float, backward: float) -> float:
    """CPU offload's added time per micro-batch for a chunk whose layers run `policies`, a stated
    model: a layer's saved bytes B go to the host while the next layer runs forward (F) and come
    back while the layer above runs backward (Bwd), so with the host link's bandwidth W each
    offloaded layer adds max(0, B/W - F) + max(0, B/W - Bwd). B is Megatron's saved bytes of the
    layer (`analysis.megatron.layer.layer_bytes`); BadInput where the GPU kind has no host-link rate."""
    count = sum(p.offload for p in policies)
    if not count:
        return 0.0
    if not rates.host_link_bytes_per_s:
        raise BadInput(f"{rates.product} has no host-link rate to price CPU offloading with; drop "
                       "--activation-offload-layers or pass another --gpu")
    from recompute_bench.analysis.megatron.layer import layer_bytes

    copy = layer_bytes(cfg, run) / rates.host_link_bytes_per_s
    return count * (max(0.0, copy - forward) + max(0.0, copy - backward))


def layer_seconds(cfg: Config, run: MegatronRun, rates: GpuRates, policy: LayerPolicy = LayerPolicy()) -> dict[str, float]:
    """One layer's forward, backward and recompute seconds for one micro-batch under `policy` (the
    per-layer times Korthikanti et al. Table 4 measured)."""
    layer = layer_ops(cfg, run)
    times_f = op_times(layer.forward, rates)
    return {"forward": pass_seconds(layer.forward, rates), "backward": pass_seconds(layer.backward, rates),
            "recompute": sum(times_f[op.name] for op in recompute_ops(layer, policy))}
