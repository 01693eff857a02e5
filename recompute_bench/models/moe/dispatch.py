"""Token dispatch between the router and the experts of a MoE layer.

`LocalDispatch` (one rank holds every expert) passes the expert-sorted copies through. Under expert
parallel (`--ep`, Megatron's expert_model_parallel_size) each rank of an expert-parallel group
holds `num_moe_experts / ep` consecutive experts, and `AllToAllDispatch` does what Megatron's
all-to-all token dispatcher does:

    counts  -> all-to-all (equal splits): how many copies every rank sends to each of my experts
    splits  -> one host read of the send/receive sizes (all_to_all_single takes lists)
    copies, probabilities -> all-to-all with those splits (rank-major, expert-minor on arrival)
    sort the arrivals by local expert -> experts -> unsort -> the reverse all-to-all (combine)

The all-to-all is an autograd function whose backward is the reverse all-to-all (torch's
`torch.distributed.nn.functional.all_to_all_single` does the same and works on gloo, but is
deprecated in the torch in use). It saves nothing for backward but the split sizes. Under `moe`
recompute the whole block is checkpointed, so its collectives run again in backward; every rank
reaches the same layer's recompute in the same order (same graph, same backward order), so the
collectives pair up as in forward.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

Combine = Callable[[torch.Tensor], torch.Tensor]


class LocalDispatch:
    """Every expert on this rank: the copies go to the experts as they are."""

    def __call__(self, rows: torch.Tensor, probs: torch.Tensor,
                 counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Combine]:
        return rows, probs, counts, lambda y: y


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over `group` with explicit splits; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class AllToAllDispatch:
    """The copies of this rank's tokens sent to the ranks holding their experts, and back (see the
    module docstring). `counts` are per global expert; what it returns is per local expert."""

    def __init__(self, group, num_experts: int):
        self.group = group
        self.size = dist.get_world_size(group)
        self.local_experts = num_experts // self.size

    def __call__(self, rows: torch.Tensor, probs: torch.Tensor,
                 counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Combine]:
        ep, local = self.size, self.local_experts
        received = torch.empty_like(counts)  # [source rank, my local expert], flattened
        dist.all_to_all_single(received, counts, group=self.group)
        send, recv = torch.stack([counts.view(ep, local).sum(1), received.view(ep, local).sum(1)]).tolist()
        rows = _AllToAll.apply(rows, recv, send, self.group)
        probs = _AllToAll.apply(probs, recv, send, self.group)
        # Arrivals are rank-major; the grouped matmul wants them expert-major (each expert's rows
        # together, tokens of lower ranks first): a stable sort by local expert.
        expert = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(
            received.long(), output_size=rows.shape[0])
        order = expert.argsort(stable=True)
        inverse = order.argsort()

        def combine(y: torch.Tensor) -> torch.Tensor:
            return _AllToAll.apply(y.index_select(0, inverse), send, recv, self.group)

        return (rows.index_select(0, order), probs.index_select(0, order),
                received.view(ep, local).sum(0), combine)


def expert_parallel_groups(ep: int) -> tuple[object, object | None]:
    """(this rank's expert-parallel group, its expert-data-parallel group or None) as Megatron lays
    them out with tensor and pipeline parallel 1: ep consecutive ranks share one copy of the
    experts; ranks ep apart hold the same experts and reduce their gradients. Every rank creates
    every group, in the same order (new_group is collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for first in range(0, world, ep):
        group = dist.new_group(list(range(first, first + ep)))
        if first <= rank < first + ep:
            mine = group
    replicas = None
    if world > ep:
        for j in range(ep):
            group = dist.new_group(list(range(j, world, ep)))
            if rank % ep == j:
                replicas = group
    return mine, replicas


class ExpertRows:
    """What a rank's expert weight holds of the whole model's: experts `rows` (a slice of dim 0) of a
    weight of `whole_shape`. `GPT.init_weights` draws the whole weight, as one rank does, and keeps
    these rows, so the weights equal a single-rank build's."""

    def __init__(self, rows: slice, whole_shape: torch.Size):
        self.rows, self.whole_shape = rows, torch.Size(whole_shape)


def shard_experts(model: nn.Module, group) -> None:
    """Keep this rank's `num_moe_experts / ep` experts of every MoE layer and dispatch to them by
    all-to-all. On the meta device, before the model is materialised (as the tensor-parallel and
    FSDP builds split it), so a rank allocates its own experts only: mixtral-8x7b's are 93 GB in
    bf16 on one rank. Each expert weight is marked with the rows it holds (`ExpertRows`, its
    `init_rows`), which `GPT.init_weights` draws; `expert_weights` lists them once materialised."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    for layer in model.layers:
        moe = layer.mlp
        if not hasattr(moe, "dispatch"):
            continue
        moe.dispatch = AllToAllDispatch(group, moe.num_experts)
        local = moe.num_experts // ep
        for linear in (moe.experts.linear_fc1, moe.experts.linear_fc2):
            whole = linear.weight
            if not whole.is_meta:
                raise ValueError("shard_experts slices the experts of a model on the meta device (build it there)")
            linear.init_rows = ExpertRows(slice(rank * local, (rank + 1) * local), whole.shape)
            linear.weight = nn.Parameter(torch.empty((local, *whole.shape[1:]), dtype=whole.dtype, device="meta"))


def expert_weights(model: nn.Module) -> list[nn.Parameter]:
    """The routed-expert weights `shard_experts` left this rank (not replicated over the data-parallel ranks)."""
    return [linear.weight for layer in model.layers if isinstance(getattr(layer.mlp, "dispatch", None), AllToAllDispatch)
            for linear in (layer.mlp.experts.linear_fc1, layer.mlp.experts.linear_fc2)]
