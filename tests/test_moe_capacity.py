"""Token dropping (Megatron's moe_expert_capacity_factor / moe_token_drop_policy) on tiny-moe."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import config, invoke, probe

from recompute_bench.analysis import flops
from recompute_bench.analysis.harness.stage import activation_bytes
from recompute_bench.config.schema import RecomputeConfig
from recompute_bench.measure.probe import tokens_per_expert
from recompute_bench.measure.verify import verify
from recompute_bench.models import spec_for
from recompute_bench.models.moe.capacity import expert_capacity
from recompute_bench.workload import resolved

ONE_STEP = {"training__global_batch_size": 2}


def capped(policy, **overrides):
    return config("tiny-moe", model__moe_expert_capacity_factor=0.5, model__moe_token_drop_policy=policy,
                  training__precision="fp32", **ONE_STEP, **overrides)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_dropped_rows_add_nothing_and_the_experts_run_at_most_capacity_rows(policy):
    cfg = capped(policy)
    m = cfg.model
    model = spec_for(m).build(cfg, "cpu", torch.float32).eval()
    layer = model.layers[0].mlp
    x = torch.randn(cfg.training.micro_batch_size, cfg.training.seq_length, m.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = layer(x)
        probs, experts = layer.router(x)
    tokens = x.shape[0] * x.shape[1]
    cap = expert_capacity(tokens, m.moe_router_topk, m.num_moe_experts, 0.5)
    counts = torch.bincount(experts.reshape(-1), minlength=m.num_moe_experts)
    assert counts.max() > cap  # some rows are dropped
    assert int(layer.tokens_per_expert.sum()) == int(counts.clamp(max=cap).sum())
    assert int(layer.tokens_dropped) == tokens * m.moe_router_topk - int(counts.clamp(max=cap).sum())
    # the reference: per expert, the kept copies (highest probability, or first tokens), one matmul each
    xs, p, e = x.reshape(tokens, -1), probs.reshape(tokens, -1), experts.reshape(tokens, -1)
    ref = layer.shared_experts(x).reshape(tokens, -1)
    fc1, fc2 = layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight
    for expert in range(m.num_moe_experts):
        copies = [(t, j) for t in range(tokens) for j in range(m.moe_router_topk) if e[t, j] == expert]
        if policy == "probs":
            copies.sort(key=lambda c: -p[c].item())
        for t, j in copies[:cap]:
            gate, up = (xs[t] @ fc1[expert].T).chunk(2)
            ref[t] = ref[t] + (F.silu(gate) * up * p[t, j]) @ fc2[expert].T
    torch.testing.assert_close(y.reshape(tokens, -1), ref, rtol=1e-5, atol=1e-6)
    assert tokens_per_expert(model)["tokens_dropped"] == int(layer.tokens_dropped)


@pytest.mark.parametrize("policy,recompute", [("probs", RecomputeConfig()),
                                              ("position", RecomputeConfig("selective", modules=["moe_act", "layernorm"])),
                                              ("probs", RecomputeConfig("selective", modules=["moe"]))])
def test_capacity_bytes_and_flops_are_what_the_probe_and_the_flop_counter_measure(policy, recompute):
    # factor 0.5 on tiny-moe's random routing fills every expert: the experts run E x capacity rows,
    # the estimate's min(tokens x k, E x capacity)
    cfg = dataclasses.replace(capped(policy), recompute=recompute)
    total, _, _, counted = probe(cfg)
    assert activation_bytes(cfg, "cpu")["activation_bytes"] == total
    assert flops.hardware_flops_per_step(cfg, "cpu") == counted
    dropless = resolved(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_expert_capacity_factor=None)))
    assert flops.hardware_flops_per_step(cfg, "cpu") < flops.hardware_flops_per_step(dropless, "cpu")


def test_capacity_under_expert_parallel_is_refused_in_one_line(tmp_path):
    result = invoke("run", "--device", "cpu", "--results", str(tmp_path / "r.jsonl"), "-w", "tiny-moe",
                    "--nproc-per-node", "2", "--ep", "2", "--set", "model.moe_expert_capacity_factor=1.0")
    assert result.exit_code == 2 and "under expert parallel is not modelled" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_recompute_with_token_dropping_leaves_loss_and_gradients_bitwise_equal():
    # the drop is chosen again in a `moe` recompute: the same rows, since routing re-runs bitwise
    cfg = config("tiny-moe", model__moe_expert_capacity_factor=0.5)
    settings = [RecomputeConfig("selective", modules=mods) for mods in (["moe"], ["moe_act"], ["moe", "shared_experts"])]
    settings.append(RecomputeConfig("full", method="uniform", num_layers=1))
    outcomes = verify(cfg, settings, ["sdpa"], torch.device("cpu"))
    assert len(outcomes) == 4 and all(o.exact for o in outcomes), [(o.setting, o.max_grad_diff) for o in outcomes]


def test_the_paper_comparison_says_dropless_only_without_a_capacity_factor():
    from recompute_bench.analysis.paper import paper_layer_differences
    moe = lambda cfg: next(d for d in paper_layer_differences(cfg) if "mixture-of-experts" in d)  # noqa: E731
    assert "dropless" in moe(config("tiny-moe"))
    assert "dropless" not in moe(capped("probs")) and "capacity factor 0.5" in moe(capped("probs"))
