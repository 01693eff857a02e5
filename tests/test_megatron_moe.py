"""Framework megatron's MoE layer term by term (analysis/megatron/moe.py): what each recompute module,
dispatcher, routing assumption and parallel layout changes in what a rank keeps, and the MoE fields
this harness refuses because it cannot run them."""

import json

import pytest

from helpers import invoke
from recompute_bench.analysis.megatron import MegatronRun, moe, optimizer, parameters, stage_peak
from recompute_bench.analysis.megatron.layer import layer_saved_bytes
from recompute_bench.config.pipeline_split import model_chunks
from recompute_bench.ingest.megatron_args import config_from_megatron
from recompute_bench.config.schema import BadInput

H100 = MegatronRun("h100", ":4096:8")
# A small Megatron MoE run: s 1024, b 4, h 512, 8 experts of ffn 1024, top-2, grouped GEMM, tp 2 with
# sequence parallel, ep 4, etp 1 (experts on one rank each), 8 GPUs.
ARGS = {"--num-layers": 4, "--hidden-size": 512, "--num-attention-heads": 8, "--seq-length": 1024,
        "--max-position-embeddings": 1024, "--micro-batch-size": 4, "--global-batch-size": 32, "--bf16": True,
        "--disable-bias-linear": True, "--tensor-model-parallel-size": 2, "--sequence-parallel": True,
        "--expert-model-parallel-size": 4, "--expert-tensor-parallel-size": 1, "--num-experts": 8,
        "--moe-router-topk": 2, "--moe-ffn-hidden-size": 1024, "--moe-grouped-gemm": True,
        "--moe-token-dispatcher-type": "alltoall", "--use-distributed-optimizer": True}


def _cfg(**extra):
    return config_from_megatron({**ARGS, **{"--" + k.replace("_", "-"): v for k, v in extra.items()}}, world_size=8)


def test_balanced_routing_gives_each_rank_n_x_etp_x_k_rows_and_the_bound_the_whole_group():
    cfg = _cfg()
    n = 1024 * 4 // 2  # tokens of one sequence-parallel rank
    assert moe.local_tokens(cfg) == n and moe.dispatch_group(cfg) == 4 and moe.local_experts(cfg) == 2
    assert moe.routed_rows(cfg) == n * 1 * 2
    assert moe.routed_rows(cfg, "bound") == n * 4 * 2  # 4 ranks' tokens, each to both local experts
    # etp 2: each expert's columns split over 2 ranks, which both run the rows the pair receives
    wide = _cfg(expert_tensor_parallel_size=2, expert_model_parallel_size=2)
    assert moe.routed_rows(wide) == n * 2 * 2 and moe.routed_rows(wide, "bound") == n * 4 * 2
    # without expert parallel every routed copy runs here, whatever the routing
    alone = _cfg(expert_model_parallel_size=1)
    assert moe.routed_rows(alone) == moe.routed_rows(alone, "bound") == n * 2


def test_the_experts_keep_their_input_fc1_output_activation_and_fc2_input():
    cfg = _cfg()
    rows, saved = moe.routed_rows(cfg), moe.moe_saved_bytes(cfg)
    assert saved["experts.linear_fc1.input"] == 2 * rows * 512
    assert saved["experts.linear_fc1.output"] == saved["experts.activation_output"] == 2 * rows * 1024  # GeLU
    assert saved["experts.linear_fc2.input"] == 2 * rows * 1024
    swiglu = _cfg(swiglu=True)  # the fused weighted SwiGLU keeps fc1's 2f output and no activation output
    kept = moe.moe_saved_bytes(swiglu)
    assert kept["experts.linear_fc1.output"] == 2 * rows * 2048 and "experts.activation_output" not in kept


