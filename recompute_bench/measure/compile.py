"""`--compile`: torch.compile per transformer layer, as torchtitan applies it (torchtitan/models/llama3/
infra/parallelize.py `apply_compile`: each TransformerBlock compiled on its own, `fullgraph=False`).

It runs after `recompute.apply` has installed the point's policy, so each setting still applies:
selective recompute's checkpoints and discard-output primitives run inside the compiled layer (a
re-entrant checkpoint is an autograd.Function dynamo does not trace into: the graph breaks around it
and the checkpointed module re-runs eagerly in backward), and full recompute's checkpoint around a
chunk of layers calls the compiled layers (its no-grad forward and its recompute each get a graph).
Inductor (the default backend) builds the kernels; `launch.compiler.compile_problem` says beforehand
where it cannot. The embedding, the output layer and the loss stay eager, as torchtitan leaves them.
"""

from __future__ import annotations

import torch
from torch import nn


COMPILE_BACKEND = "inductor"
"""torch.compile's backend the layers are compiled with (its default, in its default mode)."""


def compile_layers(model: nn.Module) -> nn.Module:
    """Compile each of `model.layers` in place (`nn.Module.compile`: the module and its parameter
    names stay, only its call goes through torch.compile); returns the model."""
    for layer in model.layers:
        layer.compile(backend=COMPILE_BACKEND)
    # Each layer is its own code object with its own guards; the default cache of 8 per code object
    # is shared by every layer's forward (one function), so let every layer keep its graph.
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 8 * len(model.layers))
    return model


def compiled(model: nn.Module) -> dict[str, str]:
    """The record's `env` entry of a model whose layers are compiled: `compile`, torch.compile's
    backend ("inductor"); nothing for an eager one."""
    layers = getattr(model, "layers", [])
    options = [getattr(layer, "_compiled_call_impl", None) for layer in layers]
    if not options or any(o is None for o in options):
        return {}
    return {"compile": COMPILE_BACKEND}
