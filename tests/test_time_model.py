"""The time model (analysis/megatron/time_model.py): its ops' work against the FLOPs model, which ops each
recompute module re-runs in Megatron, the roofline and the pipeline's step, the rates and where
they come from, and the goal against the two public measurements (3 points)."""

import dataclasses

import pytest
from helpers import config

from recompute_bench.analysis import gpu_rates
from recompute_bench.analysis.megatron import MegatronRun, stage_peaks, time_checks
from recompute_bench.analysis.megatron import time_model as tm
from recompute_bench.config.schema import BadInput, RecomputeConfig
from recompute_bench.models import spec_for
from recompute_bench.recompute.policy import LayerPolicy

H100 = gpu_rates.datasheet_rates("h100")
RUN = MegatronRun("h100")


def megatron(workload="llama3-70b", **overrides):
    return config(workload, training__framework="megatron", **overrides)


# ----- the goal --------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", ["full", "selective"])
def test_the_paper_s_table_4_is_predicted_within_3_points(setting):
    row = next(r for r in time_checks.paper_rows() if r["setting"] == setting)
    assert abs(row["predicted_relative"] - row["measured_relative"]) <= time_checks.GOAL_POINTS, row


@pytest.mark.parametrize("setting", ["selective[mlp]", "selective[core_attn,mlp]", "selective[core_attn,layernorm]"])
@pytest.mark.parametrize("against", ["predicted_relative_to_baseline", "predicted_relative_to_none"])
def test_the_seeds_llama3_70b_fp8_table_is_predicted_within_3_points(setting, against):
    row = next(r for r in time_checks.seeds_rows() if r["setting"] == setting)
    assert abs(row[against] - row["measured_relative"]) <= time_checks.GOAL_POINTS, row


def test_the_published_ratios_are_the_sources_figures():
    paper = {r["setting"]: r["measured_relative"] for r in time_checks.paper_rows()}
    assert paper == {"none": 1.0, "full": 19.6 / 27.2, "selective": 19.6 / 20.9}
    seeds = {r["setting"]: r["measured_tflops"] for r in time_checks.seeds_rows()}
    assert seeds == {"selective[core_attn]": 704.0, "selective[mlp]": 593.6, "selective[core_attn,mlp]": 586.8,
                     "selective[core_attn,layernorm]": 702.0}


# ----- the ops ----------------------------------------------------------------------------------


@pytest.mark.parametrize("workload,overrides", [
    ("gpt3-22b", {"model__transformer_impl": "local", "model__attention_backend": "local",
                  "parallel__tensor_model_parallel_size": 8}),
    ("llama3-70b", {"parallel__tensor_model_parallel_size": 4, "parallel__sequence_parallel": True}),
])
def test_the_layer_s_linear_flops_are_the_flops_model_s_split_over_tensor_parallel(workload, overrides):
    cfg = megatron(workload, **overrides)
    ops = {op.name: op for op in tm.layer_ops(cfg, RUN).forward}
    parts = spec_for(cfg.model).layer_flops(cfg, None, "cuda")
    t = cfg.parallel.tensor_model_parallel_size
    assert ops["linear_qkv"].flops * t == parts["qkv_proj"].forward
    assert ops["linear_proj"].flops * t == parts["out_proj"].forward
    assert (ops["linear_fc1"].flops + ops["linear_fc2"].flops) * t == parts["mlp"].forward
    backward = {op.name: op for op in tm.layer_ops(cfg, RUN).backward}
    for name in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):  # data and weight gradient, each as big
        assert backward[f"{name}.dgrad"].flops == backward[f"{name}.wgrad"].flops == ops[name].flops


def test_the_explicit_attention_path_multiplies_the_whole_square_and_the_fused_kernel_the_causal_half():
    local = megatron("gpt3-22b", model__transformer_impl="local", model__attention_backend="local")
    ops = {op.name: op for op in tm.layer_ops(local, RUN).forward}
    b, s, a, d = 4, 2048, 64, 96
    assert ops["core_attention.qk"].flops == ops["core_attention.pv"].flops == 2 * b * a * s * s * d
    fused = megatron("gpt3-22b")  # Transformer Engine on H100: cuDNN's fused attention
    (op,) = [op for op in tm.layer_ops(fused, RUN).forward if op.kind == "attention"]
    assert op.flops == b * a * s * (s + 1) / 2 * 4 * d
    (back,) = [op for op in tm.layer_ops(fused, RUN).backward if op.kind == "attention"]
    assert back.flops == 2.5 * op.flops  # QK^T again, then dV, dP, dQ, dK: five matmuls for the forward's two


def test_what_each_recompute_module_re_runs_follows_megatron_s_layer_spec():
    te = tm.layer_ops(megatron(), RUN)
    local = tm.layer_ops(megatron(model__transformer_impl="local"), RUN)

    def rerun(layer, *modules):
        return {op.name for op in tm.recompute_ops(layer, LayerPolicy(modules=frozenset(modules)))}

    # TE fuses both norms into linear_qkv / linear_fc1 (IdentityOp norms): layernorm re-runs nothing,
    # and mlp's checkpoint holds the pre-MLP norm.
    assert rerun(te, "layernorm") == set()
    assert rerun(te, "mlp") == {"pre_mlp_layernorm", "linear_fc1", "activation", "linear_fc2"}
    assert rerun(local, "layernorm") == {"input_layernorm", "pre_mlp_layernorm"}
    assert "pre_mlp_layernorm" not in rerun(local, "mlp")
    assert rerun(te, "core_attn") == {"core_attention"}  # RoPE runs before it, linear_proj after it
    full = tm.recompute_ops(te, LayerPolicy(chunk=0))
    assert [op.name for op in full] == [op.name for op in te.forward]


