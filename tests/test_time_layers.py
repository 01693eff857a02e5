"""The time model's layers beyond the dense one (analysis/megatron/time_moe.py, time_mla.py,
time_attention.py): mixture-of-experts, multi-latent attention and context parallel priced op by op,
their FLOPs against the FLOPs model split over the ranks, the bytes each collective sends and the
link that carries them, what each recompute module re-runs, and a step built layer by layer."""

import dataclasses

import pytest
from helpers import config

from recompute_bench.analysis import gpu_rates
from recompute_bench.analysis.megatron import MegatronRun
from recompute_bench.analysis.megatron import time_model as tm
from recompute_bench.analysis.megatron.time_moe import destination_ranks
from recompute_bench.config.schema import RecomputeConfig
from recompute_bench.models import spec_for
from recompute_bench.recompute.policy import LayerPolicy

H100 = gpu_rates.datasheet_rates("h100")
RUN = MegatronRun("h100")


def megatron(workload, **overrides):
    return config(workload, training__framework="megatron", **overrides)


def ops(cfg, layer=0, forward=True):
    layer_ops = tm.layer_ops(cfg, RUN, layer)
    return {op.name: op for op in (layer_ops.forward if forward else layer_ops.backward)}


def rerun(cfg, *modules, layer=0):
    return [op.name for op in tm.recompute_ops(tm.layer_ops(cfg, RUN, layer), LayerPolicy(modules=frozenset(modules)))]


# ----- mixture of experts ----------------------------------------------------------------------

MIXTRAL = {"parallel__tensor_model_parallel_size": 2, "parallel__sequence_parallel": True,
           "parallel__expert_model_parallel_size": 4, "parallel__data_parallel_size": 4}


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather", "flex"])
def test_the_experts_and_router_flops_are_the_flops_model_s_split_over_the_ranks(dispatcher):
    cfg = megatron("mixtral-8x7b", model__moe_token_dispatcher_type=dispatcher, **MIXTRAL)
    fwd = ops(cfg)
    parts = spec_for(cfg.model).layer_flops(cfg, None, "cuda")  # every layer is a MoE layer
    t = cfg.parallel.tensor_model_parallel_size
    # balanced routing: each rank's experts run n x etp x k rows of its n = s b / t tokens
    assert (fwd["experts.linear_fc1"].flops + fwd["experts.linear_fc2"].flops) * t == parts["experts"].forward
    assert fwd["router.gating"].flops * t == parts["router"].forward
    bwd = ops(cfg, forward=False)
    for name in ("experts.linear_fc1", "experts.linear_fc2"):
        assert bwd[f"{name}.dgrad"].flops == bwd[f"{name}.wgrad"].flops == fwd[name].flops
    assert "linear_fc1" not in fwd and "mlp_bda" in fwd  # the MoE block in the MLP's place


def test_each_dispatcher_sends_its_bytes_over_its_group():
    e, h, k, s = 2, 4096, 2, 4096
    n = s // 2  # the rank's sequence shard (tp 2, sequence parallel)
    a2a = ops(megatron("mixtral-8x7b", model__moe_token_dispatcher_type="alltoall", **MIXTRAL))
    # the n x k routed copies, (ep - 1)/ep of them to the other expert ranks (members etp = 2 apart)
    op = a2a["moe.dispatch_all_to_all"]
    assert (op.bytes, op.group, op.stride, op.pattern) == (3 / 4 * e * n * k * h, 4, 2, "all_to_all")
    # then each rank of the etp pair gathers the other's received rows
    assert a2a["moe.dispatch_all_gather"].bytes == 1 * e * n * k * h and a2a["moe.dispatch_all_gather"].group == 2
    assert a2a["moe.combine_all_to_all"].bytes == op.bytes
    gather = ops(megatron("mixtral-8x7b", model__moe_token_dispatcher_type="allgather", **MIXTRAL))
    # the tokens, probabilities (bf16) and routing map (bool) of the 8 ranks of etp x ep
    op = gather["moe.dispatch_all_gather"]
    assert (op.bytes, op.group, op.stride) == (7 * n * (e * h + 8 * (2 + 1)), 8, 1)
    assert gather["moe.combine_reduce_scatter"].bytes == 7 * n * e * h
    flex = megatron("mixtral-8x7b", model__moe_token_dispatcher_type="flex", **MIXTRAL)
    # DeepEP sends a token once per rank holding one of its experts: 8 experts on 4 expert ranks (2 each),
    # top-2, each expert shared by the etp pair
    assert destination_ranks(flex) == pytest.approx(2 * 4 * (1 - (6 * 5) / (8 * 7)))
    assert ops(flex)["moe.dispatch_all_to_all"].bytes == pytest.approx(7 / 8 * e * n * destination_ranks(flex) * h)


