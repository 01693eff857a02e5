"""Backends: the modules a layer is built from and the recompute primitives (see `pytorch.py`).

Only the pure-PyTorch backend builds layers; `transformer_engine.py` holds what a Transformer Engine
backend will follow (Megatron's TE layer and its recompute) and refuses the flag until it builds."""

from __future__ import annotations

from types import ModuleType

BACKENDS = ("torch",)


def get_backend(name: str = "torch") -> ModuleType:
    """The backend module called `name`."""
    if name == "torch":
        from recompute_bench.backends import pytorch
        return pytorch
    raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
