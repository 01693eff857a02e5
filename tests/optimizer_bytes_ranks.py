"""What tests/test_optimizer_bytes.py runs on each of 4 gloo ranks under torchrun, one launch for
every layout: two training steps of two micro-batches per rank, reading back from the live objects
(`helpers.held_bytes`) what the rank holds after the first micro-batch's backward of the second
step and when its optimizer step begins, the collectives of that step, and (fp32 layouts without
model parallelism) the gradients the update reads, next to one rank's over the same global batch.
Writes OUT/rank<N>.json."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import all_gathered, config, fsdp_param_groups, held_bytes, storage_bytes
from torch.utils._python_dispatch import TorchDispatchMode

from recompute_bench.analysis.harness.rank import fsdp_unsharded_bytes, is_fsdp, optimizer_bytes_per_parameter
from recompute_bench.analysis.harness.stage import stage_parameters
from recompute_bench.backends.pytorch import local
from recompute_bench.measure import data_parallel
from recompute_bench.measure.data_parallel import DataParallel
from recompute_bench.measure.distributed import init_process_group
from recompute_bench.measure.layout import SingleRank
from recompute_bench.measure.step import Stepper

CPU = torch.device("cpu")


class Counted:
    """Counts the calls of `torch.distributed.<name>` (FSDP2 reduce-scatters with
    `reduce_scatter_single`, `_fsdp_collectives.DefaultReduceScatter`) while `counting` is set."""

    def __init__(self, name: str):
        self.name, self.real, self.calls, self.counting = name, getattr(dist, name), 0, False
        setattr(dist, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += self.counting
        return self.real(*args, **kwargs)


COLLECTIVES = [Counted("reduce_scatter_single"), Counted("all_reduce")]


@contextmanager
def update_reads(optimizer):
    """Inside: the optimizer's step records the gradients its update reads, whole, one per parameter
    in `model.parameters()` order: main gradients once reduced (Megatron's scheme, read where Adam
    reads them), FSDP's sharded gradients gathered."""
    read: list[torch.Tensor] = []
    if hasattr(optimizer, "adam"):  # MainGradAdam
        owner, params = optimizer.adam, optimizer.grads.params
        grads = lambda: [p.main_grad.clone() for p in params]  # noqa: E731
    else:
        owner, params = optimizer, [p for group in optimizer.param_groups for p in group["params"]]
        grads = lambda: [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone() for p in params]  # noqa: E731
    inner = owner.step

    def step(*args, **kwargs):
        read.extend(zip(params, grads()))
        return inner(*args, **kwargs)

    owner.step = step
    try:
        yield read
    finally:
        del owner.step


class AllGatheredPeak(TorchDispatchMode):
    """The most bytes of FSDP's all-gathered weights alive after any op of a backward."""

    def __init__(self, model, stepper: Stepper):
        super().__init__()
        self.groups, self.stepper, self.peak = fsdp_param_groups(model), stepper, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.stepper.phase == "backward":
            self.peak = max(self.peak, storage_bytes(t for g in self.groups for t in all_gathered(g)))
        return out


def run(cfg, kind: str | None) -> dict:
    """Two steps of `cfg` under `kind` (None: one rank alone): the gradients the first one's update
    reads and the collectives it runs, what the second one holds."""
    layout = DataParallel(kind, cfg, "cpu") if kind else SingleRank()
    model = layout.build(cfg, CPU)
    model.train()
    optimizer = layout.optimizer(model, cfg.training.precision)
    stepper = Stepper(cfg, model, optimizer, layout.batches(cfg, CPU), lambda: layout.no_sync(model, optimizer))
    torch.manual_seed(cfg.training.seed)
    out = {"parameters_local": sum(local(p).numel() for p in model.parameters())}
    grads = getattr(optimizer, "grads", None)
    finish = getattr(grads, "finish", None)
    if finish:
        def watched_finish():
            out["buckets_started_in_backward"] = len(getattr(grads, "handles", ()))
            finish()
        grads.finish = watched_finish
    with update_reads(optimizer) as read:
        for c in COLLECTIVES:
            c.calls, c.counting = 0, True
        stepper.step()
        for c in COLLECTIVES:
            c.counting = False
            out[c.name] = c.calls
    if finish:
        del grads.finish
        out["buckets"] = len(getattr(grads, "buckets", ()))
    by_param = {id(p): g for p, g in read}
    out["grads"] = {n: by_param[id(p)] for n, p in model.named_parameters()}

    # The second step (Adam's state exists now): after the first micro-batch's backward, and when
    # the optimizer step begins.
    no_sync = stepper.no_sync

    @contextmanager
    def watched():
        with no_sync():
            yield
        out["after_first_microbatch"] = held_bytes(model, optimizer)

    stepper.no_sync = watched
    step = optimizer.step

    def watched_step():
        out["at_step"] = held_bytes(model, optimizer)
        step()

    optimizer.step = watched_step
    with AllGatheredPeak(model, stepper) as peak:
        stepper.step()
    out["all_gathered_peak_in_backward"] = peak.peak
    return out


def main(out: Path, layouts: dict[str, tuple[str, str, list[str], int | None]]) -> None:
    init_process_group(CPU, 120.0)
    results = {}
    default_bucket = data_parallel.BUCKET_PARAMETERS
    for name, (kind, workload, sets, bucket_parameters) in layouts.items():
        cfg = config(workload, sets=sets)
        data_parallel.BUCKET_PARAMETERS = bucket_parameters or default_bucket
        mine = run(cfg, kind)
        grads = mine.pop("grads")
        result = {**mine, "held": [h.__dict__ for h in optimizer_bytes_per_parameter(cfg)],
                  "parameters": stage_parameters(cfg, 0), "num_microbatches": cfg.num_microbatches,
                  "fsdp_shards": cfg.parallel.data_parallel_size * cfg.parallel.context_parallel_size if is_fsdp(cfg) else 1,
                  "fsdp_unsharded": fsdp_unsharded_bytes(cfg)}
        if cfg.training.precision == "fp32" and cfg.parallel.tensor_model_parallel_size == 1 and \
                cfg.parallel.expert_model_parallel_size == 1:
            alone_cfg = config(workload, sets=[*sets, "parallel.data_parallel_size=1",
                                               "parallel.use_distributed_optimizer=false"])
            alone = run(alone_cfg, None)["grads"] if dist.get_rank() == 0 else None
            if alone is not None:
                worst = max(((grads[n] - alone[n]).abs().max() / alone[n].abs().max().clamp_min(1e-30)).item()
                            for n in alone)
                result["max_relative_grad_diff"] = worst
                result["grad_names_match"] = sorted(alone) == sorted(grads)
        results[name] = result
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