def test_selective_moe_modules_free_what_megatron_recomputes():
    cfg = _cfg()
    full = moe.moe_saved_bytes(cfg)
    act = moe.moe_saved_bytes(cfg, ["moe_act"])
    assert set(full) - set(act) == {"experts.activation_output", "experts.linear_fc2.input"}
    block = moe.moe_saved_bytes(cfg, ["moe"])  # the checkpoint keeps its input, the norm's output
    assert set(block) == {"pre_mlp_layernorm.input", "pre_mlp_layernorm.norm_stats", "pre_mlp_layernorm.output"}
    norm = moe.moe_saved_bytes(cfg, ["layernorm"])
    assert set(full) - set(norm) == {"pre_mlp_layernorm.norm_stats", "pre_mlp_layernorm.output"}
    shared = _cfg(moe_shared_expert_intermediate_size=512)
    with_shared, without = moe.moe_saved_bytes(shared), moe.moe_saved_bytes(shared, ["shared_experts"])
    assert set(with_shared) - set(without) == {"shared_experts.linear_fc1.output", "shared_experts.linear_fc2.input"}
    assert with_shared["shared_experts.linear_fc2.input"] == 2 * 1024 * 4 * 512 / 2  # [s, b, S / tp]


def test_alltoall_keeps_the_combined_copies_whatever_the_routing():
    # unpermute weights the combine all-to-all's output by the probabilities and keeps both: n x k
    # rows, the dispatcher's static num_out_tokens, under any routing; the experts' rows follow it.
    cfg = _cfg()
    balanced, bound = moe.moe_saved_bytes(cfg), moe.moe_saved_bytes(cfg, routing="bound")
    assert balanced["dispatcher.combined_tokens"] == bound["dispatcher.combined_tokens"] == 2 * 2048 * 2 * 512
    assert bound["experts.linear_fc1.input"] == 4 * balanced["experts.linear_fc1.input"]
    fused = moe.moe_saved_bytes(_cfg(moe_permute_fusion=True))
    assert "dispatcher.argsort" not in fused and fused["dispatcher.row_id_map"] == 4 * 2048 * (2 * 8 + 1)


def test_router_dtype_fp32_keeps_fp32_probabilities():
    bf16, fp32 = moe.moe_saved_bytes(_cfg()), moe.moe_saved_bytes(_cfg(moe_router_dtype="fp32"))
    rows = moe.routed_rows(_cfg())
    assert (bf16["experts.probs"], fp32["experts.probs"]) == (2 * rows, 4 * rows)
    assert fp32["dispatcher.permuted_probs"] == 2 * bf16["dispatcher.permuted_probs"]


