"""Step time of a Megatron run on a GPU kind, op by op: a roofline per op.

Each op a Megatron layer runs (and the embedding, output layer, loss and optimizer step around the
layers) is listed with the work it does on one rank for one micro-batch: its matrix FLOPs, the HBM
bytes it reads and writes, or the bytes it sends over the interconnect (`time_ops.Op`). Its time is

    matrix work (linears, grouped experts): max(FLOPs / the precision's peak, bytes / HBM bandwidth)
    attention (the fused kernel):           max(FLOPs / its forward or backward rate, bytes / HBM bandwidth)
    memory-bound work:                      bytes / HBM bandwidth (the optimizer's multi-tensor kernels at
                                            their measured share of it, `time_optimizer`)
    communication:                          bytes sent / the link's bandwidth (one direction): NVLink
                                            within the NVLink domain, the network beyond it, the host
                                            link for CPU offload (`GpuRates.comm_seconds`)

with every rate from `gpu_rates` (a datasheet, or a profile measured on the GPU). A GEMM beside a NCCL
collective runs on the SMs its channels leave while it lasts (`time_ops.beside_nccl`). FP8 runs the
linears' three GEMMs (forward, data gradient, weight gradient) at FP8's peak and adds the
quantisation of their inputs and of the gradients that reach them; attention, the output layer and
everything memory-bound stay 16-bit. No rate is scaled by an efficiency.

A layer is built from its kind and index (`layer_ops`): its attention (GQA/MHA, or multi-latent
attention `time_mla`; the core attention `time_attention`, with context parallel's K/V exchange by
the layer's cp_comm_type) and its MLP (dense, or a mixture-of-experts layer's router, dispatcher,
experts and shared experts `time_moe`); FP8's first/last bf16 layers run in bf16.

A recompute setting re-runs forward ops in backward: `selective` the ops of its modules (which ops
each module covers follows Megatron's layer spec: each op names the modules that re-run it), `full`
every forward op of each checkpointed layer. The step is the pipeline's: per micro-batch each stage
runs its model chunks' layers forward, backward and recompute (plus the embedding on the first
stage and the loss on the last), and Megatron's schedule takes (m + (p - 1) / vp) of the slowest
stage's micro-batch (Narayanan et al. 2021, the interleaved schedule's bubble), then the optimizer
step. Without virtual stages (1F1B) each stage's micro-batch also waits for its pipeline sends
(`pipeline_send_ops`), and so does each chunk's under the interleaved schedule without
overlap_p2p_comm; with it (Megatron's default) they run beside compute. Activation offload adds
the copies to and from the host that the layer's own compute does not hide (`offload_seconds`). With the stages'
parameters given, the step adds the data-parallel gradient reduce and parameter all-gather that
overlap_grad_reduce and overlap_param_gather leave exposed (`time_data_parallel`).

Not priced (setting-independent, so they change absolute time, not which setting is faster by
how much): kernel launch gaps (with or without CUDA graphs: the model predicts no gain
from graphs), the weights' FP8 cast (once per step: TE caches it over the micro-batches), the
interleaved schedule's sends in its warm-up and cool-down under overlap_p2p_comm (they block there). Pure
Python.

Sources (Megatron-LM d98e8a6, TransformerEngine d0067d0), beside those of `time_ops`,
`time_attention`, `time_mla` and `time_moe`:
- megatron/core/transformer/transformer_layer.py, attention.py, mlp.py (what each recompute module runs)
- megatron/core/tensor_parallel/cross_entropy.py, megatron/core/fusions/fused_cross_entropy.py (the loss's passes)
- megatron/core/pipeline_parallel/schedules.py `get_tensor_shapes` (what a pipeline send carries),
  `forward_backward_pipelining_without_interleaving` (1F1B's blocking send_forward_recv_backward and
  send_backward_recv_forward; it refuses overlap_p2p_comm), `forward_backward_pipelining_with_interleaving`
  (overlap_p2p_comm: the sends run beside the next chunk; without it the blocking
  send_forward_backward_recv_forward_backward after each chunk step); megatron/training/arguments.py
  (--no-overlap-p2p-communication: overlap on by default for the interleaved schedule)
- megatron/core/optimizer (the optimizer step's passes: `time_optimizer`), megatron/core/tensor_parallel/random.py
  (CheckpointFunction with distribute_saved_activations)
- transformer_engine/pytorch/cpu_offload.py, megatron/core/pipeline_parallel/fine_grained_activation_offload.py
  (which saved tensors leave for the host: `analysis.megatron.offload`)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from recompute_bench.analysis.gpu_rates import GpuRates
from recompute_bench.analysis.megatron.context_parallel import layer_attention
from recompute_bench.analysis.megatron.fp8 import layer_config, layer_runs_fp8
from recompute_bench.analysis.megatron.gpu import MegatronRun
from recompute_bench.analysis.megatron.time_attention import Heads, attention_ops
from recompute_bench.analysis.megatron.time_data_parallel import data_parallel_seconds
from recompute_bench.analysis.megatron.time_mla import mla_attention_ops
from recompute_bench.analysis.megatron.time_moe import moe_ops
from recompute_bench.analysis.megatron.time_optimizer import optimizer_ops
from recompute_bench.analysis.megatron.time_ops import (HOST, LayerOps, Op, Shape, bias_dropout_add, column_input,
                                                        linear, linear_backward, mlp_ops, modules, norm,
                                                        norm_backward, op_times, pass_seconds, quantize, row_output)
from recompute_bench.config.pipeline_split import model_chunks
from recompute_bench.config.schema import BadInput, Config
from recompute_bench.models import FP32_BYTES, MASK_BYTES
from recompute_bench.recompute.policy import LayerPolicy, layer_policies

__all__ = ["LayerOps", "Op", "STEP_CLASSES", "StepTime", "part_class", "checkpoint_ops", "embedding_ops", "gemm_shapes", "layer_ops", "layer_seconds", "loss_ops",
           "offload_seconds", "op_times", "optimizer_ops", "pass_seconds", "pipeline_send_ops", "recompute_ops", "step_time"]


# ----- one layer --------------------------------------------------------------------------------


def _dense_attention(cfg: Config, run: MegatronRun, sh: Shape, layer: int) -> LayerOps:
    """A GQA/MHA attention block: linear_qkv (TE fuses input_layernorm into it; the local spec's
    norm is its own module, re-run by `layernorm`), RoPE on q and k, core attention (`core_attn`
    re-runs it only: RoPE runs before it, linear_proj after it, attention.py), linear_proj."""
    m = cfg.model
    te = m.transformer_impl == "transformer_engine"
    q, kv = sh.heads * sh.d, sh.groups * sh.d
    T, h = sh.tokens, sh.h
    none = frozenset()
    fwd = column_input("linear_qkv", sh, none, "input_layernorm", none if te else modules("layernorm"))
    qkv = linear("linear_qkv", sh, T, h, q + 2 * kv, none)
    fwd.append(qkv)
    if m.position_embedding_type == "rope":  # q and k rotated (read and written) before core attention
        fwd.append(Op("rotary", "memory", bytes=2 * sh.e * T * (q + kv)))
    attention = attention_ops(cfg, run, sh, Heads(sh.heads, sh.groups, sh.d, sh.d), layer)
    fwd += attention.forward
    fwd += quantize("linear_proj", T * q, sh, none)
    proj = linear("linear_proj", sh, T, q, h, none, row=True)
    fwd.append(proj)
    fwd += row_output("linear_proj", sh, none)
    bwd = linear_backward(proj, sh, T, q, h, row=True)
    bwd += attention.backward
    if m.position_embedding_type == "rope":
        bwd.append(Op("rotary.backward", "memory", bytes=2 * sh.e * T * (q + kv)))
    bwd += linear_backward(qkv, sh, T, h, q + 2 * kv, column=True)
    bwd.append(norm_backward("input_layernorm", sh))
    return LayerOps(fwd, bwd)


def layer_ops(cfg: Config, run: MegatronRun, layer: int = 0) -> LayerOps:
    """The ops of Megatron GPT layer `layer` (0-based over the model: its kind, dense or MoE, its
    cp_comm_type and whether FP8 keeps it in bf16 come from its index) on one rank for one
    micro-batch, each forward op with the recompute modules that re-run it. Attention: GQA/MHA or
    multi-latent attention. MLP: the dense MLP (`mlp` re-runs it whole: its all-gather, fc1, the
    activation, fc2 and the reduce of fc2's output, mlp.py; with Transformer Engine the pre-MLP norm
    is fused into fc1, `TELayerNormColumnParallelLinear`, so it sits inside the `mlp` checkpoint and
    `layernorm` re-runs nothing of a dense TE layer; with Megatron's local spec each norm is its own
    module, re-run by `layernorm`), or a MoE layer's norm and MoE block (`time_moe`)."""
    cfg = layer_config(cfg, layer)
    m = cfg.model
    sh = Shape(cfg)
    attention = mla_attention_ops(cfg, run, sh, layer) if m.multi_latent_attention else \
        _dense_attention(cfg, run, sh, layer)
    if m.is_moe_layer(layer):
        mlp = moe_ops(cfg, sh)
    else:
        te = m.transformer_impl == "transformer_engine"
        mlp = mlp_ops(cfg, sh, "", sh.f, modules("mlp"), "pre_mlp_layernorm", modules("mlp" if te else "layernorm"))
    fwd = attention.forward + [bias_dropout_add("self_attn_bda", sh, m.hidden_dropout, forward=True)] + \
        mlp.forward + [bias_dropout_add("mlp_bda", sh, m.hidden_dropout, forward=True)]
    bwd = [bias_dropout_add("mlp_bda", sh, m.hidden_dropout, forward=False)] + mlp.backward + \
        [bias_dropout_add("self_attn_bda", sh, m.hidden_dropout, forward=False)] + attention.backward
    return LayerOps(fwd, bwd)


