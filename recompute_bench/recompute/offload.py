"""Activation offload: what a layer saves for backward waits in host memory (Megatron's CPU offload).

Only activations move. `torch.autograd.graph.save_on_cpu` copies every saved tensor, including
the weights a linear layer saves for its input gradient: a second host copy of the parameters
each step, and device memory saved only on paper since the parameter stays on the device anyway.
Here a tensor whose storage belongs to a parameter or buffer stays where it is, and the set of
those storages is read when each offloaded layer's forward starts: under FSDP2 that is after the
layer's pre-forward all-gather, so the unsharded weights it swapped in are parameters too (a set
taken when the offloader was made, before `fully_shard`, would miss them and copy every gathered
weight to the host).

A tensor-parallel DTensor is a wrapper whose own storage holds no data: what moves is its local
shard, and the unpacked tensor is a DTensor again, with the saved one's mesh, placements and shape.
So is the AsyncCollectiveTensor a functional collective returns (a tensor-parallel module's local
output, the embedding's all-reduced one that the first norm saves): it is waited for, and what moves
and comes back is the tensor it wraps. A wrapper of any other kind stays on the device.

Copies overlap with compute both ways, as Megatron's do. Forward: when autograd saves a tensor
inside an offloaded layer, its storage is copied to pinned host memory on a side stream (which
first waits for the compute stream, so the values are final), and the device memory is released
once the copy has read it (`record_stream`). Backward: when layer i's backward starts, layer i-1's
storages are copied back on the side stream while layer i's backward computes; the compute stream
waits for a storage's copy only when it unpacks it.

Storages, not tensors, are the unit: the views a layer saves of one storage (q, k and v of the
fused QKV output) are copied once and rebuilt as views of one restored storage, so the bytes
moved equal the layer's activation bytes as `measure.probe.SavedTensorProbe` counts them.

Where the device is not CUDA (CPU tests) the same bookkeeping runs with synchronous copies into
ordinary memory: nothing is saved, but the result is bitwise the same as without offload, which
is what the CPU tests prove.

Use (as `recompute.apply._install_offload` does):

    offloader = ActivationOffloader(lambda: [*model.parameters(), *model.buffers()])
    for i, layer in enumerate(model.layers):
        with offloader.layer(i) if i < n else contextlib.nullcontext():
            x = layer(x)
        x = offloader.on_backward_start(i, x)

`on_backward_start(i, output)` is the backward-side hook: when the gradient of layer i's output
arrives (the moment layer i's backward starts) the nearest offloaded layer below i starts coming
back. Between offloaded layers it is not needed (the first unpack inside layer i does the same);
it matters for the layer just above the last offloaded one, whose backward is the one to overlap
with the first copy back.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

from recompute_bench.backends.pytorch import local


class _Stored:
    """One storage saved by an offloaded layer: its host copy and, while backward needs it, the
    copy back on the device."""

    __slots__ = ("layer", "nbytes", "host", "on_device", "ready", "unpacks_left", "__weakref__")

    def __init__(self, layer: int, nbytes: int, host: torch.Tensor):
        self.layer = layer
        self.nbytes = nbytes
        self.host = host                                  # uint8 [nbytes], pinned on CUDA
        self.on_device: torch.UntypedStorage | None = None
        self.ready: torch.cuda.Event | None = None        # the copy back has finished (CUDA)
        self.unpacks_left = 0


@dataclass(frozen=True)
class _Packed:
    """What autograd keeps instead of a saved tensor: its storage's copy, the view's geometry, and
    for a DTensor what rebuilds the wrapper around the local view (`_DTensorLayout`)."""

    stored: _Stored
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtensor: Any = None


@dataclass(frozen=True)
class _DTensorLayout:
    """A saved DTensor's mesh, placements and global shape and stride."""

    mesh: Any
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        with torch.no_grad():  # a saved tensor comes back without a graph of its own
            return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                      shape=self.shape, stride=self.stride)


