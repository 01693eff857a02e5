"""The process that measures one point: `python -m recompute_bench.launch.worker --out FILE < config.json`.

The launcher starts one worker per point, so an out-of-memory error, a crash or a leaked allocation
never reaches the next point, and the CUDA allocator starts fresh each time. The resolved config
comes as JSON on stdin (`config_to_dict`); the worker validates it again, runs
`measure.run_point`, and writes the result record to `--out` (through a rename, so the launcher
reads a whole record or none). Its stderr is the point's log. SIGUSR1 dumps every thread's Python
stack to stderr, which is how the launcher learns where a hung point was stuck.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys
from pathlib import Path

from recompute_bench.spec.config import Config, ConfigError, ModelConfig, ParallelConfig, RecomputeConfig, TrainingConfig
from recompute_bench.spec.rules import validate


def config_to_dict(cfg: Config) -> dict:
    """A resolved Config as plain data: workload, model, training, parallel and recompute."""
    r = cfg.recompute
    return {"workload": cfg.workload, **cfg.to_dict(),
            "recompute": {"granularity": r.granularity, "modules": list(r.modules), "method": r.method,
                          "num_layers": r.num_layers, "activation_offload_layers": r.activation_offload_layers,
                          "distribute_saved_activations": r.distribute_saved_activations}}


def config_from_dict(data: dict) -> Config:
    """The inverse of `config_to_dict`, validated; ConfigError when the data is not a valid config."""
    try:
        cfg = Config(workload=data["workload"], model=ModelConfig(**data["model"]),
                     training=TrainingConfig(**data["training"]), parallel=ParallelConfig(**data["parallel"]),
                     recompute=RecomputeConfig(**data["recompute"]))
    except (KeyError, TypeError) as e:
        raise ConfigError(f"not a resolved recompute-bench config ({e}); write it with config_to_dict") from None
    validate(cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Measure the point on stdin and write its record to --out; 0 when a record was written."""
    parser = argparse.ArgumentParser(prog="python -m recompute_bench.launch.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="file the result record is written to")
    parser.add_argument("--device", default=None, help="torch device; default CUDA when present")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU")
    args = parser.parse_args(argv)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)

    cfg = config_from_dict(json.load(sys.stdin))
    from recompute_bench.measure.point import pick_device, run_point
    from recompute_bench.results.store import write_json_atomic

    record = run_point(cfg, device=pick_device(args.device), peak_tflops=args.peak_tflops)
    write_json_atomic(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
