"""Framework megatron with CUDA graphs and activation offload: the static buffers Transformer Engine's
per-layer graphs keep, the eager / capture / replay phases whose most is the peak, full_iteration's
data buffers, what layer-level and fine-grained offloading take off the device; Megatron's arguments
for them; and the seeds' Llama 3 70B FP8 configuration, estimated stage by stage."""

import json

import pytest
from helpers import invoke

from recompute_bench.analysis import megatron as mg
from recompute_bench.analysis.megatron import cuda_graphs, layer, offload, outside, stage
from recompute_bench.analysis.megatron_schedule import chunk_forwards_in_flight
from recompute_bench.ingest.megatron_args import config_from_megatron, megatron_overrides, overrides_as_flags
from recompute_bench.ingest.megatron_argv import module_list

MiB = 2**20
H100 = mg.MegatronRun("h100", ":4096:8")
# tp 2 with sequence parallel, pp 2, 8 micro-batches: stage 0 holds 2 micro-batches in flight.
PIPELINED = {"--num-layers": 4, "--hidden-size": 512, "--num-attention-heads": 8, "--seq-length": 1024,
             "--max-position-embeddings": 1024, "--micro-batch-size": 2, "--global-batch-size": 16, "--swiglu": True,
             "--tensor-model-parallel-size": 2, "--sequence-parallel": True, "--pipeline-model-parallel-size": 2,
             "--use-distributed-optimizer": True, "--bf16": True, "--attention-dropout": 0.0, "--hidden-dropout": 0.0,
             "--normalization": "RMSNorm"}
ONE_STAGE = {**PIPELINED, "--pipeline-model-parallel-size": 1, "--hidden-size": 1024, "--seq-length": 4096,
             "--max-position-embeddings": 4096, "--micro-batch-size": 1, "--global-batch-size": 8}


def _cfg(base, **more):
    return config_from_megatron({**base, **more}, world_size=8)


