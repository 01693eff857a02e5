"""Recompute overhead measured side by side in one process: step time and saved bytes of each
setting relative to no recompute. Settings run interleaved, round after round, so drift of a
shared machine hits them alike; the median of each setting's rounds is compared. On CUDA it also
measures activation offload of all layers but the last (device bytes saved and the step time its
side-stream copies cost) and each setting's peak allocated bytes.

    python bench/recompute_overhead.py [--workload tiny] [--rounds 5] [--set section.key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from recompute_bench.measure.layout import DTYPES
from recompute_bench.measure.optimizer import make_optimizer
from recompute_bench.measure.point import pick_device
from recompute_bench.measure.probe import SavedTensorProbe
from recompute_bench.measure.step import Stepper, synthetic_batches
from recompute_bench.models.dense.layers import build_model
from recompute_bench.recompute.apply import apply_recompute
from recompute_bench.workload import resolve

SETTINGS = {
    "none": {},
    "selective[core_attn]": {"recompute.granularity": "selective", "recompute.modules": ["core_attn"]},
    "selective[layernorm]": {"recompute.granularity": "selective", "recompute.modules": ["layernorm"]},
    "selective[mlp]": {"recompute.granularity": "selective", "recompute.modules": ["mlp"]},
    "full uniform 1": {"recompute.granularity": "full", "recompute.method": "uniform", "recompute.num_layers": 1},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="tiny")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args()
    device = pick_device()
    settings = dict(SETTINGS)
    if device.type == "cuda":  # offload moves saved tensors from a GPU to host memory
        layers = resolve(args.workload, sets=args.sets, gpu="cpu")[0].model.num_layers
        settings[f"offload {layers - 1}"] = {"recompute.activation_offload_layers": layers - 1}

    steppers, saved = {}, {}
    for name, overrides in settings.items():
        cfg, _ = resolve(args.workload, overrides=overrides, sets=args.sets, gpu="cpu")
        model = apply_recompute(build_model(cfg.model, cfg.training.seed, device, DTYPES[cfg.training.precision]),
                                cfg.recompute).train()
        stepper = Stepper(cfg, model, make_optimizer(model, cfg.training.precision), synthetic_batches(cfg, device))
        probe = SavedTensorProbe(model)
        stepper.step(probe)  # probe step doubles as the first warm-up
        stepper.step()
        steppers[name], saved[name] = stepper, probe.result[0]

    times: dict[str, list[float]] = {name: [] for name in settings}
    peaks: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, stepper in steppers.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            stepper.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
                peaks[name] = torch.cuda.max_memory_allocated(device)
            times[name].append(time.perf_counter() - start)

    base_t, base_b = statistics.median(times["none"]), saved["none"]
    print(f"{args.workload} on {device}, {args.rounds} interleaved rounds (median step time)")
    print(f"{'setting':<24}{'step time':>12}{'time / none':>14}{'saved bytes':>14}{'bytes / none':>14}"
          + (f"{'peak alloc':>16}{'peak / none':>13}" if peaks else ""))
    for name in settings:
        t = statistics.median(times[name])
        peak = f"{peaks[name]:>16,}{peaks[name] / peaks['none']:>13.3f}" if peaks else ""
        print(f"{name:<24}{t * 1e3:>10.1f}ms{t / base_t:>14.3f}{saved[name]:>14,}{saved[name] / base_b:>14.3f}{peak}")


if __name__ == "__main__":
    main()
