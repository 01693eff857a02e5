"""Mixture-of-experts layers: measured bytes and FLOPs against the spec, gradients unchanged by
every MoE recompute module, Megatron's MoE FLOPs formula, and the MoE rules."""

import dataclasses
import json

import pytest
import torch
from helpers import config, invoke, probe
from torch.utils.flop_counter import FlopCounterMode

from recompute_bench.analysis import flops
from recompute_bench.analysis.harness.stage import activation_bytes, stage_parameters
from recompute_bench.config.rules import validate
from recompute_bench.config.schema import BadInput, RecomputeConfig
from recompute_bench.measure.layout import DTYPES
from recompute_bench.measure.step import synthetic_batches
from recompute_bench.measure.verify import verify
from recompute_bench.models import spec_for
from recompute_bench.recompute.settings import all_settings, selective_settings
from recompute_bench.workload import resolved

ONE_STEP = {"training__global_batch_size": 2}
# Variants of tiny-moe: the preset (softmax, shared expert, grouped GEMM); DeepSeek's sigmoid router
# with GeLU experts and no shared expert (see settings_of); one matmul per expert with every other
# layer dense.
VARIANTS = {
    "tiny-moe": {},
    "sigmoid-gelu": {"model__moe_router_score_function": "sigmoid", "model__activation": "gelu"},
    "loop-freq2": {"model__moe_grouped_gemm": False, "model__moe_layer_freq": 2, "model__num_layers": 3},
    "aux-loss": {"model__moe_aux_loss_coeff": 0.01},
}


def measure(cfg):
    """(activation bytes, FLOPs of forward + backward) of one micro-batch (the probe's tokens are
    random: what the layers keep does not depend on the routing)."""
    total, _, _, counted = probe(cfg, DTYPES[cfg.training.precision])
    return total, counted


def settings_of(variant, precision):
    base = config("tiny-moe", training__precision=precision, **ONE_STEP, **VARIANTS[variant])
    if variant == "sigmoid-gelu":  # and no shared expert (an unset field: not an override)
        base = resolved(dataclasses.replace(base, model=dataclasses.replace(base.model, moe_shared_expert_intermediate_size=None)))
        validate(base)
    targets = spec_for(base.model).recompute_targets
    sizes = {"tiny-moe": (1, 2, len(targets)), "loop-freq2": (1, len(targets)), "aux-loss": (1,)}.get(variant)  # test time
    chosen = [r for r in selective_settings(targets) if sizes is None or len(r.modules) in sizes]
    full = [RecomputeConfig("full", method="uniform", num_layers=1)]
    return [dataclasses.replace(base, recompute=r) for r in [RecomputeConfig()] + chosen + full]


@pytest.mark.slow
@pytest.mark.parametrize("variant,precision", [("tiny-moe", "bf16"), ("sigmoid-gelu", "fp32"), ("loop-freq2", "fp32"),
                                               ("aux-loss", "bf16")])
def test_every_moe_setting_s_bytes_and_flops_are_what_the_probe_and_the_flop_counter_measure(variant, precision):
    for cfg in settings_of(variant, precision):
        total, counted = measure(cfg)
        # exact, up to one rounding of the mean over dense and MoE layers (moe_layer_freq 2)
        assert activation_bytes(cfg, "cpu")["activation_bytes"] == pytest.approx(total, rel=1e-12), cfg.recompute.label
        assert flops.hardware_flops_per_step(cfg, "cpu") == pytest.approx(counted, rel=1e-12), cfg.recompute.label