def _data(t: torch.Tensor) -> tuple[torch.Tensor | None, _DTensorLayout | None]:
    """The plain tensor holding t's data (None for a wrapper subclass this module does not open) and,
    for a DTensor, what rebuilds it: a DTensor's local shard, an AsyncCollectiveTensor's result once
    its collective is done (its `elem` may still be being written)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    layout = None
    if hasattr(t, "_local_tensor"):
        layout = _DTensorLayout(t.device_mesh, t.placements, t.shape, t.stride())
        t = t._local_tensor
    if isinstance(t, AsyncCollectiveTensor):
        t = t.trigger_wait()
    return (None if is_traceable_wrapper_subclass(t) else t), layout


@dataclass
class _LayerState:
    stored: list[weakref.ref] = field(default_factory=list)  # weak: autograd's handles own the copies
    packed_bytes: int = 0
    back: bool = False


class ActivationOffloader:
    """Moves what offloaded layers save for backward to host memory and brings it back in time.

    `keep`: called when each offloaded layer's forward starts, the tensors never offloaded (the
    model's parameters and buffers as they are then); any saved tensor whose storage (a DTensor's
    local shard's) is one of theirs stays on the device. `device`: where the activations live
    (default: where the first kept tensor is when the first offloaded forward starts, since a model
    built on the meta device is materialised after recompute is installed); tensors on other
    devices are left alone.
    """

    def __init__(self, keep: Callable[[], Iterable[torch.Tensor]], device: torch.device | str | None = None):
        self._keep_of = keep
        self.device: torch.device | None = None
        self._layers: dict[int, _LayerState] = {}
        if device is not None:
            self._place(torch.device(device))

    def _place(self, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:  # tensors say cuda:N, never cuda
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self._cuda = device, device.type == "cuda"
        # One side stream for both directions: a storage's copy back is queued behind its copy out.
        self._stream = torch.cuda.Stream(device) if self._cuda else None

    # ----- forward ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def layer(self, index: int) -> Iterator[None]:
        """Offload what the forward of layer `index` run inside saves for backward."""
        state = self._layers[index] = _LayerState()
        seen: dict[int, tuple[weakref.ref, _Stored]] = {}  # storage key -> its copy, this forward only
        kept = [local(t) for t in self._keep_of()]  # the weights as this forward sees them
        if self.device is None:
            self._place(kept[0].device)
        keep = {t.untyped_storage()._cdata for t in kept}

        def pack(t: torch.Tensor):
            data, layout = _data(t)
            if data is None:
                return t
            storage = data.untyped_storage()
            key = storage._cdata
            if key in keep or data.device != self.device or storage.nbytes() == 0:
                return t
            hit = seen.get(key)
            # A key whose storage died is a new storage at a reused address, not the one copied.
            if hit is None or hit[0]() is None:
                hit = seen[key] = (weakref.ref(storage), self._copy_out(index, storage))
                state.stored.append(weakref.ref(hit[1]))
                state.packed_bytes += hit[1].nbytes
            stored = hit[1]
            stored.unpacks_left += 1
            return _Packed(stored, data.dtype, data.storage_offset(), tuple(data.shape), tuple(data.stride()), layout)

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _copy_out(self, index: int, storage: torch.UntypedStorage) -> _Stored:
        source = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        if not self._cuda:
            return _Stored(index, storage.nbytes(), source.clone())
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the values are final
        with torch.cuda.stream(self._stream):
            host.copy_(source, non_blocking=True)
        source.record_stream(self._stream)  # its memory is not handed out again before the copy read it
        return _Stored(index, storage.nbytes(), host)

    # ----- backward --------------------------------------------------------------------------------
    def on_backward_start(self, index: int, output: torch.Tensor) -> torch.Tensor:
        """Return `output` (layer `index`'s output) with a hook: when its gradient arrives, the
        nearest offloaded layer below `index` starts coming back to the device."""
        if output.requires_grad:
            output.register_hook(lambda grad: self._bring_back(self._below(index)))
        return output

    def _below(self, index: int) -> int | None:
        return max((i for i in self._layers if i < index), default=None)

    def _bring_back(self, index: int | None) -> None:
        """Start copying layer `index`'s storages back to the device (once per backward)."""
        state = self._layers.get(index) if index is not None else None
        if state is None or state.back:
            return
        state.back = True
        for ref in state.stored:
            stored = ref()
            if stored is not None:
                self._copy_in(stored)

    def _copy_in(self, stored: _Stored) -> None:
        if stored.on_device is not None:
            return
        if not self._cuda:
            stored.on_device = stored.host.clone().untyped_storage()
            return
        compute = torch.cuda.current_stream(self.device)
        target = torch.empty(stored.nbytes, dtype=torch.uint8, device=self.device)  # on the compute stream
        # The block may have served kernels queued on the compute stream before it was freed.
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            target.copy_(stored.host, non_blocking=True)
            stored.ready = torch.cuda.Event()
            stored.ready.record(self._stream)
        stored.on_device = target.untyped_storage()

    def _unpack(self, packed) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        stored = packed.stored
        # Layer i's backward has started: bring it back if nothing did yet, and start i-1's copy
        # so that it overlaps with the rest of layer i's backward.
        self._bring_back(stored.layer)
        self._bring_back(self._below(stored.layer))
        self._copy_in(stored)  # after a retain_graph backward had let go of it
        if stored.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(stored.ready)
        t = torch.empty(0, dtype=packed.dtype, device=self.device).set_(
            stored.on_device, packed.offset, packed.size, packed.stride)
        stored.unpacks_left -= 1
        if stored.unpacks_left <= 0:
            # Autograd's tensors keep the storage for as long as backward needs it; we need not.
            stored.on_device, stored.ready = None, None
        return packed.dtensor.wrap(t) if packed.dtensor is not None else t

    # ----- facts -----------------------------------------------------------------------------------
    def packed_bytes(self, index: int) -> int:
        """Bytes the last forward of layer `index` copied to host memory (distinct storages)."""
        state = self._layers.get(index)
        return state.packed_bytes if state is not None else 0

    def is_back(self, index: int) -> bool:
        """Whether layer `index`'s copies have been sent back to the device in this backward."""
        state = self._layers.get(index)
        return state is not None and state.back
