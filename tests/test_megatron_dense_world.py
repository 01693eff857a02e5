"""Framework megatron's dense world beyond an even split and Adam in fp32: Megatron's arguments map
onto the fields, each term is pinned where a golden of Megatron-LM's functional tests isolates it,
and what Megatron rejects is refused in one line."""

import json
from pathlib import Path

import pytest
from helpers import invoke

from recompute_bench.analysis import megatron as mg
from recompute_bench.analysis.megatron import attention, layer, optimizer, outside
from recompute_bench.analysis.megatron.parameters import layer_parameters, stage_parameters
from recompute_bench.analysis.megatron.stage import DEFERRED_WGRAD_ITEM
from recompute_bench.analysis.megatron_schedule import chunk_forwards_in_flight
from recompute_bench.config.pipeline_split import ModelChunk, model_chunks, parse_layout
from recompute_bench.config.schema import BadInput
from recompute_bench.ingest.megatron_args import config_from_megatron

CASES = json.loads((Path(__file__).parent / "data" / "megatron" / "cases.json").read_text())
MiB = 2**20
SMALL = {"--num-layers": 12, "--hidden-size": 512, "--num-attention-heads": 8, "--seq-length": 1024,
         "--max-position-embeddings": 1024, "--micro-batch-size": 4, "--global-batch-size": 32, "--bf16": True}


def _case(name):
    return next(c for c in CASES["cases"] if c["case"] == name)


def _estimates(name):
    """(cfg, peak on the last stage, golden) for every golden of a case."""
    case = _case(name)
    for golden, g in case["goldens"].items():
        cfg = config_from_megatron(case["args"], world_size=g["gpus"])
        run = mg.MegatronRun(golden.split("_")[1], case["env"].get("CUBLAS_WORKSPACE_CONFIG"))
        yield cfg, mg.stage_peak(cfg, cfg.parallel.pipeline_model_parallel_size - 1, run), g


def test_the_dense_world_arguments_map_onto_the_fields():
    cfg = config_from_megatron({**SMALL, "--pipeline-model-parallel-size": 4, "--decoder-first-pipeline-num-layers": 2,
                                "--decoder-last-pipeline-num-layers": 2}, world_size=8)
    assert (cfg.parallel.decoder_first_pipeline_num_layers, cfg.parallel.decoder_last_pipeline_num_layers) == (2, 2)
    # validate_args counts the embedding and loss as layers before splitting into virtual stages
    cfg = config_from_megatron({**SMALL, "--num-layers": 6, "--pipeline-model-parallel-size": 4,
                                "--num-layers-per-virtual-pipeline-stage": 1, "--account-for-embedding-in-pipeline-split": True,
                                "--account-for-loss-in-pipeline-split": True}, world_size=8)
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2
    cfg = config_from_megatron({**SMALL, "--pipeline-model-parallel-size": 2, "--pipeline-model-parallel-layout": "Ettt|(tt|)*4tL"},
                               world_size=8)
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 3  # 6 stages / pp 2
    dump = {**SMALL, "--use-distributed-optimizer": True, "--use-precision-aware-optimizer": True,
            "--main-grads-dtype": "torch.bfloat16", "--exp-avg-dtype": "torch.uint8", "--exp-avg-sq-dtype": "bf16",
            "--num-distributed-optimizer-instances": 2, "--no-create-attention-mask-in-dataloader": True,
            "--qk-layernorm": True, "--squared-relu": True, "--cross-entropy-loss-fusion": True,
            "--cross-entropy-fusion-impl": "te", "--no-rope-fusion": True}
    cfg = config_from_megatron(dump, world_size=8)
    t, m, p = cfg.training, cfg.model, cfg.parallel
    assert (t.main_grads_dtype, t.main_params_dtype, t.exp_avg_dtype, t.exp_avg_sq_dtype) == ("bf16", "fp32", "fp8", "bf16")
    assert t.use_precision_aware_optimizer and p.num_distributed_optimizer_instances == 2
    assert not t.create_attention_mask_in_dataloader and m.qk_layernorm and not m.apply_rope_fusion
    assert m.activation == "squared_relu" and m.ffn_hidden_size == 4 * 512
    assert m.cross_entropy_loss_fusion and m.cross_entropy_fusion_impl == "te"
    # multi-latent attention: argparse's defaults fill what a yaml leaves out (--kv-lora-rank 32)
    cfg = config_from_megatron({**SMALL, "--multi-latent-attention": True, "--q-lora-rank": 192}, world_size=8)
    m = cfg.model
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim) == (192, 32, 128, 64, 128)


