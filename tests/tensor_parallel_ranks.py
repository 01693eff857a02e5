"""What tests/test_tensor_parallel.py runs on each of 2 ranks under torchrun: several tensor-parallel
points measured in one launch (a launch costs far more than a tiny point). Writes OUT/rank<N>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from conftest import config
from recompute_bench.measure.distributed import DataParallel, init_process_group
from recompute_bench.measure.point import run_point


def main(out: Path, points: dict[str, tuple[str, list[str]]]) -> None:
    device = torch.device("cpu")
    init_process_group(device, 120.0)
    results = {}
    for name, (workload, sets) in points.items():
        cfg = config(workload, sets=sets)
        record = run_point(cfg, device=device, layout=DataParallel("ddp", cfg, device.type))
        results[name] = {"status": record["ranks"][0]["status"], "failure": record["ranks"][0]["failure"],
                         "losses": record["ranks"][0]["losses"], "metrics": record["metrics"]}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