def test_sequence_parallel_mlp_recompute_re_runs_its_all_gather_and_reduce_scatter():
    cfg = megatron(parallel__tensor_model_parallel_size=4, parallel__sequence_parallel=True)
    names = {op.name for op in tm.recompute_ops(tm.layer_ops(cfg, RUN), LayerPolicy(modules=frozenset({"mlp"})))}
    assert {"linear_fc1.all_gather", "linear_fc2.reduce_scatter"} <= names


def test_fp8_runs_the_linears_at_fp8_s_rate_and_quantizes_their_inputs_by_recipe():
    bf16 = megatron(parallel__tensor_model_parallel_size=4, parallel__sequence_parallel=True)
    fp8 = dataclasses.replace(bf16, training=dataclasses.replace(bf16.training, precision="fp8", fp8_recipe="tensorwise"))
    delayed = dataclasses.replace(fp8, training=dataclasses.replace(fp8.training, fp8_recipe="delayed"))
    ops8 = {op.name: op for op in tm.layer_ops(fp8, RUN).forward}
    ops16 = {op.name: op for op in tm.layer_ops(bf16, RUN).forward}
    assert ops8["linear_fc1"].precision == "fp8" and ops16["linear_fc1"].precision == "bf16"
    assert ops8["linear_fc1"].seconds(H100) == pytest.approx(ops16["linear_fc1"].seconds(H100) / 2)  # compute-bound
    (attention,) = [op for op in ops8.values() if op.kind == "attention"]
    assert attention.precision == "bf16"
    elements = 8192 * 28672 // 4  # fc2's input on a rank: s x b x f / t
    # current scaling: an amax pass and the cast (two reads of 2 bytes), rowwise + columnwise FP8 copies
    assert ops8["linear_fc2.quantize"].bytes == (2 * 2 + 2) * elements
    assert {op.name: op for op in tm.layer_ops(delayed, RUN).forward}["linear_fc2.quantize"].bytes == (2 + 2) * elements
    # the norm's own amax (TE's fused norm + amax kernel) spares linear_qkv's input the amax pass; delayed
    # scaling writes FP8 from the norm kernel itself
    assert "linear_qkv.quantize" not in {op.name for op in tm.layer_ops(delayed, RUN).forward}
    assert ops8["linear_qkv.quantize"].bytes == (2 + 2) * 8192 * 8192 // 4


def test_ring_collectives_send_their_share_and_backward_ones_hide_behind_a_gemm():
    cfg = megatron(parallel__tensor_model_parallel_size=8)
    fwd = {op.name: op for op in tm.layer_ops(cfg, RUN).forward}
    tensor = 2 * 8192 * 8192  # bf16 [s, b, h]
    assert fwd["linear_proj.all_reduce"].bytes == 2 * 7 / 8 * tensor
    bwd = tm.layer_ops(cfg, RUN).backward
    times = tm.op_times(bwd, H100)
    ar = next(op for op in bwd if op.name == "linear_fc1.dgrad_all_reduce")
    assert ar.overlaps == "linear_fc1.wgrad"
    assert times[ar.name] == max(0.0, ar.seconds(H100) - next(o for o in bwd if o.name == ar.overlaps).seconds(H100))


def test_an_op_takes_the_longer_of_its_work_and_its_bytes():
    op = tm.Op("x", "matrix", flops=989.5e12, bytes=3.35e12, precision="bf16")
    assert op.seconds(H100) == pytest.approx(1.0)
    assert tm.Op("x", "matrix", flops=1e12, bytes=6.7e12).seconds(H100) == pytest.approx(2.0)
    assert tm.Op("x", "memory", bytes=3.35e12).seconds(H100) == pytest.approx(1.0)
    assert tm.Op("x", "comm", bytes=450e9).seconds(H100) == pytest.approx(1.0)


# ----- the step ---------------------------------------------------------------------------------


def test_the_step_is_the_slowest_stage_s_micro_batches_and_the_interleaved_bubble():
    cfg = megatron(parallel__tensor_model_parallel_size=8, parallel__pipeline_model_parallel_size=4,
                   parallel__virtual_pipeline_model_parallel_size=5, training__global_batch_size=16)
    params = [s.parameters for s in stage_peaks(cfg, RUN)]
    st = tm.step_time(cfg, RUN, H100, params)
    slowest = max(st.microbatch_seconds)
    assert st.pacing_stage == 3  # the output layer and the loss
    assert st.step_seconds == pytest.approx((16 + 3 / 5) * slowest + st.optimizer_seconds)
    # the parts: the pacing stage's micro-batches, then the optimizer step pass by pass (listed since its passes
    # became ops of their own)
    assert sum(p["seconds"] for p in st.parts if p["pass"] != "optimizer") == pytest.approx(16 * slowest)
    assert st.optimizer_seconds == max(tm.pass_seconds(tm.optimizer_ops(cfg, p), H100) for p in params)
    assert sum(p["seconds"] for p in st.parts if p["pass"] == "optimizer") == pytest.approx(st.optimizer_seconds)
    assert st.by_class()["optimizer"] == pytest.approx(st.optimizer_seconds)


