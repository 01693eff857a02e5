"""FLOPs of one training step: Megatron's model FLOPs, and the hardware FLOPs this model executes.

Model FLOPs follow Megatron Core's `num_floating_point_operations` (main, 2026): GEMMs only, 3
passes (forward, data gradient, weight gradient) x 2 (multiply-add), the causal half of attention,
GQA's smaller K/V projections, SwiGLU's third matrix, the output layer over the padded vocabulary,
and no recompute. TFLOP/s/GPU and MFU are built on it, so recompute shows up as lower TFLOP/s/GPU.

Hardware FLOPs count what the implementation runs, the way `torch.utils.flop_counter` counts it:
attention over the full s x s square (no kernel's formula skips the masked half), each kernel's own
backward (a fused attention kernel recomputes QK^T in its backward), plus the forward work each
recompute setting repeats in backward. The per-layer terms come from the model's spec
(`recompute_bench.models`); this module adds them up over layers, pipeline stages and the batch.
"""

from __future__ import annotations

import dataclasses

from recompute_bench.config.gpus import GPUS
from recompute_bench.config.rules import layers_per_model_chunk
from recompute_bench.config.schema import Config, RecomputeConfig
from recompute_bench.models import kind_config
from recompute_bench.recompute.policy import LayerPolicy, layer_kind, layer_policies
from recompute_bench.recompute.policy import recomputed_layers as count_recomputed


def layer_forward_flops(cfg: Config, samples: int | None = None, device: str = "cuda") -> dict[str, float]:
    """Forward FLOPs of one layer for `samples` sequences (default: one micro-batch), by part."""
    return {name: work.forward for name, work in cfg.spec.layer_flops(cfg, samples, device).items()}


def model_flops_per_step(cfg: Config) -> float:
    """Megatron's model FLOPs for one optimizer step over the global batch (recompute excluded)."""
    spec, batch = cfg.spec, cfg.training.global_batch_size
    return cfg.model.num_layers * spec.layer_model_flops(cfg, batch) + spec.logits_model_flops(cfg, batch)


def recomputed_layers(cfg: Config) -> int:
    """How many layers of the whole model full recompute re-runs in backward (0 unless full).
    Megatron applies the method within each model chunk (a pipeline stage, or with virtual stages
    each of its chunks): uniform re-runs every layer, block the first N layers of every chunk."""
    per_chunk = layers_per_model_chunk(cfg)
    chunk = count_recomputed(layer_policies(cfg.recompute, per_chunk))
    return cfg.model.num_layers // per_chunk * chunk


def recompute_forward_flops(cfg: Config, samples: int | None = None, device: str = "cuda") -> float:
    """Forward FLOPs that the recompute setting runs a second time, for `samples` sequences."""
    spec, r = cfg.spec, cfg.recompute
    if r.layer_policy:
        return policy_recompute_flops(cfg, layer_policies(r, cfg.model.num_layers), samples, device)
    if r.granularity == "full":
        layer = spec.layer_flops(cfg, samples, device)
        return recomputed_layers(cfg) * sum(w.forward for w in layer.values())
    if r.granularity == "selective":
        return cfg.model.num_layers * spec.selective_recompute_flops(cfg, r.modules, samples, device)
    return 0


def policy_recompute_flops(cfg: Config, policies: list[LayerPolicy], samples: int | None = None,
                           device: str = "cuda", first: int = 0) -> float:
    """Forward FLOPs a per-layer policy list (model layers `first`, `first` + 1, ...) runs a second
    time, for `samples` sequences: a whole layer's forward per checkpointed layer, the selective
    modules' forward per other layer, each as its kind (dense or MoE) runs them."""
    cache: dict[tuple[str, frozenset[str] | None], float] = {}
    total = 0.0
    for i, p in enumerate(policies):
        if p.chunk is None and not p.modules:
            continue
        key = (layer_kind(cfg.model, first + i), None if p.chunk is not None else p.modules)
        if key not in cache:
            c = kind_config(cfg, key[0])
            spec = c.spec
            cache[key] = (sum(w.forward for w in spec.layer_flops(c, samples, device).values()) if key[1] is None
                          else spec.selective_recompute_flops(c, sorted(key[1]), samples, device))
        total += cache[key]
    return total


def hardware_flops_per_step(cfg: Config, device: str = "cuda") -> float:
    """FLOPs one step executes over the global batch on `device`'s kernels: every layer's forward
    and backward, the output layer's, and the forward work recompute repeats."""
    spec, batch = cfg.spec, cfg.training.global_batch_size
    layer = sum(w.total for w in spec.layer_flops(cfg, batch, device).values())
    return (cfg.model.num_layers * layer + spec.output_layer_flops(cfg, batch).total
            + recompute_forward_flops(cfg, batch, device))


# Dense tensor-core peaks (no sparsity) by the exact name CUDA reports (`torch.cuda.get_device_name`,
# NVML's name): (product, bf16/fp16 FLOP/s, TF32 FLOP/s), from the one GPU table (`config.gpus`, each
# figure with its datasheet). A name not listed has no peak: MFU is not measured unless --peak-tflops
# gives one, never borrowed from a similar name (an "H100 NVL" is not an SXM at 989).
PEAK_FLOPS = {name: (gpu.short, gpu.dense_flops["bf16"], gpu.dense_flops["fp32"])
              for gpu in GPUS if gpu.dense_flops for name in gpu.device_names}


def peak(device_name: str, precision: str) -> tuple[str, float] | None:
    """(product, dense peak FLOP/s) of the device named exactly `device_name` for `precision` (fp32
    runs on TF32, the figure its MFU divides by), or None where the name is not in the table (every
    CPU)."""
    found = PEAK_FLOPS.get(device_name.strip())
    if found is None:
        return None
    product, half, tf32 = found
    return (f"{product} {'tf32' if precision == 'fp32' else precision}", tf32 if precision == "fp32" else half)


def setting_flops(cfg: Config, device: str = "cuda") -> dict[str, float]:
    """Model and hardware FLOPs per step, the recompute overhead, and the model TFLOP/s/GPU relative
    to no recompute, assuming the GPU sustains the same hardware FLOP/s (so time scales with
    hardware FLOPs; norm recompute, which adds no GEMM FLOPs, shows as free although it costs some
    memory-bound time)."""
    none = dataclasses.replace(cfg, recompute=RecomputeConfig())
    hw, hw_none = hardware_flops_per_step(cfg, device), hardware_flops_per_step(none, device)
    return {"model_flops_per_step": model_flops_per_step(cfg), "hardware_flops_per_step": hw,
            "recompute_overhead": hw / hw_none - 1, "relative_tflops_per_gpu": hw_none / hw}
