"""Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"):
Table 2's activation bytes per layer, the first stage's total (Eq. 5/6), the FLOPs of Appendix A
(Eq. 7 and 8), exactly as published for the paper's GPT-3 layer (math attention, dropout on, GeLU
4h MLP, LayerNorm, full heads, 16-bit), and how the layer built here differs from it. For the
paper's layer the built layer (`analysis.harness.layer`) is Table 2 plus the two norms' statistics (mean and
rstd, 2sb elements per norm, fp32 on CUDA), which the paper leaves out as small.
"""

from __future__ import annotations

from recompute_bench.analysis.harness.layer import attention_kernel
from recompute_bench.config.schema import Config
from recompute_bench.models import ELEMENT_BYTES
from recompute_bench.models.context_parallel import rank_seq_length


def paper_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                      recompute: str = "none") -> float:
    """Korthikanti et al. 2022, Table 2: activation bytes per layer of the GPT-3 layer.
    recompute: "none", "selective" (core attention) or "full"."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh
    core = 0.0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh / t * (34 + core)
    return sbh * (10 + 24 / t + core / t)


def paper_first_stage_bytes(cfg: Config, recompute: str = "none") -> float:
    """The paper's total on the first pipeline stage: Eq. 5/6 plus §4.3's embedding dropout sbhp/t,
    both times the interleave factor, and with p = 1 the final norm, output-layer input and fp32
    logits, 4sbh/t (1 + v/h)."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    # the paper's v, the tokenizer's vocabulary (its models' 51200 needs no padding)
    s, b, h, L, v = tr.seq_length, tr.micro_batch_size, m.hidden_size, m.num_layers, m.vocab_size
    t, p, vpp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    # The first stage's p micro-batches in flight hold L layers' worth, and p embedding dropout masks;
    # interleaving scales both (Megatron's theoretical memory does the same).
    in_flight = L * paper_layer_bytes(s, b, h, m.num_attention_heads, t, par.sequence_parallel, recompute) + s * b * h * p / t
    if vpp > 1:
        in_flight *= 1 + (p - 1) / (p * vpp)
    return in_flight + (4 * s * b * h / t * (1 + v / h) if p == 1 else 0.0)


def paper_flops_per_step(cfg: Config, recompute: str = "none") -> dict[str, float]:
    """The paper's FLOPs per step over the global batch B (Appendix A), full s^2 attention, GeLU 4h:
    model FLOPs (Eq. 7) 72 B L s h^2 (1 + s/6h + v/12hL); hardware FLOPs with selective recompute as
    published (Eq. 8, which Table 5's HFU uses) 72 B L s h^2 (1 + s/3h + v/12hL); the same from the
    text's "+4Bs^2h per layer" 72 B L s h^2 (1 + 2s/9h + v/12hL); full recompute (Narayanan et al.)
    96 B L s h^2 (1 + s/6h + v/16hL)."""
    m, tr = cfg.model, cfg.training
    B, L, s, h, v = tr.global_batch_size, m.num_layers, tr.seq_length, m.hidden_size, m.vocab_size
    base = 72 * B * L * s * h**2
    model = base * (1 + s / (6 * h) + v / (12 * h * L))
    hardware = {
        "none": model,
        "selective": base * (1 + s / (3 * h) + v / (12 * h * L)),
        "full": 96 * B * L * s * h**2 * (1 + s / (6 * h) + v / (16 * h * L)),
    }[recompute]
    text = base * (1 + 2 * s / (9 * h) + v / (12 * h * L)) if recompute == "selective" else hardware
    return {"model_flops_per_step": model, "hardware_flops_per_step": hardware,
            "hardware_flops_per_step_from_text": text}


def paper_layer_differences(cfg: Config, device: str = "cuda") -> list[str]:
    """How this layer differs from the paper's GPT-3 layer (empty when it is that layer, apart from
    the norm statistics, which `built_minus_paper_bytes` accounts for)."""
    m, tr = cfg.model, cfg.training
    diffs = []
    if attention_kernel(cfg, device) != "math":
        diffs.append(f"attention runs the {attention_kernel(cfg, device)} kernel, not the paper's explicit softmax path")
    if m.attention_dropout <= 0 or m.hidden_dropout <= 0:
        diffs.append("dropout is off (the paper keeps 1-byte masks)")
    if m.num_moe_experts:
        diffs.append(f"{m.moe_layers} of {m.num_layers} layers are mixture-of-experts ({m.num_moe_experts} experts, "
                     f"top-{m.moe_router_topk}), which the paper's formula does not describe; "
                     + ("routing is dropless, so the experts keep tokens x top-k rows whatever the routing"
                        if m.moe_expert_capacity_factor is None else
                        f"capacity factor {m.moe_expert_capacity_factor:g} drops routed rows over capacity: the estimate "
                        f"takes min(tokens x top-k, experts x capacity), which assumes uniform routing"))
    if cfg.parallel.context_parallel_size > 1:
        diffs.append(f"context parallel {cfg.parallel.context_parallel_size}: a rank holds s/cp tokens (the paper's s "
                     "below), and its attention over the split keeps q, k, v, the output and the log-sum-exp, no s x s "
                     "tensor")
    if m.activation != "gelu" or m.ffn_hidden_size != 4 * m.hidden_size:
        diffs.append(f"MLP is {m.activation} with ffn {m.ffn_hidden_size}, not GeLU 4h")
    if m.normalization != "LayerNorm":
        diffs.append(f"{m.normalization}, not LayerNorm")
    if m.groups != m.num_attention_heads:
        diffs.append(f"grouped-query attention ({m.groups} groups)")
    if m.position_embedding_type == "rope":
        diffs.append("RoPE makes new q and k while v keeps the fused QKV output alive")
    if ELEMENT_BYTES[tr.precision] != 2:
        diffs.append(f"{tr.precision} activations, not 16-bit")
    return diffs


def built_minus_paper_bytes(cfg: Config, device: str = "cuda") -> float:
    """For the paper's layer, built minus Table 2: the two norms' statistics the paper leaves out."""
    par, tr = cfg.parallel, cfg.training
    t = par.tensor_model_parallel_size if par.sequence_parallel else 1
    return 2 * cfg.spec.norm_stats_bytes(cfg, device, rank_seq_length(cfg) * tr.micro_batch_size) / t