def layer_key(cfg: Config, layer: int) -> tuple:
    """What makes two layers' ops differ: their kind, their context-parallel attention, FP8."""
    return cfg.model.is_moe_layer(layer), layer_attention(cfg, layer), layer_runs_fp8(cfg, layer)


def recompute_ops(layer: LayerOps, policy: LayerPolicy) -> list[Op]:
    """The forward ops a layer re-runs in its backward under `policy`: all of them inside a
    full-recompute checkpoint, the ops of its modules under selective recompute, once per chosen
    module that holds them: a checkpoint nested in another (`moe_act` or `shared_experts` inside
    `moe`) runs its part once more when the outer one's recompute builds its graph, and again in that
    graph's backward (moe_layer.py checkpoints `custom_forward`, inside which experts.py's
    CheckpointWithoutOutput and the shared experts' checkpoint run as they did in forward)."""
    if policy.chunk is not None:
        return list(layer.forward)
    return [op for op in layer.forward for _ in range(len(op.modules & policy.modules))]


# ----- outside the layers -----------------------------------------------------------------------


def embedding_ops(cfg: Config) -> LayerOps:
    """The first stage's word (and learned position) embedding: the rows gathered and, under
    tensor parallel, reduced over the vocabulary shards (VocabParallelEmbedding: all-reduce, or
    reduce-scatter with sequence parallel); backward scatters the gradient into a dense gradient of
    the rank's vocabulary shard, which Megatron's DDP hook adds into the fp32 main gradient."""
    sh = Shape(cfg)
    rows = cfg.vocab_rows / sh.t
    fwd = [Op("embedding", "memory", bytes=2 * sh.e * sh.tokens * sh.h)]
    if sh.t > 1:
        kind = "reduce_scatter" if sh.sp else "all_reduce"
        fwd.append(sh.tp_comm(f"embedding.{kind}", kind, sh.tokens * sh.h, sh.e))
    if cfg.model.hidden_dropout > 0:
        fwd.append(Op("embedding.dropout", "memory", bytes=(2 * sh.e + MASK_BYTES) * sh.local))
    bwd = [Op("embedding.backward", "memory",
              bytes=sh.e * sh.tokens * sh.h + sh.e * rows * sh.h + (sh.e + 2 * FP32_BYTES) * rows * sh.h)]
    if sh.sp:
        bwd.insert(0, sh.tp_comm("embedding.grad_all_gather", "all_gather", sh.tokens * sh.h, sh.e))
    return LayerOps(fwd, bwd)


