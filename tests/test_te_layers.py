"""The harness's GPT built from Transformer Engine's modules (`backends/te_layers.py`), checked on the CPU
against a plain-torch stand-in of `transformer_engine.pytorch` with TE's constructor signatures
(tests/te_standin.py): the layer is built from the classes TE_MODULES names, each recompute setting
re-runs the modules `te_recompute` says, and loss and gradients equal the harness's own layer in fp32.
The same on real TE and CUDA: tests/gpu/test_transformer_engine_cuda.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import te_standin
from helpers import SETTINGS, SMALL_LLAMA, config, invoke, saved_step
from recompute_bench.backends import te_layers
from recompute_bench.backends import transformer_engine as te_backend
from recompute_bench.backends.transformer_engine import TE_MODULES, te_recompute

LLAMA = [f"{k}={v}" for k, v in SMALL_LLAMA.items()]
TE = ["model.transformer_impl=transformer_engine"]
# the harness's norm weights -> the TE module each is fused into (FUSED_NORMS)
NORM_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
              "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
              "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
              "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}


@pytest.fixture
def te(monkeypatch):
    """The stand-in installed and a CUDA device reported: what `te_problem` asks before the layers build."""
    module = te_standin.install(monkeypatch)
    monkeypatch.setattr(te_backend, "cuda_present", lambda: True)
    return module


def _te_name(name: str) -> str:
    prefix, _, rest = name.partition(".")  # layers.
    index, _, tail = rest.partition(".")
    return f"{prefix}.{index}.{NORM_NAMES[tail]}" if tail in NORM_NAMES else name


def _cfg(sets, workload="tiny"):
    return config(workload, ["model.hidden_dropout=0.0", "model.attention_dropout=0.0", *sets])


@pytest.mark.parametrize("sets", [LLAMA, []], ids=["rmsnorm-swiglu-gqa", "tiny"])
def test_each_dense_layer_is_built_from_the_te_modules_megatron_uses(te, sets):
    cfg = _cfg([*sets, *TE])
    model = saved_step(cfg)[3]
    assert model.backend == "transformer_engine" and te_layers.implementation(model) == {"transformer_impl": "transformer_engine"}
    for layer in model.layers:
        built = {"linear_qkv": layer.self_attention.linear_qkv, "core_attention": layer.self_attention.core_attention,
                 "linear_proj": layer.self_attention.linear_proj, "linear_fc1": layer.mlp.linear_fc1,
                 "linear_fc2": layer.mlp.linear_fc2}
        assert {name: type(m) for name, m in built.items()} == {name: getattr(te, cls) for name, (_, cls) in TE_MODULES.items()}
        assert type(layer.input_layernorm) is type(layer.pre_mlp_layernorm) is nn.Identity  # Megatron's IdentityOp
        assert layer.self_attention.linear_qkv.normalization == cfg.model.normalization
        assert layer.self_attention.core_attention.groups == cfg.model.groups
    assert not isinstance(model.output_layer, te.Linear)  # Megatron's output layer is not TE's


@pytest.mark.parametrize("sets", [LLAMA, []], ids=["rmsnorm-swiglu-gqa", "tiny"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_loss_and_gradients_equal_the_harness_layer_under_every_recompute_setting(te, sets, setting):
    loss, _, grads, model = saved_step(_cfg([*sets, *TE, *SETTINGS[setting]]))
    ref_loss, _, ref_grads, ref = saved_step(_cfg([*sets, *SETTINGS[setting]]))
    assert ref.backend == "torch"
    weights = dict(model.named_parameters())
    for name, p in ref.named_parameters():  # the same seed draws the same weights, norm weights fused
        torch.testing.assert_close(weights[_te_name(name)], p, rtol=0, atol=0)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert set(grads) == {_te_name(n) for n in ref_grads}
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[_te_name(name)], g, rtol=1e-5, atol=1e-6)


# forward calls per layer in one step: (LayerNormLinear, Linear, DotProductAttention)
RERUN = {"none": (2, 2, 1), "core_attn": (2, 2, 2), "layernorm": (2, 2, 1), "mlp": (3, 3, 1), "full": (4, 4, 2)}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_each_recompute_setting_reruns_what_te_recompute_says(te, setting):
    cfg = _cfg([*LLAMA, *TE, *SETTINGS[setting]])
    te_standin.calls.clear()
    _, saved, _, _ = saved_step(cfg)
    layers = cfg.model.num_layers
    assert (te_standin.calls["LayerNormLinear"], te_standin.calls["Linear"],
            te_standin.calls["DotProductAttention"]) == tuple(layers * n for n in RERUN[setting])
    plan = te_recompute(cfg.recompute.granularity, cfg.recompute.modules, cfg.training.precision)
    reruns_attention, reruns_mlp = RERUN[setting][2] == 2, RERUN[setting][0] > 2
    assert ("core_attn" in plan.checkpointed or plan.checkpointed == ("layers",)) == reruns_attention
    assert ("mlp" in plan.checkpointed or plan.checkpointed == ("layers",)) == reruns_mlp
    none = saved_step(_cfg([*LLAMA, *TE]))[1]
    if setting in ("none", "layernorm"):  # layernorm: both norms fused (IdentityOp), nothing recomputed
        assert saved == none and plan.checkpointed == ()
    else:
        assert saved < none


def test_layers_not_built_for_te_are_refused_in_one_line(te, tmp_path):
    result = invoke("run", "--results", str(tmp_path / "r.jsonl"), "--transformer-impl", "transformer_engine",
                    "--set", "model.num_moe_experts=4")
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and "mixture-of-experts layers" in err and "Traceback" not in result.output
    assert not (tmp_path / "r.jsonl").exists()
