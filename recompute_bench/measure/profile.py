"""`plan --auto --profile`: measure, on this machine's device, what each selective target of one
layer of each kind costs to run forward and what the layer saves (the format and how the solver
uses it: `analysis/harness/profile_costs.py`).

One layer of each kind the model has (dense, MoE) is built alone (`kind_config`, one layer)
in the training precision and run forward and backward `warmup` + `steps` times with no recompute.
Forward hooks on the layer and on each target's module time every forward: `time.perf_counter` on a
CPU, CUDA events recorded on the device's own stream on a GPU (read after the step's
synchronisation, only here: a measured training step never synchronises). A target's time in a step is the sum over its modules (`layernorm`: both
norms); the profile keeps the median over the steps. The saved-tensor probe counts the layer's
bytes with no recompute and with each target recomputed. On CUDA the host link is timed with
pinned copies of one layer's activation bytes, both ways.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from recompute_bench.analysis.cache import read_or_measure
from recompute_bench.analysis.harness.layer import layer_activation_bytes
from recompute_bench.analysis.harness.profile_costs import PROFILE_DIR, PROFILE_SCHEMA, cache_path, read_cached, shape_key
from recompute_bench.config.schema import Config, RecomputeConfig
from recompute_bench.measure.layout import DTYPES
from recompute_bench.measure.point import float32_matmul_precision, pick_device
from recompute_bench.measure.probe import SavedTensorProbe
from recompute_bench.measure.step import synthetic_batches
from recompute_bench.measure.telemetry import device_name
from recompute_bench.measure.timing import cuda_event
from recompute_bench.models import kind_config
from recompute_bench.recompute.apply import apply_recompute
from recompute_bench.recompute.policy import kind_targets, layer_kind
from recompute_bench.workload import resolved


def _modules(layer: torch.nn.Module, target: str) -> list[torch.nn.Module]:
    """The modules of one built layer (`models/*/layers.py`) whose forward `target` re-runs."""
    mlp = layer.mlp
    found = {"layer": [layer], "core_attn": [layer.self_attention.core_attention],
             "layernorm": [layer.input_layernorm, layer.pre_mlp_layernorm], "mlp": [mlp], "moe": [mlp],
             "moe_act": [getattr(getattr(mlp, "experts", None), "activation_func", None)],
             "shared_experts": [getattr(mlp, "shared_experts", None)]}[target]
    return [m for m in found if m is not None]


class _Spans:
    """Forward spans of named modules within one step, summed per name."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.open: dict[int, Any] = {}
        self.closed: list[tuple[str, Any, Any]] = []

    def _now(self) -> Any:
        return cuda_event(self.device) if self.cuda else time.perf_counter()

    def hook(self, name: str, module: torch.nn.Module) -> list:
        def start(*_: Any) -> None:
            self.open[id(module)] = self._now()

        def stop(*_: Any) -> None:
            self.closed.append((name, self.open.pop(id(module)), self._now()))

        return [module.register_forward_pre_hook(start), module.register_forward_hook(stop)]

    def take(self) -> dict[str, float]:
        """Seconds per name since the last take (call after the step has synchronised)."""
        out: dict[str, float] = defaultdict(float)
        for name, a, b in self.closed:
            out[name] += a.elapsed_time(b) / 1e3 if self.cuda else b - a
        self.closed.clear()
        return out


def _layer_model(cfg: Config, kind: str, device: torch.device, r: RecomputeConfig | None = None):
    one = kind_config(cfg, kind)
    one = resolved(dataclasses.replace(one, model=dataclasses.replace(one.model, num_layers=1),
                                       recompute=r or RecomputeConfig()))
    model = one.spec.build(one, device, DTYPES[cfg.training.precision])
    return one, apply_recompute(model, one.recompute).train()


def _saved_bytes(cfg: Config, kind: str, target: str | None, device: torch.device, tokens: torch.Tensor) -> int:
    r = RecomputeConfig("selective", [target]) if target else None
    _, model = _layer_model(cfg, kind, device, r)
    probe = SavedTensorProbe(model)
    with probe.watch():
        loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return probe.bytes()[1]


def _kind(cfg: Config, kind: str, targets: tuple[str, ...], device: torch.device, warmup: int, steps: int) -> dict:
    one, model = _layer_model(cfg, kind, device)
    tokens = synthetic_batches(one, device)[0]
    spans = _Spans(device)
    handles = [h for t in ("layer", *targets) for m in _modules(model.layers[0], t) for h in spans.hook(t, m)]
    samples: dict[str, list[float]] = defaultdict(list)
    try:
        for step in range(warmup + steps):
            model(tokens[:, :-1], tokens[:, 1:]).backward()
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = spans.take()
            if step >= warmup:
                for name in ("layer", *targets):
                    samples[name].append(seconds.get(name, 0.0))
    finally:
        for h in handles:
            h.remove()
    saved = {t or "none": _saved_bytes(cfg, kind, t, device, tokens) for t in (None, *targets)}
    return {"seconds": {name: statistics.median(v) for name, v in samples.items()}, "saved_bytes": saved,
            "analytical_saved_bytes": {t: layer_activation_bytes(kind_config(cfg, kind),
                                                                        () if t == "none" else (t,), device.type)
                                       for t in saved}}


def _host_link(nbytes: int, device: torch.device, steps: int) -> float:
    """Bytes per second of pinned copies device -> host -> device (median over `steps`)."""
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(steps + 1):
        start = cuda_event(device)  # the copies run on the device's current stream
        host.copy_(on_device, non_blocking=True)
        on_device.copy_(host, non_blocking=True)
        end = cuda_event(device)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times[1:])


def measure_profile(cfg: Config, device: torch.device, warmup: int = 1, steps: int = 5) -> dict[str, Any]:
    """The profile of cfg's layers on `device` (see the module docstring)."""
    device = pick_device(device)  # the current device: every span's event and kernel on it
    targets = cfg.spec.recompute_targets
    kinds = sorted({layer_kind(cfg.model, i) for i in range(cfg.model.num_layers)})
    torch.manual_seed(cfg.training.seed)
    with float32_matmul_precision(device, cfg.training.precision):
        out = {k: _kind(cfg, k, kind_targets(targets, k), device, warmup, steps) for k in kinds}
        link = None
        if device.type == "cuda":
            largest = max(v["saved_bytes"]["none"] for v in out.values())
            link = _host_link(max(int(largest), 16 * 2**20), device, steps)
    return {"schema": PROFILE_SCHEMA, "key": shape_key(cfg, device_name(device)), "device": device.type,
            "warmup": warmup, "steps": steps, "kinds": out, "host_link_bytes_per_s": link}


def cached_profile(cfg: Config, device: torch.device, steps: int = 5,
                   folder: Path = PROFILE_DIR) -> tuple[dict[str, Any], Path, bool]:
    """(the profile, its cache file, whether it was read from the cache): measured on `device`
    unless `folder` already holds one for this device and shape."""
    key = shape_key(cfg, device_name(device))
    return read_or_measure(cache_path(key, folder), lambda path: read_cached(path, key),
                           lambda: measure_profile(cfg, device, steps=steps))
