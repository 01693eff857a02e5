"""The estimate of framework megatron against Megatron-LM's functional tests, case by case.

For every GPT case in tests/data/megatron/cases.json whose arguments the estimate can express: the
last rank's estimated peak and after-step bytes beside what the golden file's last step logged,
then the summary against the goal (median |peak error| <= 3%, >= 90% of rows within 5%, median
|static error| <= 5%) and every skipped case with the reason.

    python bench/megatron_check.py            # the whole table
    python bench/megatron_check.py --misses   # only rows off by more than 5%
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recompute_bench.ingest.megatron_check import (CATEGORIES, GOAL, check, load_cases, meets_goal,  # noqa: E402
                                                  skipped_in, summary)

GiB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=ROOT / "tests" / "data" / "megatron" / "cases.json")
    parser.add_argument("--misses", action="store_true", help="print only rows whose peak is off by more than 5%%")
    args = parser.parse_args()
    data = load_cases(args.cases)
    rows, skipped = check(data)
    print(f"Megatron-LM {data['commit'][:10]} functional tests ({data['source']}): last rank, estimate vs golden last step")
    print(f"{'case':72s} {'golden':9s} {'layout':16s} {'peak est':>9s} {'measured':>9s} {'error':>7s}  "
          f"{'static est':>10s} {'measured':>9s} {'error':>7s}  where")
    for r in sorted(rows, key=lambda r: (r.case, r.golden)):
        if args.misses and abs(r.peak_error) <= 0.05:
            continue
        print(f"{r.case[:72]:72s} {r.golden:9s} {r.layout:16s} {r.estimated_peak_bytes / GiB:8.2f}G "
              f"{r.measured_peak_bytes / GiB:8.2f}G {100 * r.peak_error:+6.2f}%  {r.estimated_static_bytes / GiB:9.3f}G "
              f"{r.measured_static_bytes / GiB:8.3f}G {100 * r.static_error:+6.2f}%  {r.phase}")
    figures = summary(rows)
    print(f"\n{figures['rows']} goldens of {figures['cases']} cases: median |peak error| "
          f"{100 * figures['median_peak_error']:.2f}% (goal <= {100 * GOAL['median_peak_error']:.0f}%), within 5%: "
          f"{100 * figures['peak_within_5_percent']:.1f}% (goal >= {100 * GOAL['peak_within_5_percent']:.0f}%), worst "
          f"{100 * figures['worst_peak_error']:.1f}%; median |static error| {100 * figures['median_static_error']:.2f}% "
          f"(goal <= {100 * GOAL['median_static_error']:.0f}%): {'goal met' if meets_goal(figures) else 'GOAL MISSED'}")
    print(f"\n{'category':18s} {'goldens':>7s} {'cases':>5s} {'median |peak|':>13s} {'within 5%':>9s} "
          f"{'median |static|':>15s} {'skipped':>7s}  goal")
    for name in (*CATEGORIES, None):
        f = summary(rows, name)
        label = name or "overall"
        skips = skipped_in(skipped, name) if name else sum(map(len, skipped.values()))
        if not f["rows"]:
            print(f"{label:18s} {0:7d} {0:5d} {'-':>13s} {'-':>9s} {'-':>15s} {skips:7d}  no golden checked")
            continue
        print(f"{label:18s} {f['rows']:7d} {f['cases']:5d} {100 * f['median_peak_error']:12.2f}% "
              f"{100 * f['peak_within_5_percent']:8.1f}% {100 * f['median_static_error']:14.2f}% {skips:7d}  "
              f"{'met' if meets_goal(f) else 'MISSED'}")
    print(f"\nskipped {sum(map(len, skipped.values()))} goldens:")
    for reason, which in sorted(skipped.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(which):3d}  {reason}")


if __name__ == "__main__":
    main()