def test_a_group_beyond_the_nvlink_domain_crosses_the_network():
    nbytes = 1e9
    assert H100.comm_seconds(nbytes, 8, 1, "all_to_all") == pytest.approx(nbytes / 450e9)
    # 16 ranks 2 apart span 32 GPUs: 3 of a rank's 15 peers share its 8-GPU domain
    outside = (16 - 4) / 15
    assert H100.comm_seconds(nbytes, 16, 2, "all_to_all") == pytest.approx(
        max(nbytes * (1 - outside) / 450e9, nbytes * outside / 50e9))
    assert H100.comm_seconds(nbytes, 4, 4, "ring") == pytest.approx(nbytes / 50e9)  # a ring's slowest hop
    gb200 = gpu_rates.datasheet_rates("gb200")
    assert gb200.comm_seconds(nbytes, 64, 1, "all_to_all") == pytest.approx(nbytes / 900e9)  # NVL72: one domain
    wide = megatron("qwen3-30b-a3b", parallel__expert_model_parallel_size=16, parallel__data_parallel_size=16,
                    model__moe_token_dispatcher_type="alltoall")
    op = ops(wide)["moe.dispatch_all_to_all"]
    assert op.seconds(H100) == pytest.approx(H100.comm_seconds(op.bytes, 16, 1, "all_to_all"))
    assert op.seconds(H100) > op.bytes / 450e9  # half its peers are in the next domain


def test_what_each_moe_module_re_runs():
    cfg = megatron("tiny-mla", model__multi_latent_attention=False, model__q_lora_rank=None)
    moe_layer = 1  # tiny-mla's pattern [0, 1]: a dense layer, then a MoE layer
    block = rerun(cfg, "moe", layer=moe_layer)
    assert {"router.gating", "router.scores", "moe.permute", "experts.linear_fc1", "experts.activation",
            "experts.linear_fc2", "moe.unpermute", "shared_experts.linear_fc1", "shared_experts.linear_fc2"} <= set(block)
    assert "pre_mlp_layernorm" not in block and "linear_qkv" not in block
    assert rerun(cfg, "moe_act", layer=moe_layer) == ["experts.activation"]
    assert set(rerun(cfg, "shared_experts", layer=moe_layer)) == {"shared_experts.linear_fc1", "shared_experts.activation",
                                                                  "shared_experts.linear_fc2"}
    assert rerun(cfg, "layernorm", layer=moe_layer) == ["pre_mlp_layernorm"]  # the MoE layer's own TENorm
    assert rerun(cfg, "mlp", layer=moe_layer) == [] and rerun(cfg, "moe", layer=0) == []
    # moe_act's checkpoint inside moe's runs its part once more when moe's recompute builds its graph
    both = rerun(cfg, "moe", "moe_act", layer=moe_layer)
    assert both.count("experts.activation") == 2 and both.count("experts.linear_fc1") == 1
    # the FLOPs model counts the same: the shared experts a third time inside a moe recompute
    spec = spec_for(cfg.model)
    nested = spec.selective_recompute_flops(cfg, ["moe", "shared_experts"]) - spec.selective_recompute_flops(cfg, ["moe"])
    shared = rerun(cfg, "moe", "shared_experts", layer=moe_layer)
    assert shared.count("shared_experts.linear_fc1") == 2 and nested > 0


