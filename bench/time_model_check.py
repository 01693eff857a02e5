"""The time model against the public measurements of recompute's cost in time, side by side
(`recompute_bench/analysis/megatron/time_checks.py`): Korthikanti et al. Table 4 and the seeds' Llama 3 70B
FP8 table, each predicted relative throughput beside the measured one and the goal (3 points).

    python bench/time_model_check.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recompute_bench.analysis.megatron.time_checks import (  # noqa: E402
    GOAL_POINTS,
    PAPER_SOURCE,
    SEEDS_BASELINE,
    SEEDS_SOURCE,
    paper_rows,
    seeds_rows,
)


def main() -> None:
    print(PAPER_SOURCE)
    print(f"{'setting':<12} {'measured ms':>12} {'predicted ms':>13} {'measured rel.':>14} {'predicted rel.':>15} {'points':>7}")
    worst = 0.0
    for r in paper_rows():
        miss = 100 * (r["predicted_relative"] - r["measured_relative"])
        worst = max(worst, abs(miss))
        print(f"{r['setting']:<12} {r['measured_ms']:>12.1f} {r['predicted_ms']:>13.2f} {r['measured_relative']:>14.3f} "
              f"{r['predicted_relative']:>15.3f} {miss:>+7.1f}")
    print()
    print(SEEDS_SOURCE)
    print(f"relative to the measured baseline row {SEEDS_BASELINE} (~704 TFLOP/s/GPU), and to no recompute")
    print(f"{'setting':<32} {'TFLOP/s':>8} {'measured rel.':>14} {'pred. vs base':>14} {'points':>7} "
          f"{'pred. vs none':>14} {'points':>7} {'roofline TFLOP/s':>17}")
    for r in seeds_rows():
        a = 100 * (r["predicted_relative_to_baseline"] - r["measured_relative"])
        b = 100 * (r["predicted_relative_to_none"] - r["measured_relative"])
        worst = max(worst, abs(a), abs(b))
        print(f"{r['setting']:<32} {r['measured_tflops']:>8.1f} {r['measured_relative']:>14.3f} "
              f"{r['predicted_relative_to_baseline']:>14.3f} {a:>+7.1f} {r['predicted_relative_to_none']:>14.3f} {b:>+7.1f} "
              f"{r['roofline_tflops']:>17.0f}")
    print()
    print(f"largest miss: {worst:.1f} points (goal: {100 * GOAL_POINTS:.0f})")


if __name__ == "__main__":
    main()