def test_1f1b_waits_for_each_pipeline_exchange_and_the_interleaved_schedule_overlaps_them():
    # tp 8 +sp, pp 4, dp 1: a send carries s/t x b x h bf16 values to the rank 8 away, in the next node
    cfg = megatron(parallel__tensor_model_parallel_size=8, parallel__sequence_parallel=True,
                   parallel__pipeline_model_parallel_size=4, training__seq_length=2048, training__global_batch_size=8)
    one = 2048 // 8 * 1 * 8192 * 2
    assert [sum(op.bytes for op in tm.pipeline_send_ops(cfg, s)) for s in range(4)] == [one, 2 * one, 2 * one, one]
    (op,) = tm.pipeline_send_ops(cfg, 1)
    assert (op.group, op.stride) == (2, 8) and op.seconds(H100) == 2 * one / (400e9 / 8)  # the DGX H100 NIC
    st = tm.step_time(cfg, RUN, H100)
    sends = [p for p in st.parts if p["op"] == "pipeline.send_recv"]
    assert sends and sends[0]["seconds"] == pytest.approx(8 * sum(tm.op_times(
        tm.pipeline_send_ops(cfg, st.pacing_stage), H100).values()))
    assert st.by_class()["pipeline_p2p"] == pytest.approx(sends[0]["seconds"])
    # within one NVLink domain (tp 2, pp 2: 2 apart) the exchange runs over NVLink
    near = megatron(parallel__tensor_model_parallel_size=2, parallel__pipeline_model_parallel_size=2)
    (op,) = tm.pipeline_send_ops(near, 0)
    assert op.bytes == 8192 * 1 * 8192 * 2 and op.seconds(H100) == op.bytes / (900e9 / 2)
    interleaved = megatron(parallel__tensor_model_parallel_size=8, parallel__pipeline_model_parallel_size=4,
                           parallel__virtual_pipeline_model_parallel_size=5, training__global_batch_size=16)
    assert not any(tm.pipeline_send_ops(interleaved, s) for s in range(4))
    assert tm.step_time(interleaved, RUN, H100).by_class()["pipeline_p2p"] == 0.0


def test_recompute_adds_the_forward_ops_it_re_runs_in_every_layer():
    cfg = megatron(parallel__tensor_model_parallel_size=8)
    base = tm.step_time(cfg, RUN, H100)
    mlp = tm.step_time(dataclasses.replace(cfg, recompute=RecomputeConfig("selective", ["mlp"])), RUN, H100)
    layer = tm.layer_ops(cfg, RUN)
    once = sum(tm.op_times(layer.forward, H100)[op.name]
               for op in tm.recompute_ops(layer, LayerPolicy(modules=frozenset({"mlp"}))))
    m = cfg.num_microbatches
    assert mlp.step_seconds - base.step_seconds == pytest.approx(m * 80 * once)
    assert mlp.recompute_seconds == pytest.approx(m * 80 * once)
    block = tm.step_time(dataclasses.replace(cfg, recompute=RecomputeConfig("full", [], "block", 3)), RUN, H100)
    assert block.recompute_seconds == pytest.approx(m * 3 * tm.pass_seconds(layer.forward, H100))


def test_offload_adds_only_the_copies_the_layers_do_not_hide():
    from recompute_bench.analysis.megatron.layer import layer_saved_bytes
    from recompute_bench.analysis.megatron.offload import fine_grained_offloaded, layer_offloaded

    cfg = megatron("llama3-8b")
    policy = LayerPolicy(offload=True)
    moved = tm.offloaded_bytes(cfg, RUN, policy, 0)  # the memory model's tensors of 256 Ki elements or more
    assert moved == sum(layer_offloaded(cfg, layer_saved_bytes(cfg, RUN, (), 0)).values()) > 0
    copy = moved / H100.host_link_bytes_per_s
    assert tm.offload_seconds(cfg, RUN, H100, policy, 0, copy / 2, copy / 4) == pytest.approx(copy / 2 + 3 * copy / 4)
    assert tm.offload_seconds(cfg, RUN, H100, policy, 0, copy, copy) == 0.0
    with pytest.raises(BadInput, match="no host-link rate"):
        tm.offload_seconds(cfg, RUN, gpu_rates.datasheet_rates("b200"), policy, 0, 0.0, 0.0)
    # fine-grained offloading moves its modules' groups of every layer; a checkpointed layer none
    fine = dataclasses.replace(cfg, recompute=RecomputeConfig(fine_grained_activation_offloading=True,
                                                              offload_modules=["core_attn"]))
    groups = fine_grained_offloaded(fine, layer_saved_bytes(fine, RUN, (), 0))
    assert tm.offloaded_bytes(fine, RUN, LayerPolicy(), 0) == sum(groups.values()) > 0
    assert all(name.startswith(("core_attention.", "rotary.", "linear_qkv.output")) for name in groups)
    assert tm.offloaded_bytes(fine, RUN, LayerPolicy(chunk=0), 0) == 0.0
    # GB200's host link is NVLink-C2C: the same bytes take 7x less time than over H100's PCIe
    gb200 = gpu_rates.datasheet_rates("gb200")
    assert tm.offload_seconds(cfg, RUN, gb200, policy, 0, 0.0, 0.0) == pytest.approx(2 * moved / gb200.host_link_bytes_per_s)
    step = tm.step_time(dataclasses.replace(cfg, recompute=RecomputeConfig(activation_offload_layers=4)), RUN, H100)
    offloaded = sum(p["seconds"] for p in step.parts if p["pass"] == "offload")
    ops = tm.layer_ops(cfg, RUN)
    hidden = tm.offload_seconds(cfg, RUN, H100, policy, 0, tm.pass_seconds(ops.forward, H100),
                                tm.pass_seconds(ops.backward, H100))
    assert offloaded == pytest.approx(cfg.num_microbatches * 4 * hidden)


