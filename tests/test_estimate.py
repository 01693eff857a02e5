"""The analytical model against measurement (saved-tensor probe, FlopCounterMode, parameter count),
against the paper's Table 2, Eq. 7/8 and Table 5, and the `estimate` / `plan` commands."""

import dataclasses
import json
import subprocess
import sys

import pytest
from helpers import SHRUNK, config, invoke, meta_step_flops, probe_step, shrunk

from recompute_bench.analysis import flops
from recompute_bench.analysis.checkpoint import checkpoint_input_bytes
from recompute_bench.analysis.harness.layer import attention_kernel, layer_activation_bytes
from recompute_bench.analysis.harness.rank import (CUBLAS_WORKSPACES, ROPE_TABLES, chunks_in_flight,
                                                   microbatches_in_flight, optimizer_bytes_per_parameter, rank_memory)
from recompute_bench.analysis.harness.stage import (activation_bytes, loss_saved_bytes, loss_workspace_bytes,
                                                    stage_activations, stage_parameters)
from recompute_bench.analysis.paper import (built_minus_paper_bytes, paper_first_stage_bytes, paper_flops_per_step,
                                            paper_layer_bytes, paper_layer_differences)
from recompute_bench.config.schema import RecomputeConfig
from recompute_bench.models import DeviceKernels
from recompute_bench.models.dense.layers import build_model
from recompute_bench.recompute.settings import all_settings
from recompute_bench.workload import resolved

MiB, GiB = 2**20, 2**30
PAPER_PRESETS = ["gpt3-22b", "gpt3-175b", "gpt3-530b", "gpt3-1t"]


def every_setting(workload, backend, dropout):
    """The shrunken workload in fp32 (fast on a CPU): no recompute and every setting `verify` checks."""
    base = shrunk(workload, **{"model.attention_backend": backend, "model.attention_dropout": dropout,
                               "model.hidden_dropout": dropout, "training.precision": "fp32"})
    return [dataclasses.replace(base, recompute=r) for r in [RecomputeConfig()] + all_settings(base.model.num_layers)]


def test_the_analysis_imports_no_torch():
    # estimate and plan must start at once and run where torch is absent: a fresh interpreter
    # imports the analysis and the model spec and must not have loaded torch on the way.
    code = ("import sys, recompute_bench.analysis.harness.planner, recompute_bench.analysis.harness.auto, "
            "recompute_bench.models.dense.spec, recompute_bench.config.rules; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _error(estimate, measured):
    return abs(estimate - measured) / measured


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["dropout-off", "dropout-on"])
@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("workload", list(SHRUNK))
def test_every_setting_activation_bytes_match_the_probe(workload, backend, dropout):
    for cfg in every_setting(workload, backend, dropout):
        r = cfg.recompute
        total, per_layer, _, _ = probe_step(cfg)
        est = activation_bytes(cfg, "cpu")
        assert _error(est["activation_bytes"], total) <= 0.02, (r.label, est, total)
        assert _error(est["activation_bytes_per_layer"], per_layer) <= 0.02, (r.label, est, per_layer)


def _rerun_layers(r, num_layers):
    """Layers whose core attention a setting runs a second time: full uniform re-runs every layer,
    full block N the first N, selective core_attn every layer's attention."""
    if r.granularity == "full":
        return num_layers if r.method == "uniform" else r.num_layers
    return num_layers if "core_attn" in r.modules else 0


# FLOPs do not depend on dropout, except that on a CPU it decides which kernel sdpa runs.
@pytest.mark.slow
@pytest.mark.parametrize("backend,dropout", [("math", 0.1), ("sdpa", 0.1), ("sdpa", 0.0)],
                         ids=["math", "sdpa-math-fallback", "sdpa-cpu-flash"])