def test_a_layout_places_every_layer_and_the_uneven_splits_follow_get_num_layers_to_build():
    assert parse_layout("Et*3|(tt|)*2tm,L") == ["Ettt", "tt", "tt", "tmL"]
    cfg = config_from_megatron({**SMALL, "--num-layers": 8, "--pipeline-model-parallel-size": 2,
                                "--pipeline-model-parallel-layout": "Et*3|(tt|)*2tL"}, world_size=2)
    # stage i is pp rank i % 2, virtual stage i // 2; each chunk's first layer counts the layers of
    # every virtual stage before it (get_transformer_layer_offset)
    assert model_chunks(cfg, 0) == [ModelChunk(3, embedding=True, first_layer=0), ModelChunk(2, first_layer=5)]
    assert model_chunks(cfg, 1) == [ModelChunk(2, first_layer=3), ModelChunk(1, loss=True, first_layer=7)]
    cfg = config_from_megatron({**SMALL, "--pipeline-model-parallel-size": 4, "--decoder-first-pipeline-num-layers": 2,
                                "--decoder-last-pipeline-num-layers": 2}, world_size=8)
    assert [model_chunks(cfg, r)[0].layers for r in range(4)] == [2, 4, 4, 2]
    cfg = config_from_megatron({**SMALL, "--num-layers": 6, "--pipeline-model-parallel-size": 4,
                                "--num-virtual-stages-per-pipeline-rank": 2, "--account-for-embedding-in-pipeline-split": True,
                                "--account-for-loss-in-pipeline-split": True}, world_size=8)
    assert [[c.layers for c in model_chunks(cfg, r)] for r in range(4)] == [[0, 1], [1, 1], [1, 1], [1, 0]]


@pytest.mark.parametrize("extra,words", [
    ({"--pipeline-model-parallel-size": 2, "--pipeline-model-parallel-layout": "Et*6|t*6xL"}, "unknown layer characters x"),
    ({"--pipeline-model-parallel-size": 2, "--pipeline-model-parallel-layout": "Et*5|t*6L"}, "places 11 layers"),
    ({"--pipeline-model-parallel-size": 4, "--decoder-first-pipeline-num-layers": 2}, "do not split evenly"),
    ({"--pipeline-model-parallel-size": 4, "--account-for-loss-in-pipeline-split": True}, "not divisible by pipeline"),
    ({"--pipeline-model-parallel-size": 4, "--num-layers-per-virtual-pipeline-stage": 1,
      "--microbatch-group-size-per-virtual-pipeline-stage": 3}, "microbatch_group_size_per_vp_stage 3"),
    ({"--num-distributed-optimizer-instances": 3, "--use-distributed-optimizer": True}, "must divide the data-parallel"),
    ({"--defer-embedding-wgrad-compute": True}, "Cannot defer embedding wgrad compute"),
    ({"--use-precision-aware-optimizer": True}, "runs under the distributed optimizer only"),
])
def test_what_megatron_rejects_is_refused_in_one_line(extra, words):
    with pytest.raises(BadInput) as e:
        config_from_megatron({**SMALL, **extra}, world_size=8)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_harness_refuses_megatron_only_settings():
    result = invoke("estimate", "--set", "model.qk_layernorm=true")
    assert result.exit_code == 2 and "model.qk_layernorm is a Megatron argument" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = invoke("estimate", "--framework", "megatron", "--set", "parallel.pipeline_model_parallel_layout=Et|tL",
                    "--pp", "2")
    assert result.exit_code == 2 and "pipeline_model_parallel_layout" in result.stderr