def test_te_graphs_keep_a_hidden_state_input_per_layer_forward_in_flight():
    cfg = _cfg(PIPELINED, **{"--cuda-graph-impl": "transformer_engine", "--cuda-graph-modules": "[mlp]"})
    hidden = 2 * (1024 // 2) * 2 * 512  # bf16 [s/t, b, h]: get_layer_static_inputs
    assert chunk_forwards_in_flight(cfg, 0) == 2 and chunk_forwards_in_flight(cfg, 1) == 1
    for s, forwards in ((0, 2), (1, 1)):
        buffers = cuda_graphs.static_buffer_bytes(cfg, s, 2)
        assert buffers == {"CUDA graph static inputs (hidden states)": forwards * 2 * hidden,
                           "CUDA graph static gradients": 2 * hidden}
    # graphing attention adds each buffer's [b, 1, s, s] bool mask
    attn = _cfg(PIPELINED, **{"--cuda-graph-impl": "transformer_engine", "--cuda-graph-modules": "[attn mlp]"})
    assert cuda_graphs.static_buffer_bytes(attn, 0, 2)["CUDA graph static inputs (attention masks)"] == 2 * 2 * 2 * 1024 * 1024


def test_graphs_capture_their_part_of_each_layer():
    cfg = _cfg(PIPELINED, **{"--cuda-graph-impl": "transformer_engine", "--cuda-graph-scope": "mlp"})
    saved = layer.layer_saved_bytes(cfg, H100)
    graphed = cuda_graphs.in_graph(cfg, saved)
    assert set(graphed) == {"linear_fc1.input", "linear_fc1.norm_stats", "linear_fc1.ln_out", "linear_fc1.output",
                            "linear_fc2.input"}
    # during replay the next layer's input (the MLP graph's output) is pool memory too, but not the
    # first layer's of a chunk, which the previous stage sends
    assert set(cuda_graphs.pool_resident(cfg, saved, first_in_chunk=False)) == {*graphed, "linear_qkv.input"}
    assert set(cuda_graphs.pool_resident(cfg, saved, first_in_chunk=True)) == set(graphed)


def test_the_peak_is_the_most_of_eager_warm_up_capture_and_replay():
    plain = _cfg(PIPELINED)
    graphed = _cfg(PIPELINED, **{"--cuda-graph-impl": "transformer_engine", "--cuda-graph-modules": "[mlp]"})
    for s in (0, 1):
        a, b = mg.stage_peak(plain, s, H100), mg.stage_peak(graphed, s, H100)
        # three eager steps first (cuda_graph_warmup_steps 3): the MLP graphs never exceed them here
        assert b.peak_allocated_bytes == a.peak_allocated_bytes and b.phase == a.phase + " (eager warm-up step)"
        assert set(b.phase_peaks) == {"eager warm-up step", "CUDA graph capture", "CUDA graph replay"}
        assert max(b.phase_peaks.values()) == b.peak_allocated_bytes
        # after the step the graphs' static buffers stay
        extra = sum(cuda_graphs.static_buffer_bytes(graphed, s, 2).values())
        assert b.static_bytes == pytest.approx(a.static_bytes + extra)
    # captured before the first step (no warm-up): no eager phase, the capture without Adam moments
    early = _cfg(PIPELINED, **{"--cuda-graph-impl": "transformer_engine", "--cuda-graph-modules": "[mlp]",
                               "--cuda-graph-warmup-steps": 0})
    peak = mg.stage_peak(early, 1, H100)
    assert set(peak.phase_peaks) == {"CUDA graph capture", "CUDA graph replay"}
    assert peak.phase.endswith("(CUDA graph replay)") and peak.peak_allocated_bytes < mg.stage_peak(plain, 1, H100).peak_allocated_bytes


def test_full_iteration_graphs_hold_every_micro_batchs_inputs():
    cfg = _cfg(PIPELINED, **{"--cuda-graph-impl": "full_iteration"})
    plain = _cfg(PIPELINED)
    assert cfg.num_microbatches == 4
    for s in (0, 1):  # both stages read data: their rank 0 of tensor parallel keeps 4 batches
        items = stage.static_items(cfg, s, H100)
        assert items["CUDA graph static inputs (every micro-batch's data)"] == 4 * outside.batch_bytes(cfg)
    # the eager step's own batch is one of those buffers
    a, b = mg.stage_peak(plain, 1, H100), mg.stage_peak(cfg, 1, H100)
    assert b.peak_allocated_bytes - a.peak_allocated_bytes == pytest.approx(3 * outside.batch_bytes(cfg))


def test_layer_offloading_keeps_l_minus_n_layers_on_the_device():
    # TE's DefaultOffloadSynchronizer: layers 0..N-1 leave the device (their tensors of 256 Ki
    # elements or more), so 4 - 2 layers' worth stays, plus the small tensors of the two offloaded.
    cfg = _cfg(ONE_STAGE, **{"--cpu-offloading": True, "--cpu-offloading-num-layers": 2})
    saved = layer.layer_saved_bytes(cfg, H100)
    big = offload.layer_offloaded(cfg, saved)
    assert set(saved) - set(big) == {"linear_qkv.norm_stats", "linear_fc1.norm_stats", "core_attention.softmax_stats"}
    full = sum(saved.values())
    assert stage.chunk_bytes(cfg, H100, 4).stored == pytest.approx(4 * full - 2 * sum(big.values()))


def test_fine_grained_offloading_moves_the_listed_modules_groups():
    cfg = _cfg(ONE_STAGE, **{"--fine-grained-activation-offloading": True,
                             "--offload-modules": "[qkv_linear core_attn attn_proj]"})
    saved = layer.layer_saved_bytes(cfg, H100)
    away = offload.fine_grained_offloaded(cfg, saved)
    # qkv_linear: the fused norm's input and ln_out; core_attn: the QKV output behind q, k, v;
    # attn_proj: the attention output; the 1 Mi-element minimum keeps the statistics on the device
    assert set(away) == {"linear_qkv.input", "linear_qkv.ln_out", "linear_qkv.output", "core_attention.output"}
    chunk = stage.chunk_bytes(cfg, H100, 4)
    assert chunk.stored == pytest.approx(4 * (sum(saved.values()) - sum(away.values())))
    assert chunk.last_layer_offloaded == pytest.approx(sum(away.values()))
    # the loss's chunk keeps its last layer's groups (its backward comes next): 3 layers offloaded
    plain = mg.stage_peak(_cfg(ONE_STAGE), 0, H100)
    peak = mg.stage_peak(cfg, 0, H100)
    assert plain.peak_allocated_bytes - peak.peak_allocated_bytes == pytest.approx(3 * sum(away.values()))
    # core_attn recomputed: its checkpoint runs outside the offload group
    recomputed = _cfg(ONE_STAGE, **{"--fine-grained-activation-offloading": True, "--offload-modules": "[core_attn]",
                                    "--recompute-granularity": "selective", "--recompute-modules": ["core_attn"]})
    assert offload.fine_grained_offloaded(recomputed, layer.layer_saved_bytes(recomputed, H100, ["core_attn"])) == {}


def test_megatrons_graph_and_offload_arguments_map_onto_the_fields():
    assert module_list("[attn mlp]") == module_list("attn,mlp") == module_list(["attn", "mlp"]) == ["attn", "mlp"]
    t = _cfg(PIPELINED, **{"--external-cuda-graph": True, "--cuda-graph-scope": "[attn mlp]"}).training
    assert (t.cuda_graph_impl, t.cuda_graph_modules) == ("transformer_engine", ["attn", "mlp"])
    t = _cfg(PIPELINED, **{"--enable-cuda-graph": True, "--cuda-graph-scope": "full"}).training
    assert (t.cuda_graph_impl, t.cuda_graph_modules) == ("local", [])
    t = _cfg(PIPELINED, **{"--cuda-graph-scope": "full_iteration"}).training
    assert (t.cuda_graph_impl, t.cuda_graph_modules) == ("full_iteration", [])
    r = _cfg(ONE_STAGE, **{"--fine-grained-activation-offloading": True, "--offload-modules": "[core_attn attn_proj]"}).recompute
    assert r.fine_grained_activation_offloading and r.offload_modules == ["core_attn", "attn_proj"]
    assert r.label == "offload[core_attn,attn_proj]"


@pytest.mark.parametrize("sets,words", [
    (["training.cuda_graph_impl=\"transformer_engine\"", "recompute.granularity=\"full\"", "recompute.method=\"uniform\"",
      "recompute.num_layers=1"], "full recompute is only supported with full iteration CUDA graph"),
    (["training.cuda_graph_impl=\"transformer_engine\"", "training.cuda_graph_modules=[\"moe\"]"], "moe cuda graph"),
    (["training.cuda_graph_impl=\"full_iteration\"", "training.cuda_graph_modules=[\"mlp\"]"], "must be empty"),
    (["recompute.fine_grained_activation_offloading=true", "recompute.offload_modules=[\"attn_proj\"]"],
     "attn_proj cannot be set to offload_modules alone"),
    (["recompute.offload_modules=[\"core_attn\"]"], "needs fine_grained_activation_offloading"),
])
def test_bad_graph_and_offload_settings_are_one_line(sets, words):
    result = invoke("estimate", "-w", "llama3-8b", "--framework", "megatron", "--gpu", "h100",
                    *[x for s in sets for x in ("--set", s)])
    assert result.exit_code == 2 and words in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_this_harness_refuses_megatrons_graphs_and_offload_groups():
    for s in ("training.cuda_graph_impl=\"local\"", "recompute.fine_grained_activation_offloading=true"):
        result = invoke("estimate", "--set", s, *(["--set", "recompute.offload_modules=[\"core_attn\"]"]
                                                   if "fine" in s else []))
        assert result.exit_code == 2 and "--framework megatron" in result.stderr


# The seeds' configuration (shared/seeds/003, Megatron Bridge's LLAMA3_70B_SFT_CONFIG_H100_FP8_CS_V1):
# Llama 3 70B on 32 H100s, TP 4, PP 4, VP 5, sequence parallel, FP8 current scaling with FP8
# weights, TE CUDA graphs on the MLP, the distributed optimizer, recompute [core_attn] (the
# experiment table's baseline). TE's fused cross-entropy and deferred embedding weight gradients,
# which the recipe also sets, belong to other terms and are left out here.
LLAMA3_70B_FP8_CS = {
    "--num-layers": 80, "--hidden-size": 8192, "--ffn-hidden-size": 28672, "--num-attention-heads": 64,
    "--group-query-attention": True, "--num-query-groups": 8, "--kv-channels": 128, "--swiglu": True,
    "--normalization": "RMSNorm", "--position-embedding-type": "rope", "--rotary-base": 500000,
    "--untie-embeddings-and-output-weights": True, "--disable-bias-linear": True, "--attention-dropout": 0.0,
    "--hidden-dropout": 0.0, "--seq-length": 4096, "--max-position-embeddings": 8192, "--micro-batch-size": 1,
    "--global-batch-size": 32, "--tokenizer-type": "NullTokenizer", "--vocab-size": 128256,
    "--tensor-model-parallel-size": 4, "--pipeline-model-parallel-size": 4, "--num-layers-per-virtual-pipeline-stage": 4,
    "--sequence-parallel": True, "--use-distributed-optimizer": True, "--bf16": True,
    "--fp8-format": "hybrid", "--fp8-recipe": "tensorwise", "--fp8-param-gather": True,
    "--cuda-graph-impl": "transformer_engine", "--cuda-graph-scope": "mlp",
    "--recompute-granularity": "selective", "--recompute-modules": ["core_attn"],
}


def test_the_seeds_llama3_70b_fp8_configuration_estimates_stage_by_stage():
    cfg = config_from_megatron(LLAMA3_70B_FP8_CS, world_size=32)
    t, p = cfg.training, cfg.parallel
    assert (t.precision, t.fp8_recipe, t.fp8_param_gather, t.cuda_graph_impl, t.cuda_graph_modules) == \
        ("fp8", "tensorwise", True, "transformer_engine", ["mlp"])
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size,
            p.data_parallel_size) == (4, 4, 5, 2)
    peaks = mg.stage_peaks(cfg, H100)
    assert [r.stage for r in peaks] == [0, 1, 2, 3]
    linear = 80 // 4 * sum(r * c for r, c in layer.layer_linear_weights(cfg).values())  # FP8 values on a rank
    for r in peaks:
        # FP8 weights: one byte in the uint8 buffer, their Hopper transposes one more
        assert r.items["FP8 weight transposes"] == linear
        assert set(r.phase_peaks) == {"eager warm-up step", "CUDA graph capture", "CUDA graph replay"}
        assert r.peak_allocated_bytes > r.static_bytes > 40 * 2**30
    # the first stage holds the most micro-batches in flight: (p - 1) x 2 + (vp - 1) x p + 1 chunks
    assert chunk_forwards_in_flight(cfg, 0) == 23
    assert max(peaks, key=lambda r: r.peak_allocated_bytes).stage == 0
    # and through `estimate`, with the flags the arguments map onto
    result = invoke("estimate", *overrides_as_flags(megatron_overrides(LLAMA3_70B_FP8_CS, world_size=32)),
                    "--gpu", "h100", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [s["peak_allocated_bytes"] for s in report["stages"]] == [r.peak_allocated_bytes for r in peaks]
