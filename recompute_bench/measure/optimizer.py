"""The optimizer a point steps: Megatron's fp32 main gradients (`MainGrads`) and Adam on them
(`MainGradAdam`), with fp32 master weights under bf16/fp16.

Per parameter held: 2 (16-bit weight) + 4 (main gradient) + 4 (master weight) + 8 (Adam's two
moments) = 18 bytes under bf16/fp16, 16 in fp32 (`analysis.harness.rank.optimizer_bytes_per_parameter`
counts the same). The data-parallel reduction of the main gradients is `measure.data_parallel.BucketedGrads`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from recompute_bench.backends.main_grad_linear import FUSED_DEVICES, fusable_weights
from recompute_bench.backends.pytorch import local


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of p's gradient, laid out as p is: a partial sum (the gradient of a replicated
    weight applied to a sequence-parallel shard) is all-reduced first."""
    g = p.grad
    if hasattr(g, "placements") and g.placements != p.placements:
        g = g.redistribute(p.device_mesh, p.placements)
    return local(g)


def make_adam(params: list[torch.Tensor], lr: float) -> torch.optim.Adam:
    """torch's Adam with its fused kernel where torch has one for the device (CUDA and CPU do),
    else the foreach implementation: one multi-tensor kernel per update, no Python loop over
    parameters, and (fused) no temporaries the size of the parameters."""
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except RuntimeError:  # "fused=True requires all the params to be floating point Tensors of supported devices"
        return torch.optim.Adam(params, lr=lr, foreach=True)


class MainGrads:
    """Megatron's gradient buffer: one flat fp32 tensor holding every parameter's main gradient
    (`p.main_grad`, a view of it, Megatron's name). As soon as autograd has accumulated a
    parameter's gradient, a post-accumulate-grad hook adds it into the main gradient and frees it
    (megatron/core/distributed/distributed_data_parallel.py, `DistributedDataParallel._make_backward_post_hook`),
    so micro-batches accumulate in fp32 and at most one parameter's own gradient exists at a time:
    4 bytes per parameter held, in every precision. A DTensor (tensor-parallel) parameter takes part
    through its local shard. One rank reduces nothing (`measure.data_parallel.BucketedGrads` reduces
    over the data-parallel ranks).

    The weights in `fused` (`backends.main_grad_linear.fusable_weights`) get no gradient from their
    linear: its weight-gradient matmul accumulates into the main gradient (Megatron's
    gradient_accumulation_fusion); the hook still runs, adds what other uses gave, if any, and
    marks the weight ready."""

    def __init__(self, params: list[torch.nn.Parameter], fused: set[int] = frozenset()):
        self.params = params
        self.data = torch.zeros(sum(local(p).numel() for p in params), dtype=torch.float32, device=params[0].device)
        offset = 0
        for p in params:
            mine = local(p)
            p.main_grad = self.data[offset:offset + mine.numel()].view_as(mine)
            p.register_post_accumulate_grad_hook(self._accumulate)
            p.fuse_wgrad = id(p) in fused
            offset += mine.numel()

    @torch.no_grad()
    def _accumulate(self, p: torch.nn.Parameter) -> None:
        if p.grad is not None:  # None: a fused weight's linear accumulated into main_grad itself
            p.main_grad.add_(local_grad(p))  # fp32 += 16-bit, computed in fp32
        p.grad = None  # the parameter's own gradient is not kept
        self.ready(p)

    def ready(self, p: torch.nn.Parameter) -> None:
        """p's gradient of this backward is in its main gradient."""

    def no_sync(self) -> AbstractContextManager:
        """Around the micro-batches whose gradients are only accumulated: all of them here."""
        return nullcontext()

    def finish(self) -> None:
        """Make the step's main gradients complete before the optimizer reads them: they are, on one rank."""


class MainGradAdam:
    """Adam on the main gradients (`MainGrads`), as Megatron's optimizers read them. Under bf16/fp16:
    16-bit weights for compute, fp32 master weights in one flat buffer that Adam (fused where
    available) updates with the flat main gradients as its `.grad`, then one foreach copy into the
    16-bit weights: 2 + 4 + 4 + 8 = 18 bytes held per parameter. In fp32 the weights are the master
    weights, updated in place with their main gradients: 4 + 4 + 8 = 16."""

    def __init__(self, grads: MainGrads, precision: str, lr: float = 1e-4):
        self.grads = grads
        self.master: torch.Tensor | None = None
        """The flat fp32 master weights (None in fp32: the weights themselves)."""
        if precision == "fp32":
            self.master_params = [local(p) for p in grads.params]
            self.adam = make_adam(self.master_params, lr)
            return
        self.master = torch.empty_like(grads.data)
        self.master_params = []
        """Each parameter's fp32 master weights (a view of `master`), in `grads.params` order."""
        offset = 0
        for p in grads.params:
            mine = local(p)
            master = self.master[offset:offset + mine.numel()].view_as(mine)
            master.copy_(mine.detach())
            self.master_params.append(master)
            offset += mine.numel()
        self.master.grad = grads.data  # Adam reads the main gradients where they are: no copy
        self.adam = make_adam([self.master], lr)

    def step(self) -> None:
        """Complete the main gradients (`grads.finish`), update the master weights from them, copy
        them into the 16-bit weights, and zero the main gradients for the next step."""
        self.grads.finish()
        if self.master is None:
            for mine, p in zip(self.master_params, self.grads.params):
                mine.grad = p.main_grad
            self.adam.step()
            for mine in self.master_params:
                mine.grad = None  # else the next backward would accumulate into the main gradient itself
        else:
            self.adam.step()
            with torch.no_grad():  # one multi-tensor copy, fp32 -> 16-bit
                torch._foreach_copy_([local(p) for p in self.grads.params], self.master_params)
        self.grads.data.zero_()


def make_optimizer(model: torch.nn.Module, precision: str, lr: float = 1e-4,
                   fused_devices: tuple[str, ...] = FUSED_DEVICES) -> MainGradAdam:
    """The optimizer `run_point` steps on one rank: Adam on fp32 main gradients (18 bytes per
    parameter under bf16/fp16, 16 in fp32), the linears' weight gradients accumulated into them in
    their matmul on `fused_devices`."""
    params = [p for p in model.parameters() if p.requires_grad]
    return MainGradAdam(MainGrads(params, fusable_weights(model, fused_devices)), precision, lr)
