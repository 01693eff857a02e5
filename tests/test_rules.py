"""Megatron's validation rules as the user meets them: one exact line naming the problem and the
fix, exit code 2; and the interleaved schedule's model chunks in validation and in the estimate."""

import dataclasses

import pytest
from helpers import config, invoke

from recompute_bench.analysis import flops
from recompute_bench.analysis.checkpoint import checkpoint_input_bytes
from recompute_bench.analysis.harness.layer import layer_activation_bytes
from recompute_bench.analysis.harness.stage import stage_activations
from recompute_bench.config.schema import BadInput, RecomputeConfig
from recompute_bench.workload import resolved

FULL = ["--recompute-granularity", "full", "--recompute-method"]
VPP = "parallel.virtual_pipeline_model_parallel_size"

REFUSED = [
    # Megatron refuses the interleaved schedule without pipeline parallelism (tiny: 4 layers, p = 1).
    (["estimate", "--set", f"{VPP}=2"],
     "virtual_pipeline_model_parallel_size 2 needs pipeline parallelism (the interleaved schedule splits each "
     "pipeline stage into model chunks); pass --pipeline-model-parallel-size 2 or more, or drop --set "
     "parallel.virtual_pipeline_model_parallel_size"),
    # gpt3-175b at p = 8: 12 layers per stage, which 5 virtual stages do not divide.
    (["estimate", "-w", "gpt3-175b", "--pp", "8", "--set", f"{VPP}=5"],
     "virtual_pipeline_model_parallel_size 5 must divide the 12 layers of each pipeline stage; pass --set "
     "parallel.virtual_pipeline_model_parallel_size=M with M dividing 12"),
    # ... and with 3 virtual stages each model chunk has 4 layers: Megatron applies recompute_num_layers
    # within a chunk, so 5 is out of range although the stage has 12.
    (["estimate", "-w", "gpt3-175b", "--pp", "8", "--set", f"{VPP}=3", *FULL, "block", "--recompute-num-layers", "5"],
     "recompute_num_layers 5 must lie between 1 and 4 (layers per model chunk: 12 per pipeline stage / "
     "virtual_pipeline_model_parallel_size 3); pass --recompute-num-layers N"),
    # Pipeline schedules: torch's names, and what each needs.
    (["estimate", "--pp", "2", "--pp-schedule", "ZeroBubble"],
     "pipeline_parallel_schedule 'ZeroBubble' is not one of 1F1B, Interleaved1F1B, GPipe, InterleavedZeroBubble, "
     "ZBVZeroBubble, DualPipeV; pass --pp-schedule 1F1B"),
    (["estimate", "--pp-schedule", "GPipe"],
     "pipeline_parallel_schedule GPipe needs pipeline parallelism; pass --pp 2 or more, or drop --pp-schedule"),
    (["estimate", "--pp", "2", "--pp-schedule", "ZBVZeroBubble"],
     "ZBVZeroBubble needs exactly two stages per rank (the V: rank r holds stages r and 2p - 1 - r); pass --set "
     "parallel.virtual_pipeline_model_parallel_size=2"),
    (["estimate", "--pp", "2", "--pp-schedule", "InterleavedZeroBubble"],
     "InterleavedZeroBubble interleaves model chunks: pass --set parallel.virtual_pipeline_model_parallel_size=M "
     "(M >= 2 chunks per rank), or --pp-schedule 1F1B"),
    (["estimate", "--pp", "2", "--set", f"{VPP}=2", "--pp-schedule", "1F1B"],
     "1F1B runs one model chunk per rank; drop --set parallel.virtual_pipeline_model_parallel_size or pass "
     "--pp-schedule Interleaved1F1B"),
    (["estimate", "--pp", "2", "--set", f"{VPP}=2", "--pp-schedule", "DualPipeV"],
     "DualPipeV needs at least as many micro-batches as stages (2 x pp = 4), got 2; pass --global-batch-size 8 or more"),
    # Megatron's interleaved schedule takes the micro-batches in groups of p: tiny has 2, p = 4 (1 layer a chunk).
    (["estimate", "--num-layers", "8", "--pp", "4", "--set", f"{VPP}=2"],
     "the interleaved schedule needs the number of micro-batches (2) to be a multiple of pipeline_model_parallel_size "
     "4; pass --global-batch-size as a multiple of 8"),
    (["run", "--pp", "2", "--activation-offload-layers", "1"],
     "Currently there is no support for Pipeline parallelism with CPU offloading (Megatron's rule); drop "
     "--activation-offload-layers or pass --pipeline-model-parallel-size 1"),
    (["run", "--activation-offload-layers", "4"],
     "activation_offload_layers must lie between 1 and 3 (CPU offloading can be done only for layers less than "
     "num_layers), got 4; pass --activation-offload-layers N with N from 1 to 3"),
    (["estimate", "--set", "recompute.distribute_saved_activations=true", *FULL, "uniform", "--recompute-num-layers", "1"],
     "distribute_saved_activations needs tensor parallelism (TP > 1); pass --tensor-model-parallel-size 2 or more, "
     "or drop --set recompute.distribute_saved_activations=true"),
    (["estimate", "--tp", "2", "--sequence-parallel", "--set", "recompute.distribute_saved_activations=true",
      *FULL, "uniform", "--recompute-num-layers", "1"],
     "distribute_saved_activations must be false when sequence parallelism is enabled; drop --sequence-parallel "
     "or --set recompute.distribute_saved_activations=true"),
    # Context parallel: 2 x cp chunks of the sequence (tiny: s = 128), and each rank's tokens over tp with SP.
    (["estimate", "--framework", "megatron", "--cp", "3"],
     "context parallel 3 splits seq_length 128 into 2 x cp = 6 chunks, which do not divide it; pass --seq-length as "
     "a multiple of 6 or a smaller --context-parallel-size"),
    (["estimate", "--framework", "megatron", "--cp", "2", "--seq-length", "12", "--tp", "4", "--sequence-parallel"],
     "sequence parallelism splits each context-parallel rank's 6 tokens over tensor_model_parallel_size 4, which "
     "does not divide them; pass --seq-length as a multiple of 16"),
    (["estimate", "--framework", "megatron", "--cp", "2", "--set", "parallel.cp_comm_type=ring"],
     "cp_comm_type 'ring' is not one of p2p, all_gather, a2a, a2a+p2p; pass --set parallel.cp_comm_type=p2p"),
    # Megatron runs context parallel only through Transformer Engine's flash or fused attention
    # (dot_product_attention.py's assert; get_attention_backend disables the unfused kernel under CP).
    (["estimate", "--framework", "megatron", "--cp", "2", "--transformer-impl", "local"],
     "Megatron runs context parallel only with Transformer Engine's attention; pass --transformer-impl "
     "transformer_engine or drop --context-parallel-size"),
    (["estimate", "--framework", "megatron", "--cp", "2", "--attention-backend", "unfused"],
     "Transformer Engine's unfused attention cannot split the sequence over context-parallel ranks; pass "
     "--attention-backend flash, fused or auto, or drop --context-parallel-size"),
    # a2a spreads each tensor-parallel rank's heads over the cp ranks (tiny: 4 heads)
    (["estimate", "--framework", "megatron", "--cp", "8", "--set", "parallel.cp_comm_type=a2a"],
     "cp_comm_type a2a splits each tensor-parallel rank's 4 heads and 4 query groups over 8 ranks, which do not "
     "divide them; pass another --set parallel.cp_comm_type or --context-parallel-size"),
    (["estimate", "--framework", "megatron", "--cp", "4", "--set", "parallel.cp_comm_type=a2a+p2p"],
     "cp_comm_type a2a+p2p needs the two levels of context parallel; pass --set "
     "parallel.hierarchical_context_parallel_sizes=[A2A,P2P] with A2A x P2P = 4"),
    (["estimate", "--framework", "megatron", "--cp", "4", "--set", "parallel.cp_comm_type=a2a+p2p", "--set",
      "parallel.hierarchical_context_parallel_sizes=[2,4]"],
     "hierarchical_context_parallel_sizes [2, 4] must be two sizes [a2a, p2p] whose product is "
     "context_parallel_size 4; pass --set parallel.hierarchical_context_parallel_sizes=[2,2]"),
    # one type per layer (tiny: 4 layers), as Megatron's list form gives them
    (["estimate", "--framework", "megatron", "--cp", "2", "--set", "parallel.cp_comm_type=p2p a2a"],
     "cp_comm_type lists 2 types for 4 layers; pass one type for every layer (--set parallel.cp_comm_type=p2p) "
     "or 4 separated by spaces"),
    (["run", "--precision", "fp8"],
     "--precision fp8 runs torchao's float8 training here, tensorwise or rowwise, not delayed (Transformer "
     "Engine's); pass --fp8-recipe tensorwise or rowwise"),
    (["estimate", "--framework", "megatron", "--precision", "fp8", "--set", "training.fp8_recipe=current"],
     "fp8_recipe 'current' is not one of delayed, tensorwise, blockwise, mxfp8, rowwise; pass --set training.fp8_recipe=tensorwise"),
    # The message lists what the dense model offers, not modules it would then refuse.
    (["run", "--recompute-modules", "attention"],
     "unknown recompute module(s) attention; pass --recompute-modules with any of core_attn, mlp, layernorm "
     "(moe, moe_act, shared_experts, mla_up_proj need MoE or MLA layers, which this workload's model does not have)"),
]