def loss_ops(cfg: Config) -> LayerOps:
    """The last stage's final norm, output layer (Megatron's ColumnParallelLinear, in the training's
    16 bits even under FP8: the FP8 region is the transformer layers) and vocabulary-parallel
    cross-entropy. Its passes over the logits (cross_entropy.py): the fp32 copy and max, the in-place
    subtract, exp, sum and divide, and in backward the in-place scale and the cast back; the fused
    loss (fused_cross_entropy.py) runs its steps as three compiled kernels and one in backward."""
    sh = Shape(cfg)
    precision = "bf16" if sh.fp8 else cfg.training.precision
    e = sh.e
    vocab = cfg.vocab_rows / sh.t
    logits = sh.tokens * vocab
    fwd = [norm("final_layernorm", sh, frozenset(), quantized_output=False)]
    if sh.sp:
        fwd.append(sh.tp_comm("output_layer.all_gather", "all_gather", sh.tokens * sh.h, e))
    out = Op("output_layer", "matrix", flops=2 * sh.tokens * sh.h * vocab,
             bytes=e * (sh.tokens * sh.h + sh.h * vocab + logits), precision=precision, shape=(sh.tokens, vocab, sh.h))
    fwd.append(out)
    if cfg.model.cross_entropy_loss_fusion:  # float+max; subtract, exp, sum; divide
        forward_bytes, backward_bytes = (e + FP32_BYTES) + 2 * FP32_BYTES + 2 * FP32_BYTES, FP32_BYTES + e
    else:  # float; max; subtract; exp; sum; divide   |   scale; cast
        forward_bytes = (e + FP32_BYTES) + FP32_BYTES + 2 * FP32_BYTES + 2 * FP32_BYTES + FP32_BYTES + 2 * FP32_BYTES
        backward_bytes = 2 * FP32_BYTES + FP32_BYTES + e
    fwd.append(Op("cross_entropy", "memory", bytes=forward_bytes * logits))
    bwd = [Op("cross_entropy.backward", "memory", bytes=backward_bytes * logits)]
    dgrad = Op("output_layer.dgrad", "matrix", flops=out.flops, bytes=e * (logits + sh.h * vocab + sh.tokens * sh.h),
               precision=precision, shape=(sh.tokens, sh.h, vocab))
    wgrad = Op("output_layer.wgrad", "matrix", flops=out.flops,
               bytes=e * (logits + sh.tokens * sh.h) + 2 * FP32_BYTES * sh.h * vocab, precision=precision,
               shape=(vocab, sh.h, sh.tokens))
    bwd += [dgrad, wgrad]
    if sh.t > 1:
        kind = "reduce_scatter" if sh.sp else "all_reduce"
        # Megatron's own ColumnParallelLinear: its collectives are NCCL's even under --tp-comm-overlap
        bwd.append(sh.tp_comm(f"output_layer.dgrad_{kind}", kind, sh.tokens * sh.h, e, overlaps=wgrad.name, nccl=True))
    bwd.append(Op("final_layernorm.backward", "memory", bytes=3 * e * sh.local))
    return LayerOps(fwd, bwd)


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
    data_parallel: dict[str, float] = field(default_factory=lambda: {"grad_reduce": 0.0, "param_gather": 0.0})
    """The data-parallel gradient reduce and parameter all-gather the step leaves exposed
    (`time_data_parallel.data_parallel_seconds`)."""

    @property
    def data_parallel_seconds(self) -> float:
        return sum(self.data_parallel.values())

    @property
    def recompute_seconds(self) -> float:
        return sum(p["seconds"] for p in self.parts if p["pass"] == "recompute")

    def by_class(self) -> dict[str, float | None]:
        """Where the step goes, by class (seconds; None: a class the model does not price): the
        pacing stage's GEMMs, attention kernels and memory-bound ops of forward and backward, what
        recompute re-runs, the tensor/sequence-parallel collectives left exposed, the context-parallel
        K/V exchange, the experts' dispatch and combine, activation offload's copies, the pipeline's
        blocking sends, the pipeline bubble, the data-parallel gradient reduce and parameter gather left
        exposed, the optimizer step; host (kernel launch) overhead, which the model does not price."""
        out: dict[str, float | None] = dict.fromkeys(STEP_CLASSES, 0.0)
        for p in self.parts:
            out[part_class(p)] += p["seconds"]
        out["pipeline_bubble"] = self.bubble_seconds
        out["data_parallel_exposed"] = self.data_parallel_seconds
        out["host_overhead"] = None
        return out


