"""What tests/test_tensor_parallel.py runs on each of 2 ranks under torchrun, in one launch (a launch
costs far more than a tiny point): tensor-parallel points measured with `run_point`, and for other
points one micro-batch's loss and gradients gathered into the single-rank layout, compared on rank 0
with one rank computing them alone. Writes OUT/rank<N>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from helpers import config
from recompute_bench.measure.data_parallel import DataParallel, gathered_loss_and_grads
from recompute_bench.measure.distributed import init_process_group
from recompute_bench.measure.point import run_point
from recompute_bench.measure.verify import max_grad_diff, loss_and_grads

Points = dict[str, tuple[str, list[str]]]


def main(out: Path, measured: Points, gathered: Points) -> None:
    device = torch.device("cpu")
    init_process_group(device, 120.0)
    results = {}
    for name, (workload, sets) in measured.items():
        cfg = config(workload, sets=sets)
        record = run_point(cfg, device=device, layout=DataParallel("ddp", cfg, device.type))
        results[name] = {"status": record["ranks"][0]["status"], "failure": record["ranks"][0]["failure"],
                         "losses": record["ranks"][0]["losses"], "metrics": record["metrics"]}
    for name, (workload, sets) in gathered.items():
        cfg = config(workload, sets=sets)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.training.micro_batch_size, cfg.training.seq_length + 1),
                               generator=g)
        loss, grads = gathered_loss_and_grads(cfg, tokens, device, DataParallel("ddp", cfg, device.type))
        alone_loss, alone_grads = loss_and_grads(cfg, cfg.recompute, tokens, device)
        worst, worst_name = max_grad_diff(alone_grads, grads)
        results[name] = {"loss_diff": (loss - alone_loss).abs().item(), "max_grad_diff": worst,
                         "worst_parameter": worst_name, "max_grad": max(g.abs().max().item() for g in alone_grads.values())}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]))