@pytest.mark.parametrize("argv,line", REFUSED, ids=[a[-1] if len(a) < 4 else " ".join(a[1:5]) for a, _ in REFUSED])
def test_refused_in_one_exact_line_with_the_fix_and_exit_2(argv, line):
    result = invoke(*argv)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"error: {line}"


def test_recompute_num_layers_may_fill_a_model_chunk():
    cfg = config("gpt3-175b", parallel__pipeline_model_parallel_size=8, parallel__virtual_pipeline_model_parallel_size=3,
                 recompute__granularity="full", recompute__method="uniform", recompute__num_layers=4)
    assert cfg.recompute.num_layers == 4
    with pytest.raises(BadInput, match="between 1 and 4"):
        config("gpt3-175b", parallel__pipeline_model_parallel_size=8, parallel__virtual_pipeline_model_parallel_size=3,
               recompute__granularity="full", recompute__method="uniform", recompute__num_layers=5)


def _vpp(recompute: RecomputeConfig, vpp=3):
    cfg = config("gpt3-175b", parallel__tensor_model_parallel_size=8, parallel__pipeline_model_parallel_size=8,
                 parallel__virtual_pipeline_model_parallel_size=vpp)
    return dataclasses.replace(cfg, recompute=recompute)


def test_the_estimate_applies_uniform_and_block_within_each_model_chunk():
    # gpt3-175b at p = 8 with 3 virtual stages: a stage holds 3 model chunks of 4 layers. With c the
    # bytes of one checkpointed input and f those of one layer's full activations (both measured
    # against the probe elsewhere), per micro-batch:
    block = _vpp(RecomputeConfig("full", [], "block", 2))
    c, f = checkpoint_input_bytes(block), layer_activation_bytes(block)
    assert c < f
    # block 2: each chunk checkpoints its first 2 layers and keeps the other 2: 3 x (2c + 2f); its
    # backward rebuilds one layer at a time while the other chunks still hold theirs: the same peak.
    acts = stage_activations(block)
    assert (acts.stored_bytes, acts.peak_bytes) == (6 * c + 6 * f, 6 * c + 6 * f)
    # uniform 3: each chunk of 4 layers is split 3 + 1, two inputs kept: 3 x 2c. Backward rebuilds the
    # last layer (holding it, f, and the first group's input, c), then the first 3 layers (3f, their
    # input among them), while the 2 other chunks hold theirs: peak 2 x 2c + max(c + f, 3f) = 4c + 3f.
    acts = stage_activations(_vpp(RecomputeConfig("full", [], "uniform", 3)))
    assert (acts.stored_bytes, acts.peak_bytes) == (6 * c, 4 * c + 3 * f)


def test_block_recompute_repeats_the_first_layers_of_every_model_chunk():
    # The paper's per-layer forward FLOPs (Appendix A): 24Bsh^2 + 4Bs^2h for the GPT-3 layer, attention
    # over the full square as the paper's explicit attention runs it (a fused kernel skips the tiles
    # the causal mask hides); B = 64 sequences per step.
    B, s, h = 64, 2048, 12288
    layer_forward = 24 * B * s * h**2 + 4 * B * s**2 * h

    def hardware(r: RecomputeConfig, vpp=3) -> float:
        cfg = _vpp(r, vpp)
        return flops.hardware_flops_per_step(resolved(dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, attention_backend="math"))))

    # 8 stages x 3 chunks, the first 2 layers of each: 48 of the 96 layers are run again.
    assert hardware(RecomputeConfig("full", [], "block", 2)) - hardware(RecomputeConfig()) == 48 * layer_forward
    # Without virtual stages each of the 8 stages re-runs its first layer.
    assert hardware(RecomputeConfig("full", [], "block", 1), None) - hardware(RecomputeConfig(), None) == 8 * layer_forward
