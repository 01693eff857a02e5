"""Recompute changes memory and time, never the math: measured bytes, FLOPs and gradients."""

import pytest
import torch

from helpers import SMALL_LLAMA, config, probe
from recompute_bench.measure.verify import verify
from recompute_bench.recompute.settings import all_settings

SELECTIVE = lambda *mods: dict(recompute__granularity="selective", recompute__modules=list(mods))
FULL = lambda method, n: dict(recompute__granularity="full", recompute__method=method, recompute__num_layers=n)


@pytest.mark.slow
@pytest.mark.parametrize("workload,overrides", [("tiny", {}), ("llama3-8b", SMALL_LLAMA)], ids=["tiny", "small-llama"])
def test_every_setting_leaves_loss_and_gradients_bitwise_equal(workload, overrides):
    cfg = config(workload, **{k.replace(".", "__"): v for k, v in overrides.items()})
    outcomes = verify(cfg, all_settings(cfg.model.num_layers), ["sdpa", "math"], torch.device("cpu"))
    assert len(outcomes) == 2 * (7 + 2 * len({1, 2, cfg.model.num_layers - 1, cfg.model.num_layers}))
    bad = [(o.setting, o.attention_backend, o.loss_diff, o.max_grad_diff) for o in outcomes if not o.exact]
    assert not bad


@pytest.mark.slow
@pytest.mark.parametrize("setting,backend", [(FULL("uniform", 1), "math"), (SELECTIVE("core_attn"), "math"),
                                             (SELECTIVE("core_attn"), "sdpa")], ids=["full", "core_attn-math", "core_attn-sdpa"])
def test_restoring_the_rng_state_is_what_keeps_recomputed_dropout_masks_equal(monkeypatch, setting, backend):
    # Same weights, same inputs, same seed: the only change is whether the checkpoint restores the
    # RNG state before re-running the forward. Without it the recomputed dropout masks differ, and
    # verify must see that in the gradients.
    from torch.utils.checkpoint import checkpoint as torch_checkpoint
    from recompute_bench.backends import pytorch
    cfg = config(**setting)
    assert cfg.model.attention_dropout > 0 and cfg.model.hidden_dropout > 0
    (kept,) = verify(cfg, [cfg.recompute], [backend], torch.device("cpu"))
    assert kept.exact
    monkeypatch.setattr(pytorch, "checkpoint",
                        lambda fn, *args: torch_checkpoint(fn, *args, use_reentrant=True, preserve_rng_state=False))
    (lost,) = verify(cfg, [cfg.recompute], [backend], torch.device("cpu"))
    assert lost.loss_diff == 0.0  # the forward is untouched
    assert lost.max_grad_diff > 1e-4  # the backward used other masks


def test_recompute_keeps_every_parameter_name():
    from recompute_bench.models.dense.layers import build_model
    from recompute_bench.recompute.apply import apply_recompute
    from recompute_bench.config.schema import RecomputeConfig
    cfg = config()
    names = [n for n, _ in build_model(cfg.model, 1).named_parameters()]
    for setting in [RecomputeConfig()] + all_settings(cfg.model.num_layers):
        model = apply_recompute(build_model(cfg.model, 1), setting)
        assert [n for n, _ in model.named_parameters()] == names, setting.label
        assert list(model.state_dict()) == list(build_model(cfg.model, 1).state_dict())


