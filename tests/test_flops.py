"""Megatron's model FLOPs against hand-computed values."""

from conftest import config
from recompute_bench.analysis.flops import model_flops_per_step, peak_flops


def test_gpt3_175b_matches_the_closed_form():
    cfg = config("gpt3-175b")
    B, s, L, h, V = 64, 2048, 96, 12288, 51200
    # MHA, f = 4h, causal half of attention: 72 B s L h^2 (1 + s/(12h) + V/(12 L h))
    expected = 72 * B * s * L * h**2 * (1 + s / (12 * h) + V / (12 * L * h))
    assert abs(model_flops_per_step(cfg) - expected) / expected < 1e-12


def test_llama3_8b_by_hand():
    cfg = config("llama3-8b")
    B, s, L, h, f, V, q, kv = 128, 8192, 32, 4096, 14336, 128256, 4096, 1024
    per_token = 6 * (L * (h * (q + 2 * kv) + q * h) + L * h * f * 3 + h * V)  # GQA, SwiGLU: 3 matrices
    attention = 6 * q * L * s  # QK^T and times V, causal half, 3 passes x 2 per query-key pair
    assert model_flops_per_step(cfg) == B * s * (per_token + attention)
    # sanity: 6 x 7.5e9 GEMM parameters x 1.05e6 tokens = 47.2 PFLOP, plus 6.8 PFLOP of attention
    assert round(model_flops_per_step(cfg) / 1e15, 1) == 54.0


def test_recompute_is_not_in_model_flops():
    full = config(recompute__granularity="full", recompute__method="uniform", recompute__num_layers=1)
    assert model_flops_per_step(full) == model_flops_per_step(config())


def test_peak_table():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("cpu", "bf16") is None
