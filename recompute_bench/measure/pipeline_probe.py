"""The saved-tensor probe of a pipeline rank: what autograd keeps for backward over a whole
schedule step, chunk-forward by chunk-forward, with the chunks holding it at the peak. One rank's
probe is `measure.probe`; this one has the same methods, so `measure.point` reads either."""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from recompute_bench.backends.pytorch import local


class _Held:
    """What autograd keeps for a saved tensor while the probe watches: the tensor without its
    autograd history (a saved output that kept its own grad_fn would keep its node, and so every
    saved tensor upstream, alive in a reference cycle after the backward meant to free it)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ScheduleProbe:
    """The saved-tensor probe over a whole pipeline step: every storage autograd keeps for backward
    (de-duplicated, parameters and buffers excluded, a DTensor's local shard) is followed from the
    chunk-forward that first saved it until autograd lets go of its last reference to it; after each
    chunk-forward (and the loss) the bytes held are summed. The largest sum is the stage's saved
    activations at its peak (`activation_peak_bytes`), with the chunk-forwards holding them then; the
    first micro-batch's own bytes through each chunk give `activation_bytes`, as one rank measures."""

    def __init__(self, model: nn.ModuleList, stages: list[int]):
        """`model`: this rank's model chunks (`measure.pipeline.PipelineChunks`); `stages`: their virtual stages."""
        self.model, self.stages = model, stages
        self.num_layers = sum(len(c.layers) for c in model)
        self.excluded: set[int] = set()
        self.live: dict[int, list] = {}  # storage key -> [weakref to it, references held, first tag, in layers]
        self.tags: dict[tuple[int, int], int] = {}  # (virtual stage, micro-batch) -> references its forward saved, still held
        self._refs: set = set()
        self.tag: tuple[int, int] = (-1, -1)
        self.in_layers = False
        self.peak = self.peak_layers = 0
        self.held: dict[int, int] = {}
        self.first: dict[int, tuple[int, int]] = {}  # virtual stage -> (bytes, in-layer bytes) of micro-batch 0

    def _exclude_parameters(self, *_: Any) -> None:
        # FSDP2 swaps unsharded parameters in at a module's forward: read them where each runs.
        for chunk in self.model:
            for t in list(chunk.parameters()) + list(chunk.buffers()):
                self.excluded.add(local(t).untyped_storage()._cdata)

    def _pack(self, t: torch.Tensor):
        storage = local(t).untyped_storage()
        key = storage._cdata
        if key in self.excluded:
            return t
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [weakref.ref(storage), 0, self.tag, self.in_layers]
        entry[1] += 1
        tag = self.tag
        self.tags[tag] = self.tags.get(tag, 0) + 1
        held = _Held(t.detach())

        def release(_ref, key=key) -> None:
            self._refs.discard(_ref)
            self.tags[tag] -= 1
            e = self.live.get(key)
            if e is not None:
                e[1] -= 1
                if e[1] == 0:
                    del self.live[key]

        self._refs.add(weakref.ref(held, release))
        return held

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    @contextmanager
    def watch(self) -> Iterator["ScheduleProbe"]:
        """Follow what the schedule's step saves."""
        handles = []
        for stage in self.model:
            handles += [stage.layers.register_forward_pre_hook(self._enter), stage.layers.register_forward_hook(self._leave)]
            for module in [stage, *stage.layers]:
                handles.append(module.register_forward_pre_hook(self._exclude_parameters))
        self._exclude_parameters()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            for h in handles:
                h.remove()
            self.live.clear()
            self.tags.clear()
            self._refs.clear()

    def _enter(self, *_: Any) -> None:
        self.in_layers = True

    def _leave(self, *_: Any) -> None:
        self.in_layers = False

    @contextmanager
    def chunk_forward(self, stage: int, microbatch: int) -> Iterator[None]:
        """Around one chunk-forward: what it saves is tagged with it; the sum is read after it."""
        self.tag = (stage, microbatch)
        yield
        self.sample()

    def sample(self) -> None:
        """Sum what is held now; keep the largest sum, and micro-batch 0's own bytes per chunk."""
        total = layers = 0
        for ref, count, _tag, in_layers in self.live.values():
            storage = ref()
            nbytes = storage.nbytes() if storage is not None and count else 0  # freed: holds nothing
            total += nbytes
            layers += nbytes if in_layers else 0
        if total > self.peak:
            self.peak, self.peak_layers = total, layers
            self.held = {}
            for stage, _mb in (t for t, refs in self.tags.items() if refs and t[0] >= 0):
                self.held[stage] = self.held.get(stage, 0) + 1
        stage, microbatch = self.tag
        if microbatch == 0:
            mine = [(s.nbytes() if (s := e[0]()) is not None else 0, e[3]) for e in self.live.values() if e[2] == self.tag]
            self.first[stage] = (sum(b for b, _ in mine), sum(b for b, inside in mine if inside))

    def bytes(self) -> tuple[int, int]:
        """(bytes, in-layer bytes) micro-batch 0 saves through this rank's chunks, each read when its
        chunk-forward (and loss) ended."""
        return sum(b for b, _ in self.first.values()), sum(x for _, x in self.first.values())

    def fields(self) -> dict[str, Any]:
        """The rank's pipeline figures: its stage, chunks, saved bytes at the peak and the micro-batches
        held then (chunk-forwards over chunks per rank)."""
        return {"activation_peak_bytes": self.peak, "activation_peak_layer_bytes": self.peak_layers,
                "microbatches_in_flight": sum(self.held.values()) / len(self.stages),
                "chunks_in_flight": {str(k): v for k, v in sorted(self.held.items())}}
