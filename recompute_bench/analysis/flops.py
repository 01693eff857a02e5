"""FLOPs of one training step: Megatron's model FLOPs, and the hardware FLOPs this model executes.

Model FLOPs follow Megatron Core's `num_floating_point_operations` (main, 2026): GEMMs only, 3
passes (forward, data gradient, weight gradient) x 2 (multiply-add), the causal half of attention,
GQA's smaller K/V projections, SwiGLU's third matrix, the output layer over the vocabulary, and no
recompute. TFLOP/s/GPU and MFU are built on it, so recompute shows up as lower TFLOP/s/GPU.

Hardware FLOPs count what the implementation runs, the way `torch.utils.flop_counter` counts it:
attention over the full s x s square (no kernel here skips the masked half in the count), plus
the forward work each recompute setting repeats in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from recompute_bench.spec.config import Config
from recompute_bench.recompute.apply import recomputed_layers


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one micro-batch through one layer, split by what recompute can repeat."""

    qkv_proj: float
    core_attn: float   # QK^T and times V over the full square
    out_proj: float
    mlp: float

    @property
    def total(self) -> float:
        return self.qkv_proj + self.core_attn + self.out_proj + self.mlp


def layer_forward_flops(cfg: Config, samples: int | None = None) -> LayerFlops:
    """Forward FLOPs of one layer for `samples` sequences (default: one micro-batch)."""
    m, s = cfg.model, cfg.training.seq_length
    b = cfg.training.micro_batch_size if samples is None else samples
    q = m.kv_channels * m.num_attention_heads
    kv = m.kv_channels * m.groups
    tokens = b * s
    ffn_factor = 3 if m.activation == "swiglu" else 2
    return LayerFlops(
        qkv_proj=2 * tokens * m.hidden_size * (q + 2 * kv),
        core_attn=2 * 2 * b * s * s * q,
        out_proj=2 * tokens * q * m.hidden_size,
        mlp=2 * tokens * m.hidden_size * m.ffn_hidden_size * ffn_factor,
    )


def logits_forward_flops(cfg: Config, samples: int | None = None) -> float:
    """Forward FLOPs of the output layer."""
    b = cfg.training.micro_batch_size if samples is None else samples
    return 2 * b * cfg.training.seq_length * cfg.model.hidden_size * cfg.model.vocab_size


def model_flops_per_step(cfg: Config) -> float:
    """Megatron's model FLOPs for one optimizer step over the global batch (recompute excluded)."""
    m, s = cfg.model, cfg.training.seq_length
    batch = cfg.training.global_batch_size
    q = m.kv_channels * m.num_attention_heads
    kv = m.kv_channels * m.groups
    ffn_factor = 3 if m.activation == "swiglu" else 2
    per_token = 6 * (m.num_layers * (m.hidden_size * (q + 2 * kv) + q * m.hidden_size)
                     + m.num_layers * m.hidden_size * m.ffn_hidden_size * ffn_factor
                     + m.hidden_size * m.vocab_size)
    core = 6 * q * m.num_layers  # 3 passes x 2 x (QK^T + times V) x 1/2 causal, per query-key pair
    return batch * s * per_token + batch * s * s * core


def recompute_forward_flops(cfg: Config, samples: int | None = None) -> float:
    """Forward FLOPs that the recompute setting runs a second time, for `samples` sequences."""
    r, layers = cfg.recompute, cfg.model.num_layers
    f = layer_forward_flops(cfg, samples)
    if r.granularity == "full":
        return recomputed_layers(r, layers) * f.total
    if r.granularity == "selective":
        per_layer = (f.core_attn if "core_attn" in r.modules else 0.0) + (f.mlp if "mlp" in r.modules else 0.0)
        return layers * per_layer  # layernorm re-runs a norm only: no GEMM FLOPs
    return 0.0


def hardware_flops_per_step(cfg: Config) -> float:
    """FLOPs one step executes over the global batch: 3x forward plus the recomputed forward."""
    batch = cfg.training.global_batch_size
    forward = cfg.model.num_layers * layer_forward_flops(cfg, batch).total + logits_forward_flops(cfg, batch)
    return 3 * forward + recompute_forward_flops(cfg, batch)


# Dense 16-bit tensor-core peak FLOP/s by device name (substring match, first hit wins);
# fp32 uses the TF32 figure. Datasheet numbers without sparsity; override with --peak-tflops.
PEAK_FLOPS = {
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 378e12},
    "H100": {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 494.7e12},
    "H200": {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 494.7e12},
    "GB200": {"bf16": 2500e12, "fp16": 2500e12, "fp32": 1250e12},
    "B200": {"bf16": 2250e12, "fp16": 2250e12, "fp32": 1100e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12},
    "L40S": {"bf16": 362.05e12, "fp16": 362.05e12, "fp32": 183e12},
}


def peak_flops(device_name: str, precision: str) -> float | None:
    """The device's peak for `precision`, or None where it is not known (every CPU)."""
    for key, peaks in PEAK_FLOPS.items():
        if key.lower() in device_name.lower():
            return peaks[precision]
    return None
