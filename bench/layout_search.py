"""How long `plan --framework megatron --search-layouts` takes, and what its pruning saves.

1. Llama 3 70B (workload llama3-70b, seq 8192, global batch 128, bf16) on 64 H100 with 80 GiB: the
   search's wall and CPU seconds beside the goal of 10 s, and how many layouts each step of the
   pruning left (refused, over the static memory, priced, searched for a setting). On a shared
   machine the wall time follows the load; the CPU time is the search's own work.
2. A small model on 8 GPUs, small enough to price every setting of every layout: the pruned
   search's time beside that exhaustive pricing's, and whether both find the same layouts.

    python bench/layout_search.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GOAL_SECONDS = 10.0


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    from recompute_bench.analysis.gpu_rates import achieved_rates
    from recompute_bench.analysis.megatron import MegatronRun
    from recompute_bench.analysis.megatron.layouts import candidate_layouts, price_every_layout, search_layouts
    from recompute_bench.analysis.megatron.stage import stage_peaks
    from recompute_bench.workload import resolve

    run, rates = MegatronRun("h100"), achieved_rates("h100")
    cfg, _ = resolve("llama3-70b", overrides={"training.framework": "megatron"}, gpu="cpu")
    result, wall, cpu = timed(lambda: search_layouts(cfg, run, rates, 64, 80 * 2**30, 0.1, 2**30))
    s = result["searched"]
    print("Llama 3 70B on 64 H100, 80 GiB (plan --framework megatron -w llama3-70b --search-layouts --gpus 64 "
          "--gpu h100 --memory-gb 80)")
    print(f"  search: {wall:.1f} s wall, {cpu:.1f} s CPU; goal {GOAL_SECONDS:g} s: CPU / goal = {cpu / GOAL_SECONDS:.2f}, "
          f"wall / goal = {wall / GOAL_SECONDS:.2f}")
    print(f"  layouts: {s['layouts']} enumerated, {s['refused']} refused by the rules, {s['over_static_memory']} over "
          f"the static memory, {s['priced']} priced, {s['searched_settings']} searched for a setting, {s['pruned']} pruned")
    for r in result["layouts"]:
        print(f"  {r['layout_label']:<28} {r['setting']:<24} {r['tflops_per_gpu']:6.0f} TFLOP/s/GPU  "
              f"{r['device_bytes_needed'] / 2**30:5.1f} GiB")

    small_cfg, _ = resolve("tiny", gpu="cpu", overrides={  # a Llama-style model of 8 layers
        "training.framework": "megatron", "model.num_layers": 8, "model.hidden_size": 256,
        "model.num_attention_heads": 8, "model.ffn_hidden_size": 1024, "model.max_position_embeddings": 1024,
        "training.seq_length": 1024, "training.global_batch_size": 16, "training.micro_batch_size": 1})
    layouts, _ = candidate_layouts(small_cfg, 8, set(), rates)
    peaks = sorted(max(p.peak_allocated_bytes for p in stage_peaks(c, run)) for c in layouts)
    budget = peaks[len(peaks) // 4]
    pruned, p_wall, p_cpu = timed(lambda: search_layouts(small_cfg, run, rates, 8, budget, 0.0, 0.0, top=4))
    every, e_wall, e_cpu = timed(lambda: price_every_layout(small_cfg, run, rates, 8, budget, 0.0, 0.0, 4))
    same = [(round(r["step_seconds"], 12), r["layout_label"]) for r in pruned["layouts"]] == every
    print(f"small model (8 layers, h 256, seq 1024) on 8 GPUs, {budget / 2**20:.0f} MiB: pruned {p_cpu:.2f} s CPU, "
          f"every setting of every layout {e_cpu:.2f} s CPU: exhaustive / pruned = {e_cpu / p_cpu:.1f}; "
          f"same {len(every)} best layouts: {same}")


if __name__ == "__main__":
    main()
