"""`plan --auto` against the best uniform setting at the same budget, side by side: for budgets
between the least memory full recompute needs and what selective recompute of every module needs,
the predicted need and recompute overhead of each, and the ratio of predicted TFLOP/s/GPU
(auto over uniform, time scaling with hardware FLOPs). Analytical: no device needed. With
--profile the policies are priced by this machine's measured profile (`plan --auto --profile`,
cached under results/profiles/), and the last column is the measured recompute time of each per
micro-batch and stage (model the CUDA device: run it on the GPU).

    python bench/auto_policy.py [--workload llama3-8b] [--set section.key=value ...] [--steps 6] [--profile]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recompute_bench.analysis.allowance import device_bytes_needed
from recompute_bench.analysis.harness.auto import auto_plan  # noqa: E402
from recompute_bench.analysis.harness.planner import setting_candidates  # noqa: E402
from recompute_bench.workload import resolve  # noqa: E402

DEFAULT_SETS = ["model.num_layers=8", "training.seq_length=8192"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="llama3-8b")
    parser.add_argument("--set", dest="sets", action="append", default=None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--profile", action="store_true", help="price by a measured profile of this machine's device")
    args = parser.parse_args()
    cfg, _ = resolve(args.workload, sets=DEFAULT_SETS if args.sets is None else args.sets, gpu="cpu")
    costs, device = None, "cuda"
    if args.profile:
        from recompute_bench.analysis.harness.profile_costs import ProfileCosts
        from recompute_bench.measure.point import pick_device
        from recompute_bench.measure.profile import cached_profile

        profile, path, _ = cached_profile(cfg, pick_device())
        costs, device = ProfileCosts(profile), profile["device"]
        print(f"profile: {path} ({profile['key']['device_name']}); {costs.offload_note}")
    rows = {r["label"]: device_bytes_needed(r["peak_allocated_bytes"]) for r in setting_candidates(cfg, device)}
    selective_all = min(v for k, v in rows.items() if k.startswith("selective"))  # every module recomputed
    low, high = min(rows.values()), max(selective_all, min(rows.values()))
    print(f"{cfg.workload}: L={cfg.model.num_layers} s={cfg.training.seq_length} b={cfg.training.micro_batch_size}; "
          f"budgets from {low / 2**30:.2f} to {high / 2**30:.2f} GiB ({device} model, default allowance)")
    print(f"{'budget GiB':>10}  {'auto need':>9} {'auto ovh':>8}  {'uniform':<34} {'need':>7} {'ovh':>7}  {'TFLOP/s auto/uniform':>20}"
          + ("  measured ms auto / uniform" if costs else ""))
    for i in range(args.steps + 1):
        budget = low + (high - low) * i / args.steps
        result = auto_plan(cfg, budget + 1, device, costs=costs)  # +1 byte: the end points themselves fit
        auto, uniform = result["predicted"], result["uniform"]
        if auto is None or uniform is None:
            print(f"{budget / 2**30:10.2f}  nothing fits")
            continue
        ratio = (1 + uniform["recompute_overhead"]) / (1 + auto["recompute_overhead"])
        print(f"{budget / 2**30:10.2f}  {auto['device_bytes_needed'] / 2**30:9.2f} {100 * auto['recompute_overhead']:7.1f}%  "
              f"{uniform['label']:<34} {uniform['device_bytes_needed'] / 2**30:7.2f} {100 * uniform['recompute_overhead']:6.1f}%  "
              f"{ratio:20.3f}" + (f"  {1e3 * auto['recompute_cost']:.3f} / {1e3 * uniform['recompute_cost']:.3f}" if costs else ""))


if __name__ == "__main__":
    main()
