"""The time model against the public measurements of recompute's cost in time, side by side
(`recompute_bench/analysis/megatron/time_checks.py`): Korthikanti et al. Table 4 and the seeds' Llama 3 70B
FP8 table, each predicted relative throughput beside the measured one and the goal (3 points); then
absolute step time, predicted beside measured: Table 4's one-layer times, the seeds' four rows and Table 5's iterations of the 22B,
175B, 530B and 1T models, with where the predicted step goes by class, as shares of it (goal: within 10%).

    python bench/time_model_check.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recompute_bench.analysis.megatron.time_checks import (  # noqa: E402
    GOAL_ABSOLUTE,
    GOAL_POINTS,
    PAPER_SOURCE,
    PAPER_TABLE5_SOURCE,
    SEEDS_BASELINE,
    SEEDS_SOURCE,
    h200_gemm_row,
    paper_rows,
    paper_table5_rows,
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
          f"{'pred. vs none':>14} {'points':>7} {'pred. TFLOP/s':>14}")
    for r in seeds_rows():
        a = 100 * (r["predicted_relative_to_baseline"] - r["measured_relative"])
        b = 100 * (r["predicted_relative_to_none"] - r["measured_relative"])
        worst = max(worst, abs(a), abs(b))
        print(f"{r['setting']:<32} {r['measured_tflops']:>8.1f} {r['measured_relative']:>14.3f} "
              f"{r['predicted_relative_to_baseline']:>14.3f} {a:>+7.1f} {r['predicted_relative_to_none']:>14.3f} {b:>+7.1f} "
              f"{r['predicted_tflops']:>14.0f}")
    print()
    print(f"largest miss: {worst:.1f} points (goal: {100 * GOAL_POINTS:.0f})")
    print()
    print(f"absolute step time (goal: within {100 * GOAL_ABSOLUTE:.0f}%)")
    print(f"{'run':<48} {'measured s':>11} {'predicted s':>12} {'pred./meas.':>12}")
    rows = [(f"22B Table 4 one layer, {r['setting']}", r["measured_ms"] / 1e3, r["predicted_ms"] / 1e3)
            for r in paper_rows()]
    rows += [(f"seeds {r['setting']}", r["measured_step_seconds"], r["predicted_step_seconds"]) for r in seeds_rows()]
    table5 = paper_table5_rows()
    rows += [(f"{r['model']} Table 5 {r['setting']}", r["measured_step_seconds"], r["predicted_step_seconds"])
             for r in table5]
    within = 0
    for name, measured, predicted in rows:
        within += abs(predicted / measured - 1) <= GOAL_ABSOLUTE
        print(f"{name:<48} {measured:>11.4f} {predicted:>12.4f} {predicted / measured:>12.3f}")
    print(f"{within} of {len(rows)} within {100 * GOAL_ABSOLUTE:.0f}% "
          f"(seeds: measured step = model FLOPs per GPU / the measured TFLOP/s; {PAPER_TABLE5_SOURCE})")
    g = h200_gemm_row()
    print(f"  GEMMs of our H200 llama3-8b slice step ({g['gemms']}, {g['flops'] / 1e12:.1f} TFLOP): predicted "
          f"{1e3 * g['predicted_seconds']:.1f} ms, measured {1e3 * g['measured_seconds']:.1f} ms ({g['ratio']:.3f})")
    for r in paper_rows():
        print(f"  22B Table 4 one layer, {r['setting']}: forward {r['predicted_forward_ms']:.2f} of {r['measured_forward_ms']} ms "
              f"({r['predicted_forward_ms'] / r['measured_forward_ms']:.3f}), backward with its recompute "
              f"{r['predicted_backward_ms']:.2f} of {r['measured_backward_ms']} ms "
              f"({r['predicted_backward_ms'] / r['measured_backward_ms']:.3f})")
    for r in table5:
        parts = ", ".join(f"{k} {v / r['predicted_step_seconds']:.0%}" for k, v in r["by_class"].items() if v)
        print(f"  {r['model']} {r['setting']} by class: {parts}")


if __name__ == "__main__":
    main()