@pytest.mark.parametrize("workload", list(SHRUNK))
def test_every_setting_hardware_flops_match_the_flop_counter(workload, backend, dropout):
    for cfg in every_setting(workload, backend, dropout):
        r = cfg.recompute
        _, _, measured_flops, _ = probe_step(cfg, count_flops=True)
        hardware = flops.hardware_flops_per_step(cfg, "cpu")
        if backend == "sdpa" and dropout == 0.0:
            # sdpa without dropout runs torch's CPU flash kernel, which has no FlopCounterMode formula.
            # It runs QK^T and times V forward, each 2·b·a·s²·d FLOPs, and five such matmuls in backward
            # (it kept no scores, so it recomputes QK^T first: cpu_flash_attention_backward in
            # ATen/native/cpu/FlashAttentionKernel.cpp); a recomputed attention runs its forward again.
            # The count misses exactly those, which the estimate includes.
            m, t = cfg.model, cfg.training
            matmul = 2 * t.micro_batch_size * m.num_attention_heads * t.seq_length**2 * m.head_dim
            blind = (7 * m.num_layers + 2 * _rerun_layers(r, m.num_layers)) * matmul
            assert measured_flops == hardware - blind, r.label
        else:
            assert measured_flops == hardware, r.label


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["dropout-off", "dropout-on"])
@pytest.mark.parametrize("workload", list(SHRUNK))
def test_gpu_hardware_flops_are_what_the_flop_counter_counts_for_the_cuda_kernel(workload, dropout, precision):
    # What CUDA runs: 16-bit takes the flash kernel; fp32 the memory-efficient one, unless the heads
    # are grouped (it has no GQA), where sdpa falls back to its math path. FlopCounterMode counts the
    # fused kernels with torch's registered formulas (five matmuls in backward: the scores are
    # recomputed) over the whole square, which run here on meta tensors; the math fallback is counted
    # op by op. The kernels skip the tiles the causal mask hides (`_hidden_tile_flops`).
    for base in every_setting(workload, "sdpa", dropout):
        cfg = dataclasses.replace(base, training=dataclasses.replace(base.training, precision=precision))
        gqa = cfg.model.groups != cfg.model.num_attention_heads
        kernel = "flash" if precision == "bf16" else None if gqa else "efficient"
        assert attention_kernel(cfg, "cuda") == (kernel or "sdpa_math")
        assert flops.hardware_flops_per_step(cfg) == meta_step_flops(cfg, kernel) - _hidden_tile_flops(cfg, kernel), \
            cfg.recompute.label


# torch 2.13's tiles on sm90, (queries, keys), forward then backward (see models/attention.py for the
# sources): flash at head dim <= 32 and 128, memory-efficient at <= 64 (its backward assumed), cuDNN assumed.
TILES = {("flash", 32): ((128, 128), (128, 128)), ("flash", 128): ((128, 64), (64, 128)),
         ("efficient", 32): ((64, 64), (64, 64)), ("cudnn", 32): ((128, 128), (128, 128))}


def _tiles(kernel, head_dim):
    return TILES[kernel, 32 if head_dim <= 32 else head_dim]


def _hidden_pairs(s, rows, cols):
    """(query, key) pairs in the tiles of an s x s score matrix that hold only masked pairs (every
    key after every query of the tile), counted tile by tile."""
    return sum(min(rows, s - i) * min(cols, s - j) for i in range(0, s, rows) for j in range(0, s, cols)
               if j > min(i + rows, s) - 1)


def _hidden_tile_flops(cfg, kernel):
    """FLOPs FlopCounterMode counts for a fused kernel's causal attention that the kernel never runs:
    per forward (every layer's, and again where recompute re-runs it) QK^T and times V over the
    hidden pairs of its forward tiles, per backward five matmuls over those of its backward tiles."""
    if kernel is None:
        return 0
    m, t = cfg.model, cfg.training
    forward, backward = _tiles(kernel, m.head_dim)
    per_pair = 2 * t.global_batch_size * m.num_attention_heads * m.head_dim
    runs = m.num_layers + _rerun_layers(cfg.recompute, m.num_layers)
    return (runs * 2 * per_pair * _hidden_pairs(t.seq_length, *forward)
            + m.num_layers * 5 * per_pair * _hidden_pairs(t.seq_length, *backward))