# ----- the rates --------------------------------------------------------------------------------


def test_datasheet_rates_are_the_dense_half_of_the_printed_sparse_figures():
    assert H100.matrix_flops == {"bf16": 989.5e12, "fp16": 989.5e12, "fp32": 494.5e12, "fp8": 1979e12, "fp64": 67e12}
    assert (H100.hbm_bytes_per_s, H100.link_bytes_per_s) == (3.35e12, 450e9)
    assert (H100.network_bytes_per_s, H100.nvlink_domain) == (50e9, 8)  # DGX H100: a 400 Gb/s NIC per GPU
    a100 = gpu_rates.datasheet_rates("a100")
    assert a100.matrix_flops["bf16"] == 312e12 and "fp8" not in a100.matrix_flops
    with pytest.raises(BadInput, match="A100 SXM4 80GB has no fp8 tensor cores"):
        a100.matrix_rate("fp8")


def test_a_gpu_kind_without_rates_is_refused_naming_the_kinds_that_have_some():
    with pytest.raises(BadInput) as e:
        gpu_rates.datasheet_rates("v100")
    assert str(e.value) == ("no datasheet rates for GPU kind 'v100' to price time with; pass --gpu with one of a100, "
                            "h100, h200, b200, gb200, or --profile on that GPU to measure its rates")


def test_a_measured_profile_overrides_what_it_measured_and_names_itself(tmp_path):
    import json
    path = gpu_rates.rates_cache_path("NVIDIA H100 80GB HBM3", tmp_path)
    path.write_text(json.dumps({"schema": gpu_rates.RATES_SCHEMA, "device_name": "NVIDIA H100 80GB HBM3",
                                "measured": {"bf16_flops": 700e12, "fp8_flops": None, "hbm_bytes_per_s": 2.9e12}}))
    rates = gpu_rates.with_profile(H100, gpu_rates.read_rates_profile(path))
    assert rates.matrix_flops == {"bf16": 700e12, "fp16": 700e12, "fp32": 494.5e12, "fp8": 1979e12, "fp64": 67e12}
    assert rates.hbm_bytes_per_s == 2.9e12 and rates.link_bytes_per_s == H100.link_bytes_per_s
    assert rates.source.startswith("measured on NVIDIA H100 80GB HBM3 (bf16_flops, hbm_bytes_per_s)")
    path.write_text("{}")
    with pytest.raises(BadInput, match="is not a rates profile"):
        gpu_rates.read_rates_profile(path)


def test_tp_comm_overlap_pipelines_each_linear_s_collectives_with_its_gemm():
    plain = megatron(parallel__tensor_model_parallel_size=4, parallel__sequence_parallel=True)
    overlapped = megatron(parallel__tensor_model_parallel_size=4, parallel__sequence_parallel=True,
                          parallel__tp_comm_overlap=True)
    fwd = {op.name: op for op in tm.layer_ops(overlapped, RUN).forward}
    assert fwd["linear_fc1.all_gather"].overlaps == "linear_fc1" and fwd["linear_fc2.reduce_scatter"].overlaps == "linear_fc2"
    assert {op.name: op for op in tm.layer_ops(plain, RUN).forward}["linear_fc1.all_gather"].overlaps is None
    bwd = {op.name: op for op in tm.layer_ops(overlapped, RUN).backward}
    assert bwd["linear_fc2.grad_all_gather"].overlaps == "linear_fc2.dgrad"
    times = tm.op_times(tm.layer_ops(overlapped, RUN).forward, H100)
    ag, gemm = fwd["linear_fc1.all_gather"], fwd["linear_fc1"]
    assert times[ag.name] == max(0.0, ag.seconds(H100) - gemm.seconds(H100))
    # the embedding's and the output layer's collectives are Megatron's own, not TE's userbuffers
    assert tm.embedding_ops(overlapped).forward[1].overlaps is None
    assert tm.step_time(overlapped, RUN, H100).step_seconds < tm.step_time(plain, RUN, H100).step_seconds


def test_the_pipelined_reduce_scatter_leaves_its_last_chunk_exposed_after_the_gemm():
    """TE's split_overlap_rs: 4 GEMM chunks, each chunk's reduce-scatter once its GEMM is done, so the last
    quarter of the collective runs after the whole GEMM."""
    overlapped = megatron(parallel__tensor_model_parallel_size=4, parallel__sequence_parallel=True,
                          parallel__tp_comm_overlap=True)
    plain = megatron(parallel__tensor_model_parallel_size=4, parallel__sequence_parallel=True)
    fwd = {op.name: op for op in tm.layer_ops(overlapped, RUN).forward}
    whole = {op.name: op for op in tm.layer_ops(plain, RUN).forward}["linear_fc2.reduce_scatter"]
    rest, last = fwd["linear_fc2.reduce_scatter"], fwd["linear_fc2.reduce_scatter_last_chunk"]
    assert rest.bytes + last.bytes == pytest.approx(whole.bytes) and last.bytes == pytest.approx(whole.bytes / 4)
    assert rest.overlaps == "linear_fc2" and last.overlaps is None
    times = tm.op_times(tm.layer_ops(overlapped, RUN).forward, H100)
    assert times[last.name] == pytest.approx(last.seconds(H100)) and last.seconds(H100) > 0
    assert times[rest.name] == max(0.0, rest.seconds(H100) - fwd["linear_fc2"].seconds(H100))