def test_fp8_runs_the_grouped_experts_at_fp8_s_rate_and_the_router_in_16_bits():
    cfg = megatron("mixtral-8x7b", **MIXTRAL)
    fp8 = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, precision="fp8", fp8_recipe="tensorwise"))
    fwd = ops(fp8)
    assert fwd["experts.linear_fc1"].precision == "fp8" and fwd["router.gating"].precision == "bf16"
    assert "experts.linear_fc2.quantize" in rerun(fp8, "moe_act")  # fc2 quantises its original input again


# ----- multi-latent attention ------------------------------------------------------------------


def test_mla_s_projections_and_attention_are_the_flops_model_s():
    cfg = megatron("tiny-mla")
    fwd = ops(cfg)
    parts = spec_for(cfg.model).layer_flops(cfg, None, "cuda")
    assert fwd["linear_q_down_proj"].flops + fwd["linear_kv_down_proj"].flops == parts["qkv_down_proj"].forward
    assert fwd["linear_q_up_proj"].flops + fwd["linear_kv_up_proj"].flops == parts["qkv_up_proj"].forward
    assert fwd["linear_proj"].flops == parts["out_proj"].forward
    m, b, s = cfg.model, 2, 64
    # the causal half over qk + r query/key dims and v value dims
    pairs = s * (s + 1) / 2
    assert fwd["core_attention"].flops == b * m.num_attention_heads * pairs * 2 * (
        m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim)


def test_mla_up_proj_re_runs_the_up_projections_and_rope_only():
    cfg = megatron("tiny-mla", parallel__tensor_model_parallel_size=2, parallel__sequence_parallel=True,
                   model__attention_dropout=0.0, model__hidden_dropout=0.0, parallel__data_parallel_size=2)
    assert set(rerun(cfg, "mla_up_proj")) == {"linear_q_up_proj.all_gather", "linear_q_up_proj",
                                              "linear_kv_up_proj.all_gather", "linear_kv_up_proj", "rotary"}
    assert rerun(cfg, "layernorm") == ["input_layernorm"]  # MLA's input norm is a TENorm of its own
    fwd = ops(cfg)
    # the duplicated down projections run on the rank's sequence shard, whole weights
    assert fwd["linear_kv_down_proj"].flops == 2 * (2 * 64 / 2) * 64 * (32 + 8)


# ----- context parallel ------------------------------------------------------------------------


def _cp(comm, cp=2, **overrides):
    return megatron("llama3-8b", parallel__context_parallel_size=cp, parallel__cp_comm_type=comm,
                    parallel__tensor_model_parallel_size=2, parallel__sequence_parallel=True, **overrides)


def test_context_parallel_splits_every_op_s_tokens_and_attention_s_pairs():
    one, two = ops(_cp("p2p", cp=1)), ops(_cp("p2p"))
    assert two["linear_qkv"].flops == one["linear_qkv"].flops / 2
    assert two["core_attention"].flops == pytest.approx(one["core_attention"].flops / 2)


def test_the_p2p_ring_hides_its_sends_behind_every_attention_step_but_the_last():
    cfg = _cp("p2p", cp=4)
    fwd = ops(cfg)
    ring = fwd["core_attention.kv_ring"]
    e, tokens, kv_heads, d = 2, 8192 // 4, 8 // 2, 128
    assert ring.bytes == 3 * e * tokens * kv_heads * 2 * d  # K and V of the rank's chunk, cp - 1 times
    assert (ring.group, ring.stride, ring.overlaps, ring.overlap_share) == (4, 2, "core_attention", 3 / 4)
    times = tm.op_times(tm.layer_ops(cfg, RUN).forward, H100)
    attention = fwd["core_attention"].seconds(H100)
    assert times["core_attention.kv_ring"] == pytest.approx(max(0.0, ring.seconds(H100) - 3 / 4 * attention))
    bwd = ops(cfg, forward=False)
    assert bwd["core_attention.backward.kv_dkv_ring"].bytes == 2 * ring.bytes  # K/V and their gradients
    assert {"core_attention", "core_attention.kv_ring", "core_attention.output_correction"} <= set(rerun(cfg, "core_attn"))


