"""The data-parallel layouts of a multi-rank point: DDP (Megatron's) and FSDP2, with tensor, context
and expert parallel inside them.

- `DataParallel("ddp")`: Megatron's data parallelism, the whole model on every rank in the training
  precision: each gradient is added into the optimizer's flat fp32 main-gradient buffer and freed
  (`optimizer.MainGrads`), and the buffer is all-reduced in place, bucket by bucket, during the last
  micro-batch's backward (`BucketedGrads`); earlier micro-batches only accumulate. Nothing else is
  held: 18 bytes per parameter under bf16/fp16 (2 + 4 + 4 + 8), 16 in fp32, as on one rank.
- `DataParallel("fsdp")`: FSDP2, `fully_shard` on every transformer layer and then on the root,
  after recompute is installed (torchtitan's order: TP -> AC -> compile -> FSDP). Weights, fp32
  gradients and Adam's state are sharded over the ranks (`use_distributed_optimizer` is what
  FSDP does); under bf16/fp16 the sharded weights are fp32 and FSDP casts them to the training
  precision for compute (`MixedPrecisionPolicy`), reducing gradients in fp32. Micro-batches before
  the last do not reduce-scatter (`set_requires_gradient_sync(False)`): FSDP keeps their unsharded
  gradients, in fp32, until the last micro-batch's backward reduce-scatters once per layer.

Under context parallel (`measure.context_parallel`) the ranks form a (dp, cp, tp) mesh: the cp ranks
of a replica share its micro-batches, each works on its part of every sequence, and gradients are
reduced (DDP) or sharded (FSDP2) over dp x cp.

Each rank takes its own micro-batches of the global batch (micro-batch x data-parallel size x
accumulation), so the step's loss, averaged over the ranks, is the single-rank loss of the
same global batch. Pipeline stages over these layouts are `measure.pipeline`'s.
"""

from __future__ import annotations

import dataclasses
import statistics
from contextlib import AbstractContextManager, contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from recompute_bench.backends.main_grad_linear import fusable_weights
from recompute_bench.backends.pytorch import local
from recompute_bench.measure.layout import DTYPES, SingleRank
from recompute_bench.measure.optimizer import MainGradAdam, MainGrads, make_adam
from recompute_bench.measure.step import synthetic_batches
from recompute_bench.config.schema import Config

DATA_PARALLEL = ("ddp", "fsdp")


