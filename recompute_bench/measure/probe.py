"""The probe step's instruments: what autograd keeps for backward (`SavedTensorProbe`), the FLOPs
this rank runs (`LocalFlopCounter`), and the routed tokens per expert of a MoE model (`tokens_per_expert`).

The probe step is the point's first step, not timed: `FlopCounterMode` counts every FLOP of the whole
step, recompute included (a tensor-parallel DTensor op by its local shards), and saved-tensor hooks
around the first micro-batch's forward collect the storages autograd keeps for backward (a
DTensor's local shard). `measure.pipeline_probe.ScheduleProbe` is the pipeline's probe, with the same methods.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

from recompute_bench.backends.pytorch import local


class _GlobalOnly:
    """A module tracker that tracks nothing: every FLOP counts under "Global" alone."""

    parents = ("Global",)

    def __enter__(self) -> "_GlobalOnly":
        return self

    def __exit__(self, *_: Any) -> None:
        return None


class LocalFlopCounter(FlopCounterMode):
    """`FlopCounterMode` counting the FLOPs this rank runs: an op on DTensors (a tensor-parallel
    linear) is counted by the shapes of its local shards, not its global shapes (the mode sees
    DTensor ops before they are split into local ones). Plain tensors count as they are.

    Only the total is read, so no module is tracked: torch's module tracker hooks every module's
    inputs for backward (`register_multi_grad_hook`), which fails inside the `autograd.grad(inputs=)`
    of a zero-bubble pipeline schedule's input-gradient pass."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.mod_tracker = _GlobalOnly()

    def _count_flops(self, func_packet, out, args, kwargs):
        from torch.utils._pytree import tree_map

        super()._count_flops(func_packet, tree_map(local, out), tree_map(local, args), tree_map(local, kwargs))
        return out


class SavedTensorProbe:
    """Counts the bytes autograd keeps for backward: storages, de-duplicated, parameters and buffers
    excluded, read when the forward is over (so storages freed in the meantime count as zero).

    Bytes are attributed to the transformer layers while the layer stack `model.layers` runs (a
    full-recompute chunk's checkpoint saves its input there, outside any one layer). An outer hook
    sees what a re-entrant checkpoint saves (its inputs), which is what it really holds; tensors
    saved inside a CPU-offloaded layer are packed by that layer's own hooks and are not on the device.

    The probe holds no storage: it keeps weak references while the forward runs and only the two
    totals afterwards, so the micro-batch's activations are freed by its backward as in any other
    step (holding them would inflate the measured peak by about `activation_bytes`).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.num_layers = len(model.layers)
        # Storages are keyed by their StorageImpl (`_cdata`), not their address. Parameters live
        # for the whole run, so their keys cannot be reused by another storage.
        self.excluded = self._storages_of_parameters()
        self.storages: dict[int, tuple[weakref.ref, bool]] = {}
        self.in_layers = False
        self.result: tuple[int, int] = (0, 0)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = local(t).untyped_storage()  # a DTensor holds this rank's shard: its local bytes count
        key = storage._cdata
        if key in self.excluded:
            return t
        seen = self.storages.get(key)
        # A storage freed during the forward (its saved tensor dropped) may hand its StorageImpl's
        # address to a later one: a dead reference under the same key is a different storage.
        if seen is None or seen[0]() is None:
            # torch keeps one Python object per live storage, so this reference dies with the storage.
            self.storages[key] = (weakref.ref(storage), self.in_layers)
        return t

    @contextmanager
    def watch(self) -> Iterator["SavedTensorProbe"]:
        """Count what the forward run inside saves; the totals are in `result` (and `bytes()`) once
        the block ends, and the probe lets go of every storage then."""
        def enter(*_):
            self.in_layers = True

        def leave(*_):
            self.in_layers = False

        self.storages.clear()
        stack = self.model.layers
        handles = [stack.register_forward_pre_hook(enter), stack.register_forward_hook(leave)]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            for h in handles:
                h.remove()
            self.result = self._count()
            self.storages.clear()

    def _storages_of_parameters(self) -> set[int]:
        # A sharded (DTensor) parameter is its local shard; FSDP2 swaps unsharded parameters in
        # for the forward, and the root module keeps them until its backward: weights, not activations.
        return {local(t).untyped_storage()._cdata
                for t in list(self.model.parameters()) + list(self.model.buffers())}

    def _count(self) -> tuple[int, int]:
        total = layers = 0
        weights = self._storages_of_parameters()
        for key, (ref, in_layers) in self.storages.items():
            storage = ref() if key not in weights else None
            nbytes = storage.nbytes() if storage is not None else 0  # freed: nothing held for backward
            total += nbytes
            layers += nbytes if in_layers else 0
        return total, layers

    def bytes(self) -> tuple[int, int]:
        """(all saved bytes, bytes saved inside the transformer layers) of the last watched forward,
        read when it ended."""
        return self.result

    def fields(self) -> dict[str, Any]:
        """Figures beyond `bytes()` for the rank's entry: none for one micro-batch's forward."""
        return {}


def tokens_per_expert(model: torch.nn.Module) -> dict[str, float]:
    """Routed rows per expert in the probe step's last micro-batch, over every MoE layer: the max
    (the busiest expert) and the mean (tokens x top-k / experts; what the experts ran, after any
    token dropping), and the routed rows dropped over capacity summed over the MoE layers; nothing
    for a dense model. Read once, after the probe step, never inside a timed one."""
    counts = [layer.mlp.tokens_per_expert for layer in model.layers
              if getattr(layer.mlp, "tokens_per_expert", None) is not None]
    if not counts:
        return {}
    stacked = torch.stack(counts).float()
    dropped = sum(int(layer.mlp.tokens_dropped) for layer in model.layers if getattr(layer.mlp, "tokens_dropped", None) is not None)
    return {"tokens_per_expert_max": stacked.max().item(), "tokens_per_expert_mean": stacked.mean().item(),
            "tokens_dropped": dropped}
