"""Multi-latent attention: measured bytes and FLOPs against the spec, `mla_up_proj` frees q, k, v and
re-runs only the up-projections, gradients unchanged, Megatron's MLA FLOPs formula, MLA rules."""

import dataclasses

import pytest
import torch
from helpers import config, invoke, probe

from recompute_bench.analysis import flops
from recompute_bench.analysis.harness.stage import activation_bytes, stage_parameters
from recompute_bench.config.rules import validate
from recompute_bench.config.schema import RecomputeConfig
from recompute_bench.measure.layout import DTYPES
from recompute_bench.measure.verify import verify
from recompute_bench.models import spec_for
from recompute_bench.workload import resolved

ONE_STEP = {"training__global_batch_size": 2}


def dense_mla(**overrides):
    """tiny-mla without experts and without a q latent (one plain q projection), fp32, one sample,
    explicit attention: core attention keeps q, k and v as they come, so mla_up_proj frees them."""
    cfg = config("tiny-mla", training__precision="fp32", training__micro_batch_size=1, training__global_batch_size=1,
                 model__attention_backend="math", **overrides)
    cfg = resolved(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_moe_experts=None, q_lora_rank=None)))
    validate(cfg)
    return cfg


def with_recompute(cfg, *modules, full=False):
    r = RecomputeConfig("full", method="uniform", num_layers=1) if full else (
        RecomputeConfig("selective", list(modules)) if modules else RecomputeConfig())
    out = dataclasses.replace(cfg, recompute=r)
    validate(out)
    return out


def measure(cfg):
    total, _, _, counted = probe(cfg, DTYPES[cfg.training.precision])
    return total, counted


SETTINGS = [(), ("mla_up_proj",), ("core_attn",), ("core_attn", "mla_up_proj"), ("layernorm", "mla_up_proj"),
            ("layernorm", "moe_act", "mla_up_proj"), ("moe", "mla_up_proj"), "full"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["tiny-mla", "dense-mla"])
def test_every_mla_setting_s_bytes_and_flops_are_what_the_probe_and_the_flop_counter_measure(variant):
    base = config("tiny-mla", **ONE_STEP) if variant == "tiny-mla" else dense_mla()
    assert spec_for(base.model).name == {"tiny-mla": "mla-moe", "dense-mla": "mla"}[variant]
    for setting in SETTINGS:
        if variant == "dense-mla" and {"moe", "moe_act"} & set(setting):
            setting = tuple(m for m in setting if m not in ("moe", "moe_act")) + ("mlp",)
        cfg = with_recompute(base, full=True) if setting == "full" else with_recompute(base, *setting)
        total, counted = measure(cfg)
        assert activation_bytes(cfg, "cpu")["activation_bytes"] == total, cfg.recompute.label
        assert flops.hardware_flops_per_step(cfg, "cpu") == counted, cfg.recompute.label


def test_mla_up_proj_frees_q_k_v_and_re_runs_only_the_up_projections():
    none = dense_mla()
    (b_none, f_none), (b_up, f_up) = measure(none), measure(with_recompute(none, "mla_up_proj"))
    m, t = none.model, none.training.seq_length
    n, qk, r, v = m.num_attention_heads, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    # q and k of n(qk + r), v of n·v per token, fp32, in every layer
    assert b_none - b_up == m.num_layers * 4 * t * n * (2 * (qk + r) + v)
    # the plain q projection h -> n(qk + r) and kv_up kv_lora_rank -> n(qk + v), once more per layer
    assert f_up - f_none == m.num_layers * 2 * t * (m.hidden_size * n * (qk + r) + m.kv_lora_rank * n * (qk + v))
    # with a q latent the q up-projection starts from q_lora_rank instead
    latent = resolved(dataclasses.replace(none, model=dataclasses.replace(none.model, q_lora_rank=32)))
    (_, f_latent), (_, f_latent_up) = measure(latent), measure(with_recompute(latent, "mla_up_proj"))
    assert f_latent_up - f_latent == m.num_layers * 2 * t * (32 * n * (qk + r) + m.kv_lora_rank * n * (qk + v))


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["tiny-mla", "dense-mla"])
def test_mla_up_proj_alone_and_combined_leaves_loss_and_gradients_bitwise_equal(workload):
    cfg = config("tiny-mla") if workload == "tiny-mla" else dense_mla()
    assert cfg.model.hidden_dropout > 0 and cfg.model.attention_dropout > 0
    combos = [["mla_up_proj"], ["core_attn", "mla_up_proj"], ["layernorm", "moe_act", "mla_up_proj"]]
    if workload == "dense-mla":
        combos = [["mla_up_proj"], ["core_attn", "layernorm", "mlp", "mla_up_proj"]]
    settings = [RecomputeConfig("selective", c) for c in combos]
    outcomes = verify(cfg, settings, ["sdpa", "math"], torch.device("cpu"))
    assert len(outcomes) == 2 * len(settings)
    assert not [(o.setting, o.attention_backend, o.max_grad_diff) for o in outcomes if not o.exact]