def test_the_attention_mask_is_b_s_s_bytes_on_the_last_stage():
    # pretrain_gpt.py get_batch moves the [b, 1, s, s] bool mask to the GPU unless the data loader
    # makes none: 4 x 1024 x 1024 = 4 MiB at the loss's forward. The goldens of the case with and
    # without --no-create-attention-mask-in-dataloader (otherwise the same arguments) differ by 2 to 8 MiB.
    masked = config_from_megatron({**SMALL, "--pipeline-model-parallel-size": 2}, world_size=8)
    bare = config_from_megatron({**SMALL, "--pipeline-model-parallel-size": 2,
                                 "--no-create-attention-mask-in-dataloader": True}, world_size=8)
    run = mg.MegatronRun("a100")
    assert outside.batch_bytes(masked) - outside.batch_bytes(bare) == 4 * MiB
    assert mg.stage_peak(masked, 1, run).peak_allocated_bytes - mg.stage_peak(bare, 1, run).peak_allocated_bytes == 4 * MiB
    with_mask, without = _case("gpt3_mcore_te_tp2_pp2")["goldens"], _case(
        "gpt3_mcore_te_tp2_pp2_no_create_attention_mask_in_dataloader")["goldens"]
    for golden in ("dev_a100", "lts_a100"):
        assert 2 * MiB <= with_mask[golden]["max_allocated_bytes"] - without[golden]["max_allocated_bytes"] <= 8 * MiB
    for cfg, peak, g in _estimates("gpt3_mcore_te_tp2_pp2_no_create_attention_mask_in_dataloader"):
        assert abs(peak.peak_allocated_bytes / g["max_allocated_bytes"] - 1) < 0.01


def test_query_key_norms_keep_their_inputs_and_statistics():
    name = "gpt3_mcore_te_tp4_pp1_resume_torch_dist_qk_layernorm_test_mode"
    args = _case(name)["args"]
    normed, run = config_from_megatron(args, world_size=8), mg.MegatronRun("h100")
    plain = config_from_megatron({k: v for k, v in args.items() if k != "--qk-layernorm"}, world_size=8)
    # fused attention on H100: each norm saves `input_.contiguous()` (2 heads of 64 per rank over
    # 4096 tokens, bf16) and fp32 mean and rstd per head; k becomes a new tensor (the norm's output)
    # where it was a view of the QKV output; q was the view too (8 heads, 8 groups: no reshape copy)
    tokens, heads, d = 4096, 2, 64
    extra = 2 * (2 * tokens * heads * d + 2 * 4 * tokens * heads) + 2 * (2 * tokens * heads * d)
    assert layer.layer_bytes(normed, run) - layer.layer_bytes(plain, run) == extra
    assert layer_parameters(normed) - layer_parameters(plain) == 2 * 2 * d  # two LayerNorms of one head
    for cfg, peak, g in _estimates(name):
        assert abs(peak.peak_allocated_bytes / g["max_allocated_bytes"] - 1) < 0.025
        assert abs(peak.static_bytes / g["allocated_bytes"] - 1) < 0.002