STEP_CLASSES = ("gemm", "attention", "memory", "recompute", "tp_comm", "cp_exchange", "expert_all_to_all", "offload",
                "pipeline_p2p", "pipeline_bubble", "data_parallel_exposed", "optimizer", "host_overhead")
"""The classes of `StepTime.by_class`, in the order a step runs them."""


def part_class(part: dict[str, Any]) -> str:
    """The class of one part of `StepTime.parts` (an op in one pass)."""
    if part["pass"] in ("recompute", "offload", "optimizer"):
        return part["pass"]
    if part["pass"] == "pipeline":
        return "pipeline_p2p"
    if part["kind"] == "matrix":
        return "gemm"
    if part["kind"] in ("attention", "memory"):
        return part["kind"]
    if part["op"].startswith("core_attention"):
        return "cp_exchange"
    return "expert_all_to_all" if part["op"].startswith("moe.") else "tp_comm"


class _Layers:
    """Each distinct layer's ops and op times, and its offload time under each policy, built once per step."""

    def __init__(self, cfg: Config, run: MegatronRun, rates: GpuRates):
        self.cfg, self.run, self.rates = cfg, run, rates
        self.built: dict[tuple, tuple[LayerOps, dict[str, float], dict[str, float]]] = {}
        self.offloads: dict[tuple, float] = {}

    def __call__(self, layer: int) -> tuple[LayerOps, dict[str, float], dict[str, float]]:
        key = layer_key(self.cfg, layer)
        if key not in self.built:
            ops = layer_ops(self.cfg, self.run, layer)
            self.built[key] = (ops, op_times(ops.forward, self.rates), op_times(ops.backward, self.rates))
        return self.built[key]

    def offload(self, layer: int, policy: LayerPolicy) -> float:
        """`offload_seconds` of layer `layer` under `policy` (the same for every layer of its key)."""
        key = (layer_key(self.cfg, layer), policy)
        if key not in self.offloads:
            _, times_f, times_b = self(layer)
            self.offloads[key] = offload_seconds(self.cfg, self.run, self.rates, policy, layer, sum(times_f.values()),
                                                 sum(times_b.values()))
        return self.offloads[key]


