"""Context parallelism of a layout: the device mesh with a "cp" dimension and the GPT's split.

The ranks form a (pp, dp, cp, tp) mesh, tensor parallel innermost, then context parallel, data
parallel, pipeline outermost (Megatron's default order "tp-cp-ep-dp-pp"): rank = ((pp_rank x dp +
dp_rank) x cp + cp_rank) x tp + tp_rank, so the tp ranks of a group are neighbours and a cp group
spans tp x cp consecutive ranks. "dp" and "cp" flattened ("dp_cp") are the ranks that hold the same
weights and different tokens: gradients are reduced over them (DDP's all-reduce, FSDP2's shards),
as Megatron reduces over its data-parallel-with-context group.

`ContextParallel.parallelize` hands the GPT (or a pipeline chunk of it) this rank's part of each
sequence (`models.cp_attention.SequenceSplit`): the embedding takes this rank's positions of the
tokens, RoPE its rows, core attention reaches the other ranks' keys and values, and the loss takes
this rank's labels; every rank of a data-parallel replica reads the whole micro-batches.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from recompute_bench.backends.pytorch import CoreAttention
from recompute_bench.models.cp_attention import SequenceSplit
from recompute_bench.config.schema import Config


def layout_mesh(device_type: str, *, pp: int = 1, dp: int, cp: int, tp: int) -> tuple[DeviceMesh, DeviceMesh]:
    """The (pp, dp, cp, tp) mesh of the process group (no "pp" dimension when pp is 1), and "dp" and
    "cp" flattened into one ("dp_cp"), the ranks gradients are reduced over."""
    if pp * dp * cp * tp != dist.get_world_size():
        raise ValueError(f"pp {pp} x dp {dp} x cp {cp} x tp {tp} is not the {dist.get_world_size()} ranks")
    shape, names = (dp, cp, tp), ("dp", "cp", "tp")
    if pp > 1:
        shape, names = (pp, *shape), ("pp", *names)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return mesh, mesh["dp", "cp"]._flatten("dp_cp")


class ContextParallel:
    """This rank's context-parallel group (the "cp" dimension of `mesh`) and its split of every sequence."""

    def __init__(self, cfg: Config, mesh: DeviceMesh):
        par = cfg.parallel
        self.size = par.context_parallel_size
        self.rank = mesh.get_local_rank("cp")
        self.group = mesh["cp"].get_group()
        self.split = SequenceSplit(self.group, self.rank, self.size, par.cp_comm_type, cfg.training.seq_length,
                                   mesh["cp"])

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Give `model` (built on the meta device: the whole GPT or a pipeline chunk) this rank's part of
        every sequence, in place, keeping every name."""
        model.context_parallel = self.split
        if getattr(model, "rotary", None) is not None:
            model.rotary.split(self.split.ranges)  # buffers registered before they are materialised
        for module in model.modules():
            if isinstance(module, CoreAttention):
                module.context_parallel = self.split
        return model

    def place(self) -> dict:
        """This rank's place in its context-parallel group, for its record entry."""
        return {"context_parallel_rank": self.rank}
