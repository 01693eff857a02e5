"""The pieces the time model (`analysis.megatron.time_model`) builds a Megatron layer from: an op and its
roofline time, a layer's forward and backward op lists, the sizes one rank works on, and the ops of
Transformer Engine's linears, norms, casts and the tensor-parallel collectives around them. Each op
states its work on one rank for one micro-batch (matrix FLOPs, HBM bytes, or bytes sent), and which
selective-recompute modules re-run it. Pure Python.

Sources (Megatron-LM d98e8a6, TransformerEngine d0067d0):
- megatron/core/tensor_parallel/layers.py `LinearWithGradAccumulationAndAsyncCommunication` (the
  all-reduce / reduce-scatter of a column-parallel linear's data gradient overlaps its weight
  gradient GEMM; with sequence parallel its input is all-gathered again beside the data gradient;
  forward collectives are waited for)
- transformer_engine/pytorch/module/layernorm_linear.py, linear.py, grouped_linear.py (FP8: the
  norm's output quantised then all-gathered in FP8; rowwise and columnwise copies for the two GEMMs)
- transformer_engine/pytorch/csrc/extensions/normalization.cpp (delayed scaling writes FP8 from the
  norm kernel; current scaling computes the norm and its amax, then quantises)
- transformer_engine/pytorch/csrc/quantizer.cpp `Float8CurrentScalingQuantizer::quantize_impl`
  (an amax pass, then the cast)
- megatron/core/fusions/fused_bias_dropout.py, fused_bias_swiglu.py, fused_bias_gelu.py
- transformer_engine/pytorch/module/base.py `initialize_ub` (--tp-comm-overlap's default methods:
  ring_exchange for qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad with 1 SM and no SM margin; pipeline
  for proj_fprop, fc2_fprop and bulk for qkv/fc1 dgrad and wgrad with num_sm 16 and set_sm_margin);
  transformer_engine/common/comm_gemm_overlap/comm_gemm_overlap.cpp `CommOverlapCore` (with the margin
  the GEMM beside the communication runs on `_math_sms` = the SM count - num_sm: `UB_COMM_SMS`) and
  `CommOverlapBase::split_overlap_rs` (the pipelined reduce-scatter of 4 GEMM chunks: `UB_PIPELINE_SPLITS`)
- nccl-tests doc/PERFORMANCE.md (busbw = algbw x (n - 1)/n for all-gather and reduce-scatter, x 2 (n - 1)/n
  for all-reduce: the bytes one rank sends per second, `ring_bytes`)
- NCCL src/enqueue.cc (a collective's kernel runs one thread block per channel) and the channel count
  NCCL's log prints (`config.gpus`): the SMs a NCCL collective holds beside a GEMM (`beside_nccl`)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from recompute_bench.analysis.gpu_rates import GpuRates
from recompute_bench.analysis.megatron.context_parallel import rank_tokens
from recompute_bench.config.schema import Config
from recompute_bench.models import ELEMENT_BYTES, MASK_BYTES

FP8_BYTES = 1
UB_COMM_SMS = 16
"""SMs Transformer Engine's userbuffers communication kernel holds beside a pipelined or bulk-overlapped
GEMM (`initialize_ub`'s default num_sm for those methods, with set_sm_margin: the GEMM gets the rest;
Megatron passes no ub_cfgs unless the run names a tp_comm_overlap_cfg, and the seeds' names none)."""
UB_PIPELINE_SPLITS = 4
"""Chunks TE's pipelined reduce-scatter overlap (proj_fprop, fc2_fprop) splits a row-parallel linear's GEMM
into (`initialize_ub`'s default num_splits for the pipeline method). `CommOverlapBase::split_overlap_rs`
reduce-scatters each chunk once its GEMM is done, so the last chunk's reduce-scatter runs after every GEMM
chunk, exposed: 1 / UB_PIPELINE_SPLITS of the collective."""
HOST = "host"
"""The pattern of a copy between the GPU and host memory (CPU offload), over the host link."""


@dataclass(frozen=True)
class Op:
    """One op on one rank for one micro-batch."""

    name: str
    kind: str
    """matrix, attention, memory or comm."""
    flops: float = 0.0
    bytes: float = 0.0
    """HBM bytes read and written (matrix, attention, memory), or bytes one rank sends (comm)."""
    precision: str = "bf16"
    """The matrix rate it runs at (matrix and attention)."""
    modules: frozenset[str] = frozenset()
    """The selective-recompute modules whose forward re-runs this op (forward ops only); empty:
    only full recompute re-runs it."""
    overlaps: str | None = None
    """comm: the op it runs beside; only what outlasts that op's share (below) adds time."""
    overlap_share: float = 1.0
    """comm: the share of the `overlaps` op's time that runs beside it (a context-parallel ring
    hides its sends behind every attention step but the last)."""
    group: int = 1
    """comm: the ranks of the collective."""
    stride: int = 1
    """comm: how many ranks apart its members are (Megatron's rank order)."""
    pattern: str = "ring"
    """comm: ring (all-gather, reduce-scatter, all-reduce, ring step), all_to_all, or host (CPU offload)."""
    collective: str | None = None
    """comm: all_gather, reduce_scatter or all_reduce, sending the bytes `ring_bytes` counts; a NCCL one (`nccl`)
    is priced by its size where the GPU table has nccl-tests' sweep of it (`GpuRates.collective_seconds`);
    None: by bytes over the link."""
    shape: tuple[float, float, float] | None = None
    """matrix: the GEMM's (m, n, k), whose output tiles run in waves over the SMs (`GpuRates.gemm_seconds`);
    None: priced by its FLOPs alone."""
    groups: int = 1
    """matrix: GEMMs of `shape` run as one grouped GEMM (the local experts', each over its share of the
    routed tokens): their tiles share the waves."""
    backward: bool = False
    """attention: the kernel's backward (it runs at the GPU's backward attention rate)."""
    nccl: bool = False
    """comm: a NCCL collective (not TE's userbuffers): its channels' thread blocks hold `GpuRates.nccl_sms`
    SMs while it runs, so the GEMM it `overlaps` runs on the rest meanwhile (`op_times`)."""
    comm_sms: int = 0
    """matrix: SMs a communication kernel running beside it holds (`UB_COMM_SMS` under --tp-comm-overlap's
    pipelined and bulk overlaps); its tiles run over the rest."""
    kernel: str | None = None
    """memory: the multi-tensor-apply kernel that runs it ("adam", "multi_tensor"), whose bytes move at its
    measured share of the copy bandwidth (`GpuRates.memory_rate`); None: a copy, cast or fill, at the copy's."""

    @property
    def module(self) -> str | None:
        """The recompute module it belongs to, for display (the first of `modules`)."""
        return min(self.modules) if self.modules else None

    def seconds(self, rates: GpuRates) -> float:
        """The op's roofline time on `rates`."""
        if self.kind == "comm":
            if self.pattern == HOST:
                return self.bytes / rates.host_link_bytes_per_s
            # nccl-tests measured NCCL's collectives; TE's userbuffers (--tp-comm-overlap) keep the flat link rate
            return rates.comm_seconds(self.bytes, self.group, self.stride, self.pattern,
                                      self.collective if self.nccl else None)
        memory = self.bytes / rates.memory_rate(self.kernel)
        if self.kind == "memory":
            return memory
        if self.kind == "attention" and rates.attention_flops and self.precision in ("bf16", "fp16"):
            return max(self.flops / rates.attention_flops["backward" if self.backward else "forward"], memory)
        return max(rates.gemm_seconds(self.flops, self.precision, self.shape, self.comm_sms, self.groups), memory)


def pass_seconds(ops: list[Op], rates: GpuRates) -> float:
    """A pass's time: its ops one after another, a comm op with `overlaps` hidden behind that op."""
    return sum(op_times(ops, rates).values())


def op_times(ops: list[Op], rates: GpuRates) -> dict[str, float]:
    """Each op's added time in a pass, by name (an overlapped comm op: only what outlasts its share
    of the op it runs beside)."""
    own = {op.name: op.seconds(rates) for op in ops}
    out = {op.name: max(0.0, own[op.name] - op.overlap_share * own.get(op.overlaps, 0.0)) if op.overlaps
           else own[op.name] for op in ops}
    if rates.nccl_sms:
        by_name = {op.name: op for op in ops}
        for op in ops:
            gemm = by_name.get(op.overlaps) if op.nccl else None
            if gemm is not None and gemm.kind == "matrix":
                out[gemm.name], out[op.name] = beside_nccl(gemm, own[op.name], rates)
    return out


def beside_nccl(gemm: Op, comm_seconds: float, rates: GpuRates) -> tuple[float, float]:
    """(the GEMM's time, the collective's exposed time) when a NCCL collective of `comm_seconds` runs
    beside `gemm` (Megatron's LinearWithGradAccumulationAndAsyncCommunication launches it, then the
    GEMM): while it runs, the GEMM's tiles run on the SMs its channels leave (`GpuRates.nccl_sms`),
    at the rate of that many SMs; the rest of the GEMM runs on all of them afterwards. A collective
    that outlasts the slowed GEMM leaves the difference exposed."""
    full = gemm.seconds(rates)
    slowed = dataclasses.replace(gemm, comm_sms=gemm.comm_sms + rates.nccl_sms).seconds(rates)
    if comm_seconds >= slowed:
        return slowed, comm_seconds - slowed
    return comm_seconds + (1 - comm_seconds / slowed) * full, 0.0


@dataclass
class LayerOps:
    """The ops of one layer (or of what lies outside the layers) in its forward and its backward."""

    forward: list[Op] = field(default_factory=list)
    backward: list[Op] = field(default_factory=list)


def modules(*names: str | None) -> frozenset[str]:
    """The recompute modules named (None: none), as an op's `modules`."""
    return frozenset(n for n in names if n)


class Shape:
    """The sizes one tensor-parallel rank works on for one micro-batch: the rank's s / cp x b tokens
    (`context_parallel.rank_tokens`), sequence-sharded over t outside the tensor-parallel region."""

    def __init__(self, cfg: Config):
        m, tr, par = cfg.model, cfg.training, cfg.parallel
        self.t = par.tensor_model_parallel_size
        self.sp = par.sequence_parallel and self.t > 1
        self.cp = par.context_parallel_size
        self.b, self.s = tr.micro_batch_size, tr.seq_length
        self.tokens = rank_tokens(cfg)
        self.h, self.f = m.hidden_size, m.ffn_hidden_size
        self.heads, self.groups, self.d = m.num_attention_heads // self.t, m.groups // self.t, m.head_dim
        self.e = ELEMENT_BYTES[tr.precision]
        self.fp8 = tr.precision == "fp8"
        self.recipe = tr.fp8_recipe
        # Elementwise work outside the tensor-parallel region runs on the rank's sequence shard.
        self.local_tokens = self.tokens / (self.t if self.sp else 1)
        self.local = self.local_tokens * self.h
        self.gemm_precision = "fp8" if self.fp8 else tr.precision
        self.in_bytes = FP8_BYTES if self.fp8 else self.e
        # --tp-comm-overlap: TE's userbuffers pipeline each linear's sequence-parallel all-gather
        # and reduce-scatter with its GEMM (every Megatron TE linear passes a tp_comm_buffer_name)
        self.ub = bool(par.tp_comm_overlap) and self.sp
        # ... and the pipelined and bulk overlaps take UB_COMM_SMS from the GEMM they run beside
        self.ub_sms = UB_COMM_SMS if self.ub else 0

    def ring(self, kind: str, elements: float, element_bytes: float, group: int | None = None) -> float:
        """Bytes one rank sends in a ring collective over `group` ranks (default t) of the whole
        tensor of `elements` (`ring_bytes`)."""
        return ring_bytes(kind, elements * element_bytes, self.t if group is None else group)

    def tp_comm(self, name: str, kind: str, elements: float, element_bytes: float, mods: frozenset[str] = frozenset(),
                overlaps: str | None = None, nccl: bool | None = None) -> Op:
        """A tensor-parallel collective (consecutive ranks) of the whole tensor of `elements`: NCCL's
        unless --tp-comm-overlap runs it in TE's userbuffers (`nccl`: the caller's word where it knows)."""
        return Op(name, "comm", bytes=self.ring(kind, elements, element_bytes), modules=mods, overlaps=overlaps,
                  group=self.t, stride=1, nccl=not self.ub if nccl is None else nccl, collective=kind)


def ring_bytes(kind: str, nbytes: float, group: int) -> float:
    """Bytes one rank sends in a ring `kind` over `group` ranks of a whole buffer of `nbytes` (nccl-tests'
    size: the all-gather's output, the reduce-scatter's input): all-gather and reduce-scatter (g - 1)/g of it,
    all-reduce twice that. That is nccl-tests' busbw x time (busbw = algbw x (g - 1)/g, x 2 (g - 1)/g for
    all-reduce; its doc/PERFORMANCE.md), so these bytes / busbw is the collective's time."""
    share = (group - 1) / group * nbytes
    return 2 * share if kind == "all_reduce" else share


def quantize(name: str, elements: float, sh: Shape, mods: frozenset[str], fused_with_norm: bool = False) -> list[Op]:
    """FP8: the cast of a GEMM operand of `elements` 16-bit values into its rowwise and columnwise
    FP8 copies (one for each GEMM that reads it). Current scaling (tensorwise) first reads the input
    for its amax unless the norm kernel computed it; delayed scaling casts inside the norm kernel."""
    if not sh.fp8:
        return []
    if fused_with_norm and sh.recipe == "delayed":
        return []  # the norm kernel writes FP8 itself (counted there)
    amax_pass = sh.recipe == "tensorwise" and not fused_with_norm
    reads = (2 if amax_pass else 1) * sh.e * elements
    return [Op(f"{name}.quantize", "memory", bytes=reads + 2 * FP8_BYTES * elements, modules=mods)]


def amax_reduction(name: str, sh: Shape, mods: frozenset[str] = frozenset()) -> list[Op]:
    """FP8 current scaling under sequence parallel: the amax of an operand that is all-gathered in FP8 (a
    column-parallel linear's input) or whose gradient comes gathered (a row-parallel linear's output
    gradient) is all-reduced over the tensor-parallel group first, so every rank casts with one scale
    (TE module/linear.py and layernorm_linear.py `set_quantizer_amax_reduction_group`: the input
    quantizer of a column-parallel linear, the grad-output quantizer of a row-parallel one). One fp32,
    a NCCL all-reduce even under --tp-comm-overlap: its latency, not its bytes. Delayed scaling reduces
    its amax history once a step; blockwise and MXFP8 scale locally."""
    if not (sh.fp8 and sh.recipe == "tensorwise" and sh.sp):
        return []
    return [sh.tp_comm(f"{name}.amax_all_reduce", "all_reduce", 1, 4, mods, nccl=True)]


def norm(name: str, sh: Shape, mods: frozenset[str], quantized_output: bool, tokens: float | None = None,
         width: float | None = None) -> Op:
    """A LayerNorm/RMSNorm forward over `tokens` x `width` (default: the rank's sequence shard of the
    hidden states): reads its input, writes its output (FP8 directly when TE's delayed-scaling kernel
    fuses the cast)."""
    out = 2 * FP8_BYTES if quantized_output and sh.fp8 and sh.recipe == "delayed" else sh.e
    elements = sh.local if tokens is None else tokens * (width or sh.h)
    return Op(name, "memory", bytes=(sh.e + out) * elements, modules=mods)


def norm_backward(name: str, sh: Shape, tokens: float | None = None, width: float | None = None) -> Op:
    """A norm's backward: reads its input and the output gradient, writes the input gradient."""
    elements = sh.local if tokens is None else tokens * (width or sh.h)
    return Op(f"{name}.backward", "memory", bytes=3 * sh.e * elements)


def linear(name: str, sh: Shape, tokens: float, k: float, n: float, mods: frozenset[str], weights: float = 1,
           precision: str | None = None, row: bool = False) -> Op:
    """A linear's forward GEMM [tokens, k] x [k, n] (`weights` such weights, the local experts of a
    grouped GEMM, each over an even share of the tokens): reads its input and weights, writes its
    output. A row-parallel one (`row`) under --tp-comm-overlap runs beside its output's pipelined
    reduce-scatter, on the SMs it leaves."""
    in_bytes = sh.in_bytes if precision is None else ELEMENT_BYTES.get(precision, sh.e)
    return Op(name, "matrix", flops=2 * tokens * k * n, bytes=in_bytes * (tokens * k + weights * k * n) + sh.e * tokens * n,
              precision=precision or sh.gemm_precision, modules=mods, shape=(tokens / weights, n, k), groups=weights,
              comm_sms=sh.ub_sms if row else 0)


def linear_backward(fwd: Op, sh: Shape, tokens: float, k: float, n: float, column: bool = False, row: bool = False,
                    weights: float = 1) -> list[Op]:
    """A linear's backward: FP8 casts of the output gradient, the data-gradient and weight-gradient
    GEMMs (the weight gradient accumulated into Megatron's fp32 main gradient), and its tensor-parallel
    collective: a column-parallel linear reduces its data gradient (reduce-scatter or all-reduce of
    the k-wide input gradient) beside the weight-gradient GEMM and, with sequence parallel,
    all-gathers its input again beside the data gradient; a row-parallel one all-gathers the
    n-wide output gradient first (sequence parallel). Under --tp-comm-overlap a column-parallel
    linear's input all-gather and data-gradient reduce-scatter are TE's bulk overlaps, which hold
    `UB_COMM_SMS` beside the data- and weight-gradient GEMMs; the row-parallel gather is a ring
    exchange, which takes no SMs from its GEMM."""
    ops = []
    fp8 = fwd.precision == "fp8"
    if fp8:
        reads = (2 if sh.recipe == "tensorwise" else 1) * sh.e * tokens * n
        ops.append(Op(f"{fwd.name}.grad_quantize", "memory", bytes=reads + 2 * FP8_BYTES * tokens * n))
        if row:
            ops += amax_reduction(f"{fwd.name}.grad", sh)
    in_bytes = FP8_BYTES if fp8 else sh.e
    rows = tokens / weights  # each expert's share of a grouped GEMM's tokens
    bulk = sh.ub_sms if column and sh.t > 1 else 0
    dgrad = Op(f"{fwd.name}.dgrad", "matrix", flops=fwd.flops, bytes=in_bytes * (tokens * n + weights * k * n) + sh.e * tokens * k,
               precision=fwd.precision, shape=(rows, k, n), groups=weights, comm_sms=bulk)
    if row and sh.sp:  # the output gradient gathered first (with tp_comm_overlap, pipelined with dgrad)
        ops.insert(0, sh.tp_comm(f"{fwd.name}.grad_all_gather", "all_gather", sh.tokens * n, sh.e,
                                 overlaps=dgrad.name if sh.ub else None))
    wgrad = Op(f"{fwd.name}.wgrad", "matrix", flops=fwd.flops,
               bytes=in_bytes * (tokens * n + tokens * k) + 2 * 4 * weights * k * n, precision=fwd.precision,
               shape=(n, k, rows), groups=weights, comm_sms=bulk)
    ops += [dgrad, wgrad]
    if column and sh.t > 1:
        if sh.sp:
            ops.append(sh.tp_comm(f"{fwd.name}.input_all_gather", "all_gather", sh.tokens * k, in_bytes,
                                  overlaps=dgrad.name))
        kind = "reduce_scatter" if sh.sp else "all_reduce"
        ops.append(sh.tp_comm(f"{fwd.name}.dgrad_{kind}", kind, sh.tokens * k, sh.e, overlaps=wgrad.name))
    return ops


def column_input(name: str, sh: Shape, mods: frozenset[str], norm_name: str | None, norm_mods: frozenset[str],
                 width: float | None = None) -> list[Op]:
    """What precedes a column-parallel linear whose input is `width` wide (default h): its norm
    (fused in TE's LayerNormLinear), the FP8 cast (before the all-gather: TE gathers FP8) and,
    with sequence parallel, the all-gather (beside the linear's GEMM with tp_comm_overlap)."""
    width = width or sh.h
    ops = [norm(norm_name, sh, norm_mods, quantized_output=True, tokens=sh.local_tokens, width=width)] if norm_name else []
    ops += quantize(name, sh.local_tokens * width, sh, mods, fused_with_norm=norm_name is not None)
    ops += amax_reduction(name, sh, mods)
    if sh.sp:
        ops.append(sh.tp_comm(f"{name}.all_gather", "all_gather", sh.tokens * width, sh.in_bytes, mods,
                              overlaps=name if sh.ub else None))
    return ops


def row_output(name: str, sh: Shape, mods: frozenset[str]) -> list[Op]:
    """What follows a row-parallel linear: the reduce-scatter (sequence parallel) or all-reduce of its
    output; with tp_comm_overlap, TE's pipelined reduce-scatter beside the GEMM, its last chunk exposed
    (`UB_PIPELINE_SPLITS`)."""
    if sh.t == 1:
        return []
    kind = "reduce_scatter" if sh.sp else "all_reduce"
    if not sh.ub:
        return [sh.tp_comm(f"{name}.{kind}", kind, sh.tokens * sh.h, sh.e, mods)]
    # TE's pipelined overlap: every chunk's reduce-scatter but the last runs beside the GEMM's later chunks
    rest = sh.tp_comm(f"{name}.{kind}", kind, sh.tokens * sh.h, sh.e, mods, overlaps=name)
    last = rest.bytes / UB_PIPELINE_SPLITS
    return [dataclasses.replace(rest, bytes=rest.bytes - last), dataclasses.replace(rest, name=f"{name}.{kind}_last_chunk",
                                                                                     bytes=last, overlaps=None)]


def bias_dropout_add(name: str, sh: Shape, dropout: float, forward: bool) -> Op:
    """Megatron's fused bias-dropout-add on the rank's tokens: forward reads the branch and the
    residual and writes the sum (and the dropout mask); backward applies the mask to the gradient
    and adds the branch's gradient into the residual stream's."""
    mask = MASK_BYTES if dropout > 0 else 0
    if forward:
        return Op(name, "memory", bytes=(3 * sh.e + mask) * sh.local)
    return Op(name + ".backward", "memory", bytes=(3 * sh.e + (2 * sh.e + mask if dropout > 0 else 0)) * sh.local)


def mlp_ops(cfg: Config, sh: Shape, prefix: str, width: float, mods: frozenset[str], norm_name: str | None,
            norm_mods: frozenset[str]) -> LayerOps:
    """A tensor-parallel MLP of hidden width `width` (fc1 to width, x2 for SwiGLU; fc2 back to h),
    each op re-run by `mods`: the dense layer's MLP (with TE's norm fused into fc1) or a MoE layer's
    shared experts. Its fused bias-GeLU / bias-SwiGLU reads fc1's output and writes fc2's input."""
    m, T, h = cfg.model, sh.tokens, sh.h
    fc1_width = (2 if m.activation == "swiglu" else 1) * width / sh.t
    f_local = width / sh.t
    fwd = column_input(f"{prefix}linear_fc1", sh, mods, norm_name, norm_mods)
    fc1 = linear(f"{prefix}linear_fc1", sh, T, h, fc1_width, mods)
    fwd.append(fc1)
    fwd.append(Op(f"{prefix}activation", "memory", bytes=sh.e * T * (fc1_width + f_local), modules=mods))
    fwd += quantize(f"{prefix}linear_fc2", T * f_local, sh, mods)
    fc2 = linear(f"{prefix}linear_fc2", sh, T, f_local, h, mods, row=True)
    fwd.append(fc2)
    fwd += row_output(f"{prefix}linear_fc2", sh, mods)
    bwd = linear_backward(fc2, sh, T, f_local, h, row=True)
    # GeLU backward reads its input and the gradient, writes the input's gradient; SwiGLU reads the
    # 2f-wide input and the f-wide gradient and writes a 2f-wide gradient.
    bwd.append(Op(f"{prefix}activation.backward", "memory", bytes=sh.e * T * (2 * fc1_width + f_local)))
    bwd += linear_backward(fc1, sh, T, h, fc1_width, column=True)
    if norm_name:
        bwd.append(norm_backward(norm_name, sh))
    return LayerOps(fwd, bwd)