def test_model_flops_follow_megatron_s_mla_formula():
    # num_floating_point_operations' MLA term, written out for tiny-mla (q latent) and without it
    for q_lora in (32, None):
        cfg = config("tiny-mla")
        cfg = resolved(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, q_lora_rank=q_lora)))
        m, B, s = cfg.model, cfg.training.global_batch_size, cfg.training.seq_length
        h, n, L = m.hidden_size, m.num_attention_heads, m.num_layers
        q_term = h * n * (16 + 8) if q_lora is None else 32 * (h + n * (16 + 8) + 1)
        attn = 3 * 2 * (q_term + 32 * (h + n * (16 + 16) + 1) + h * 8 + n * 16 * h)
        core = 3 * 2 * (n * (16 + 8) / 2 + n * 16 / 2)
        mlps = 3 * 2 * h * 3 * (128 + (64 * 2 + 64))  # a dense first layer, then top-2 experts and the shared one
        expected = B * s * (L * attn + mlps + 3 * 2 * h * 512) + B * s * s * core * L
        assert flops.model_flops_per_step(cfg) == expected


def test_deepseek_v3_has_its_published_size_and_megatron_s_flops():
    cfg = config("deepseek-v3")
    m, B, s = cfg.model, cfg.training.global_batch_size, cfg.training.seq_length
    assert (m.num_layers, m.moe_layers) == (61, 58)
    assert round(stage_parameters(cfg, 0) / 1e9) == 671  # the published 671B (without multi-token prediction)
    h, n = 7168, 128
    attn = 3 * 2 * (1536 * (h + n * 192 + 1) + 512 * (h + n * 256 + 1) + h * 64 + n * 128 * h)
    mlp = 3 * 2 * h * 3 * (18432 * 3 + (2048 * 8 + 2048) * 58)
    expected = B * s * (61 * attn + mlp + 3 * 2 * h * 129280) + B * s * s * 3 * 2 * (n * 192 / 2 + n * 128 / 2) * 61
    assert flops.model_flops_per_step(cfg) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("q_lora", [32, None])
def test_parameter_count_matches_the_built_model(q_lora):
    cfg = config("tiny-mla")
    cfg = resolved(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, q_lora_rank=q_lora)))
    built = sum(p.numel() for p in spec_for(cfg.model).build(cfg, "meta").parameters())
    assert built == stage_parameters(cfg, 0)


@pytest.mark.parametrize("argv,needle", [
    (["--set", "model.qk_pos_emb_head_dim=7"], "even qk_pos_emb_head_dim"),
    (["--set", "model.kv_lora_rank=0"], "kv_lora_rank must be a positive integer"),
    (["--set", "model.num_query_groups=2"], "one key/value head per attention head"),
    (["--tp", "2"], "tensor parallelism of multi-latent attention"),
])
def test_mla_bad_input_is_one_line_and_exit_2(argv, needle):
    result = invoke("estimate", "-w", "tiny-mla", *argv)
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_mla_up_proj_needs_mla():
    result = invoke("estimate", "-w", "tiny", "--recompute-modules", "mla_up_proj")
    assert result.exit_code == 2 and "mla_up_proj needs multi-latent attention" in result.stderr
