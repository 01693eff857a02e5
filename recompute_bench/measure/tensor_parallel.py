"""Tensor parallelism, with or without sequence parallelism, on DTensor: the plan of the GPT.

A 2-D device mesh (dp, tp): ranks dp_rank x tp + tp_rank; tensor parallelism runs over "tp", data
parallelism (FSDP2) over "dp". The plan (`torch.distributed.tensor.parallel`) keeps every module
and parameter name, and is applied before recompute is installed and before FSDP (torchtitan's
order: TP -> AC -> FSDP):

- attention: `linear_qkv` column-parallel (its output laid out per query group, so each rank holds
  whole groups), `linear_proj` row-parallel; MLP: `linear_fc1` column-parallel, `linear_fc2`
  row-parallel. The core attention, RoPE and the activation run on this rank's heads / columns.
- the word embedding vocabulary-parallel (row-parallel over the padded vocabulary; the tied output
  layer shares its shard), the output layer column-parallel over the vocabulary, its logits a
  DTensor sharded over the vocabulary, which the backend's cross-entropy works on shard by shard
  (no rank holds the whole logits).
- with sequence parallelism: the residual stream, the norms and the hidden dropouts run on this
  rank's 1/tp of the sequence (`SequenceParallel`); a column-parallel linear all-gathers the
  sequence for its input but keeps only the shard for backward, all-gathering it again there, as
  Megatron does (`SequenceGatheredColwise`); a row-parallel one reduce-scatters its output. The embedding's output
  (with learned positions added) is split over the sequence before its dropout. Without it those
  run on every rank on the whole sequence, and a row-parallel linear all-reduces.

The residual stream between modules is this rank's local tensor, so dropout masks, checkpoints and
the saved-tensor probe see local tensors; what a DTensor module saves is counted by its local shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

SEQUENCE = 1
"""The sequence dimension of the [b, s, h] activations."""


class _GatheredLinear(torch.autograd.Function):
    """y = all_gather(x over the sequence) @ w.T + b on this rank's columns, keeping only the
    sequence shard x for backward and all-gathering it again there (Megatron's sequence-parallel
    column linear, and the paper's accounting). The gradient of x is reduce-scattered over the
    sequence. Local tensors in and out; the collectives are DTensor redistributions."""

    @staticmethod
    def forward(ctx, x, weight, bias, mesh):
        ctx.mesh, ctx.has_bias = mesh, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_gather(x, mesh), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole = _gather(x, ctx.mesh)
        grad_x = DTensor.from_local(grad @ weight, ctx.mesh, [Partial()], run_check=False)
        grad_x = grad_x.redistribute(ctx.mesh, [Shard(SEQUENCE)]).to_local()
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_w = grad_2d.t() @ whole.reshape(-1, whole.shape[-1])
        return grad_x, grad_w, grad_2d.sum(0) if ctx.has_bias else None, None


def _gather(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return DTensor.from_local(x, mesh, [Shard(SEQUENCE)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


class SequenceGatheredColwise(ParallelStyle):
    """Column-parallel linear whose input is a sequence-parallel shard (`_GatheredLinear`): the weight
    (and bias) split over output features as `ColwiseParallel` splits them; the output this rank's
    columns, a local tensor, or (`output_dtensor`) a DTensor sharded on the last dim for the loss.
    `ColwiseParallel(input_layouts=Shard(1))` would keep the all-gathered input whole for backward,
    t times the shard (measured: 2 x (1 - 1/t) x s x b x h bytes per layer more than Megatron keeps)."""

    def __init__(self, output_dtensor: bool = False):
        super().__init__()
        self.output_dtensor = output_dtensor

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(p.data, device_mesh, [Shard(0)])))

        def forward(x: torch.Tensor) -> torch.Tensor:
            bias = module.bias.to_local() if module.bias is not None else None
            y = _GatheredLinear.apply(x, module.weight.to_local(), bias, device_mesh)
            return DTensor.from_local(y, device_mesh, [Shard(-1)], run_check=False) if self.output_dtensor else y

        module.forward = forward
        return module


def layer_plan(sequence_parallel: bool) -> dict:
    """One transformer layer's plan, by module name."""
    seq = Shard(SEQUENCE) if sequence_parallel else Replicate()
    column = SequenceGatheredColwise if sequence_parallel else ColwiseParallel
    plan = {
        "self_attention.linear_qkv": column(),
        "self_attention.linear_proj": RowwiseParallel(output_layouts=seq),
        "mlp.linear_fc1": column(),
        "mlp.linear_fc2": RowwiseParallel(output_layouts=seq),
    }
    if sequence_parallel:
        plan["input_layernorm"] = SequenceParallel(use_local_output=True)
        plan["pre_mlp_layernorm"] = SequenceParallel(use_local_output=True)
    return plan


def model_plan(sequence_parallel: bool) -> dict:
    """The plan of everything outside the layers, by module name."""
    seq = Shard(SEQUENCE) if sequence_parallel else Replicate()
    plan = {
        "word_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "output_layer": (SequenceGatheredColwise(output_dtensor=True) if sequence_parallel else
                         ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)),
    }
    if sequence_parallel:
        plan["embedding_dropout"] = PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=seq,
                                                       use_local_output=True)
        plan["final_layernorm"] = SequenceParallel(use_local_output=True)
    return plan