def test_moe_act_frees_the_activation_without_rerunning_an_expert_matmul():
    none, act, moe = (config("tiny-moe", **ONE_STEP, recompute__granularity=g, recompute__modules=mods)
                      for g, mods in (("none", []), ("selective", ["moe_act"]), ("selective", ["moe"])))
    (b_none, f_none), (b_act, f_act), (b_moe, f_moe) = measure(none), measure(act), measure(moe)
    assert f_act == f_none  # only the weighted SwiGLU re-runs: no GEMM
    m, tr = none.model, none.training
    rows = tr.seq_length * tr.micro_batch_size * m.moe_router_topk
    # silu(gate), silu(gate) * up and fc2's input, per MoE layer, in bf16
    assert b_none - b_act == m.num_layers * 3 * rows * m.moe_ffn * 2
    # `moe` re-runs router, experts and shared experts once more in backward
    layer = spec_for(m).layer_flops(none, samples=tr.global_batch_size, device="cpu")
    assert f_moe - f_none == m.num_layers * sum(layer[p].forward for p in ("router", "experts", "shared_experts"))
    assert b_moe < b_act


@pytest.mark.slow
def test_every_moe_setting_leaves_loss_and_gradients_bitwise_equal():
    cfg = config("tiny-moe")
    assert cfg.model.hidden_dropout > 0 and cfg.model.attention_dropout > 0
    targets = spec_for(cfg.model).recompute_targets
    assert targets == ("core_attn", "layernorm", "moe", "moe_act", "shared_experts")
    outcomes = verify(cfg, all_settings(cfg.model.num_layers, targets), ["sdpa", "math"], torch.device("cpu"))
    assert len(outcomes) == 2 * (31 + 2 * 2)
    assert not [(o.setting, o.attention_backend, o.max_grad_diff) for o in outcomes if not o.exact]


def test_grouped_matmuls_and_the_per_expert_reference_agree():
    grouped, loop = config("tiny-moe", training__precision="fp32"), config("tiny-moe", model__moe_grouped_gemm=False)
    results = []
    for cfg in (grouped, loop):
        model = spec_for(cfg.model).build(cfg, "cpu", torch.float32).train()
        tokens = synthetic_batches(cfg, torch.device("cpu"))[0]
        torch.manual_seed(0)
        with FlopCounterMode(display=False) as counter:
            model(tokens[:, :-1], tokens[:, 1:]).backward()
        results.append((counter.get_total_flops(), {n: p.grad for n, p in model.named_parameters()}))
    (f_grouped, g_grouped), (f_loop, g_loop) = results
    assert f_grouped == f_loop  # the grouped-matmul FLOP formula counts what per-expert matmuls count
    assert g_grouped.keys() == g_loop.keys()
    for name in g_grouped:
        torch.testing.assert_close(g_grouped[name], g_loop[name], rtol=1e-4, atol=1e-6, msg=name)


def test_model_flops_follow_megatron_s_moe_formula():
    # Megatron's num_floating_point_operations for Mixtral 8x7B: every layer MoE, top-2 of 8 experts
    # of ffn 14336, SwiGLU, GQA with 8 groups; the router is not counted.
    cfg = config("mixtral-8x7b")
    m, B, s = cfg.model, cfg.training.global_batch_size, cfg.training.seq_length
    h, L, q, kv = m.hidden_size, m.num_layers, m.head_dim * m.num_attention_heads, m.head_dim * m.groups
    expected = B * s * (3 * 2 * h * (14336 * 2 * 3 * L)
                        + 3 * 2 * (h * (q + 2 * kv) + q * h) * L
                        + 3 * 2 * h * 32000) + B * s * s * (3 * 2 * q / 2 * 2) * L
    assert flops.model_flops_per_step(cfg) == expected
    # dense first layers and shared experts: moe_layer_freq 2 makes every other layer dense
    mixed = config("tiny-moe", model__moe_layer_freq=2, model__num_layers=4)
    mm, t = mixed.model, mixed.training.global_batch_size * mixed.training.seq_length
    mlp = 3 * 2 * mm.hidden_size * 3 * (2 * mm.ffn_hidden_size + 2 * (mm.moe_ffn * 2 + 64))
    assert flops.model_flops_per_step(mixed) - flops.model_flops_per_step(
        resolved(dataclasses.replace(mixed, model=dataclasses.replace(mm, ffn_hidden_size=0, moe_ffn_hidden_size=0,
                                                             moe_shared_expert_intermediate_size=None,
                                                             num_moe_experts=None)))) == pytest.approx(t * mlp)