def test_tp_comm_overlap_s_pipelined_and_bulk_overlaps_take_16_sms_from_their_gemms():
    """TE's initialize_ub defaults: pipeline (proj/fc2 fprop) and bulk (qkv/fc1 dgrad and wgrad) hold
    num_sm 16 with set_sm_margin; ring exchanges (qkv/fc1 fprop, proj/fc2 dgrad) take none."""
    overlapped = megatron(parallel__tensor_model_parallel_size=4, parallel__sequence_parallel=True,
                          parallel__tp_comm_overlap=True)
    plain = megatron(parallel__tensor_model_parallel_size=4, parallel__sequence_parallel=True)
    ops = tm.layer_ops(overlapped, RUN)
    by_name = {op.name: op for op in ops.forward + ops.backward}
    taken = {name for name, op in by_name.items() if op.comm_sms}
    assert taken == {"linear_proj", "linear_fc2", "linear_qkv.dgrad", "linear_qkv.wgrad", "linear_fc1.dgrad",
                     "linear_fc1.wgrad"}
    assert {by_name[n].comm_sms for n in taken} == {16}
    assert not any(op.comm_sms for op in tm.layer_ops(plain, RUN).forward + tm.layer_ops(plain, RUN).backward)
    achieved = gpu_rates.achieved_rates("h100")
    # fc2 forward on a tp-4 rank: [8192, 7168] x [7168, 8192] in bf16; 64 x 32 tiles of 128 x 256 take 18
    # waves over the 132 - 16 = 116 SMs left (16 over all 132), each wave as long as over all SMs
    fc2 = by_name["linear_fc2"]
    assert fc2.shape == (8192, 8192, 7168) and fc2.precision == "bf16"
    # (and its K of 7168 pays a little more per FLOP than the MAMF shape's 13312: `short_k_factor`)
    short = achieved.short_k_factor(7168, "bf16")
    assert fc2.seconds(achieved) == pytest.approx(fc2.flops / 794.5e12 * 18 * 132 * 128 * 256 / (8192 * 8192) * short)
    assert dataclasses.replace(fc2, comm_sms=0).seconds(achieved) == pytest.approx(
        fc2.flops / 794.5e12 * 16 * 132 * 128 * 256 / (8192 * 8192) * short)
    # a GEMM priced without a shape runs at 116 / 132 of its rate
    bare = dataclasses.replace(fc2, shape=None)
    assert bare.seconds(achieved) == pytest.approx(fc2.flops / 794.5e12 * 132 / 116)  # no shape, no K
    assert fc2.seconds(H100) == fc2.flops / 989.5e12  # the datasheet roofline has no SMs to take


def test_the_plan_prices_at_the_gpu_table_s_achieved_rates_with_each_gemm_s_waves():
    achieved = gpu_rates.achieved_rates("h100")
    assert achieved.matrix_flops["bf16"] == 794.5e12 and achieved.matrix_flops["fp8"] == 1402.6e12
    assert achieved.peak("bf16") == 989.5e12 and achieved.sms == 132
    # 32 x 10 tiles of 128 x 256 take 3 waves over 132 SMs: 396 tiles' time for 320 tiles' work
    op = tm.Op("g", "matrix", flops=2 * 4096 * 2560 * 8192, precision="fp8", shape=(4096, 2560, 8192))
    short = (8192 + 774) / 8192 / ((14336 + 774) / 14336)  # K 8192 against the MAMF shape's 14336
    assert op.seconds(achieved) == pytest.approx(op.flops / 1402.6e12 * 396 / 320 * short)
    assert op.seconds(H100) == op.flops / 1979e12  # the datasheet: the roofline, no waves, no short K
    from recompute_bench.config.gpus import COMPUTE_CAPABILITY
    from recompute_bench.analysis.flops import PEAK_FLOPS
    assert COMPUTE_CAPABILITY["h200"] == 90 and PEAK_FLOPS["NVIDIA H200"][1] == H100.matrix_flops["bf16"]


# DeepGEMM's H800 FP8 table at M 4096 (config/gpus.py): (N, K) -> TFLOP/s
DEEPGEMM_H800 = {(24576, 1536): 990, (32768, 512): 590, (7168, 16384): 1358, (4096, 7168): 1304, (7168, 2048): 1025}


TILELANG_H800_FP16 = {256: 386, 512: 520, 1024: 628, 2048: 705, 4096: 736, 8192: 758, 16384: 766}
"""xwhzz/tilelang benchmark/matmul/README.md: FP16 matmul TFLOP/s on H800 SXM at M = N = 8192, by K."""