def _add_times(parts: dict[tuple[str, str, str | None, str], float], ops: list[Op], rates: GpuRates,
               pass_name: str) -> None:
    """Each op's seconds on `rates` added to `parts` under (name, kind, no module, `pass_name`)."""
    for name, sec in op_times(ops, rates).items():
        op = next(o for o in ops if o.name == name)
        parts[(name, op.kind, None, pass_name)] += sec


def step_time(cfg: Config, run: MegatronRun, rates: GpuRates,
              parameters: list[float] | list[dict[str, float]] | None = None) -> StepTime:
    """The predicted step time of cfg (its recompute setting included) on `rates`, with the pacing
    stage's ops. Each stage runs the model chunks Megatron builds for it (`model_chunks`: even,
    uneven or by layout), each layer by its index. `parameters`: each stage's parameters on a rank
    (a count, or counts by group) for the optimizer step; with them the step also adds the
    data-parallel reduce and gather it leaves exposed (`time_data_parallel`, which reads the chunks'
    parameters layer by layer); without them the step leaves both out."""
    par = cfg.parallel
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    layers = _Layers(cfg, run, rates)
    outside = {"embedding": embedding_ops(cfg), "loss": loss_ops(cfg)}
    stages = []
    for stage in range(p):
        parts: dict[tuple[str, str, str | None, str], float] = defaultdict(float)
        for chunk in model_chunks(cfg, stage):
            policies = layer_policies(cfg.recompute, chunk.layers, chunk.first_layer)
            for i, policy in enumerate(policies):
                index = chunk.first_layer + i
                ops, times_f, times_b = layers(index)
                for op in ops.forward:
                    parts[(op.name, op.kind, op.module, "forward")] += times_f[op.name]
                for op in ops.backward:
                    parts[(op.name, op.kind, None, "backward")] += times_b[op.name]
                for op in recompute_ops(ops, policy):
                    parts[(op.name, op.kind, op.module, "recompute")] += times_f[op.name]
                offload = layers.offload(index, policy)
                if offload:
                    parts[("activation offload", "comm", None, "offload")] += offload
            _add_times(parts, checkpoint_ops(cfg, policies), rates, "recompute")
            ends = (["embedding"] if chunk.embedding else []) + (["loss"] if chunk.loss else [])
            for end in ends:
                _add_times(parts, outside[end].forward, rates, "forward")
                _add_times(parts, outside[end].backward, rates, "backward")
        _add_times(parts, pipeline_send_ops(cfg, stage), rates, "pipeline")
        stages.append(parts)
    micro = [sum(parts.values()) for parts in stages]
    pacing = max(range(p), key=lambda s: micro[s])
    m = cfg.num_microbatches
    bubble = (p - 1) / vp * micro[pacing]
    listed = [{"op": name, "kind": kind, "module": module, "pass": pass_name, "seconds": m * sec}
              for (name, kind, module, pass_name), sec in stages[pacing].items() if sec]
    optimizer, data_parallel = 0.0, {"grad_reduce": 0.0, "param_gather": 0.0}
    if parameters is not None:
        data_parallel = data_parallel_seconds(cfg, rates, *_pass_sums(stages))
        # the slowest stage's optimizer step, pass by pass
        ops, times = max(((ops, op_times(ops, rates)) for ops in (optimizer_ops(cfg, params) for params in parameters)),
                         key=lambda pair: sum(pair[1].values()))
        optimizer = sum(times.values())
        listed += [{"op": op.name, "kind": op.kind, "module": None, "pass": "optimizer", "seconds": times[op.name]}
                   for op in ops if times[op.name]]
    listed.sort(key=lambda r: -r["seconds"])
    return StepTime(m * micro[pacing] + bubble + optimizer + sum(data_parallel.values()), micro, pacing, bubble,
                    optimizer, listed, data_parallel)