class DataParallel(SingleRank):
    """The model on every rank (or on every tensor-parallel group, `measure.tensor_parallel`), the
    global batch split over the data-parallel ranks (DDP or FSDP2), each sequence over the
    context-parallel ones (`measure.context_parallel`)."""

    def __init__(self, kind: str, cfg: Config | None = None, device_type: str = "cpu"):
        if kind not in DATA_PARALLEL:
            raise ValueError(f"data parallel kind {kind!r} is not one of {DATA_PARALLEL}")
        self.kind = kind
        self.device_type = device_type
        """Where this rank's tensors live, and so every tensor it hands a collective: an NCCL group
        maps only "cuda" (torch/distributed/distributed_c10d.py, `BackendConfig`), so a CPU tensor
        there fails with "No backend type associated with device type cpu"."""
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        tp = cfg.parallel.tensor_model_parallel_size if cfg is not None else 1
        cp = cfg.parallel.context_parallel_size if cfg is not None else 1
        self.tensor = self.context = None
        mesh = grad_mesh = None
        if cp > 1:  # a (dp, cp, tp) mesh (`measure.context_parallel`)
            from recompute_bench.measure.context_parallel import ContextParallel, layout_mesh
            mesh, grad_mesh = layout_mesh(device_type, dp=self.world_size // (cp * tp), cp=cp, tp=tp)
            self.context = ContextParallel(cfg, mesh)
        if tp > 1:
            from recompute_bench.measure.tensor_parallel import TensorParallel
            self.tensor = TensorParallel(tp, cfg.parallel.sequence_parallel, device_type, mesh)
        self.dp_size, self.dp_rank = self.world_size // (tp * cp), self.rank // (tp * cp)
        self.grad_ranks = self.dp_size * cp
        """The ranks this rank's gradients are reduced over: data x context parallel (dp x cp)."""
        self.grad_mesh = grad_mesh if mesh is not None else self.tensor.dp_mesh if self.tensor else None
        """Their mesh (None: every rank, the world, when neither tensor nor context parallel splits it)."""
        self.ep = cfg.parallel.expert_model_parallel_size if cfg is not None else 1
        self.experts: list[torch.nn.Parameter] = []
        """This rank's routed-expert weights under expert parallel (reduced over the ranks holding
        the same experts only)."""
        self.ep_group = self.expert_dp_group = None
        if self.ep > 1:
            from recompute_bench.models.moe.dispatch import expert_parallel_groups
            self.ep_group, self.expert_dp_group = expert_parallel_groups(self.ep)

    @property
    def tensor_group(self):
        return self.tensor.group if self.tensor else None

    def split(self, model: torch.nn.Module) -> torch.nn.Module:
        """This rank's part of the model, on the meta device: its tensor-parallel shards, under
        expert parallel its experts (`moe.dispatch.shard_experts`), under context parallel its
        attention across the split."""
        model = self.tensor.parallelize(model) if self.tensor else model
        if self.ep > 1:
            from recompute_bench.models.moe.dispatch import shard_experts
            shard_experts(model, self.ep_group)
        return self.context.parallelize(model) if self.context else model

    @property
    def splits(self) -> bool:
        return (self.tensor is not None or self.context is not None or (self.kind == "fsdp" and self.grad_ranks > 1)
                or self.ep > 1)

    def build(self, cfg: Config, device: torch.device, dtype: torch.dtype | None = None) -> torch.nn.Module:
        if self.grad_ranks > 1 and self.kind == "ddp":  # the whole model on every rank, but its experts under ep
            model = super().build(cfg, device, dtype)  # cut on the meta device, then materialised (`splits`)
            if self.ep > 1:
                from recompute_bench.models.moe.dispatch import expert_weights
                self.experts = expert_weights(model)
            return model
        if self.grad_ranks > 1:  # FSDP: fp32 sharded weights, cast for compute (`shard`)
            dtype = torch.float32
        return super().build(cfg, device, dtype)

    def shard(self, model: torch.nn.Module, cfg: Config) -> torch.nn.Module:
        """FSDP2 over the data-parallel ranks (x the context-parallel ones): every layer, then the root
        (on the meta device, before anything is allocated)."""
        if self.kind != "fsdp" or self.grad_ranks == 1:
            return model
        return fsdp_shard(model, cfg, self.grad_mesh)

    def whole_expert_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """Every expert's gradient of one weight, gathered from the expert-parallel group."""
        parts = [torch.empty_like(grad) for _ in range(self.ep)]
        dist.all_gather(parts, grad.contiguous(), group=self.ep_group)
        return torch.cat(parts)

    def num_parameters(self, model: torch.nn.Module) -> int:
        """The whole model's parameters: each rank holds 1 / ep of the routed experts."""
        return super().num_parameters(model) + (self.ep - 1) * sum(p.numel() for p in self.experts)

    @property
    def reduces_main_grads(self) -> bool:
        """Whether gradients are reduced in the optimizer's main-gradient buffer (DDP), not in `.grad`."""
        return self.kind == "ddp" and self.grad_ranks > 1

    def optimizer(self, model: torch.nn.Module, precision: str):
        params = [p for p in model.parameters() if p.requires_grad]
        if self.kind == "fsdp" and self.grad_ranks > 1:
            return make_adam(params, 1e-4)  # fp32 sharded weights, gradients and state (the distributed optimizer)
        if not self.reduces_main_grads:  # tensor parallel only: DTensor shards and replicas, one rank's way
            return MainGradAdam(MainGrads(params), precision)
        # Megatron's expert parallel: expert gradients are reduced over the expert-data-parallel group
        # (ranks holding the same experts; none when ep is the world), every other one over all ranks.
        # Each group's parameters in backward order (the reverse of the forward's), as Megatron lays out its buffers.
        experts = {id(p) for p in self.experts}
        dense = [p for p in params if id(p) not in experts]
        ordered = dense[::-1] + [p for p in params if id(p) in experts][::-1]
        dense_group = self.grad_mesh.get_group() if self.grad_mesh is not None else dist.group.WORLD
        groups = [dense_group] * len(dense) + [self.expert_dp_group] * (len(ordered) - len(dense))
        return MainGradAdam(BucketedGrads(ordered, groups, self.grad_ranks, BUCKET_PARAMETERS,
                                          fusable_weights(model)), precision)

    def no_sync(self, model: torch.nn.Module, optimizer) -> AbstractContextManager:
        """Around a micro-batch but the last: DDP accumulates into the main gradients without
        reducing them; FSDP keeps the unsharded gradients instead of reduce-scattering them."""
        if self.kind == "fsdp" and self.grad_ranks > 1:
            return _fsdp_no_sync(model)
        return optimizer.grads.no_sync()

    def batches(self, cfg: Config, device: torch.device) -> torch.Tensor:
        """Micro-batches r, r + dp, r + 2 dp, ... of the global batch's, r this rank's data-parallel
        rank (every rank of a tensor-parallel group takes the same)."""
        p = cfg.parallel
        whole = dataclasses.replace(cfg, parallel=dataclasses.replace(p, data_parallel_size=1))
        return synthetic_batches(whole, device)[self.dp_rank::self.dp_size].contiguous()

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        value = value.detach().clone()
        dist.all_reduce(value)
        return value / self.world_size

    def world_flops(self, local_flops: int) -> int:
        """The step's FLOPs over every rank: under context parallel their sum (each rank's attention
        blocks are its own), else this rank's times the world."""
        if self.context is None:
            return super().world_flops(local_flops)
        return self.summed_flops(local_flops)

    def summed_flops(self, local_flops: int) -> int:
        """Every rank's FLOPs summed, on this rank's device (NCCL reduces CUDA tensors only; "cuda"
        is the current GPU, which `rank_device` set)."""
        total = torch.tensor(float(local_flops), dtype=torch.float64, device=self.device_type)
        dist.all_reduce(total)
        return int(total.item())

    def place(self) -> dict:
        """This rank's context-parallel rank, when it has one."""
        return self.context.place() if self.context else {}

    def barrier(self) -> None:
        """Every rank waits here for the others (NCCL: the host waits for the barrier's kernel too,
        `WorkNCCL::wait` on a barrier op), so a timed step starts on every rank at once."""
        dist.barrier()

    def slowest(self, times: list[float]) -> tuple[list[float], float | None]:
        """Each step's time on its slowest rank (the one every other rank waited for at the step's
        collectives) and the median over steps of slowest minus fastest, gathered once the timed
        steps are over."""
        every: list[list[float] | None] = [None] * self.world_size
        dist.all_gather_object(every, list(times))
        steps = list(zip(*every))
        return [max(s) for s in steps], statistics.median(max(s) - min(s) for s in steps) if steps else None


def fsdp_shard(model: torch.nn.Module, cfg: Config, mesh, reshard_after_forward: bool = True) -> torch.nn.Module:
    """FSDP2 on every transformer layer of `model`, then on `model` itself, over `mesh` (None: every
    rank): fp32 shards, compute in the training precision, gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[cfg.training.precision], reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


BUCKET_PARAMETERS = 40_000_000
"""Parameters per gradient bucket. Megatron's default when the reduction overlaps the backward is
max(40M, 1M x dp) (megatron/core/distributed/distributed_data_parallel.py,
`DistributedDataParallel.__init__`): the same up to 40 data-parallel ranks."""


class BucketedGrads(MainGrads):
    """Megatron's data-parallel gradient reduction, in place on the main-gradient buffer
    (megatron/core/distributed/param_and_grad_buffer.py: `_ParamAndGradBuffer` cuts the buffer into
    buckets; `_ParamAndGradBucketGroup.register_grad_ready` starts a bucket's reduction when its last
    gradient is in, `start_grad_sync` scales it by the gradient scaling factor 1/dp and all-reduces it
    (sum), `finish_grad_sync` waits). Buckets are runs of whole parameters of the buffer, at most about
    `bucket_parameters` each, never mixing process groups. On the micro-batch that synchronises, each
    bucket's all-reduce starts asynchronously as soon as its parameters' gradients are accumulated,
    overlapping the rest of the backward; `finish` starts any bucket still waiting (a parameter that
    got no gradient) and waits for all. Under `no_sync` gradients are only accumulated. The buffer is
    the communication buffer: no bucket copy, nothing held beyond the 4 bytes per parameter."""

    def __init__(self, params: list[torch.nn.Parameter], groups: list, dp_size: int, bucket_parameters: int,
                 fused: set[int] = frozenset()):
        super().__init__(params, fused)
        self.scale = 1.0 / dp_size
        self.sync = True
        self.buckets: list[tuple[slice, object, set[int]]] = []
        """(its slice of the buffer, its process group or None for nothing to reduce, its parameters' ids)."""
        self.bucket_of: dict[int, int] = {}
        start = offset = 0
        members: set[int] = set()
        for i, (p, group) in enumerate(zip(params, groups)):
            members.add(id(p))
            self.bucket_of[id(p)] = len(self.buckets)
            offset += local(p).numel()
            if i + 1 == len(params) or groups[i + 1] is not group or offset - start >= bucket_parameters:
                self.buckets.append((slice(start, offset), group, members))
                start, members = offset, set()
        self.waiting = [set(b[2]) for b in self.buckets]
        self.handles: dict[int, object] = {}
        """Bucket index -> its all-reduce in flight (None for a bucket with nothing to reduce)."""

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def ready(self, p: torch.nn.Parameter) -> None:
        if not self.sync:
            return
        b = self.bucket_of[id(p)]
        if b in self.handles:
            raise RuntimeError(f"a gradient of {tuple(p.shape)} arrived after its bucket was reduced")
        self.waiting[b].discard(id(p))
        if not self.waiting[b]:
            self._start(b)

    def _start(self, b: int) -> None:
        where, group, _ = self.buckets[b]
        bucket = self.data[where]
        bucket.mul_(self.scale)  # Megatron's gradient_scaling_factor (1/dp), then a sum over the group
        self.handles[b] = dist.all_reduce(bucket, group=group, async_op=True) if group is not None else None

    def finish(self) -> None:
        for b in range(len(self.buckets)):
            if b not in self.handles:
                self._start(b)
        for handle in self.handles.values():
            if handle is not None:
                handle.wait()
        self.handles.clear()
        self.waiting = [set(b[2]) for b in self.buckets]


@contextmanager
def _fsdp_no_sync(model: torch.nn.Module) -> Iterator[None]:
    """FSDP2 without reduce-scatter: each layer keeps its unsharded gradient in the fp32 reduce dtype
    (a 16-bit one upcast, torch/distributed/fsdp/_fully_shard/_fsdp_param.py `to_accumulated_grad_if_needed`;
    the next micro-batch adds into it, `accumulate_unsharded_grad_if_needed`) until a backward with
    gradient sync reduce-scatters the sum (`_fsdp_param_group.py`, `FSDPParamGroup.post_backward`)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def gathered_loss_and_grads(cfg: Config, tokens: torch.Tensor, device: torch.device,
                            layout: DataParallel) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """This rank's micro-batch forward and backward under `layout`: the loss averaged over the ranks
    and every gradient whole (DDP's all-reduced ones; FSDP's and tensor parallel's shards and the
    experts of expert parallel gathered, in the single-rank layout), by parameter name. Dropout is
    seeded with the training seed before the micro-batch, on every rank."""
    model = layout.build(cfg, device)
    model.train()
    main_grads = layout.optimizer(model, cfg.training.precision).grads if layout.reduces_main_grads else None
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.training.seed)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
    if main_grads:
        main_grads.finish()
    experts = {id(p) for p in layout.experts}
    grads = {}
    for name, p in model.named_parameters():
        g = p.main_grad if main_grads else p.grad
        if main_grads and hasattr(p, "device_mesh"):  # a tensor-parallel weight's main gradient is its local shard
            from torch.distributed.tensor import DTensor
            g = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False)
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        elif g is not None and id(p) in experts:
            g = layout.whole_expert_grad(g)
        if g is not None and layout.tensor:
            g = layout.tensor.whole(name, g, cfg)
        grads[name] = g
    return layout.mean(loss), grads
