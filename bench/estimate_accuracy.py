"""The analytical model against `run`'s measurements, side by side: for `tiny` and shrunken
`llama3-8b` / `gpt3-175b` layers, both attention backends, dropout on and off, every recompute
setting, one `run_point` each (fp32 on this machine's device), and the error of each estimate.

    python bench/estimate_accuracy.py            # all points, a table on stdout
    python bench/estimate_accuracy.py --quick    # none, selective[core_attn], full uniform 1 only
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recompute_bench.config.schema import RecomputeConfig  # noqa: E402
from recompute_bench.measure.point import run_point  # noqa: E402
from recompute_bench.recompute.settings import all_settings  # noqa: E402
from recompute_bench.workload import resolve  # noqa: E402

SHAPES = {
    "tiny": {},
    "llama3-8b": {"model.num_layers": 3, "model.hidden_size": 64, "model.num_attention_heads": 8,
                  "model.num_query_groups": 2, "model.ffn_hidden_size": 160, "model.vocab_size": 256,
                  "training.seq_length": 32, "training.micro_batch_size": 2},
    "gpt3-175b": {"model.num_layers": 3, "model.hidden_size": 64, "model.num_attention_heads": 4,
                  "model.ffn_hidden_size": 256, "model.vocab_size": 512, "model.max_position_embeddings": 64,
                  "training.seq_length": 32, "training.micro_batch_size": 2},
}
QUICK = ("none", "selective[core_attn]", "full uniform 1")


def _err(estimate: float | None, measured: float | None) -> str:
    if estimate is None or not measured:
        return "n/m"
    return f"{100 * (estimate - measured) / measured:+.2f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three settings per case instead of all")
    args = parser.parse_args()
    print(f"{'workload':10} {'attention':9} {'dropout':7} {'setting':36} {'act bytes':>10} {'err':>7} "
          f"{'per layer':>10} {'err':>7} {'HW FLOPs err':>12} {'peak err':>8}")
    worst_bytes = worst_flops = 0.0
    for workload, shape in SHAPES.items():
        for backend in ("sdpa", "math"):
            for dropout in (0.0, 0.1):
                overrides = {**shape, "model.attention_backend": backend, "model.attention_dropout": dropout,
                             "model.hidden_dropout": dropout, "training.precision": "fp32",
                             "training.warmup_steps": 0, "training.measured_steps": 1}
                base, _ = resolve(workload, overrides=overrides, gpu="cpu")
                settings = [RecomputeConfig()] + all_settings(base.model.num_layers)
                for r in settings:
                    if args.quick and r.label not in QUICK:
                        continue
                    record = run_point(dataclasses.replace(base, recompute=r))
                    m = record["metrics"]
                    e_total = (m["estimated_activation_bytes"] - m["activation_bytes"]) / m["activation_bytes"]
                    e_layer = (m["estimated_activation_bytes_per_layer"] - m["activation_bytes_per_layer"]) / m["activation_bytes_per_layer"]
                    worst_bytes = max(worst_bytes, abs(e_total), abs(e_layer))
                    e_flops = (m["estimated_hardware_flops_per_step"] - m["measured_flops_per_step"]) / m["measured_flops_per_step"]
                    # sdpa without dropout runs torch's CPU flash kernel, which FlopCounterMode cannot count
                    blind = record["env"]["device"] == "cpu" and backend == "sdpa" and dropout == 0.0
                    if not blind:
                        worst_flops = max(worst_flops, abs(e_flops))
                    print(f"{workload:10} {backend:9} {dropout:7} {r.label:36} {m['activation_bytes']:>10} "
                          f"{_err(m['estimated_activation_bytes'], m['activation_bytes']):>7} "
                          f"{m['activation_bytes_per_layer']:>10.0f} "
                          f"{_err(m['estimated_activation_bytes_per_layer'], m['activation_bytes_per_layer']):>7} "
                          f"{_err(m['estimated_hardware_flops_per_step'], m['measured_flops_per_step']) + ('*' if blind else ''):>12} "
                          f"{_err(m['estimated_peak_allocated_bytes'], m['peak_allocated_bytes']):>8}")
    print(f"worst activation-bytes error {100 * worst_bytes:.3f}%; worst FLOPs error {100 * worst_flops:.3f}% "
          "(* = CPU flash sdpa, invisible to FlopCounterMode, excluded)")


if __name__ == "__main__":
    main()
