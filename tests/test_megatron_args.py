"""Megatron's arguments -> Config: a functional test's MODEL_ARGS, a log's argument dump and a command
line give the same point; what the estimate cannot express is refused naming the argument."""

import json

import pytest

from helpers import invoke
from recompute_bench.ingest.megatron_args import (CannotExpress, config_from_megatron, megatron_overrides,
                                                  overrides_as_flags)
from recompute_bench.ingest.megatron_argv import read_argv
from recompute_bench.config.schema import BadInput

# tests/functional_tests/test_cases/gpt/gpt3_7b_tp1_pp4_memory_speed/model_config.yaml (Megatron-LM
# d98e8a6), the arguments that shape the run; the rest are paths, logging and learning rate.
SEVEN_B = {
    "--num-layers": 32, "--hidden-size": 4096, "--num-attention-heads": 32, "--group-query-attention": True,
    "--num-query-groups": 8, "--untie-embeddings-and-output-weights": True, "--micro-batch-size": 1,
    "--global-batch-size": 8, "--seq-length": 8192, "--max-position-embeddings": 8192,
    "--tokenizer-type": "NullTokenizer", "--vocab-size": 131073, "--lr": 0.00015, "--log-interval": 2,
    "--transformer-impl": "transformer_engine", "--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 4,
    "--num-layers-per-virtual-pipeline-stage": 1, "--use-distributed-optimizer": True, "--overlap-grad-reduce": True,
    "--overlap-param-gather": True, "--deterministic-mode": True, "--no-gradient-accumulation-fusion": True,
    "--use-mcore-models": True, "--ckpt-format": "torch_dist", "--bf16": True, "--log-memory-to-tensorboard": True,
}


def test_a_functional_test_case_maps_onto_the_fields():
    cfg = config_from_megatron(SEVEN_B, world_size=8)
    m, t, p = cfg.model, cfg.training, cfg.parallel
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups) == (32, 4096, 32, 8)
    assert m.ffn_hidden_size == 4 * 4096 and m.activation == "gelu"  # validate_args: 4h without --swiglu
    assert not m.share_embeddings_and_output_weights and m.add_bias_linear and m.normalization == "LayerNorm"
    assert (m.hidden_dropout, m.attention_dropout) == (0.1, 0.1)  # Megatron's defaults, not this harness's 0
    assert (m.transformer_impl, m.attention_backend, t.framework) == ("transformer_engine", "auto", "megatron")
    assert m.vocab_size == 131073 and m.padded_vocab_size(1) == 131200
    assert (t.seq_length, t.micro_batch_size, t.global_batch_size, t.precision) == (8192, 1, 8, "bf16")
    # 8 GPUs / (tp 1 x pp 4) = dp 2; one layer per virtual stage of 8 layers per stage = 8 chunks.
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size) == (1, 4, 2)
    assert p.virtual_pipeline_model_parallel_size == 8 and p.use_distributed_optimizer and not p.sequence_parallel
    assert cfg.num_microbatches == 4


def test_megatron_defaults_fill_what_the_arguments_leave_out():
    base = {"--num-layers": 12, "--hidden-size": 512, "--num-attention-heads": 8, "--seq-length": 1024,
            "--max-position-embeddings": 1024, "--micro-batch-size": 4, "--global-batch-size": 32}
    cfg = config_from_megatron({**base, "--swiglu": True, "--sequence-parallel": True}, world_size=8)
    # validate_args: swiglu's default width int((4h x 2/3) / 64) x 64; no sequence parallel at tp 1.
    assert cfg.model.ffn_hidden_size == 1344 and cfg.model.activation == "swiglu"
    assert not cfg.parallel.sequence_parallel and cfg.parallel.data_parallel_size == 8
    # pretrain_gpt.py's GPT2BPETokenizer: 50257 tokens; fp32 without --bf16/--fp16.
    assert cfg.model.vocab_size == 50257 and cfg.training.precision == "fp32"
    cfg = config_from_megatron({**base, "--recompute-activations": True, "--fp16": True,
                                "--tensor-model-parallel-size": 2, "--sequence-parallel": True}, world_size=8)
    assert (cfg.recompute.granularity, cfg.recompute.modules) == ("selective", ["core_attn"])
    assert cfg.training.precision == "fp16" and cfg.parallel.sequence_parallel and cfg.parallel.data_parallel_size == 4
    cfg = config_from_megatron({**base, "--recompute-granularity": "full", "--recompute-method": "uniform",
                                "--recompute-num-layers": 1, "--use-rotary-position-embeddings": True,
                                "--disable-bias-linear": True, "--normalization": "RMSNorm"})
    assert (cfg.recompute.granularity, cfg.recompute.method, cfg.recompute.num_layers) == ("full", "uniform", 1)
    assert cfg.model.position_embedding_type == "rope" and not cfg.model.add_bias_linear
    assert cfg.model.normalization == "RMSNorm" and cfg.parallel.data_parallel_size == 1
    # argparse's negative flags land on their destinations; apply_query_key_layer_scaling sets fp32 softmax.
    cfg = config_from_megatron({**base, "--no-masked-softmax-fusion": True, "--apply-query-key-layer-scaling": True,
                                "--cross-entropy-loss-fusion": True, "--transformer-impl": "local"})
    assert not cfg.model.masked_softmax_fusion and cfg.model.attention_softmax_in_fp32
    assert cfg.model.cross_entropy_loss_fusion and cfg.model.transformer_impl == "local"


