"""Install per-layer recompute policies on a built model, in place, keeping every parameter name.

Nothing is wrapped or renamed (torchtitan registers a wrapped block under its old name; here the
module itself stays and only its `forward` changes), so `named_parameters()` is the same for every
setting: gradients compare by name, and name-keyed parallel plans apply after recompute.

- a full-recompute chunk: the layer stack's forward runs the chunk under one checkpoint (with
  `distribute_saved_activations`, one that keeps 1/tp of the chunk's input and all-gathers it);
- selective `core_attn`: the core attention's forward is checkpointed (q, k, v are saved);
- selective `mlp`: the MLP's forward is checkpointed (its input is saved), on dense layers only;
- selective `moe`, `moe_act`, `shared_experts`: on MoE layers (see `_install_moe`);
- selective `mla_up_proj`: MLA's q/kv up-projections and RoPE run without keeping q, k, v, which are
  freed once core attention has saved them and recomputed from a hook on its output (Megatron's
  `qkv_up_proj_and_rope_apply` under CheckpointWithoutOutput); no other matmul re-runs;
- selective `layernorm`: each norm runs without keeping its output, which is freed once the next
  module (QKV projection, MLP) has saved it and recomputed from a gradient hook just before that
  module's backward. A plain checkpoint around the norm would save nothing, because the next
  linear keeps the norm's output alive; this way the norm re-runs and the following matmul does not;
- offload: the layer's saved activations (not the parameters it saves) go to host memory, copied
  out and back on a side stream (recompute/offload.py).
The primitives (checkpoint, discard-output) come from the model's backend.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from recompute_bench.backends import get_backend
from recompute_bench.recompute.offload import ActivationOffloader
from recompute_bench.recompute.policy import LayerPolicy, chunks, layer_policies
from recompute_bench.config.schema import RecomputeConfig


def _recomputing(module: nn.Module) -> bool:
    return module.training and torch.is_grad_enabled()


def _checkpoint_forward(module: nn.Module, backend) -> None:
    """From now on `module(...)` saves only its inputs and re-runs in backward."""
    inner = module.forward

    def forward(*args: torch.Tensor) -> torch.Tensor:
        if not _recomputing(module):
            return inner(*args)
        return backend.checkpoint(inner, *args)

    module.forward = forward


def _discard_after(norm: nn.Module, consumer: nn.Module, backend, method: str = "forward") -> None:
    """Run `norm` (or any module: MoE's activation; with `method`, one of its methods: MLA's
    up-projections) without keeping its output, and free that output once `consumer` has run on it."""
    inner_norm, inner_consumer = getattr(norm, method), consumer.forward
    pending: list[torch.Tensor] = []

    def norm_forward(*args: torch.Tensor) -> torch.Tensor:
        if not (_recomputing(norm) and any(x.requires_grad for x in args)):
            return inner_norm(*args)
        y = backend.without_output(inner_norm, *args)
        pending.append(y)
        return y

    def consumer_forward(*args: torch.Tensor) -> torch.Tensor:
        out = inner_consumer(*args)
        if pending:
            backend.discard(pending.pop(), out)
        return out

    setattr(norm, method, norm_forward)
    consumer.forward = consumer_forward


def _offload_forward(layer: nn.Module, offloader: ActivationOffloader, index: int) -> None:
    """From now on what `layer` saves for backward waits in host memory."""
    inner = layer.forward

    def forward(x: torch.Tensor, *rope: torch.Tensor) -> torch.Tensor:
        with offloader.layer(index):
            return inner(x, *rope)

    layer.forward = forward


def _install_offload(model: nn.Module, offloaded: list[int]) -> None:
    """Offload the layers `offloaded` through one offloader (`model.activation_offloader`); the
    layer just above the last of them starts bringing it back when its own backward starts."""
    # The weights are read when each offloaded forward starts (FSDP2 swaps its unsharded ones in then).
    offloader = ActivationOffloader(lambda: [*model.parameters(), *model.buffers()])
    for i in offloaded:
        _offload_forward(model.layers[i], offloader, i)
    above = max(offloaded) + 1
    if above < len(model.layers):
        model.layers[above].register_forward_hook(lambda _m, _args, out: offloader.on_backward_start(above, out))
    model.activation_offloader = offloader


def _chunked_forward(stack: nn.Module, ranges: list[tuple[int, int]], full: list[bool],
                     checkpoint: Callable[..., torch.Tensor]) -> None:
    """The layer stack runs each full-recompute chunk under one checkpoint, the other layers as they are."""

    def run(start: int, stop: int) -> Callable[..., torch.Tensor]:
        def fn(x: torch.Tensor, *rope: torch.Tensor) -> torch.Tensor:
            for i in range(start, stop):
                x = stack[i](x, *rope)
            return x
        return fn

    units = [(run(a, b), is_full) for (a, b), is_full in zip(ranges, full)]

    def forward(x: torch.Tensor, *rope: torch.Tensor) -> torch.Tensor:
        for fn, is_full in units:
            x = checkpoint(fn, x, *rope) if is_full and _recomputing(stack) else fn(x, *rope)
        return x

    stack.forward = forward


def _install_moe(block: nn.Module, modules: frozenset[str], backend) -> None:
    """MoE's selective targets on one MoE block (`models/moe/layers.py`), Megatron's way: `moe_act`
    runs the weighted activation without keeping its output (fc2's input), freed once fc2 has saved
    it and refilled from a hook on fc2's output, so no expert matmul re-runs; `shared_experts`
    checkpoints the shared-expert MLP; `moe` checkpoints the whole block (the others run inside it)."""
    if "moe_act" in modules:
        _discard_after(block.experts.activation_func, block.experts.linear_fc2, backend)
    if "shared_experts" in modules and block.shared_experts is not None:
        _checkpoint_forward(block.shared_experts, backend)
    if "moe" in modules:
        _checkpoint_forward(block, backend)


def apply_policies(model: nn.Module, policies: list[LayerPolicy], distribute_over=None) -> nn.Module:
    """Install one policy per layer of `model.layers` (in place); returns the model. With a process
    group `distribute_over` (the tensor-parallel group, `distribute_saved_activations`), a full
    chunk keeps only this rank's share of its input and all-gathers it before recompute."""
    if len(policies) != len(model.layers):
        raise ValueError(f"{len(policies)} policies for {len(model.layers)} layers")
    backend = get_backend(getattr(model, "backend", "torch"))
    for layer, policy in zip(model.layers, policies):
        if "core_attn" in policy.modules:
            _checkpoint_forward(layer.self_attention.core_attention, backend)
        moe = getattr(layer.mlp, "experts", None) is not None  # a MoE block in the MLP's place
        if "mlp" in policy.modules and not moe:  # Megatron: dense layers only
            _checkpoint_forward(layer.mlp, backend)
        if moe:
            _install_moe(layer.mlp, policy.modules, backend)
        if "mla_up_proj" in policy.modules:
            attention = layer.self_attention
            _discard_after(attention, attention.core_attention, backend, "qkv_up_proj_and_rope")
        # megatron/core/transformer/transformer_layer.py: an IdentityOp norm (fused into TE's
        # LayerNormLinear) is not recomputed
        if "layernorm" in policy.modules and not isinstance(layer.input_layernorm, nn.Identity):
            _discard_after(layer.input_layernorm, layer.self_attention, backend)
            _discard_after(layer.pre_mlp_layernorm, layer.mlp, backend)
    offloaded = [i for i, policy in enumerate(policies) if policy.offload]
    if offloaded:
        _install_offload(model, offloaded)
    ranges = chunks(policies)
    full = [policies[a].chunk is not None for a, _ in ranges]
    if any(full):
        checkpoint = (backend.checkpoint if distribute_over is None
                      else functools.partial(backend.checkpoint_sharded, distribute_over))
        _chunked_forward(model.layers, ranges, full, checkpoint)
    return model


def apply_recompute(model: nn.Module, r: RecomputeConfig, tensor_group=None, first: int = 0) -> nn.Module:
    """Install the (validated) Megatron setting `r` on every layer of `model` (the whole GPT, or a
    pipeline stage's model chunk whose first layer is model layer `first`); returns it.
    `tensor_group`: the model's tensor-parallel group, over which `distribute_saved_activations` splits."""
    distribute = tensor_group if r.distribute_saved_activations else None
    return apply_policies(model, layer_policies(r, len(model.layers), first), distribute)