def test_a_short_k_costs_each_output_tile_a_fixed_time_as_the_published_fp8_table_measured():
    import math
    from recompute_bench.config.gpus import SHORT_K_HOPPER
    k0 = SHORT_K_HOPPER["fp8"]
    # one rate R and the tiles' fixed cost k0 reproduce every row: R K / (K + k0), R their geometric mean
    implied = [tflops * (k + k0) / k for (_, k), tflops in DEEPGEMM_H800.items()]
    rate = math.exp(sum(map(math.log, implied)) / len(implied))
    for (_, k), tflops in DEEPGEMM_H800.items():
        assert rate * k / (k + k0) == pytest.approx(tflops, rel=0.03), (k, tflops)
    # without the fixed cost the table's K 512 and K 16384 rows would be one rate, 2.3x apart
    assert DEEPGEMM_H800[(7168, 16384)] / DEEPGEMM_H800[(32768, 512)] > 2.2
    h100, a100, b200 = (gpu_rates.achieved_rates(kind) for kind in ("h100", "a100", "b200"))
    # normalised to the K the MAMF rate was measured at, longer K runs faster, shorter slower
    assert h100.short_k_factor(14336, "fp8") == pytest.approx(1.0)
    assert h100.short_k_factor(2048, "fp8") == pytest.approx((2048 + k0) / 2048 / ((14336 + k0) / 14336))
    assert h100.short_k_factor(65536, "fp8") < 1 < h100.short_k_factor(1024, "fp8")
    # the 16-bit GEMMs' own K sweep (FP16 on H800, M = N = 8192) fits the same form at their own k0
    k16 = SHORT_K_HOPPER["bf16"]
    implied = [tflops * (k + k16) / k for k, tflops in TILELANG_H800_FP16.items()]
    rate = math.exp(sum(map(math.log, implied)) / len(implied))
    for k, tflops in TILELANG_H800_FP16.items():
        assert rate * k / (k + k16) == pytest.approx(tflops, rel=0.015), (k, tflops)
    assert rate == pytest.approx(794.5, rel=0.02)  # the main loop runs at MAMF's bf16 rate
    assert h100.short_k_factor(2048, "bf16") < h100.short_k_factor(2048, "fp8")
    # no table measures A100's or Blackwell's short K: not priced there, nor on the datasheet roofline
    assert a100.short_k_factor(96, "bf16") == b200.short_k_factor(96, "fp8") == H100.short_k_factor(96, "fp8") == 1.0
    # a profile's square matmul becomes the K its rates were measured at
    profile = {"device_name": "NVIDIA H100 80GB HBM3", "measured": {"bf16_flops": 700e12, "fp8_flops": 1300e12}}
    measured = gpu_rates.with_profile(h100, profile)
    assert measured.rate_k["fp8"] == measured.rate_k["bf16"] == gpu_rates.PROFILE_MATMUL_SIZE == 8192
    assert measured.short_k_factor(8192, "fp8") == pytest.approx(1.0)


def test_a_grouped_gemm_s_experts_share_the_waves_each_over_its_share_of_the_tokens():
    h100 = gpu_rates.achieved_rates("h100")
    sh = tm.Shape(megatron(training__precision="bf16"))
    # 8 local experts over 800 routed rows: 100 rows each, a [100, 2048] x [2048, 1536] GEMM apiece; each
    # expert's rows fill one 128-row tile: 8 x 1 x 6 = 48 tiles of 128 x 256, one wave over 132 SMs
    fc1 = tm.linear("experts.linear_fc1", sh, 800, 2048, 1536, frozenset(), weights=8)
    assert (fc1.shape, fc1.groups) == ((100, 1536, 2048), 8)
    short = h100.short_k_factor(2048, "bf16")
    assert fc1.seconds(h100) == pytest.approx(fc1.flops / 794.5e12 * 132 * 128 * 256 / (8 * 100 * 1536) * short)
    # the weight gradient's K is each expert's rows: a short K
    wgrad = next(op for op in tm.linear_backward(fc1, sh, 800, 2048, 1536, weights=8) if op.name.endswith("wgrad"))
    assert (wgrad.shape, wgrad.groups) == ((1536, 2048, 100), 8)
    assert h100.short_k_factor(100, "bf16") > 3  # (100 + 264) / 100 against the MAMF K
    # one expert is the dense linear
    one = tm.linear("x", sh, 800, 2048, 1536, frozenset(), weights=1)
    assert one.seconds(h100) == tm.linear("x", sh, 800, 2048, 1536, frozenset()).seconds(h100)


def test_current_scaling_under_sequence_parallel_all_reduces_each_gathered_operand_s_amax():
    """TE's set_quantizer_amax_reduction_group: the inputs of column-parallel linears and the output gradients
    of row-parallel ones share one scale over the tensor-parallel group; a NCCL all-reduce of one fp32."""
    fp8 = dict(training__precision="fp8", parallel__tensor_model_parallel_size=4, parallel__sequence_parallel=True)
    h100 = gpu_rates.achieved_rates("h100")

    def amax_ops(**overrides):
        ops = tm.layer_ops(megatron(**{**fp8, **overrides}), RUN)
        return {op.name: op for op in ops.forward + ops.backward if "amax" in op.name}

    ops = amax_ops(training__fp8_recipe="tensorwise")
    assert set(ops) == {"linear_qkv.amax_all_reduce", "linear_fc1.amax_all_reduce",
                        "linear_proj.grad.amax_all_reduce", "linear_fc2.grad.amax_all_reduce"}
    assert ops["linear_fc1.amax_all_reduce"].modules == frozenset({"mlp"})  # re-run with the MLP
    for op in ops.values():
        assert op.nccl and op.collective == "all_reduce" and op.group == 4 and op.bytes == 2 * 3 / 4 * 4
        # four bytes cost the collective's latency: H100's smallest measured all-reduce, 3 of its 7 steps a way
        assert op.seconds(h100) == pytest.approx(46.24e-6 * 6 / 14)
    assert not amax_ops(training__fp8_recipe="delayed") and not amax_ops(training__fp8_recipe="mxfp8")
    assert not amax_ops(training__fp8_recipe="tensorwise", parallel__sequence_parallel=False)