def test_all_gather_and_a2a_exchange_before_the_attention_runs():
    gather = ops(_cp("all_gather"))
    op = gather["core_attention.kv_all_gather"]
    assert op.overlaps is None and op.bytes == 1 * 2 * 4096 * 4 * 2 * 128
    assert "core_attention.dkv_reduce_scatter" in ops(_cp("all_gather"), forward=False)
    a2a = ops(_cp("a2a"))
    op = a2a["core_attention.qkv_all_to_all"]
    q, kv = 4096 * 16 * 128, 4096 * 4 * 128
    assert (op.bytes, op.pattern, op.group) == (1 / 2 * 2 * (q + 2 * kv), "all_to_all", 2)
    assert a2a["core_attention.output_all_to_all"].bytes == 1 / 2 * 2 * q


# ----- the step, layer by layer ----------------------------------------------------------------


def test_the_step_prices_each_layer_by_its_kind():
    cfg = megatron("tiny-mla", training__global_batch_size=2)  # one micro-batch: a dense layer, a MoE layer
    step = tm.step_time(cfg, RUN, H100)
    layers = [tm.layer_ops(cfg, RUN, i) for i in range(2)]
    outside = [tm.embedding_ops(cfg), tm.loss_ops(cfg)]
    expected = sum(tm.pass_seconds(x.forward, H100) + tm.pass_seconds(x.backward, H100) for x in layers + outside)
    assert step.microbatch_seconds == [pytest.approx(expected)]
    assert "linear_fc1" in {op.name for op in layers[0].forward} and "experts.linear_fc1" in {
        op.name for op in layers[1].forward}


def test_fp8_s_bf16_first_and_last_layers_run_their_gemms_in_bf16():
    cfg = megatron("llama3-8b", training__precision="fp8", training__fp8_recipe="tensorwise",
                   training__first_last_layers_bf16=True)
    assert ops(cfg, 0)["linear_fc1"].precision == "bf16" and ops(cfg, 1)["linear_fc1"].precision == "fp8"
    assert ops(cfg, 31)["linear_fc1"].precision == "bf16"
    assert step_with(cfg, RecomputeConfig()).step_seconds > step_with(
        dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, first_last_layers_bf16=False)),
        RecomputeConfig()).step_seconds


def step_with(cfg, r):
    return tm.step_time(dataclasses.replace(cfg, recompute=r), RUN, H100)


def test_a_mix_s_micro_batch_is_no_recompute_s_plus_what_each_layer_re_runs():
    """The additivity plan --auto prices per-layer mixes by before it asks the memory model."""
    from recompute_bench.analysis.megatron.plan import _policy_config

    cfg = megatron("mixtral-8x7b", **MIXTRAL, parallel__pipeline_model_parallel_size=2,
                   model__moe_layer_freq="([0]*2+[1]*30)")
    pattern = [LayerPolicy(chunk=0), LayerPolicy(modules=frozenset({"moe_act", "layernorm"}))] + \
        [LayerPolicy()] * 14
    mixed = tm.step_time(_policy_config(cfg, pattern), RUN, H100)
    none = tm.step_time(cfg, RUN, H100)
    for stage, first in ((0, 0), (1, 16)):
        added = sum(tm.layer_seconds(cfg, RUN, H100, pattern[j % 16], j)["recompute"] for j in range(first, first + 16))
        assert mixed.microbatch_seconds[stage] == pytest.approx(none.microbatch_seconds[stage] + added)
    # layer 0 is dense (its full forward re-run), layer 1 dense (layernorm with TE: nothing), 16 MoE, 17 MoE
    assert tm.layer_seconds(cfg, RUN, H100, pattern[1], 1)["recompute"] == 0.0
    assert tm.layer_seconds(cfg, RUN, H100, pattern[1], 17)["recompute"] > 0.0