@pytest.mark.parametrize("n", [1, 3])
def test_full_uniform_keeps_only_each_chunk_input(n):
    cfg = config(**FULL("uniform", n))
    _, layer_bytes, _, _ = probe(cfg)
    s, b, h, L = cfg.training.seq_length, cfg.training.micro_batch_size, cfg.model.hidden_size, cfg.model.num_layers
    chunks = -(-L // n)
    assert layer_bytes == chunks * s * b * h * 4  # fp32: one [s, b, h] input per chunk, nothing else
    if n == 1:
        assert layer_bytes / L == s * b * h * 4


def test_full_block_keeps_inputs_of_checkpointed_layers_and_everything_else():
    cfg_none, cfg_block = config(), config(**FULL("block", 2))
    _, none_bytes, _, _ = probe(cfg_none)
    _, block_bytes, _, _ = probe(cfg_block)
    s, b, h, L = 128, 2, 64, 4
    assert block_bytes == 2 * s * b * h * 4 + (L - 2) * none_bytes // L


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("module", ["core_attn", "mlp", "layernorm"])
def test_each_selective_module_lowers_saved_bytes(module, backend):
    _, base, _, _ = probe(config(model__attention_backend=backend))
    _, sel, _, _ = probe(config(model__attention_backend=backend, **SELECTIVE(module)))
    assert sel < base


def test_layernorm_recompute_frees_exactly_the_norm_outputs_and_statistics():
    cfg = config()
    _, base, fwd_base, total_base = probe(cfg)
    _, ln, fwd_ln, total_ln = probe(config(**SELECTIVE("layernorm")))
    s, b, h, L = 128, 2, 64, 4
    # per layer: two [b, s, h] norm outputs and each norm's mean and rstd ([b, s] fp32)
    assert base - ln == L * 2 * (s * b * h * 4 + 2 * s * b * 4)
    assert total_ln == total_base  # re-running a norm costs no matmul FLOPs


def test_layernorm_recompute_together_with_mlp_recompute():
    _, mlp, _, _ = probe(config(**SELECTIVE("mlp")))
    _, both, _, _ = probe(config(**SELECTIVE("mlp", "layernorm")))
    s, b, h, L = 128, 2, 64, 4
    # the MLP checkpoint's saved input is the pre-MLP norm output: freed as well, with the input norm's
    assert mlp - both == L * 2 * (s * b * h * 4 + 2 * s * b * 4)


def test_core_attn_recompute_drops_the_s_squared_terms_of_math_attention():
    _, base, _, _ = probe(config(model__attention_backend="math"))
    _, sel, _, _ = probe(config(model__attention_backend="math", **SELECTIVE("core_attn")))
    a, s, b = 4, 128, 2
    # softmax output (4 B) + dropout mask (1 B) + dropout output (4 B) per score, in fp32
    assert base - sel >= a * s * s * b * (4 + 1 + 4)


def test_no_recompute_flops_are_three_forwards():
    _, _, fwd, total = probe(config())
    assert total == 3 * fwd


@pytest.mark.parametrize("setting,layers", [(FULL("uniform", 1), 4), (FULL("uniform", 3), 4), (FULL("block", 1), 1),
                                            (FULL("block", 3), 3)])
def test_full_recompute_adds_one_forward_of_the_checkpointed_layers(setting, layers):
    cfg = config(**setting)
    _, _, fwd, total = probe(config())
    _, _, _, total_full = probe(cfg)
    _, _, fwd_one_layer, _ = probe(config(model__num_layers=1))
    _, _, fwd_two_layers, _ = probe(config(model__num_layers=2))
    per_layer = fwd_two_layers - fwd_one_layer
    assert total_full - total == layers * per_layer


@pytest.mark.parametrize("setting,attr", [(SELECTIVE("core_attn"), "core_attn"), (SELECTIVE("mlp"), "mlp")])
def test_selective_recompute_flops_match_the_analytic_count(setting, attr):
    from recompute_bench.analysis.flops import hardware_flops_per_step, layer_forward_flops
    cfg = config(**setting)
    _, _, _, total = probe(cfg)
    _, _, _, total_none = probe(config())
    assert total - total_none == cfg.model.num_layers * layer_forward_flops(cfg, device="cpu")[attr]
    assert total == hardware_flops_per_step(config(training__global_batch_size=2, **setting), "cpu")


def test_two_builds_with_one_seed_are_identical():
    from recompute_bench.models.dense.layers import build_model
    cfg = config("llama3-8b", **{k.replace(".", "__"): v for k, v in SMALL_LLAMA.items()})
    a, b = build_model(cfg.model, 7), build_model(cfg.model, 7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    c = build_model(cfg.model, 8)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_offloaded_layers_keep_gradients_equal_and_leave_the_device():
    from recompute_bench.config.schema import RecomputeConfig
    from recompute_bench.measure.probe import SavedTensorProbe
    from recompute_bench.models.dense.layers import build_model
    from recompute_bench.recompute.apply import apply_recompute
    cfg = config()
    grads = []
    for offload in (0, 2):
        model = apply_recompute(build_model(cfg.model, 1), RecomputeConfig(activation_offload_layers=offload)).train()
        tokens = torch.randint(0, 512, (2, 129), generator=torch.Generator().manual_seed(0))
        torch.manual_seed(0)
        p = SavedTensorProbe(model)
        with p.watch():
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads.append(([q.grad for q in model.parameters()], p.bytes()[1]))
    (g0, bytes0), (g2, bytes2) = grads
    assert all(torch.equal(a, b) for a, b in zip(g0, g2))
    assert bytes2 == bytes0 // 2  # two of four identical layers packed by the offload hooks