@pytest.mark.parametrize("workload,overrides", [("tiny-moe", {}), ("tiny-moe", VARIANTS["loop-freq2"])])
def test_parameter_count_matches_the_built_model(workload, overrides):
    cfg = config(workload, **overrides)
    built = sum(p.numel() for p in spec_for(cfg.model).build(cfg, "meta").parameters())
    assert built == stage_parameters(cfg, 0)


def test_mixtral_has_its_published_parameter_count():
    assert round(stage_parameters(config("mixtral-8x7b"), 0) / 1e9, 1) == 46.7


def test_run_records_tokens_per_expert_and_the_estimate_beside_the_measurement():
    result = invoke("run", "-w", "tiny-moe", "--set", "training.warmup_steps=0", "--set", "training.measured_steps=1",
                    "--no-save", "--json", "--recompute-granularity", "selective", "--recompute-modules", "moe_act,layernorm")
    assert result.exit_code == 0, result.output
    m = json.loads(result.stdout)["metrics"]
    assert json.loads(result.stdout)["env"]["grouped_gemm_path"] == "grouped_mm_fallback"  # torch's loop on a CPU
    assert m["tokens_dropped"] == 0  # dropless
    assert m["estimated_activation_bytes"] == m["activation_bytes"]
    assert m["estimated_hardware_flops_per_step"] == m["measured_flops_per_step"]
    cfg = config("tiny-moe")
    assert m["tokens_per_expert_mean"] == cfg.training.seq_length * cfg.training.micro_batch_size * 2 / 8
    assert m["tokens_per_expert_max"] >= m["tokens_per_expert_mean"]


@pytest.mark.parametrize("argv,needle", [
    (["--recompute-granularity", "selective", "--recompute-modules", "moe_act", "--set", "model.moe_grouped_gemm=false"],
     "moe_act needs mixture-of-experts layers with grouped GEMM"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp"], "mlp needs dense MLP layers"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"], "multi-latent attention"),
    (["--set", "model.moe_router_topk=9"], "moe_router_topk 9 is more than num_moe_experts 8"),
    (["--set", "model.moe_router_score_function=relu"], "moe_router_score_function"),
    (["--set", "model.add_bias_linear=true"], "add_bias_linear=false"),
    (["--set", "model.moe_ffn_hidden_size=60"], "multiples of 8"),
    (["--set", "model.moe_expert_capacity_factor=0"], "moe_expert_capacity_factor must be positive"),
    (["--set", "model.moe_token_drop_policy=random"], "moe_token_drop_policy"),
])
def test_moe_bad_input_is_one_line_and_exit_2(argv, needle):
    result = invoke("estimate", "-w", "tiny-moe", *argv)
    assert result.exit_code == 2
    assert needle in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_shared_experts_recompute_needs_shared_experts():
    cfg = config("tiny-moe", recompute__granularity="selective", recompute__modules=["shared_experts"])
    cfg = resolved(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_shared_expert_intermediate_size=None)))
    with pytest.raises(BadInput, match="^recompute module shared_experts needs mixture-of-experts layers with shared"):
        validate(cfg)


def test_dense_models_still_refuse_the_moe_modules():
    result = invoke("estimate", "-w", "tiny", "--recompute-granularity", "selective", "--recompute-modules", "moe")
    assert result.exit_code == 2 and "needs mixture-of-experts layers" in result.stderr


