"""Megatron's model FLOPs against hand-computed values."""

from conftest import config
from recompute_bench.analysis.flops import hardware_flops_per_step, model_flops_per_step, peak_flops


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


def test_model_flops_count_megatron_s_padded_vocabulary():
    # GPT-2's tokenizer has 50257 ids, not a multiple of 128: Megatron pads the vocabulary to a
    # multiple of make_vocab_size_divisible_by x tp = 128: ceil(50257 / 128) = 393 rows of 128,
    # 393 x 128 = 50304 (nanoGPT pads GPT-2 to the same 50304). Megatron's closed form with V = 50304:
    cfg = config("gpt3-175b", model__vocab_size=50257)
    B, s, L, h, V = 64, 2048, 96, 12288, 50304
    expected = 72 * B * s * L * h**2 * (1 + s / (12 * h) + V / (12 * L * h))
    assert abs(model_flops_per_step(cfg) - expected) / expected < 1e-12
    # Llama 3's 128256 = 1002 x 128 needs no padding at tp 1; at tp 8 the multiple is 1024:
    # ceil(128256 / 1024) = 126, 126 x 1024 = 129024 rows, 768 more. The logits term is
    # 3 passes x 2 x h x V per token, so tp 8 adds 6 x B x s x h x 768 FLOPs per step.
    one = config("llama3-8b")
    eight = config("llama3-8b", parallel__tensor_model_parallel_size=8)
    assert model_flops_per_step(eight) - model_flops_per_step(one) == 6 * 128 * 8192 * 4096 * 768
    # What the output layer executes (forward + both gradients) grows by the same.
    assert hardware_flops_per_step(eight) - hardware_flops_per_step(one) == 6 * 128 * 8192 * 4096 * 768
