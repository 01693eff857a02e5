"""What tests/test_pipeline.py runs on each of 2 ranks under torchrun, in one launch (a launch costs
far more than a tiny point): for each pipeline point, its measurement with `run_point` (this rank's
entry and the estimated stages) and the step's loss and gradients gathered through torch's schedule
(`measure.pipeline.pipeline_loss_and_grads`), compared on rank 0 with one rank running every
micro-batch alone. Writes OUT/rank<N>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from helpers import config
from recompute_bench.measure.distributed import init_process_group
from recompute_bench.measure.pipeline import PipelineParallel, pipeline_loss_and_grads
from recompute_bench.measure.point import run_point
from recompute_bench.measure.verify import loss_and_grads, max_grad_diff


def main(out: Path, points: dict[str, list[str]]) -> None:
    device = torch.device("cpu")
    init_process_group(device, 120.0)
    results = {}
    for name, sets in points.items():
        cfg = config(sets=sets)
        record = run_point(cfg, device=device, layout=PipelineParallel("ddp", cfg, device.type))
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.num_microbatches, cfg.training.micro_batch_size,
                                                         cfg.training.seq_length + 1), generator=g)
        loss, grads = pipeline_loss_and_grads(cfg, tokens, device, PipelineParallel("ddp", cfg, device.type))
        result = {"entry": record["ranks"][0], "estimated_stages": record["metrics"]["estimated_stages"]}
        if dist.get_rank() == 0:
            alone = [loss_and_grads(cfg, cfg.recompute, t, device) for t in tokens]
            alone_loss = sum(a[0] for a in alone) / len(alone)
            alone_grads = {n: sum(a[1][n] for a in alone) / len(alone) for n in alone[0][1]}
            worst, worst_name = max_grad_diff(alone_grads, grads)
            result.update(loss_diff=(loss - alone_loss).abs().item(), max_grad_diff=worst, worst_parameter=worst_name,
                          max_grad=max(g.abs().max().item() for g in alone_grads.values()))
        results[name] = result
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