def test_a_profile_s_measured_gemms_price_those_shapes_and_the_shipped_h200_profile_is_found(tmp_path):
    import json
    profile = {"schema": gpu_rates.RATES_SCHEMA, "device_name": "NVIDIA H100 80GB HBM3",
               "measured": {"bf16_flops": None, "fp8_flops": None, "hbm_bytes_per_s": None},
               "gemms": [{"m": 4096, "n": 2560, "k": 8192, "precision": "fp8", "flops_per_s": 900e12}]}
    path = gpu_rates.rates_cache_path("NVIDIA H100 80GB HBM3", tmp_path, [(4096, 2560, 8192, "fp8")])
    path.write_text(json.dumps(profile))
    found, where = gpu_rates.find_profile("h100", (tmp_path, gpu_rates.SHIPPED))
    assert where == path
    rates = gpu_rates.with_profile(gpu_rates.achieved_rates("h100"), found)
    op = tm.Op("g", "matrix", flops=2 * 4096 * 2560 * 8192, precision="fp8", shape=(4096, 2560, 8192))
    assert op.seconds(rates) == op.flops / 900e12
    # beside TE's overlapped communication the measured GEMM keeps 116 of its 132 SMs' rate
    assert dataclasses.replace(op, comm_sms=16).seconds(rates) == pytest.approx(op.flops / 900e12 * 132 / 116)
    other = tm.Op("g", "matrix", flops=2 * 4096 * 4096 * 8192, precision="fp8", shape=(4096, 4096, 8192))
    assert other.seconds(rates) == other.seconds(gpu_rates.achieved_rates("h100"))
    shipped, _ = gpu_rates.find_profile("h200", (tmp_path, gpu_rates.SHIPPED))
    assert shipped["measured"]["bf16_flops"] == 771e12
    assert gpu_rates.find_profile("a100", (tmp_path, gpu_rates.SHIPPED)) is None


def test_every_plan_row_carries_step_tflops_tokens_mfu_and_its_parts_by_class():
    from recompute_bench.analysis.flops import model_flops_per_step
    from recompute_bench.analysis.megatron.plan import throughput
    cfg = megatron(training__seq_length=2048, training__global_batch_size=8, parallel__tensor_model_parallel_size=8,
                   parallel__sequence_parallel=True, parallel__pipeline_model_parallel_size=4)
    st = tm.step_time(cfg, RUN, gpu_rates.achieved_rates("h100"))
    row = throughput(cfg, gpu_rates.achieved_rates("h100"), st)
    world = cfg.parallel.world_size
    assert row["tflops_per_gpu"] == pytest.approx(model_flops_per_step(cfg) / world / st.step_seconds / 1e12)
    assert row["mfu"] == pytest.approx(row["tflops_per_gpu"] * 1e12 / 989.5e12)
    parts = row["step_parts"]
    assert set(parts) == set(tm.STEP_CLASSES) and parts["host_overhead"] is None
    assert sum(v for v in parts.values() if v) == pytest.approx(st.step_seconds)


def test_ampere_gemms_run_in_tiles_of_256_by_128_and_hopper_s_in_128_by_256():
    """The tile reaches the rates (it once fell into `measured_gemms` by position, and A100 ran 128 x 256)."""
    a100, h100 = gpu_rates.achieved_rates("a100"), gpu_rates.achieved_rates("h100")
    assert (a100.tile, h100.tile) == ((256, 128), (128, 256))
    assert a100.measured_gemms is None and h100.measured_gemms is None
    # the 22B's qkv on a tp-8 rank: [8192, 6144] x [6144, 2304]: 32 x 18 = 576 tiles of 256 x 128, 6 waves over 108 SMs
    op = tm.Op("g", "matrix", flops=2 * 8192 * 2304 * 6144, shape=(8192, 2304, 6144))
    assert op.seconds(a100) == pytest.approx(op.flops / 271.2e12 * 6 * 108 * 256 * 128 / (8192 * 2304))


