"""The measured pipeline bubble beside the schedule's, launch after launch: 1F1B over 2 ranks (gloo on
a CPU, NCCL on 2 GPUs), 4 micro-batches of layers wide enough that compute, not Python, fills the
step. Each launch prints each stage's idle share of the schedule's span and their mean beside
Megatron's (p - 1)/(m vp + p - 1) = 0.2. A pipeline whose stages took turns (one that synchronised
at every action) would idle (p - 1)/p = 0.5. On a shared CPU a micro-batch takes 10-20% more or less
from one to the next, so single launches spread (seen 0.16 to 0.32 on 2 cores): read the median.

    python bench/pipeline_bubble.py [--launches 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETS = ["model.hidden_dropout=0", "model.attention_dropout=0", "training.precision=fp32",
        "training.global_batch_size=8", "training.warmup_steps=1", "training.measured_steps=3",
        "model.hidden_size=256", "model.ffn_hidden_size=1024", "model.num_attention_heads=8",
        "training.seq_length=128"]


def launch(device: str, results: Path) -> dict:
    """One 2-rank 1F1B point of `tiny` through the CLI: its record."""
    command = [sys.executable, "-c", "from recompute_bench.cli import main; main()", "run", "--nproc-per-node", "2",
               "--pp", "2", "--device", device, "--results", str(results), "--json",
               *[a for s in SETS for a in ("--set", s)]]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"the launch failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    measured = []
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'launch':>6s} {'stage 0':>8s} {'stage 1':>8s} {'mean':>6s} {'schedule':>9s}")
        for i in range(args.launches):
            pipe = launch(args.device, Path(tmp) / f"{i}.jsonl")["pipeline"]
            stages = [s["bubble_fraction"] for s in pipe["stages"]]
            measured.append(pipe["bubble_fraction"])
            print(f"{i + 1:6d} {stages[0]:8.3f} {stages[1]:8.3f} {pipe['bubble_fraction']:6.3f} "
                  f"{pipe['estimated_bubble_fraction']:9.3f}")
    print(f"median measured bubble {statistics.median(measured):.3f} against the schedule's "
          f"{pipe['estimated_bubble_fraction']:.3f} (stages taking turns: 0.5)")


if __name__ == "__main__":
    main()