@pytest.mark.parametrize("kernel,seq", [("flash", 512), ("efficient", 256), ("cudnn", 384)])
def test_fused_kernels_skip_the_tiles_the_causal_mask_hides(kernel, seq):
    # Longer sequences than a tile: hardware FLOPs are FlopCounterMode's full square less what the
    # kernel's tiles skip (flash at s = 512: 4 x 4 tiles, 6 hidden both ways: 37.5% of the square).
    for cfg in every_setting("tiny", "sdpa", 0.0)[:4]:
        cfg = resolved(dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, seq_length=seq),
                                           model=dataclasses.replace(cfg.model, max_position_embeddings=seq)))
        device = DeviceKernels("cuda", kernel)
        hidden = _hidden_tile_flops(cfg, kernel)
        assert hidden > 0
        assert flops.hardware_flops_per_step(cfg, device) == meta_step_flops(cfg, kernel) - hidden, cfg.recompute.label


def test_causal_kernels_run_about_half_the_square_at_llama3_8b_length():
    # llama3-8b, s = 8192, bf16 on CUDA: flash's 128 x 64 forward and 64 x 128 backward tiles run
    # 50.78% of the square. Counting the square (as FlopCounterMode does, and this estimate did)
    # overstated the step's hardware FLOPs, hence its HFU, by 14.0%.
    cfg = config("llama3-8b")
    assert attention_kernel(cfg) == "flash" and _tiles("flash", cfg.model.head_dim) == ((128, 64), (64, 128))
    square = 8192 * 8192
    assert square - _hidden_pairs(8192, 128, 64) == square - _hidden_pairs(8192, 64, 128) == 0.5078125 * square
    hardware = flops.hardware_flops_per_step(cfg)
    assert (hardware + _hidden_tile_flops(cfg, "flash")) / hardware == pytest.approx(1.1405, abs=1e-4)


@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn"])
def test_every_fused_cuda_kernel_counts_a_backward_of_five_attention_matmuls(kernel):
    # gpt3-175b's shrunken layer (MHA: every kernel takes it), bf16, dropout on, one micro-batch of b
    # sequences: the fused kernel's forward is QK^T and times V, 2·2·b·a·s²·d; its backward recomputes
    # QK^T and runs the four gradient matmuls, 5·2·b·a·s²·d; everything else is the same as with the
    # math path, whose backward is 4 matmuls. So fused - math = one matmul per layer.
    cfg = shrunk("gpt3-175b", **{"model.hidden_dropout": 0.1, "model.attention_dropout": 0.1})
    m, t = cfg.model, cfg.training
    matmul = 2 * t.micro_batch_size * m.num_attention_heads * t.seq_length**2 * m.head_dim
    assert meta_step_flops(cfg, kernel) - meta_step_flops(cfg) == m.num_layers * matmul
    assert flops.hardware_flops_per_step(cfg, DeviceKernels("cuda", kernel)) == meta_step_flops(cfg, kernel)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("micro_batch", [1, 2])
def test_the_model_is_exact_term_by_term(precision, micro_batch):
    # b = 1 keeps views of the fused QKV output where b > 1 copies q, k, v; fp32 has no upcast in
    # sdpa's math fallback: each case names different storages, and every one adds up to the byte.
    for workload in ("llama3-8b", "gpt3-175b"):
        for backend, dropout in (("sdpa", 0.0), ("sdpa", 0.1), ("math", 0.1)):
            cfg = shrunk(workload, **{"training.precision": precision, "training.micro_batch_size": micro_batch,
                                      "training.global_batch_size": micro_batch, "model.attention_backend": backend,
                                      "model.attention_dropout": dropout, "model.hidden_dropout": dropout})
            total, per_layer, _, _ = probe_step(cfg)
            assert activation_bytes(cfg, "cpu") == {"activation_bytes": total, "activation_bytes_per_layer": per_layer}