def test_a_nccl_collective_beside_a_gemm_holds_its_channels_sms_while_it_runs():
    """Megatron's column-parallel backward launches the data gradient's all-reduce (NCCL), then the weight
    gradient GEMM: on A100 NCCL's 24 channels (one block each) hold 24 of the 108 SMs while it runs."""
    from recompute_bench.analysis.megatron.time_ops import beside_nccl, op_times
    a100 = gpu_rates.achieved_rates("a100")
    assert a100.nccl_sms == 24 and gpu_rates.datasheet_rates("a100").nccl_sms == 0
    assert gpu_rates.achieved_rates("h100").nccl_sms == 0  # no published channel count: not priced
    cfg = megatron("gpt3-22b", model__transformer_impl="local", model__attention_backend="local",
                   parallel__tensor_model_parallel_size=8)
    ops = tm.layer_ops(cfg, MegatronRun("a100")).backward
    by_name = {op.name: op for op in ops}
    nccl = {op.name: op.overlaps for op in ops if op.nccl and op.overlaps}
    assert nccl == {"linear_fc1.dgrad_all_reduce": "linear_fc1.wgrad", "linear_qkv.dgrad_all_reduce": "linear_qkv.wgrad"}
    wgrad, comm = by_name["linear_fc1.wgrad"], by_name["linear_fc1.dgrad_all_reduce"]
    full, c = wgrad.seconds(a100), comm.seconds(a100)
    # fc1's weight gradient: [3072, 8192] x [8192, 6144]: 12 x 48 = 576 tiles, 6 waves over 108 SMs, 7 over 84
    slowed = wgrad.flops / 271.2e12 * 7 * 108 * 256 * 128 / (3072 * 6144)
    assert full == pytest.approx(wgrad.flops / 271.2e12 * 6 * 108 * 256 * 128 / (3072 * 6144))
    assert c < slowed
    times = op_times(ops, a100)
    assert times["linear_fc1.wgrad"] == pytest.approx(c + (1 - c / slowed) * full)
    assert times["linear_fc1.dgrad_all_reduce"] == 0.0
    # a collective that outlasts the slowed GEMM leaves the rest exposed
    short = dataclasses.replace(wgrad, flops=wgrad.flops / 10, shape=None, bytes=0)
    assert beside_nccl(short, c, a100) == pytest.approx((short.flops / 271.2e12 * 108 / 84, c - short.flops / 271.2e12 * 108 / 84))
    # under --tp-comm-overlap TE's userbuffers carry the layer's collectives; the output layer's stay NCCL's
    ub = megatron(parallel__tensor_model_parallel_size=4, parallel__sequence_parallel=True, parallel__tp_comm_overlap=True)
    assert not any(op.nccl for op in tm.layer_ops(ub, RUN).backward)
    assert [op.name for op in tm.loss_ops(ub).backward if op.nccl] == ["output_layer.dgrad_reduce_scatter"]


def test_table_5_s_four_models_run_in_table_3_s_layouts_with_its_measured_iterations():
    expected = {"22B": (8, 1, None, 4, 4, 48), "175B": (64, 8, 3, 64, 1, 96), "530B": (280, 35, 3, 280, 1, 105),
                "1T": (512, 64, None, 512, 1, 128)}
    for model, (gpus, pp, vp, batch, micro, layers) in expected.items():
        cfg = time_checks.paper_config(model)
        par = cfg.parallel
        assert (par.world_size, par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.data_parallel_size,
                par.virtual_pipeline_model_parallel_size) == (gpus, 8, pp, 1, vp)
        assert (cfg.training.global_batch_size, cfg.training.micro_batch_size, cfg.model.num_layers) == (batch, micro, layers)
    rows = time_checks.paper_table5_rows(models=("22B",))
    assert [(r["model"], r["setting"], r["measured_step_seconds"]) for r in rows] == [
        ("22B", "full", 1.42), ("22B", "sequence parallel + selective", 1.10)]
    assert {m: tuple(v.values()) for m, v in time_checks.PAPER_TABLE5_S.items()} == {
        "22B": (1.42, 1.10), "175B": (18.13, 13.75), "530B": (49.05, 37.83), "1T": (94.42, 71.49)}


def test_flash_attention_runs_at_the_rates_our_h200_measured_and_other_kinds_at_their_shares():
    """Our H200 run's profile: cuDNN's causal flash attention, seq 8192, 32 heads of 128, 52 calls each way:
    forward 52.802 ms, backward 169.173 ms; FLOPs over the causal half, backward 2.5x (`time_attention`)."""
    from recompute_bench.config import gpus
    forward = 32 * 8192 * 8193 / 2 * 2 * 256
    h200, h100 = gpu_rates.achieved_rates("h200"), gpu_rates.achieved_rates("h100")
    assert h200.attention_flops == pytest.approx({"forward": forward / (52.802e-3 / 52),
                                                  "backward": 2.5 * forward / (169.173e-3 / 52)})
    assert h200.attention_flops["forward"] == pytest.approx(541.5e12, rel=1e-3)
    assert gpus.ATTENTION_SHARE == pytest.approx({k: v / 771e12 for k, v in h200.attention_flops.items()})
    assert h100.attention_flops == pytest.approx({k: v * 794.5e12 for k, v in gpus.ATTENTION_SHARE.items()})
    assert gpu_rates.datasheet_rates("h100").attention_flops is None  # the roofline: the bf16 peak
    cfg = megatron(parallel__tensor_model_parallel_size=4, parallel__sequence_parallel=True)
    ops = tm.layer_ops(cfg, RUN)
    (fwd,) = [op for op in ops.forward if op.kind == "attention"]
    (bwd,) = [op for op in ops.backward if op.kind == "attention"]
    assert (fwd.backward, bwd.backward) == (False, True)
    assert fwd.seconds(h100) == pytest.approx(fwd.flops / h100.attention_flops["forward"])
    assert bwd.seconds(h100) == pytest.approx(bwd.flops / h100.attention_flops["backward"])
    assert fwd.seconds(H100) == pytest.approx(fwd.flops / 989.5e12)


def test_the_gemm_pricing_holds_at_a_real_run_s_shapes_on_the_h200_we_measured():
    """Our H200 profile: 663 aten::mm calls over 13 steps (51 a step: 17 GEMMs and their two gradients),
    1.216 s; the model prices those GEMMs from the 8192^3 rate in waves over the SMs."""
    row = time_checks.h200_gemm_row()
    assert row["gemms"] * 13 == 663
    assert row["flops"] == pytest.approx(3 * 2 * 8192 * (4 * 4096 * (6144 + 4096 + 28672) + 4 * 14336 * 4096
                                                         + 4096 * 128256))
    assert abs(row["ratio"] - 1) <= 0.05, row
