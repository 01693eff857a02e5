"""CUDA graphs: what a captured run keeps, and the three phases whose most Megatron's peak is.

A graph's tensors live in its private memory pool. While a graph is captured the pool's
allocations count in `torch.cuda.memory_allocated` like any other; once the capture ends, what was
freed during it stays reserved for the pool but no longer counts as allocated, and replays
allocate nothing. So `mem-max-allocated-bytes` (the peak since the process began,
training.py `training_log`) is the most of three phases:

- eager: the first `cuda_graph_warmup_steps` iterations run without graphs (training.py captures
  the TE graphs, and full_cuda_graph.py `FullCudaGraphWrapper` the full iteration, when the
  iteration count reaches it). Megatron's optimizer creates the Adam moments at the first step, so
  they exist in the eager phase from its second iteration on, and at the capture only after one.
- capture: the captured work runs (warm-up then capture, in the pipeline schedule's order: TE
  graph.py `_make_graphed_callables` with `_order`) with everything it saves alive, beside the
  graphs' static buffers.
- replay: the captured work's tensors are pool memory; what runs eagerly (the parts of a layer the
  graph does not cover, the embedding, the output layer, the loss) allocates as usual, beside the
  static buffers.

Per-layer graphs (`cuda_graph_impl transformer_engine`, megatron/core/transformer/cuda_graphs.py
`TECudaGraphHelper`): one graph per layer and micro-batch (all micro-batches with pipeline
parallel, one without), covering `cuda_graph_modules` of each layer (attn: the norm, attention and
its residual add; mlp: the MLP's; none listed: the whole layer). Static buffers
(`_get_sample_arguments`): each captured forward gets a [s/cp(/t), b, h] bf16 hidden-states input
and, where the attention is captured, the [b, 1, s/cp, s] bool attention mask
(transformer_layer.py `get_layer_static_inputs`), shared by forwards whose backward has run, so as
many as layer forwards are in flight at once; with `_reuse_graph_input_output_buffers` (TE 2.7+)
the static outputs and parameter gradients are weak references into the pool, and what stays is one
static grad-output buffer per output shape and the last static grad-input (graph.py). Megatron's
own per-layer graphs (`local`, `CudaGraphManager` / `_CudaGraphRunner`) take their inputs and
outputs from the graph pool and drop them to weak references after capture
(`_weakref_forward_buffers`): they keep no static buffers outside the pool.

Full-iteration graphs (`cuda_graph_impl full_iteration`, full_cuda_graph.py): one graph of the
whole forward-backward of a step; `StaticBufferLoader` copies every micro-batch's inputs into
static buffers held all run, on the ranks that read data (tensor-parallel rank 0 of the first and
last stages, pretrain_gpt.py `is_dataset_built_on_rank`; the estimate counts that rank). Pure
Python.
"""

from __future__ import annotations

from recompute_bench.analysis.megatron.context_parallel import attention_mask_bytes
from recompute_bench.analysis.megatron_schedule import chunk_forwards_in_flight
from recompute_bench.config.schema import Config
from recompute_bench.models import ELEMENT_BYTES
from recompute_bench.models.context_parallel import rank_seq_length

PER_LAYER = ("transformer_engine", "local")

# Storages by the part of TransformerLayer.forward that saves them: `_forward_mlp` from the MLP's
# norm on (a dense MLP's layer.py names; a MoE layer's router, dispatcher, experts), else
# `_forward_attention` (the norm, MHA or MLA, the residual add).
_MLP_PREFIXES = ("pre_mlp_layernorm.", "linear_fc1.", "linear_fc2.", "mlp_bda.", "mlp.", "moe", "router",
                 "token_dispatcher", "experts", "shared_experts")


def graphs(cfg: Config) -> str:
    """The CUDA-graph implementation the run uses ("none" without)."""
    return cfg.training.cuda_graph_impl


def captured_parts(cfg: Config) -> frozenset[str]:
    """The parts of each layer a per-layer graph covers: "attn", "mlp" (none for other impls)."""
    if graphs(cfg) not in PER_LAYER:
        return frozenset()
    modules = set(cfg.training.cuda_graph_modules)
    return frozenset({"attn", "mlp"}) if not modules else frozenset(modules & {"attn", "mlp"})


def layer_part(name: str) -> str:
    """Which part of a layer saves storage `name`: "attn" or "mlp"."""
    return "mlp" if name.startswith(_MLP_PREFIXES) else "attn"


def in_graph(cfg: Config, saved: dict[str, float]) -> dict[str, float]:
    """The storages of one layer that a per-layer graph's capture allocates."""
    parts = captured_parts(cfg)
    return {name: b for name, b in saved.items() if layer_part(name) in parts}


def pool_resident(cfg: Config, saved: dict[str, float], first_in_chunk: bool) -> dict[str, float]:
    """The storages of one layer that live in the graph pool during replay (not counted as
    allocated): the captured part's, and the eager part's input where a graph produced it (an
    attention graph's output is the MLP's input `linear_fc1.input`; a graph ending the layer gives
    the next layer its `linear_qkv.input`, except to the chunk's first layer, whose input comes from
    the embedding or the previous stage)."""
    parts = captured_parts(cfg)
    out = in_graph(cfg, saved)
    if "attn" in parts and "mlp" not in parts and "linear_fc1.input" in saved:
        out["linear_fc1.input"] = saved["linear_fc1.input"]
    if "mlp" in parts and "attn" not in parts and not first_in_chunk and "linear_qkv.input" in saved:
        out["linear_qkv.input"] = saved["linear_qkv.input"]
    return out


def static_buffer_bytes(cfg: Config, stage: int, layers_per_chunk: int) -> dict[str, float]:
    """What the graphs of a rank of pipeline stage `stage` keep outside their pool, all run."""
    impl = graphs(cfg)
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    if impl != "transformer_engine":
        return {}
    t = par.tensor_model_parallel_size
    s, b = rank_seq_length(cfg), tr.micro_batch_size
    rows = s // t if par.sequence_parallel else s
    hidden = ELEMENT_BYTES["bf16"] * rows * b * m.hidden_size  # get_layer_static_inputs: torch.bfloat16
    # Without pipeline parallel TECudaGraphHelper captures one micro-batch; with it every one, whose
    # inputs are shared once a backward has consumed them: as many as layer forwards in flight.
    forwards = chunk_forwards_in_flight(cfg, stage) if par.pipeline_model_parallel_size > 1 else 1
    buffers = forwards * layers_per_chunk
    out = {"CUDA graph static inputs (hidden states)": buffers * hidden}
    if "attn" in captured_parts(cfg):
        # the rotary table it passes is RotaryEmbedding.forward's lru-cached one, shared with eager
        out["CUDA graph static inputs (attention masks)"] = buffers * attention_mask_bytes(cfg)
    # graph.py: one static grad-output per output signature, and the last captured grad-input
    out["CUDA graph static gradients"] = 2 * hidden
    return out


def full_iteration_data_bytes(cfg: Config, batch: float) -> float:
    """full_cuda_graph.py `StaticBufferLoader`: every micro-batch's inputs (`batch` bytes each),
    copied into static buffers at their first read and held all run."""
    return cfg.num_microbatches * batch if graphs(cfg) == "full_iteration" else 0.0