@pytest.mark.parametrize("method,n", [("uniform", 1), ("uniform", 2), ("block", 2)])
def test_full_recompute_rebuilds_a_whole_layer_per_recomputed_layer_in_backward(method, n):
    cfg = shrunk("gpt3-175b", **{"model.attention_backend": "math", "model.attention_dropout": 0.1,
                                 "model.hidden_dropout": 0.1})
    cfg = dataclasses.replace(cfg, recompute=RecomputeConfig("full", [], method, n))
    *_, recomputed = probe_step(cfg, backward=True)
    layers = cfg.model.num_layers if method == "uniform" else n
    assert recomputed == layers * layer_activation_bytes(cfg, (), "cpu")
    # Stored and backward peak of the 3 layers, by hand, with c one checkpointed input and f one
    # layer's full activations (its own input among them); backward runs the last chunk first.
    acts = stage_activations(cfg, "cpu")
    f, c = layer_activation_bytes(cfg, (), "cpu"), checkpoint_input_bytes(cfg)
    expected = {
        ("uniform", 1): (3 * c, 2 * c + f),  # chunks [1][1][1]: the last rebuilt beside 2 inputs
        ("uniform", 2): (2 * c, 2 * f),      # chunks [2][1]: [1] beside one input (c + f), then [2] (2f)
        ("block", 2): (2 * c + f, 2 * c + f),  # layers 1, 2 checkpointed, layer 3 kept; one rebuilt at a time
    }[method, n]
    assert (acts.stored_bytes, acts.peak_bytes) == expected


@pytest.mark.parametrize("workload", list(SHRUNK))
def test_parameter_count_matches_the_built_model(workload):
    cfg = shrunk(workload)
    model = build_model(cfg.model, cfg.training.seed)
    assert stage_parameters(cfg, 0) == sum(p.numel() for p in model.parameters())


def test_memory_counts_megatron_s_padded_vocabulary():
    # Llama 3's 128256 ids at tp 8: Megatron pads to a multiple of 128 x 8 = 1024, ceil(128256 / 1024)
    # = 126, so 126 x 1024 = 129024 rows: 768 more than the tokenizer's (none at tp 1: 128256 = 1002 x 128).
    cfg = config("llama3-8b", parallel__tensor_model_parallel_size=8)
    s, b, h, t, rows = 8192, 1, 4096, 8, 129024
    loss = loss_saved_bytes(cfg)
    assert loss["loss.logits_gradient"] == 2 * s * b * rows / t  # in the bf16 logits of this rank's vocab shard
    chunk = 2**25 // (rows // t)  # tokens a chunk: 2080 of this rank's 16128 ids
    assert chunk == 2080 and loss_workspace_bytes(cfg) == 4 * chunk * rows / t  # one chunk's fp32 working copy
    # Word embedding and the untied output layer: 768 padded rows of h each, sharded over the 8 ranks.
    # make_vocab_size_divisible_by = 1 leaves 128256 as it is (it divides by 8).
    unpadded = config("llama3-8b", parallel__tensor_model_parallel_size=8, model__make_vocab_size_divisible_by=1)
    assert stage_parameters(cfg, 0) - stage_parameters(unpadded, 0) == 2 * 768 * h / t
    # A vocabulary that is not a multiple of 128 pads at tp 1 too: GPT-2's 50257 -> 393 x 128 = 50304.
    gpt2_vocab = config("tiny", model__vocab_size=50257)
    tokens = 128 * 2  # tiny: s = 128, b = 2
    assert loss_saved_bytes(gpt2_vocab, "cpu")["loss.logits_gradient"] == 2 * tokens * 50304


def test_parameters_match_published_counts():
    # Llama 3 8B: 8,030,261,248 parameters (Meta's release); untied output layer, no biases.
    assert stage_parameters(config("llama3-8b"), 0) == 8_030_261_248
    # GPT-3 175B by Narayanan et al. 2021 (§5.1): P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)),
    # which leaves out the final LayerNorm's 2h.
    l, h, V, s = 96, 12288, 51200, 2048
    published = 12 * l * h**2 + 13 * l * h + (V + s) * h
    assert stage_parameters(config("gpt3-175b"), 0) == published + 2 * h
    # Tensor parallelism shards everything but the norms, the row-parallel biases (2 norms of 2h and
    # 2 biases of h per layer, and the final norm) and Megatron's position embedding (s x h).
    t = 8
    replicated = l * (4 * h + 2 * h) + 2 * h + s * h
    sharded_t8 = stage_parameters(config("gpt3-175b", parallel__tensor_model_parallel_size=t), 0)
    assert sharded_t8 == (published + 2 * h - replicated) / t + replicated