def test_a_log_dump_gives_the_same_config_as_the_yaml():
    # megatron/training/arguments.py _print_args writes every argument as text, derived ones included.
    dump = {"num_layers": "32", "hidden_size": "4096", "num_attention_heads": "32", "group_query_attention": "True",
            "num_query_groups": "8", "ffn_hidden_size": "16384", "kv_channels": "128",
            "untie_embeddings_and_output_weights": "True", "micro_batch_size": "1", "global_batch_size": "8",
            "seq_length": "8192", "encoder_seq_length": "8192", "max_position_embeddings": "8192",
            "tokenizer_type": "NullTokenizer", "vocab_size": "131073", "padded_vocab_size": "131200",
            "transformer_impl": "transformer_engine", "attention_backend": "AttnBackend.auto",
            "tensor_model_parallel_size": "1", "pipeline_model_parallel_size": "4",
            "num_layers_per_virtual_pipeline_stage": "1", "virtual_pipeline_model_parallel_size": "8",
            "use_distributed_optimizer": "True", "overlap_grad_reduce": "True", "overlap_param_gather": "True",
            "ddp_bucket_size": "None", "bf16": "True", "fp16": "False", "world_size": "8",
            "data_parallel_size": "2", "hidden_dropout": "0.1", "attention_dropout": "0.1", "swiglu": "False",
            "context_parallel_size": "1", "fp8": "None", "num_experts": "None", "moe_router_topk": "2",
            "expert_tensor_parallel_size": "1", "recompute_granularity": "None", "recompute_modules": "None",
            "cuda_graph_impl": "none", "optimizer": "adam", "main_grads_dtype": "torch.float32",
            "position_embedding_type": "learned_absolute", "seed": "1234", "lr": "0.00015",
            "gradient_accumulation_fusion": "False"}
    from_dump, from_yaml = config_from_megatron(dump), config_from_megatron(SEVEN_B, world_size=8)
    assert from_dump.model.padded_vocab_size(1) == from_yaml.model.padded_vocab_size(1)
    from_dump.model.vocab_size = from_yaml.model.vocab_size  # a dump names the padded vocabulary only
    assert from_dump == from_yaml


def test_a_command_line_reads_like_its_yaml():
    argv = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--group-query-attention",
            "--num-query-groups", "8", "--untie-embeddings-and-output-weights", "--micro-batch-size", "1",
            "--global-batch-size=8", "--seq-length", "8192", "--max-position-embeddings", "8192", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "131073", "--transformer-impl", "transformer_engine",
            "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1",
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--bf16",
            "--no-gradient-accumulation-fusion", "--recompute-modules", "core_attn",
            "mlp"]
    args = read_argv(argv)
    assert args["recompute-modules"] == ["core_attn", "mlp"] and args["bf16"] is True
    del args["recompute-modules"]
    assert config_from_megatron(args, world_size=8) == config_from_megatron(SEVEN_B, world_size=8)