def test_several_optimizer_instances_shard_within_one_instance():
    # tp 2 on 8 GPUs: dp 4, two instances of 2 ranks each: Adam's 12 bytes over 2, not 4
    for cfg, peak, g in _estimates("gpt3_mcore_te_tp2_pp1_resume_torch_dist_multi_dist_optimizer_instances"):
        dp = cfg.parallel.data_parallel_size
        assert optimizer.distributed_optimizer_shards(cfg) == dp // 2
        assert optimizer.bytes_per_parameter(cfg)["Adam moments"] == 8 / (dp // 2)
        assert abs(peak.static_bytes / g["allocated_bytes"] - 1) < 0.01
        assert abs(peak.peak_allocated_bytes / g["max_allocated_bytes"] - 1) < 0.02


def test_an_interleaving_group_of_five_holds_more_chunk_forwards():
    # pp 4, 3 chunks per rank, 5 micro-batches in one group: the last rank's warm-up is
    # (vp - 1) x group = 10 chunk forwards, 11 held at once, where a group of p would hold 9
    name = "gpt3_mcore_te_tp1_pp4_vp1_tunable_overlap"
    cfg = config_from_megatron(_case(name)["args"], world_size=8)
    assert cfg.parallel.microbatch_group_size_per_vp_stage == 5 and cfg.num_microbatches == 5
    assert chunk_forwards_in_flight(cfg, 3) == (3 - 1) * 5 + 1
    for cfg, peak, g in _estimates(name):
        assert abs(peak.peak_allocated_bytes / g["max_allocated_bytes"] - 1) < 0.01


def test_uneven_stages_hold_their_own_layers():
    # 12 layers over pp 4 with 2 first and 2 last: the last rank holds 2 layers, the output layer and
    # the loss; the parameters are its 2 layers, the final norm and the untied output layer
    for cfg, peak, g in _estimates("gpt3_mcore_te_tp1_pp4_vp1_uneven_pipeline"):
        assert peak.parameters == 2 * layer_parameters(cfg) + 2 * 512 + 50304 * 512
        assert abs(peak.peak_allocated_bytes / g["max_allocated_bytes"] - 1) < 0.01
        assert abs(peak.static_bytes / g["allocated_bytes"] - 1) < 0.02
    for cfg, peak, g in _estimates("gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split"):
        assert stage_parameters(cfg, 3) == layer_parameters(cfg) + 2 * 512 + 50304 * 512  # the loss's chunk has none
        assert abs(peak.peak_allocated_bytes / g["max_allocated_bytes"] - 1) < 0.011


def test_deferred_embedding_gradients_hold_two_logit_gradients():
    # --wgrad-deferral-limit 2: the output layer keeps the first two micro-batches' bf16 logit
    # gradients (4096 tokens x 50432 / 2 vocabulary rows) and inputs (no sequence parallel) until
    # the pipeline flush, so the later loss forwards run beside them
    name = "gpt3_mcore_te_tp2_pp2_defer_embedding_wgrad_compute"
    for cfg, peak, g in _estimates(name):
        assert peak.items[DEFERRED_WGRAD_ITEM] == 2 * (2 * 4096 * 25216 + 2 * 4096 * 512)
        assert abs(peak.peak_allocated_bytes / g["max_allocated_bytes"] - 1) < 0.015
    for cfg, peak, g in _estimates("gpt3_mcore_te_tp2_pp2_resume_torch_dist_defer_embedding_wgrad_compute"):
        assert abs(peak.peak_allocated_bytes / g["max_allocated_bytes"] - 1) < 0.04


def test_transformer_engines_cross_entropy_holds_six_bytes_per_logit():
    native = config_from_megatron({**SMALL, "--cross-entropy-loss-fusion": True}, world_size=8)
    te = config_from_megatron({**SMALL, "--cross-entropy-loss-fusion": True, "--cross-entropy-fusion-impl": "te"},
                              world_size=8)
    assert outside.loss_peak_bytes(native) == 10 * outside.logits(native)
    assert outside.loss_peak_bytes(te) == 6 * outside.logits(te) and outside.loss_saved_bytes(te) == 4 * outside.logits(te)


def test_the_output_gate_and_the_qkv_bias_widen_linear_qkv():
    plain = config_from_megatron({**SMALL, "--disable-bias-linear": True}, world_size=8)
    gated = config_from_megatron({**SMALL, "--disable-bias-linear": True, "--attention-output-gate": True,
                                  "--add-qkv-bias": True}, world_size=8)
    h, run = 512, mg.MegatronRun("h100")
    # linear_qkv grows by a x d = h columns, with a bias on all (a + 2g) d + a d of them
    assert layer_parameters(gated) - layer_parameters(plain) == h * h + (3 * h + h)
    # the QKV output is a x d wider, and the gate's output is linear_proj's new input
    tokens = 4096
    assert layer.layer_bytes(gated, run) - layer.layer_bytes(plain, run) == 2 * tokens * h + 2 * tokens * h
    assert attention.attention_path(gated, run) == "fused"


def test_the_optimizer_dtypes_set_the_bytes_per_parameter():
    dist = {**SMALL, "--use-distributed-optimizer": True}  # dp 8: the optimizer's bytes over 8

    def per(extra):
        return optimizer.bytes_per_parameter(config_from_megatron({**dist, **extra}, world_size=8))

    assert per({}) == {"weights": 2, "main gradients": 4, "master weights": 4 / 8, "Adam moments": 8 / 8,
                       "fp32 gradient copies": 0}
    # a bf16 grad buffer, and the optimizer step's `.float()` copy of its shard
    assert per({"--grad-reduce-in-bf16": True})["main gradients"] == 2
    assert per({"--grad-reduce-in-bf16": True})["fp32 gradient copies"] == 4 / 8
    # TE's FusedAdam: fp32 master weights of bf16 parameters as 16-bit remainders, fp8 and bf16
    # moments, gradients read in place from a bf16 buffer
    aware = per({"--use-precision-aware-optimizer": True, "--main-grads-dtype": "bf16", "--exp-avg-dtype": "fp8",
                 "--exp-avg-sq-dtype": "bf16"})
    assert aware == {"weights": 2, "main gradients": 2, "master weights": 2 / 8, "Adam moments": 3 / 8,
                     "fp32 gradient copies": 0}


def test_userbuffers_add_their_gemms_workspace_and_squared_relu_changes_nothing():
    # --tp-comm-overlap: TE's userbuffers are allocated outside torch's caching allocator and its
    # linears save the same local inputs; what torch counts is the userbuffer GEMMs' workspace,
    # 3 x TE's cuBLAS workspace (cpp_extensions/gemm.py get_cublas_workspace(ub=True))
    base = {**SMALL, "--tensor-model-parallel-size": 2, "--sequence-parallel": True}
    overlap = config_from_megatron({**base, "--tp-comm-overlap": True}, world_size=8)
    plain = config_from_megatron(base, world_size=8)
    assert overlap.parallel.tp_comm_overlap and not plain.parallel.tp_comm_overlap
    for gpu, workspace in (("h100", 32 * MiB + 1024), ("a100", 4 * MiB)):
        run = mg.MegatronRun(gpu)
        with_ub, without = mg.stage_peak(overlap, 0, run), mg.stage_peak(plain, 0, run)
        assert with_ub.static_bytes - without.static_bytes == 3 * workspace
        assert with_ub.peak_allocated_bytes - without.peak_allocated_bytes == 3 * workspace
    with pytest.raises(BadInput, match="pass --sequence-parallel"):
        config_from_megatron({**SMALL, "--tensor-model-parallel-size": 2, "--tp-comm-overlap": True}, world_size=8)
    # squared ReLU (activations.py, under torch.compile) keeps its [s, b, f] input and gives fc2 a new
    # [s, b, f] input, as bias-GeLU keeps fc1's output: the same bytes and parameters as gelu
    gelu = config_from_megatron(base, world_size=8)
    relu2 = config_from_megatron({**base, "--squared-relu": True}, world_size=8)
    run = mg.MegatronRun("h100")
    assert relu2.model.activation == "squared_relu"
    assert layer.layer_bytes(relu2, run) == layer.layer_bytes(gelu, run)
    assert layer_parameters(relu2) == layer_parameters(gelu)