def test_pipeline_stages_split_the_layers_and_keep_an_embedding_copy_when_tied():
    cfg = config("gpt3-175b", parallel__pipeline_model_parallel_size=2)
    one = config("gpt3-175b")
    vocab = 51200 * 12288  # GPT-3's vocabulary needs no padding: 51200 = 400 x 128
    assert stage_parameters(cfg, 0) + stage_parameters(cfg, 1) == stage_parameters(one, 0) + vocab


def test_optimizer_bytes_per_parameter_are_the_layouts_own_buffers_only():
    def per(cfg):
        return {h.name: h.per_parameter for h in optimizer_bytes_per_parameter(cfg)}

    # One rank, DDP and tensor parallel: Megatron's 18 (bf16) and 16 (fp32), no 16-bit gradient kept.
    assert per(config()) == {"weights (bf16)": 2, "main gradients (fp32)": 4, "master weights (fp32)": 4,
                             "Adam moments (fp32)": 8}
    assert per(config(training__precision="fp32")) == {"weights (fp32)": 4, "main gradients (fp32)": 4,
                                                       "Adam moments (fp32)": 8}
    assert per(config(parallel__data_parallel_size=2)) == per(config())
    # FSDP (the distributed optimizer here): fp32 shards, 16/dp; with two micro-batches per rank the
    # unsharded fp32 gradients accumulated until the last one's reduce-scatter, in backward only.
    one = config("tiny", parallel__data_parallel_size=4, parallel__use_distributed_optimizer=True,
                 training__global_batch_size=8)
    assert one.num_microbatches == 1
    assert per(one) == {"weights (fp32 shards)": 1, "gradients (fp32 shards, reduce-scattered)": 1,
                        "Adam moments (fp32 shards)": 2}
    # Megatron's own distributed optimizer (framework megatron): 6 + 12/dp.
    megatron = dataclasses.replace(one, training=dataclasses.replace(one.training, framework="megatron"))
    assert per(megatron) == {"weights (bf16)": 2, "main gradients (fp32)": 4, "master weights (fp32 shards)": 1,
                             "Adam moments (fp32 shards)": 2}
    two = dataclasses.replace(one, training=dataclasses.replace(one.training, global_batch_size=16))
    held = {h.name: h for h in optimizer_bytes_per_parameter(two)}
    assert held.keys() - per(one).keys() == {"gradients (fp32, unsharded, accumulated over micro-batches)"}
    accumulated = held["gradients (fp32, unsharded, accumulated over micro-batches)"]
    assert (accumulated.per_parameter, accumulated.backward, accumulated.step) == (4, True, False)
    assert not held["gradients (fp32 shards, reduce-scattered)"].backward


def test_the_whole_rank_lists_only_what_the_layout_holds():
    ddp = rank_memory(config())
    assert all(ddp.items.values()) and not any("FSDP" in name for name in ddp.items)
    assert "activations of the other in-flight micro-batches" not in ddp.items  # no pipeline
    fsdp = config("llama3-8b", parallel__data_parallel_size=8, parallel__use_distributed_optimizer=True)
    rank = rank_memory(fsdp)
    params = stage_parameters(fsdp, 0)
    assert rank.items["gradients (fp32, unsharded, accumulated over micro-batches)"] == 4 * params
    # The root (embedding, final norm, untied output layer) stays all-gathered from forward to
    # backward, with its unsharded gradients: bf16 weights and gradients, 2 + 2 bytes each.
    outside = 2 * 128256 * 4096 + 4096
    assert rank.items["FSDP: all-gathered weights outside the layers"] == 2 * outside
    assert rank.items["FSDP: unsharded gradients outside the layers"] == 2 * outside
    # at the step: the fp32 shards and what is held all run (the token ids, cuBLAS workspaces, RoPE tables)
    held = sum(rank.items[name] for name in ("token ids (all micro-batches of the step)", CUBLAS_WORKSPACES, ROPE_TABLES))
    assert rank.optimizer_step_bytes == 16 / 8 * params + held