def test_group_limited_routing_keeps_each_token_within_its_best_groups_and_scales_its_probabilities():
    from recompute_bench.models.moe.layers import Router

    m = dataclasses.replace(config("tiny-mla").model, num_moe_experts=16, moe_router_topk=4)  # 4 groups of 4, best 2
    router = Router(m)
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(0))
    router.reset_buffers()
    probs, experts = router(torch.randn(256, m.hidden_size, generator=torch.Generator().manual_seed(1)))
    groups = experts // (16 // 4)
    assert max(len(set(row.tolist())) for row in groups) <= 2
    assert max(len(set(row.tolist())) for row in groups) == 2  # a token does take experts from two groups
    torch.testing.assert_close(probs.sum(-1), torch.full((256,), 2.5))
    # the expert bias moves the choice, not the probabilities' source: a large bias on expert 0 picks it everywhere
    router.expert_bias[0] = 10.0
    _, biased = router(torch.randn(64, m.hidden_size, generator=torch.Generator().manual_seed(2)))
    assert (biased == 0).any(-1).all()


@pytest.mark.parametrize("value,layers", [("([0]*3+[1]*5)", [0, 0, 0, 1, 1, 1, 1, 1]), ("[1,0]*4", [1, 0] * 4), (2, [1, 0] * 4)])
def test_moe_layer_freq_takes_an_integer_or_megatron_s_pattern(value, layers):
    cfg = config("tiny-moe", model__num_layers=8, model__moe_layer_freq=value)
    assert cfg.model.moe_layer_pattern == layers
    model = spec_for(cfg.model).build(cfg, "meta")
    assert [int(hasattr(layer.mlp, "experts")) for layer in model.layers] == layers


@pytest.mark.parametrize("value,needle", [
    ('"[0,1,1]"', "has 3 entries for 2 layers"),
    ('"__import__(\'os\')"', "neither an integer nor a pattern"),
    ('"[0,2]"', "neither an integer nor a pattern"),
])
def test_a_bad_moe_layer_freq_is_one_line_and_exit_2(value, needle):
    result = invoke("estimate", "-w", "tiny-moe", "--set", f"model.moe_layer_freq={value}")
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_the_auxiliary_loss_adds_its_own_gradient_to_the_router_and_nothing_to_the_probabilities(score_function):
    from recompute_bench.models.moe.layers import Router

    m = dataclasses.replace(config("tiny-moe").model, moe_router_score_function=score_function)
    x = torch.randn(128, m.hidden_size, generator=torch.Generator().manual_seed(1))
    grads, outputs = [], []
    for coeff in (0.0, 1.0):
        router = Router(dataclasses.replace(m, moe_aux_loss_coeff=coeff))
        torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(0))
        probs, experts = router(x)
        probs.sum().backward()  # the probabilities sum to 1 per token: their own gradient is rounding only
        grads.append(router.weight.grad)
        outputs.append((probs.detach(), experts))
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    # the difference is the gradient of Megatron's switch load-balancing loss, written out here
    w = router.weight.detach().requires_grad_()
    logits = x @ w.T
    scores = torch.softmax(logits, -1) if score_function == "softmax" else torch.sigmoid(logits)
    scores = scores / scores.sum(-1, keepdim=True)
    routed = torch.bincount(outputs[0][1].reshape(-1), minlength=8).to(scores.dtype)
    (1.0 * 8 / (2 * 128 * 128) * (scores.sum(0) * routed).sum()).backward()
    torch.testing.assert_close(grads[1] - grads[0], w.grad, rtol=1e-3, atol=1e-6)
    assert w.grad.abs().max() > 0


@pytest.mark.slow
def test_every_moe_setting_with_the_auxiliary_loss_leaves_loss_and_gradients_bitwise_equal():
    cfg = config("tiny-moe", model__moe_aux_loss_coeff=0.01)
    settings = [RecomputeConfig("selective", mods) for mods in (["moe"], ["moe_act", "layernorm"], ["shared_experts"])]
    outcomes = verify(cfg, settings + [RecomputeConfig("full", method="uniform", num_layers=1)], ["sdpa"], torch.device("cpu"))
    assert len(outcomes) == 4 and all(o.exact for o in outcomes)
