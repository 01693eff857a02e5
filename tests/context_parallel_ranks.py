"""What tests/test_context_parallel_ranks.py runs on each rank under torchrun, in one launch (a launch
costs far more than a tiny point): context-parallel points measured with `run_point` under their
layout (`measure.distributed.make_layout`), and for other points one micro-batch's loss and
gradients gathered into the single-rank layout, compared on rank 0 with one rank computing them
alone. Writes OUT/rank<N>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from helpers import config
from recompute_bench.launch.torchrun import Launch, check_launch
from recompute_bench.measure.data_parallel import gathered_loss_and_grads
from recompute_bench.measure.distributed import init_process_group, make_layout
from recompute_bench.measure.point import run_point
from recompute_bench.measure.verify import loss_and_grads, max_grad_diff

Points = dict[str, tuple[str, str, list[str]]]  # name -> (workload, data parallel, --set items)


def main(out: Path, measured: Points, gathered: Points) -> None:
    device = torch.device("cpu")
    init_process_group(device, 120.0)
    world = dist.get_world_size()
    results = {}
    for name, (workload, kind, sets) in measured.items():
        cfg = check_launch(config(workload, sets=sets), Launch(nproc_per_node=world, data_parallel=kind), "cpu")
        record = run_point(cfg, device=device, layout=make_layout(kind, cfg, device.type))
        rank = record["ranks"][0]
        results[name] = {"status": rank["status"], "failure": rank["failure"], "losses": rank["losses"],
                         "rank_entry": rank, "metrics": record["metrics"], "env": record["env"]}
    for name, (workload, kind, sets) in gathered.items():
        cfg = check_launch(config(workload, sets=sets), Launch(nproc_per_node=world, data_parallel=kind), "cpu")
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.training.micro_batch_size, cfg.training.seq_length + 1),
                               generator=g)
        loss, grads = gathered_loss_and_grads(cfg, tokens, device, make_layout(kind, cfg, device.type))
        alone_loss, alone_grads = loss_and_grads(cfg, cfg.recompute, tokens, device)
        worst, worst_name = max_grad_diff(alone_grads, grads)
        results[name] = {"loss_diff": (loss - alone_loss).abs().item(), "loss": alone_loss.item(), "max_grad_diff": worst,
                         "worst_parameter": worst_name, "max_grad": max(g.abs().max().item() for g in alone_grads.values())}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]))