def test_first_stage_holds_p_microbatches_and_the_interleave_factor():
    cfg = config("llama3-70b", parallel__tensor_model_parallel_size=8, parallel__pipeline_model_parallel_size=4)
    assert [microbatches_in_flight(cfg, i) for i in range(4)] == [4, 3, 2, 1]
    vpp = config("gpt3-175b", parallel__pipeline_model_parallel_size=8, parallel__virtual_pipeline_model_parallel_size=3)
    assert microbatches_in_flight(vpp, 0) == pytest.approx(8 * (1 + 7 / 24))
    # Megatron's interleaved warm-up on every rank: 2 (p - r - 1) + (vp - 1) p chunk-forwards, then one more.
    assert [chunks_in_flight(vpp, r) for r in range(8)] == [2 * (8 - r - 1) + 2 * 8 + 1 for r in range(8)]
    assert chunks_in_flight(vpp, 7) == 17 and microbatches_in_flight(vpp, 7) == pytest.approx(17 / 3)  # not 1
    few = config("gpt3-175b", parallel__pipeline_model_parallel_size=8, parallel__virtual_pipeline_model_parallel_size=3,
                 training__global_batch_size=8)
    assert chunks_in_flight(few, 0) == 8 * 3  # capped by the step's chunk-forwards (31 otherwise)
    rank = rank_memory(cfg, 0)
    stored = stage_activations(cfg).stored_bytes
    assert rank.items["activations of the other in-flight micro-batches"] == 3 * stored


# ----- the paper ------------------------------------------------------------------------------

# Table 2 at t = 8, derived by hand for each paper preset (s = 2048; 22B has b = 4, the others b = 1):
#   sbh: 22B 2048*4*6144 = 50,331,648; 175B 2048*12288 = 25,165,824; 530B 2048*20480 = 41,943,040;
#        1T 2048*25600 = 52,428,800.   5as/h: 22B 5*64*2048/6144 = 320/3; 175B 5*96*2048/12288 = 80;
#        530B 5*128*2048/20480 = 64; 1T 5*160*2048/25600 = 64.
#   none = sbh(10 + 24/8 + (5as/h)/8)  22B sbh*79/3; 175B 23 sbh; 530B and 1T 21 sbh
#   none, SP = sbh/8 (34 + 5as/h)      22B sbh*422/24; 175B 14.25 sbh; 530B and 1T 12.25 sbh
#   selective = 13 sbh, selective SP = 4.25 sbh, full = 2 sbh
TABLE_2 = {  # workload: (none, none SP, selective, selective SP, full), bytes per layer
    "gpt3-22b": (1_325_400_064, 884_998_144, 654_311_424, 213_909_504, 100_663_296),
    "gpt3-175b": (578_813_952, 358_612_992, 327_155_712, 106_954_752, 50_331_648),
    "gpt3-530b": (880_803_840, 513_802_240, 545_259_520, 178_257_920, 83_886_080),
    "gpt3-1t": (1_101_004_800, 642_252_800, 681_574_400, 222_822_400, 104_857_600),
}


@pytest.mark.parametrize("workload", PAPER_PRESETS)
def test_table_2_exactly_for_the_paper_presets(workload):
    none, none_sp, selective, selective_sp, full = TABLE_2[workload]
    for sp in (False, True):
        cfg = config(workload, model__attention_backend="math", parallel__tensor_model_parallel_size=8,
                     parallel__sequence_parallel=sp)
        s, b, h, a = cfg.training.seq_length, cfg.training.micro_batch_size, cfg.model.hidden_size, cfg.model.num_attention_heads
        table = {"none": none_sp if sp else none, "selective": selective_sp if sp else selective, "full": full}
        exactly = lambda x: pytest.approx(x, rel=1e-14, abs=0)  # noqa: E731 (float rounding only)
        for recompute, expected in table.items():
            assert paper_layer_bytes(s, b, h, a, 8, sp, recompute) == exactly(expected)
        # The layer built here is the paper's plus the two norms' statistics, exactly.
        assert not paper_layer_differences(cfg)
        stats = built_minus_paper_bytes(cfg)
        assert stats == 2 * 2 * 4 * s * b / (8 if sp else 1)  # 2 norms x (mean, rstd) x fp32
        assert layer_activation_bytes(cfg) - stats == exactly(table["none"])
        assert layer_activation_bytes(cfg, ["core_attn"]) - stats == exactly(table["selective"])
        if not sp:  # full recompute keeps the layer input; the paper does not shard it
            assert checkpoint_input_bytes(cfg) == table["full"]