def _pass_sums(stages: list[dict[tuple[str, str, str | None, str], float]]) -> tuple[list[float], ...]:
    """Each stage's forward and backward (with its recompute) seconds of one micro-batch, and the GEMM
    seconds within each (what `data_parallel_seconds` hides collectives behind)."""
    sums: tuple[list[float], ...] = tuple([0.0] * len(stages) for _ in range(4))
    for s, parts in enumerate(stages):
        for (_, kind, _, pass_name), sec in parts.items():
            i = 0 if pass_name == "forward" else 1 if pass_name in ("backward", "recompute") else None
            if i is not None:
                sums[i][s] += sec
                if kind == "matrix":
                    sums[i + 2][s] += sec
    return sums


def pipeline_send_ops(cfg: Config, stage: int) -> list[Op]:
    """What pipeline stage `stage` waits on to send and receive per micro-batch where the sends block
    (megatron/core/pipeline_parallel/schedules.py). Each send carries the activation of
    `get_tensor_shapes` (s / cp x b x h, / t with sequence parallel) in the training's 16 bits to a
    rank world / p away (the pipeline is the outermost group of Megatron's rank order); what a rank
    receives comes the other way at the same time, so a stage waits on the bytes it sends.

    - 1F1B (`forward_backward_pipelining_without_interleaving`): after each forward
      send_forward_recv_backward (its output to the next stage while an earlier micro-batch's gradient
      comes back), after each backward send_backward_recv_forward (the input gradient to the previous
      stage, the next micro-batch's input in): one send to each neighbour a micro-batch.
    - Interleaved without overlap_p2p_comm (`forward_backward_pipelining_with_interleaving`, its "No
      p2p overlap" branch): after each step of one chunk's forward and one chunk's backward,
      send_forward_backward_recv_forward_backward, one batch_isend_irecv of all four that blocks
      (then torch.cuda.synchronize, batch_p2p_sync); warm-up and cool-down send the forward and backward
      halves alone (send_forward_recv_forward, send_backward_recv_backward). Over a step every chunk
      sends each micro-batch's output onward and its input gradient back, the pipeline wrapping from the
      last rank to the first between chunks: 2 x vp sends a micro-batch, less the first chunk's gradient
      on the first stage and the last chunk's output on the last (`_is_vp_first_stage`, `_is_vp_last_stage`).
    - Interleaved with overlap_p2p_comm (Megatron-LM's and Bridge's default): none, the sends run
      beside the next chunk (its pp_post_forward / pp_post_backward wait only at the next pre step).

    With scatter_gather_tensors_in_pipeline and no sequence parallel (Megatron-LM before Megatron Core's
    pipeline, megatron/p2p_communication.py `_communicate` at 2725dc0 (2022-07): split_tensor_into_1d_equal_chunks
    before the send, gather_split_1d_tensor after the receive) each tensor-parallel rank sends 1/t of the
    activation and all-gathers what it receives over the tensor-parallel group, priced as one gather of their bytes."""
    par = cfg.parallel
    p = par.pipeline_model_parallel_size
    if p == 1 or par.p2p_overlapped:
        return []
    vp = par.virtual_pipeline_model_parallel_size if par.interleaved else 1
    sends = (vp - (stage == p - 1)) + (vp - (stage == 0))  # outputs onward, input gradients back
    sh = Shape(cfg)
    split = sh.t if par.scatter_gather_tensors_in_pipeline and not sh.sp and sh.t > 1 else 1
    ops = [Op("pipeline.send_recv", "comm", bytes=sends * sh.e * sh.local / split, group=2, stride=par.world_size // p)]
    if split > 1:  # what it receives, as many as it sends, gathered whole over the tensor-parallel group
        ops.append(sh.tp_comm("pipeline.recv_all_gather", "all_gather", sends * sh.local, sh.e))
    return ops


def gemm_shapes(cfg: Config, run: MegatronRun) -> list[tuple[float, float, float, str]]:
    """The distinct GEMMs (m, n, k, precision) of cfg's layers and output layer on one rank, forward
    and backward: what `plan --profile` measures on the GPU so that the model prices them as they ran."""
    kinds = {layer_key(cfg, i): i for i in range(cfg.model.num_layers)}
    ops = [op for i in kinds.values() for lo in [layer_ops(cfg, run, i)] for op in lo.forward + lo.backward]
    ops += loss_ops(cfg).forward + loss_ops(cfg).backward
    return sorted({(*op.shape, op.precision) for op in ops if op.kind == "matrix" and op.shape is not None})


def checkpoint_ops(cfg: Config, policies: list[LayerPolicy]) -> list[Op]:
    """What each full-recompute checkpoint of a model chunk adds beyond re-running its layers:
    with distribute_saved_activations, Megatron's CheckpointFunction (tensor_parallel/random.py)
    keeps 1/t of the checkpoint's input (a copy in forward) and all-gathers it before the recompute."""
    if not cfg.recompute.distribute_saved_activations:
        return []
    sh = Shape(cfg)
    checkpoints = len({p.chunk for p in policies if p.chunk is not None})
    if not checkpoints:
        return []
    return [Op("checkpoint.split", "memory", bytes=checkpoints * sh.e * sh.tokens * sh.h * (1 + 1 / sh.t)),
            Op("checkpoint.all_gather", "comm", bytes=checkpoints * sh.ring("all_gather", sh.tokens * sh.h, sh.e),
               group=sh.t, collective="all_gather", nccl=True)]


def offloaded_bytes(cfg: Config, run: MegatronRun, policy: LayerPolicy, layer: int) -> float:
    """The bytes of layer `layer` that leave the device between its forward and its backward under
    `policy` (the Megatron memory model's, `analysis.megatron.offload`): layer-level CPU offloading's
    tensors of 256 Ki elements or more, or fine-grained offloading's groups (offload_modules); none
    for a full-recompute checkpoint's layers."""
    if policy.chunk is not None or not (policy.offload or cfg.recompute.fine_grained_activation_offloading):
        return 0.0
    from recompute_bench.analysis.megatron.layer import layer_saved_bytes
    from recompute_bench.analysis.megatron.offload import fine_grained_offloaded, layer_offloaded

    lcfg = layer_config(cfg, layer)
    saved = layer_saved_bytes(lcfg, run, policy.modules, layer)
    moved = layer_offloaded(lcfg, saved) if policy.offload else fine_grained_offloaded(lcfg, saved)
    return sum(moved.values())


def offload_seconds(cfg: Config, run: MegatronRun, rates: GpuRates, policy: LayerPolicy, layer: int,
                    forward: float, backward: float) -> float:
    """Activation offload's added time for layer `layer` per micro-batch, a stated model: its
    offloaded bytes B (`offloaded_bytes`) go to the host while the layers after it run forward and
    come back while the layers after it run backward (TE's offload synchronizer, Megatron's
    fine-grained groups reloaded a group ahead), so with the host link's bandwidth W (PCIe, or
    NVLink-C2C on Grace, from the datasheet) the layer adds what one layer's forward (F) and
    backward (Bwd) do not hide: max(0, B/W - F) + max(0, B/W - Bwd). BadInput where the GPU kind
    has no host-link rate."""
    nbytes = offloaded_bytes(cfg, run, policy, layer)
    if not nbytes:
        return 0.0
    if not rates.host_link_bytes_per_s:
        raise BadInput(f"{rates.product} has no host-link rate to price activation offload with; drop "
                       "--activation-offload-layers (or the offload_modules) or pass another --gpu")
    copy = Op("offload", "comm", bytes=nbytes, pattern=HOST).seconds(rates)
    return max(0.0, copy - forward) + max(0.0, copy - backward)


def layer_seconds(cfg: Config, run: MegatronRun, rates: GpuRates, policy: LayerPolicy = LayerPolicy(),
                  layer: int = 0) -> dict[str, float]:
    """One layer's forward, backward and recompute seconds for one micro-batch under `policy` (the
    per-layer times Korthikanti et al. Table 4 measured)."""
    ops = layer_ops(cfg, run, layer)
    times_f = op_times(ops.forward, rates)
    return {"forward": pass_seconds(ops.forward, rates), "backward": pass_seconds(ops.backward, rates),
            "recompute": sum(times_f[op.name] for op in recompute_ops(ops, policy))}