def test_capacity_padding_gives_every_expert_its_capacity_from_every_rank():
    cfg = _cfg(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    cap = moe.capacity(cfg)
    assert cap == 2048 * 2 // 8  # ceil(n x k / E x 1.0)
    assert moe.routed_rows(cfg) == moe.routed_rows(cfg, "bound") == 2 * 4 * cap
    assert moe.sent_rows(cfg) == 8 * cap
    dropping = _cfg(moe_expert_capacity_factor=0.5)  # balanced routing fills half of each expert's share
    assert moe.routed_rows(dropping) == 2 * 4 * moe.capacity(dropping) < moe.routed_rows(_cfg())


def test_the_allgather_buffer_is_held_all_run():
    cfg = _cfg(moe_token_dispatcher_type="allgather")
    peak = stage_peak(cfg, 0, H100)
    assert peak.items["MoE allgather dispatcher's gathered tokens"] == 2 * 2048 * 4 * 512
    assert "MoE allgather dispatcher's gathered tokens" not in stage_peak(_cfg(), 0, H100).items


def test_expert_weights_shard_over_ep_and_etp_and_their_optimizer_over_expert_data_parallel():
    cfg = _cfg()
    assert moe.moe_layer_parameters(cfg)["expert"] == 2 * 2 * 512 * 1024  # 2 local experts, fc1 + fc2
    wide = _cfg(expert_tensor_parallel_size=2, expert_model_parallel_size=2)
    assert moe.moe_layer_parameters(wide)["expert"] == 4 * 2 * 512 * 1024 / 2
    # dp 4 (8 / tp 2); expert data parallel 8 / (etp 1 x ep 4) = 2
    assert (cfg.parallel.data_parallel_size, cfg.parallel.expert_data_parallel_size) == (4, 2)
    assert optimizer.bytes_per_parameter(cfg)["Adam moments"] == 8 / 4
    assert optimizer.bytes_per_parameter(cfg, expert=True)["Adam moments"] == 8 / 2
    groups = parameters.stage_parameter_groups(cfg, 0)
    assert groups["expert"] == 4 * moe.moe_layer_parameters(cfg)["expert"]


def test_dense_first_layers_keep_a_dense_mlp():
    cfg = _cfg(moe_layer_freq="([0]*1+[1]*3)", pipeline_model_parallel_size=2)
    run = H100
    assert [(c.first_layer, c.layers) for s in (0, 1) for c in model_chunks(cfg, s)] == [(0, 2), (2, 2)]
    dense, moe_layer = layer_saved_bytes(cfg, run, (), moe=False), layer_saved_bytes(cfg, run, (), moe=True)
    assert "linear_fc1.output" in dense and "experts.linear_fc1.input" not in dense
    assert "experts.linear_fc1.input" in moe_layer and "linear_fc1.output" not in moe_layer
    first, last = (parameters.stage_parameter_groups(cfg, s) for s in (0, 1))
    assert first["expert"] == moe.moe_layer_parameters(cfg)["expert"] and last["expert"] == 2 * first["expert"]


def test_the_report_carries_the_routing_spread():
    result = invoke("estimate", "-w", "tiny-moe", "--framework", "megatron", "--gpu", "h100", "--ep", "2", "--dp", "2",
                    "--json")
    assert result.exit_code == 0, result.output
    routing = json.loads(result.stdout)["routing"]
    assert routing["assumption"] == "balanced" and routing["dispatcher"] == "allgather"
    assert routing["routed_rows"]["bound"] == 2 * routing["routed_rows"]["balanced"]  # 2 ranks, 4 experts each, k 2
    assert routing["peak_allocated_bytes"]["bound"] > routing["peak_allocated_bytes"]["balanced"]
    assert "MoE routing" in result.stderr


@pytest.mark.parametrize("setting,words", [
    ("model.moe_token_dispatcher_type=allgather", "this harness dispatches tokens by all-to-all"),
    ("model.moe_router_load_balancing_type=sinkhorn", "aux_loss only"),
    ("model.moe_router_dtype=fp32", "model.moe_router_dtype is a setting of Megatron's MoE layers"),
    ("parallel.expert_tensor_parallel_size=2", "runs each expert on one rank"),
    ("parallel.overlap_moe_expert_parallel_comm=true", "combined 1F1B schedule"),
])
def test_the_harness_refuses_megatrons_moe_settings(setting, words):
    result = invoke("estimate", "-w", "tiny-moe", "--set", setting)
    assert result.exit_code == 2 and words in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_megatron_refuses_what_its_moe_layer_refuses():
    with pytest.raises(BadInput, match="takes no auxiliary loss"):
        _cfg(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.01)
    with pytest.raises(BadInput, match="needs moe_expert_capacity_factor"):
        _cfg(moe_pad_expert_input_to_capacity=True)
    with pytest.raises(BadInput, match="alltoall or flex"):
        _cfg(moe_shared_expert_intermediate_size=512, moe_shared_expert_overlap=True, moe_token_dispatcher_type="allgather")
    with pytest.raises(BadInput, match="expert_tensor_parallel_size 16 x expert_model_parallel_size 1 must divide the 8"):
        _cfg(expert_tensor_parallel_size=16, expert_model_parallel_size=1, tensor_model_parallel_size=1)
    with pytest.raises(BadInput, match="without pipeline parallelism only"):
        _cfg(overlap_moe_expert_parallel_comm=True, pipeline_model_parallel_size=2)