def test_megatron_derived_per_layer_and_first_stage_totals():
    # anchor §D.1: 34sbh/t per layer and first-stage totals (t = 8, SP + selective recompute)
    per_layer = {"gpt3-22b": 204.0, "gpt3-175b": 102.0, "gpt3-530b": 170.0, "gpt3-1t": 212.5}
    layout = {"gpt3-22b": (1, None), "gpt3-175b": (8, 3), "gpt3-530b": (35, 3), "gpt3-1t": (64, None)}
    totals = {"gpt3-22b": 9.79, "gpt3-175b": 12.38, "gpt3-530b": 23.30, "gpt3-1t": 26.95}
    for workload, mib in per_layer.items():
        p, vpp = layout[workload]
        cfg = config(workload, parallel__tensor_model_parallel_size=8, parallel__sequence_parallel=True,
                     parallel__pipeline_model_parallel_size=p, parallel__virtual_pipeline_model_parallel_size=vpp)
        m, tr = cfg.model, cfg.training
        assert paper_layer_bytes(tr.seq_length, tr.micro_batch_size, m.hidden_size, m.num_attention_heads, 8, True,
                                   "selective") == mib * MiB
        assert round(paper_first_stage_bytes(cfg, "selective") / GiB, 2) == totals[workload]


def test_paper_flops_reproduce_table_5_and_show_the_selective_inconsistency():
    # Table 5: iteration time with selective recompute + SP, A100 312 TFLOP/s; MFU (Eq. 7) and HFU (Eq. 8)
    table5 = {"gpt3-22b": (1.10, 8, 41.5, 43.7), "gpt3-175b": (13.75, 64, 51.4, 52.8),
              "gpt3-530b": (37.83, 280, 56.0, 57.0), "gpt3-1t": (71.49, 512, 56.3, 57.0)}
    for workload, (seconds, gpus, mfu, hfu) in table5.items():
        cfg = config(workload)
        f = paper_flops_per_step(cfg, "selective")
        tolerance = 0.25 if workload == "gpt3-22b" else 0.05  # the paper's own 22B row is 0.2 pt off its formulas
        assert abs(100 * f["model_flops_per_step"] / (seconds * gpus * 312e12) - mfu) <= tolerance
        assert abs(100 * f["hardware_flops_per_step"] / (seconds * gpus * 312e12) - hfu) <= tolerance
        # Eq. 8 adds 12Bs^2h per layer, the text's recompute of QK^T and times V 4Bs^2h (what flops.py
        # counts for the paper's explicit attention; a fused kernel re-runs only the tiles the causal
        # mask leaves): for 175B, B s^2 h L = 64 * 2048^2 * 12288 * 96 = 316,659,348,799,488 (3.17e17)
        if workload == "gpt3-175b":
            Bs2hL = 316_659_348_799_488
            assert f["hardware_flops_per_step"] - f["model_flops_per_step"] == pytest.approx(12 * Bs2hL)
            assert f["hardware_flops_per_step_from_text"] - f["model_flops_per_step"] == pytest.approx(4 * Bs2hL)
            paper = resolved(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_backend="math")))
            selective = dataclasses.replace(paper, recompute=RecomputeConfig("selective", ["core_attn"]))
            assert flops.hardware_flops_per_step(selective) - flops.hardware_flops_per_step(paper) == 4 * Bs2hL


# ----- the commands -------------------------------------------------------------------------------