def swiglu_rows(ffn_hidden_size: int, tp: int) -> torch.Tensor:
    """The order of fc1's 2f rows (gate, then up) under which a row split over `tp` ranks gives
    rank i [gate_i; up_i], so that the activation's `chunk(2)` pairs each gate with its up."""
    f, n = ffn_hidden_size, ffn_hidden_size // tp
    return torch.cat([torch.cat([torch.arange(i * n, (i + 1) * n), f + torch.arange(i * n, (i + 1) * n)])
                      for i in range(tp)])


class TensorParallel:
    """The (dp, tp) mesh of the process group (or a larger one with those dimensions: the pipeline's
    (pp, dp, tp)) and the GPT's tensor-parallel plan."""

    def __init__(self, tp: int, sequence_parallel: bool, device_type: str, mesh: DeviceMesh | None = None):
        world = dist.get_world_size()
        if world % tp:
            raise ValueError(f"tensor_model_parallel_size {tp} does not divide the {world} ranks")
        self.size, self.sequence_parallel = tp, sequence_parallel
        self.mesh: DeviceMesh = mesh or init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))

    @property
    def group(self) -> dist.ProcessGroup:
        """The tensor-parallel group of this rank."""
        return self.mesh["tp"].get_group()

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Shard the parts of the GPT that `model` holds (the whole model, or a pipeline stage's
        chunk: its layers, and the embedding or the output layer where it has them; built on the
        meta device) over the "tp" mesh, in place. SwiGLU's fc1 takes its rows in `swiglu_rows` order
        when it is initialised (`init_row_order`), so that each rank's shard holds its gate and up
        columns of one rank's weights."""
        tp_mesh = self.mesh["tp"]
        for layer in model.layers:
            mlp = layer.mlp
            if getattr(mlp, "swiglu", False):
                mlp.linear_fc1.init_row_order = swiglu_rows(mlp.linear_fc2.in_features, self.size)
            parallelize_module(layer, tp_mesh, layer_plan(self.sequence_parallel))
        plan = {name: style for name, style in model_plan(self.sequence_parallel).items() if getattr(model, name, None) is not None}
        parallelize_module(model, tp_mesh, plan)
        model.tie_weights()  # the output layer shares the embedding's vocabulary shard again
        return model

    def whole(self, name: str, tensor: torch.Tensor, cfg) -> torch.Tensor:
        """A gathered (full_tensor) parameter or gradient `name` in the single-rank layout."""
        if cfg.model.activation == "swiglu" and name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")):
            rows = swiglu_rows(cfg.model.ffn_hidden_size, self.size).to(tensor.device)
            out = torch.empty_like(tensor)
            out[rows] = tensor
            return out
        return tensor

