"""Recompute policies, applied to a built GPT by wrapping its modules (Megatron Core semantics).

- full/uniform N: every chunk of N consecutive layers becomes one checkpoint (the last may be shorter).
- full/block N: the first N layers are checkpointed one each; the others keep their activations.
- selective `core_attn`: only QK^T, softmax, dropout and times V are recomputed; q, k, v are saved.
- selective `mlp`: the whole MLP (fc1, activation, fc2) is recomputed from its input.
- selective `layernorm`: the norm's output is freed once its consumer (QKV projection or MLP) has
  saved it, and refilled from a gradient hook on the consumer's output just before backward needs
  it. A plain checkpoint around the norm would save nothing, because the next linear keeps the
  norm's output alive; this way the norm re-runs and the following matmul does not.
- activation offload N: the first N layers save their activations (not parameters) to host memory,
  copied out and back on a side stream (recompute/offload.py).

Checkpoints are re-entrant (`use_reentrant=True`), as Megatron's are: the forward runs under
no_grad and only the inputs are saved through `save_for_backward`, which the saved-tensor probe in
`measure.py` sees. CPU and CUDA RNG states are restored on recompute, so dropout masks match.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from recompute_bench.spec.config import RecomputeConfig
from recompute_bench.models.dense.layers import GPT
from recompute_bench.recompute.offload import ActivationOffloader


def _recomputing(module: nn.Module) -> bool:
    return module.training and torch.is_grad_enabled()


class Checkpointed(nn.Module):
    """Save the inputs of `module`, drop everything inside it, re-run it in backward."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if not _recomputing(self):
            return self.module(*args)
        return checkpoint(self.module, *args, use_reentrant=True, preserve_rng_state=True)


class CheckpointedLayers(nn.Module):
    """A chunk of consecutive layers checkpointed as one: only the chunk's input is saved."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def _run(self, x: torch.Tensor, *rope: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, *rope)
        return x

    def forward(self, x: torch.Tensor, *rope: torch.Tensor) -> torch.Tensor:
        if not _recomputing(self):
            return self._run(x, *rope)
        return checkpoint(self._run, x, *rope, use_reentrant=True, preserve_rng_state=True)


class _WithoutOutput(torch.autograd.Function):
    """Run `fn(x)` without a graph, save only x; backward uses what `_refill` recomputed."""

    @staticmethod
    def forward(ctx, fn, x):
        with torch.no_grad():
            y = fn(x)
        ctx.fn = fn
        ctx.recomputed = None
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, grad):
        if ctx.recomputed is None:  # the output was never discarded
            _refill(ctx, None)
        x, y = ctx.recomputed
        ctx.recomputed = None
        torch.autograd.backward(y, grad)
        return None, x.grad


def _refill(ctx, output: torch.Tensor | None) -> None:
    """Re-run the function with a graph and, if its output was discarded, refill that storage."""
    (x,) = ctx.saved_tensors
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        y = ctx.fn(x)
    if output is not None:
        storage = output.untyped_storage()
        storage.resize_(y.untyped_storage().nbytes())
        with torch.no_grad():
            storage.copy_(y.untyped_storage())
    ctx.recomputed = (x, y)


class DiscardableNorm(nn.Module):
    """A norm whose output can be freed after its consumer ran (Megatron's CheckpointWithoutOutput)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm
        self._pending: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (_recomputing(self) and x.requires_grad):
            return self.norm(x)
        y = _WithoutOutput.apply(self.norm, x)
        self._pending = y
        return y

    def discard(self, hook_tensor: torch.Tensor) -> None:
        """Free the last output; recompute it when the gradient reaches `hook_tensor`."""
        y, self._pending = self._pending, None
        if y is None or not hook_tensor.requires_grad:
            return
        y.untyped_storage().resize_(0)
        hook_tensor.register_hook(lambda _grad: _refill(y.grad_fn, y))


class DiscardNormAfter(nn.Module):
    """Run the consumer of a DiscardableNorm's output, then have the norm discard that output."""

    def __init__(self, module: nn.Module, norm: DiscardableNorm):
        super().__init__()
        self.module = module
        object.__setattr__(self, "_norm", norm)  # not a submodule: the layer already owns it

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.module(*args)
        self._norm.discard(out)
        return out


class OffloadedLayer(nn.Module):
    """A layer whose saved activations (not its parameters) live in host memory until backward
    needs them (recompute.offload)."""

    def __init__(self, layer: nn.Module, offloader: ActivationOffloader, index: int):
        super().__init__()
        self.layer = layer
        self.index = index
        self.offloader = offloader  # one for all offloaded layers

    def forward(self, x: torch.Tensor, *rope: torch.Tensor) -> torch.Tensor:
        with self.offloader.layer(self.index):
            return self.layer(x, *rope)


def apply_recompute(model: GPT, r: RecomputeConfig) -> GPT:
    """Wrap the modules of `model` in place for the setting `r` (already validated); returns it."""
    layers = list(model.layers)
    if r.granularity == "full":
        n = r.num_layers
        if r.method == "uniform":
            wrapped = [CheckpointedLayers(layers[i:i + n]) for i in range(0, len(layers), n)]
        else:
            wrapped = [CheckpointedLayers([layer]) if i < n else layer for i, layer in enumerate(layers)]
        model.layers = nn.ModuleList(wrapped)
    elif r.granularity == "selective":
        for layer in layers:
            if "core_attn" in r.modules:
                attn = layer.self_attention
                attn.core_attention = Checkpointed(attn.core_attention)
            if "mlp" in r.modules:
                layer.mlp = Checkpointed(layer.mlp)
            if "layernorm" in r.modules:
                layer.input_layernorm = DiscardableNorm(layer.input_layernorm)
                layer.self_attention = DiscardNormAfter(layer.self_attention, layer.input_layernorm)
                layer.pre_mlp_layernorm = DiscardableNorm(layer.pre_mlp_layernorm)
                layer.mlp = DiscardNormAfter(layer.mlp, layer.pre_mlp_layernorm)
    if r.activation_offload_layers:
        n = r.activation_offload_layers
        offloader = ActivationOffloader([*model.parameters(), *model.buffers()], next(model.parameters()).device)
        model.layers = nn.ModuleList(OffloadedLayer(layer, offloader, i) if i < n else layer
                                     for i, layer in enumerate(model.layers))
        if n < len(model.layers):  # the last offloaded layer comes back while the next one runs backward
            model.layers[n].register_forward_hook(lambda _m, _args, out: offloader.on_backward_start(n, out))
    return model


def recomputed_layers(r: RecomputeConfig, num_layers: int) -> int:
    """How many layers full recompute re-runs in backward (0 unless full)."""
    if r.granularity != "full":
        return 0
    return num_layers if r.method == "uniform" else min(r.num_layers, num_layers)