def test_estimate_commands_of_the_issue():
    result = invoke("estimate", "--workload", "llama3-70b", "--tp", "8", "--sequence-parallel", "--pp", "4",
                    "--micro-batch-size", "1", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    labels = [s["label"] for s in report["settings"]]
    assert "none" in labels and "selective[core_attn,mlp,layernorm]" in labels and "full uniform 1" in labels
    assert report["setting"]["peak_stage"] == 0 and report["microbatches_in_flight"] == 4
    assert "whole-rank peak" in result.stderr and "Table 2" in result.stderr

    result = invoke("estimate", "--workload", "gpt3-175b", "--tp", "8", "--attention-backend", "math", "--json")
    assert result.exit_code == 0, result.output
    rows = {r["recompute"]: r for r in json.loads(result.stdout)["paper"]["rows"]}
    assert rows["selective"]["paper_bytes"] == 2048 * 12288 * (10 + 24 / 8)
    assert "the paper's layer" in result.stderr


def test_a_megatron_estimate_shows_each_settings_predicted_step_and_where_it_goes():
    seed = "tests/data/seed/LLAMA3_70B_SFT_CONFIG_H100_FP8_CS_V1.yaml"
    result = invoke("estimate", "--framework", "megatron", "--from", seed, "--gpus", "32", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["settings"]
    lines = result.stderr.splitlines()
    title = next(i for i, line in enumerate(lines) if "predicted step per GPU on h100" in line)
    table = lines[title:title + len(rows) + 5]
    header = next(line for line in table if "step s" in line)
    assert all(word in header for word in ("TFLOP/s", "tokens/s", "MFU", "GEMM", "attn", "memory", "bubble", "optim"))
    for r in rows:
        cells = [c.strip() for c in next(line for line in table if f" {r['label']} " in line).split("│")[2:-1]]
        assert cells[:4] == [f"{r['step_seconds']:.3f}", f"{r['tflops_per_gpu']:.0f}", f"{r['tokens_per_s_per_gpu']:.0f}",
                             f"{100 * r['mfu']:.1f}%"]
        assert cells[4] == f"{1e3 * r['step_parts']['gemm']:.0f}"
        # the recompute class is what separates the settings' steps
        assert r["step_parts"]["recompute"] >= 0 and (r["step_parts"]["recompute"] > 0) == (r["recompute_overhead"] > 0)


def test_plan_recommends_the_fastest_setting_that_fits():
    result = invoke("plan", "--workload", "llama3-70b", "--tp", "8", "--sequence-parallel", "--pp", "4", "--memory-gb", "64", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    fits = plan["fits"]
    assert fits and all(r["device_bytes_needed"] <= 64 * GiB for r in fits)
    assert [r["hardware_flops_per_step"] for r in fits] == sorted(r["hardware_flops_per_step"] for r in fits)
    assert plan["recommended"] == fits[0]["label"] and "recommended" in result.stderr
    assert "none" not in [r["label"] for r in fits]  # no recompute does not fit 64 GiB there


def test_plan_says_when_nothing_fits_and_what_would():
    result = invoke("plan", "--workload", "llama3-70b", "--tp", "8", "--sequence-parallel", "--pp", "4", "--memory-gb", "32", "--json")
    assert result.exit_code == 1
    plan = json.loads(result.stdout)
    assert not plan["fits"] and "nothing fits" in result.stderr
    changes = {r["change"]: r for r in plan["would_fit"]}
    assert changes["--pp 8"]["fits"]
    assert any(c.startswith("offload") for c in changes)


@pytest.mark.parametrize("argv,needle", [
    (["plan", "-w", "tiny"], "--memory-gb"),
    (["plan", "-w", "tiny", "--memory-gb", "-1"], "--memory-gb"),
    (["estimate", "-w", "tiny", "--device", "tpu"], "--device"),
    (["estimate", "-w", "tiny", "--allowance-fraction", "-0.5"], "allowance"),
    (["estimate", "-w", "nope"], "unknown workload"),
    (["plan", "-w", "tiny", "--memory-gb", "80", "--tp", "3"], "must divide"),
])
def test_bad_input_is_one_line_and_exit_2(argv, needle):
    result = invoke(*argv)
    assert result.exit_code == 2
    assert needle in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_run_records_carry_the_estimate_beside_the_measurement():
    result = invoke("run", "-w", "tiny", "--set", "training.warmup_steps=0", "--set", "training.measured_steps=1",
                    "--no-save", "--json", "--attention-backend", "math")
    assert result.exit_code == 0, result.output
    m = json.loads(result.stdout)["metrics"]
    assert m["estimated_activation_bytes"] == m["activation_bytes"]
    assert m["estimated_activation_bytes_per_layer"] == m["activation_bytes_per_layer"]
    assert m["estimated_hardware_flops_per_step"] == m["measured_flops_per_step"]
    assert m["estimated_peak_allocated_bytes"] > m["activation_bytes"]
    assert "estimated activation bytes (error)" in result.stderr and "(+0.00%)" in result.stderr
