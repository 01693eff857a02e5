"""Backends: the modules a layer is built from and the recompute primitives (see `pytorch.py`).

The pure-PyTorch backend (`pytorch.py`) builds every model; Transformer Engine's (`te_layers.py`) builds
the dense layers from TE's modules as `transformer_engine.py` maps them, where TE imports on CUDA."""

from __future__ import annotations

from types import ModuleType

BACKENDS = ("torch", "transformer_engine")


def get_backend(name: str = "torch") -> ModuleType:
    """The backend module called `name`."""
    if name == "torch":
        from recompute_bench.backends import pytorch
        return pytorch
    if name == "transformer_engine":
        from recompute_bench.backends import te_layers
        return te_layers
    raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
