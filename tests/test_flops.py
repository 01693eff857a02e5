"""Megatron's model FLOPs against its closed forms, published parameter counts and hand-derived values."""

from helpers import config
from recompute_bench.analysis.flops import hardware_flops_per_step, model_flops_per_step, peak


def test_gpt3_175b_matches_the_closed_form():
    cfg = config("gpt3-175b")
    B, s, L, h, V = 64, 2048, 96, 12288, 51200
    # MHA, f = 4h, causal half of attention: 72 B s L h^2 (1 + s/(12h) + V/(12 L h))
    expected = 72 * B * s * L * h**2 * (1 + s / (12 * h) + V / (12 * L * h))
    assert abs(model_flops_per_step(cfg) - expected) / expected < 1e-12


def test_llama3_8b_is_six_flops_per_gemm_parameter_and_token_plus_causal_attention():
    # Independent of the formula's terms: Llama 3 8B has 8,030,261,248 parameters (Meta's release).
    # Megatron's model FLOPs are 3 passes x 2 FLOPs per multiply-add for every parameter a GEMM uses
    # ("6N"): all but the input embedding (a lookup, 128256 x 4096) and the 2 x 32 + 1 norm weights
    # of 4096 (the untied output layer is a GEMM). Attention adds QK^T and times V, 2 x 2 x s x q
    # FLOPs per token and layer forward, halved by the causal mask, x 3 passes: 6 x s x q.
    B, s, L, q = 128, 8192, 32, 4096
    gemm_parameters = 8_030_261_248 - 128256 * 4096 - (2 * L + 1) * 4096
    assert gemm_parameters == 7_504_658_432
    assert model_flops_per_step(config("llama3-8b")) == B * s * (6 * gemm_parameters + 6 * s * q * L)
    # 6 x 7.50e9 x 1.05e6 tokens = 47.2 PFLOP of GEMMs, plus 6.8 PFLOP of attention
    assert round(model_flops_per_step(config("llama3-8b")) / 1e15, 1) == 54.0


def test_recompute_is_not_in_model_flops():
    full = config(recompute__granularity="full", recompute__method="uniform", recompute__num_layers=1)
    assert model_flops_per_step(full) == model_flops_per_step(config())


def test_peak_table():
    assert peak("NVIDIA H100 80GB HBM3", "bf16") == ("H100 SXM bf16", 989.5e12)  # the datasheet's 1,979 with sparsity, halved
    assert peak("NVIDIA H100 PCIe", "bf16") == ("H100 PCIe bf16", 756.5e12)
    # the NVL is its own product (datasheet 1,671 TFLOPS bf16 with sparsity), not the SXM's 989
    assert peak("NVIDIA H100 NVL", "bf16") == ("H100 NVL bf16", 835.5e12)
    assert peak("NVIDIA H200 NVL", "fp32") == ("H200 NVL tf32", 417.5e12)
    assert peak("cpu", "bf16") is None and peak("NVIDIA H100 SXM5 94GB", "bf16") is None  # unknown: no borrowed peak


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