def test_the_mapped_flags_give_estimate_the_same_config():
    tables = megatron_overrides(SEVEN_B, world_size=8)
    result = invoke("estimate", *overrides_as_flags(tables), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["config"] == {**config_from_megatron(SEVEN_B, world_size=8).to_dict(),
                                                   "workload": "tiny"}


@pytest.mark.parametrize("argument,value,words", [
    ("--hybrid-context-parallel", True, "hybrid context parallel"),
    ("--fp8-dot-product-attention", True, "FP8 attention"),
    ("--use-torch-fsdp2", True, "FSDP"),
    ("--experimental-attention-variant", "gated_delta_net", "attention variants"),
    ("--qk-l2-norm", True, "L2 query/key norms"),
    ("--mla-down-proj-fusion", True, "fused down-projection"),
    ("--use-transformer-engine-op-fuser", True, "op fuser"),
    ("--export-kd-teacher-load", "/ckpt/teacher", "distillation"),
    ("--exp-avg-dtype", "fp4", "fp32, bf16, fp16 or fp8"),
    ("--optimizer", "sgd", "Adam"),
    ("--position-embedding-type", "none", "learned_absolute and rope"),
    ("--tokenizer-type", "HuggingFaceTokenizer", "--padded-vocab-size"),
])
def test_what_the_estimate_cannot_express_is_refused_naming_the_argument(argument, value, words):
    with pytest.raises(CannotExpress) as e:
        config_from_megatron({**SEVEN_B, argument: value}, world_size=8)
    assert e.value.argument == argument and argument in str(e.value) and words in str(e.value)
    assert "\n" not in str(e.value)


def test_context_parallels_arguments_are_read():
    # arguments.py: data_parallel_size = world_size // (tp x pp x cp); --cp-comm-type takes one type
    # or one per layer; --hierarchical-context-parallel-sizes two integers (a yaml writes "2 2" or
    # "[2 2]", a command line two words, a log's dump [2, 2]).
    cfg = config_from_megatron({**SEVEN_B, "--context-parallel-size": 2}, world_size=16)
    assert (cfg.parallel.context_parallel_size, cfg.parallel.data_parallel_size, cfg.parallel.cp_comm_type) == (2, 2, "p2p")
    for sizes in ("2 2", "[2 2]", [2, 2], "[2, 2]"):
        cfg = config_from_megatron({**SEVEN_B, "--context-parallel-size": 4, "--cp-comm-type": "a2a+p2p",
                                    "--hierarchical-context-parallel-sizes": sizes}, world_size=16)
        assert cfg.parallel.hierarchical_context_parallel_sizes == [2, 2] and cfg.parallel.cp_comm_type == "a2a+p2p"
    argv = read_argv(["--context-parallel-size", "2", "--cp-comm-type", *["p2p"] * 16, *["a2a"] * 16])
    cfg = config_from_megatron({**SEVEN_B, **argv}, world_size=16)
    assert cfg.parallel.cp_comm_type == " ".join(["p2p"] * 16 + ["a2a"] * 16)
    dump = {**SEVEN_B, "context_parallel_size": "2", "cp_comm_type": "['all_gather']",
            "hierarchical_context_parallel_sizes": "None"}
    assert config_from_megatron(dump, world_size=16).parallel.cp_comm_type == "all_gather"
    with pytest.raises(BadInput, match="tensor x pipeline x context parallel = 1 x 4 x 2"):
        config_from_megatron({**SEVEN_B, "--context-parallel-size": 2}, world_size=12)
    with pytest.raises(BadInput, match="--hierarchical-context-parallel-sizes"):
        config_from_megatron({**SEVEN_B, "--context-parallel-size": 4, "--cp-comm-type": "a2a+p2p",
                              "--hierarchical-context-parallel-sizes": "two two"}, world_size=16)


def test_neutral_values_of_those_arguments_are_accepted():
    neutral = {"--context-parallel-size": 1, "--fp8-format": None, "--use-torch-fsdp2": False, "--optimizer": "adam",
               "--moe-router-load-balancing-type": "seq_aux_loss"}  # a MoE option of a dense model changes nothing
    assert config_from_megatron({**SEVEN_B, **neutral}, world_size=8) == config_from_megatron(SEVEN_B, world_size=8)


def test_bad_megatron_arguments_are_config_errors():
    with pytest.raises(BadInput, match="--seq-length"):
        config_from_megatron({k: v for k, v in SEVEN_B.items() if k != "--seq-length"})
    with pytest.raises(BadInput, match="not a positive multiple"):
        config_from_megatron(SEVEN_B, world_size=6)
    with pytest.raises(BadInput, match="follows no --flag"):
        read_argv(["12", "--num-layers"])


@pytest.mark.parametrize("argv,words", [
    (["--transformer-impl", "transformer_engine"], "framework megatron"),
    (["--framework", "megatron", "--attention-backend", "sdpa"], "Megatron's --attention-backend"),
    (["--framework", "megatron", "--attention-backend", "local"], "--transformer-impl local"),
    (["--framework", "tensorflow"], "framework"),
])
def test_each_framework_takes_its_own_names(argv, words):
    result = invoke("estimate", *argv)
    assert result.exit_code == 2 and words in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_framework_megatron_takes_megatron_defaults_and_is_not_run():
    result = invoke("estimate", "--framework", "megatron", "--json")
    assert result.exit_code == 0, result.output
    model = json.loads(result.stdout)["config"]["model"]
    assert (model["transformer_impl"], model["attention_backend"]) == ("transformer_engine", "auto")
    result = invoke("run", "--no-save", "--framework", "megatron")
    assert result.exit_code == 2 and "estimated, not run" in result.stderr


def test_context_parallels_flags_give_estimate_the_same_config():
    args = {**SEVEN_B, "--context-parallel-size": 4, "--cp-comm-type": "a2a+p2p",
            "--hierarchical-context-parallel-sizes": "2 2"}
    result = invoke("estimate", *overrides_as_flags(megatron_overrides(args, world_size=16)), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["config"] == {**config_from_megatron(args, world_size=16).to_dict(),
                                                   "workload": "tiny"}


# tests/functional_tests/test_cases/moe/gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_resume_torch_dist_dist_optimizer
# (Megatron-LM d98e8a6): the arguments that shape its MoE layers.
MOE = {"--num-layers": 12, "--hidden-size": 512, "--num-attention-heads": 8, "--seq-length": 1024,
       "--max-position-embeddings": 1024, "--micro-batch-size": 4, "--global-batch-size": 32, "--bf16": True,
       "--disable-bias-linear": True, "--tensor-model-parallel-size": 4, "--pipeline-model-parallel-size": 2,
       "--expert-model-parallel-size": 2, "--expert-tensor-parallel-size": 2, "--sequence-parallel": True,
       "--num-experts": 8, "--use-distributed-optimizer": True, "--moe-token-dispatcher-type": "alltoall",
       "--moe-router-load-balancing-type": "aux_loss", "--moe-router-topk": 2, "--moe-router-dtype": "fp32",
       "--moe-ffn-hidden-size": 1024, "--moe-shared-expert-intermediate-size": 512, "--moe-grouped-gemm": True}


def test_moe_arguments_map_onto_the_fields():
    cfg = config_from_megatron(MOE, world_size=8)
    m, p = cfg.model, cfg.parallel
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn, m.moe_shared_expert_intermediate_size) == (8, 2, 1024, 512)
    assert (m.moe_token_dispatcher_type, m.moe_router_dtype, m.moe_router_load_balancing_type) == ("alltoall", "fp32", "aux_loss")
    assert m.moe_grouped_gemm and m.moe_aux_loss_coeff == 0.0 and m.moe_layer_freq == 1
    assert (p.expert_model_parallel_size, p.expert_tensor_parallel, p.data_parallel_size) == (2, 2, 1)
    assert p.expert_data_parallel_size == 1  # 8 GPUs / (pp 2 x etp 2 x ep 2)


def test_megatron_moe_defaults_fill_what_the_arguments_leave_out():
    args = {k: v for k, v in MOE.items() if k not in ("--moe-token-dispatcher-type", "--expert-tensor-parallel-size",
                                                      "--moe-ffn-hidden-size")}
    cfg = config_from_megatron({**args, "--moe-layer-freq": "([0]*2+[1]*10)", "--moe-layer-recompute": True}, world_size=16)
    m = cfg.model
    # arguments.py: allgather is the default dispatcher, etp the tensor-parallel size, moe ffn the ffn
    assert m.moe_token_dispatcher_type == "allgather" and cfg.parallel.expert_tensor_parallel == 4
    assert m.moe_ffn == m.ffn_hidden_size == 2048
    assert m.moe_layer_pattern == [0, 0] + [1] * 10
    # transformer_config.py: the deprecated --moe-layer-recompute adds moe to selective recompute
    assert (cfg.recompute.granularity, cfg.recompute.modules) == ("selective", ["core_attn", "moe"])


@pytest.mark.parametrize("argument,value,words", [
    ("--moe-latent-size", 256, "latent projections"),
    ("--moe-router-padding-for-quantization", True, "padding the routing map"),
    ("--moe-flex-dispatcher-backend", "hybridep", "DeepEP"),
])
def test_what_moe_cannot_express_is_refused_naming_the_argument(argument, value, words):
    args = {**MOE, argument: value}
    if argument == "--moe-flex-dispatcher-backend":
        args["--moe-token-dispatcher-type"] = "flex"
    with pytest.raises(CannotExpress) as e:
        config_from_megatron(args, world_size=8)
    assert e.value.argument == argument and words in str(e.value) and "\n" not in str(e.value)


def test_megatrons_moe_rules_are_bad_input():
    with pytest.raises(BadInput, match="--sequence-parallel"):  # moe_layer.py: MoE with tp trains under SP only
        config_from_megatron({k: v for k, v in MOE.items() if k != "--sequence-parallel"}, world_size=8)
    with pytest.raises(BadInput, match="must divide the 4 ranks"):  # 8 GPUs, pp 2: tp 4 x dp 1 over etp 2 x ep 4
        config_from_megatron({**MOE, "--expert-model-parallel-size": 4}, world_size=8)
