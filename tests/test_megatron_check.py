"""Framework megatron against Megatron-LM's own measurements: the GPT functional tests' golden
memory (tests/data/megatron/cases.json, Megatron-LM d98e8a6), and the terms named after Megatron's
code, each pinned by a golden where it is the only difference."""

import json
from pathlib import Path

import pytest
from helpers import invoke

from recompute_bench.analysis import megatron as mg
from recompute_bench.analysis.megatron import attention, buffers, layer, moe, optimizer, outside
from recompute_bench.analysis.megatron_schedule import chunk_forwards_in_flight
from recompute_bench.ingest.megatron_args import config_from_megatron
from recompute_bench.ingest.megatron_check import GOAL, check, load_cases, meets_goal, skipped_in, summary

CASES = Path(__file__).parent / "data" / "megatron" / "cases.json"
MiB = 2**20


@pytest.fixture(scope="module")
def data():
    return load_cases(CASES)


@pytest.fixture(scope="module")
def checked(data):
    return check(data)


def _case(data, name):
    return next(c for c in data["cases"] if c["case"] == name)


def _estimate(data, name, golden):
    case = _case(data, name)
    g = case["goldens"][golden]
    cfg = config_from_megatron(case["args"], world_size=g["gpus"])
    run = mg.MegatronRun(golden.split("_")[1], case["env"].get("CUBLAS_WORKSPACE_CONFIG"))
    return cfg, run, mg.stage_peak(cfg, cfg.parallel.pipeline_model_parallel_size - 1, run), g


def test_the_estimate_meets_the_goal_on_megatrons_own_data(checked):
    rows, skipped = checked
    figures = summary(rows)
    # Every dense GPT training case the estimate can express, on every GPU kind it was measured on.
    assert figures["cases"] >= 105 and figures["rows"] >= 265
    assert figures["median_peak_error"] <= GOAL["median_peak_error"]
    assert figures["peak_within_5_percent"] >= GOAL["peak_within_5_percent"]
    assert figures["median_static_error"] <= GOAL["median_static_error"]
    assert meets_goal(figures)


def test_dense_stays_where_it_was(checked):
    figures = summary(checked[0], "dense")
    assert figures["rows"] >= 223 and figures["median_peak_error"] <= 0.0070 and meets_goal(figures)


def test_context_parallel_meets_the_goal_on_megatrons_own_data(checked):
    rows, skipped = checked
    figures = summary(rows, "context parallel")
    # Every golden of a GPT with context parallel: tp2 pp1 cp2 and tp2 pp2 cp2 (p2p, sequence
    # parallel, flash), tp1 pp2 cp4 (a2a+p2p over [2, 2]) on A100, H100 and GB200, and the MoE cases
    # with cp 2. The 2 CP goldens that also need FP8 are checked with FP8 (test_megatron_fp8.py).
    assert figures["cases"] >= 28 and figures["rows"] >= 69
    assert meets_goal(figures) and figures["peak_within_5_percent"] == 1.0
    assert skipped_in(skipped, "context parallel") <= 2


def test_cp_attention_lets_the_qkv_output_go(data):
    # tp1 pp2 cp4, a2a+p2p over [2, 2], flash: the last stage's activations at its peak (the loss's
    # forward: 6 layers, the output layer, the loss of s/cp x b tokens) are the estimate's to 0.5% on
    # both A100 goldens. Had Transformer Engine's CP attention kept linear_qkv's output (3 MiB a layer
    # at 1024 tokens), those 6 layers would put it 18 MiB, over 4%, above.
    for golden in ("dev_a100", "lts_a100"):
        cfg, run, peak, g = _estimate(data, "gpt3_mcore_te_tp1_pp2_cp4_a2a_p2p_nondeterministic", golden)
        assert cfg.parallel.hierarchical_context_parallel_sizes == [2, 2] and peak.phase == "the loss's forward"
        estimated, measured = peak.peak_allocated_bytes - peak.static_bytes, g["max_allocated_bytes"] - g["allocated_bytes"]
        assert abs(estimated / measured - 1) < 0.005
        assert "linear_qkv.output" not in layer.layer_saved_bytes(cfg, run)
        qkv = 2 * 1024 * 3 * 512  # bf16 [s/cp x b, 3h]: 3 MiB
        assert (estimated + 6 * qkv) / measured - 1 > 0.04


def test_the_loss_runs_over_the_split_sequence(data):
    # tp2 pp2 cp2: the last stage peaks in the loss's forward, 6 bytes per logit of s/cp x b = 2048
    # tokens and the padded vocabulary over tp, 295.5 MiB of the 405 MiB the golden's pass holds.
    cfg, run, peak, g = _estimate(data, "gpt3_mcore_te_tp2_pp2_cp2", "dev_h100")
    assert outside.logits(cfg) == 2048 * 50432 / 2 and outside.loss_peak_bytes(cfg) == 295.5 * MiB
    estimated, measured = peak.peak_allocated_bytes - peak.static_bytes, g["max_allocated_bytes"] - g["allocated_bytes"]
    assert peak.phase == "the loss's forward" and abs(estimated / measured - 1) < 0.01


def test_moe_meets_the_median_goals_and_every_miss_is_explained(data, checked):
    rows, _ = checked
    # The MoE goldens where MoE (and context parallel) is all that differs from a dense GPT; the
    # goldens that also run FP8, MLA, CUDA graphs or offload are held by those categories' tests.
    rows = [r for r in rows if set(r.categories) <= {"MoE", "context parallel"}]
    figures = summary(rows, "MoE")
    # Every MoE golden whose arguments the estimate can express: allgather and alltoall dispatchers,
    # grouped and sequential experts, shared experts, etp != tp, local and TE layers, pp 1 and 2.
    assert figures["rows"] >= 59 and figures["cases"] >= 25
    assert figures["median_peak_error"] <= GOAL["median_peak_error"]
    assert figures["median_static_error"] <= GOAL["median_static_error"]
    assert figures["peak_within_5_percent"] >= 0.88
    misses = [r for r in rows if "MoE" in r.categories and abs(r.peak_error) > 0.05]
    for r in misses:
        cfg, run, balanced, g = _estimate(data, r.case, r.golden)
        twins = [o for o in rows if o.case != r.case and abs(o.static_error) < 0.01
                 and (o.measured_peak_bytes, o.measured_static_bytes) == (r.measured_peak_bytes, r.measured_static_bytes)]
        if abs(r.static_error) > 0.05:
            # off after the step too: the golden holds, byte for byte, the figures of another case whose
            # estimate they match (the multi-instance case's lts A100 golden is its single-instance
            # sibling's): it measured other arguments
            assert twins, r.case
        if abs(r.static_error) > 0.05:
            continue
        elif r.golden == "lts_a100":
            # the LTS container ran TE's UnfusedDotProductAttention under `auto` (see the dense misses)
            args = {**_case(data, r.case)["args"], "--attention-backend": "unfused"}
            unfused = config_from_megatron(args, world_size=g["gpus"])
            peak = mg.stage_peak(unfused, unfused.parallel.pipeline_model_parallel_size - 1, run).peak_allocated_bytes
            assert abs(peak / g["max_allocated_bytes"] - 1) < 0.025, r.case
        else:
            # routing: this rank's experts received more than their balanced share, within the bound
            bound = mg.stage_peak(cfg, cfg.parallel.pipeline_model_parallel_size - 1, run, "bound")
            assert balanced.peak_allocated_bytes < g["max_allocated_bytes"] < bound.peak_allocated_bytes, r.case
    assert len(misses) <= 8


def test_te_grouped_gemm_keeps_a_workspace_per_stream(data):
    # TEGroupedMLP's GroupedLinear runs general_grouped_gemm with 4 workspaces (one per compute
    # stream) beside the single GEMMs' one: after the step H100 holds 5 x (32 MiB + 1 KiB - 4 MiB)
    # more than A100; without grouped GEMM, 1 x that; with local layers, the router's TE GEMM alone.
    for name, workspaces in (("gpt3_mcore_te_tp2_pp1_frozen_resume_torch_dist_te_8experts2parallel_groupedGEMM", 5),
                             ("gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer", 5),
                             ("gpt3_mcore_te_tp2_pp1_frozen_resume_torch_dist_te_8experts2parallel_dist_optimizer", 1),
                             ("gpt3_mcore_tp2_pp2_ep2_etp2_te_4experts2parallel", 1)):
        _, _, a100, g_a = _estimate(data, name, "dev_a100")
        _, _, h100, g_h = _estimate(data, name, "dev_h100")
        assert h100.static_bytes - a100.static_bytes == workspaces * (28 * MiB + 1024)
        assert g_h["allocated_bytes"] - g_a["allocated_bytes"] == pytest.approx(workspaces * 28 * MiB, abs=1 * MiB)


def test_routed_experts_are_sharded_over_the_expert_data_parallel_group(data):
    # The same case on 8 and on 4 GB200s: dense parameters' optimizer state over dp 4 and 2, the
    # experts' over expert-data-parallel 2 and 1 (8 / (tp 2 x ep 2), 4 / 4): the after-step growth
    # from 8 to 4 GPUs is the master weights and Adam moments of those shards.
    name = "gpt3_mcore_te_tp2_pp1_resume_torch_dist_te_8experts2parallel_dist_optimizer"
    cfg8, _, eight, g8 = _estimate(data, name, "dev_gb200")
    cfg4, _, four, g4 = _estimate(data, name + "_1node", "dev_gb200")
    assert (cfg8.parallel.expert_data_parallel_size, cfg4.parallel.expert_data_parallel_size) == (2, 1)
    assert optimizer.bytes_per_parameter(cfg8, expert=True)["Adam moments"] == 8 / 2
    measured = g4["allocated_bytes"] - g8["allocated_bytes"]
    assert four.static_bytes - eight.static_bytes == pytest.approx(measured, rel=0.002)


def test_the_allgather_dispatcher_keeps_its_gathered_tokens_all_run(data):
    # gather_from_sequence_parallel_region(..., use_global_buffer=True): [n x etp x ep, h] in bf16
    # from the global memory buffer, held after the step (ep 8: 4096 x 8 tokens x 512 x 2 B).
    cfg, _, peak, g = _estimate(data, "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer", "dev_a100")
    assert peak.items["MoE allgather dispatcher's gathered tokens"] == moe.allgather_buffer_bytes(cfg) == 32 * MiB
    assert abs(peak.static_bytes / g["allocated_bytes"] - 1) < 0.005


def test_what_is_skipped_says_why(checked):
    _, skipped = checked
    reasons = " ".join(skipped)
    for words in ("FSDP", "not a training run (rl)"):
        assert words in reasons
    assert all(r.startswith(("Megatron argument", "not a training run", "GPU count unknown", "unknown recompute"))
               for r in skipped)


def test_the_data_is_megatrons(data):
    assert data["source"] == "https://github.com/NVIDIA/Megatron-LM" and len(data["commit"]) == 40
    case = _case(data, "gpt3_7b_tp1_pp4_memory_speed")
    assert case["path"] == "tests/functional_tests/test_cases/gpt/gpt3_7b_tp1_pp4_memory_speed/model_config.yaml"
    assert case["args"]["--num-layers-per-virtual-pipeline-stage"] == 1
    golden = case["goldens"]["dev_h100"]
    assert golden["path"].endswith("golden_values_dev_dgx_h100.json") and golden["gpus"] == 8
    assert golden["max_allocated_bytes"] > golden["allocated_bytes"] > 0


def test_workspaces_are_the_difference_between_gpu_kinds(data):
    # One case, three GPUs: after the step, H100 and GB200 hold exactly TE's 32 MiB + 1 KiB cuBLAS
    # workspace where A100 holds 4 MiB (gemm.py get_cublas_workspace_size_bytes); torch's two cuBLAS
    # workspaces are CUBLAS_WORKSPACE_CONFIG=:4096:8's 32 MiB each on all three.
    goldens = _case(data, "gpt3_mcore_te_tp1_pp1_resume_torch_dist_dist_optimizer")["goldens"]
    assert goldens["dev_h100"]["allocated_bytes"] - goldens["dev_a100"]["allocated_bytes"] == 28 * MiB + 1024
    for golden in ("dev_a100", "dev_h100", "dev_gb200"):
        _, run, peak, g = _estimate(data, "gpt3_mcore_te_tp1_pp1_resume_torch_dist_dist_optimizer", golden)
        assert buffers.torch_cublas_workspace_bytes(run) == 32 * MiB
        # what stays after the step, to within the few KiB of small optimizer tensors
        assert 0 <= g["allocated_bytes"] - peak.static_bytes < 8 * 1024


def test_local_attention_keeps_its_score_buffer(data):
    # transformer_impl local: dot_product_attention.py's matmul_input_buffer [b x a, s, s] in bf16
    # (4 x 8 x 1024 x 1024 x 2 = 64 MiB) stays from the first step on.
    cfg, run, peak, g = _estimate(data, "gpt3_mcore_tp1_pp1_dist_optimizer_overlap_grad_reduce_param_gather", "dev_a100")
    assert peak.items["attention score buffer (local)"] == 64 * MiB
    assert 0 <= g["allocated_bytes"] - peak.static_bytes < 8 * 1024
    assert abs(peak.peak_allocated_bytes / g["max_allocated_bytes"] - 1) < 0.001


def test_fp16_keeps_fp32_gradient_copies_after_the_step_only(data):
    # fp16 with the distributed optimizer: an fp16 grad buffer (2 bytes) and the shard's fp32
    # `.float()` copy (4/dp) held from the step to the next zero_grad: after the step, not at the peak.
    cfg, run, peak, g = _estimate(data, "gpt3_mcore_tp1_pp1_resume_torch_dist_dist_optimizer_overlap_grad_reduce_param_gather",
                                  "dev_a100")
    per = optimizer.bytes_per_parameter(cfg)
    assert per["main gradients"] == 2 and per["fp32 gradient copies"] == 4 / 8
    assert 0 <= g["allocated_bytes"] - peak.static_bytes < 8 * 1024
    assert "fp32 gradient copies" not in peak.items
    assert abs(peak.peak_allocated_bytes / g["max_allocated_bytes"] - 1) < 0.002


def test_the_loss_holds_six_bytes_per_logit_and_the_fused_one_ten(data):
    # _VocabParallelCrossEntropy: bf16 logits beside their fp32 copy; the fused one (under
    # torch.compile) one more fp32 buffer. Both cases peak at the loss; the fused case's goldens
    # on H100 and GB200 hold 4 bytes per logit more than the same case unfused.
    cfg, run, peak, g = _estimate(data, "gpt3_mcore_te_tp2_pp2_resume_torch_dist_cross_entropy_loss_fusion", "dev_h100")
    assert cfg.model.cross_entropy_loss_fusion
    assert outside.loss_peak_bytes(cfg) == 10 * outside.logits(cfg)
    assert abs(peak.peak_allocated_bytes / g["max_allocated_bytes"] - 1) < 0.01
    cfg, run, peak, g = _estimate(data, "gpt3_mcore_te_tp2_pp2_resume_torch_dist", "dev_h100")
    assert outside.loss_peak_bytes(cfg) == 6 * outside.logits(cfg)
    assert abs(peak.peak_allocated_bytes / g["max_allocated_bytes"] - 1) < 0.015


def test_attention_paths_follow_transformer_engines_choice(data):
    # auto: FusedAttention on Hopper and newer, FlashAttention on A100 under deterministic mode; the
    # flash path keeps one more [s, b, h] (the contiguous output copy): 12 layers x 4 MiB here.
    name = "gpt3_mcore_te_tp1_pp1_resume_torch_dist_dist_optimizer"
    cfg, a100, peak_a, g_a = _estimate(data, name, "dev_a100")
    _, h100, peak_h, g_h = _estimate(data, name, "dev_h100")
    assert (attention.attention_path(cfg, a100), attention.attention_path(cfg, h100)) == ("flash", "fused")
    acts = [p.peak_allocated_bytes - p.static_bytes for p in (peak_a, peak_h)]
    measured = [g["max_allocated_bytes"] - g["allocated_bytes"] for g in (g_a, g_h)]
    assert acts[0] - acts[1] == 12 * 4 * MiB
    assert measured[0] - measured[1] == pytest.approx(12 * 4 * MiB, rel=0.05)
    # unfused keeps the [b, a, s, s] softmax, dropout mask and output: 5 bytes a score per layer
    unfused = config_from_megatron({**_case(data, name)["args"], "--attention-backend": "unfused"}, world_size=8)
    extra = layer.layer_bytes(unfused, h100) - layer.layer_bytes(cfg, h100)
    assert extra == 5 * 4 * 8 * 1024 * 1024 - 4 * 4 * 8 * 1024  # minus the fused kernel's fp32 statistics [b, a, s]


def test_interleaved_last_stage_holds_vp_minus_one_times_p_plus_one_chunks(data):
    case = _case(data, "gpt3_7b_tp1_pp4_memory_speed")
    cfg = config_from_megatron(case["args"], world_size=8)  # pp 4, vp 8, 4 micro-batches
    assert chunk_forwards_in_flight(cfg, 3) == (8 - 1) * 4 + 1 == 29
    assert chunk_forwards_in_flight(cfg, 0) == 32  # (p - 1) x 2 + (vp - 1) x p >= n x vp: all in warm-up
    peak = mg.stage_peak(cfg, 3, mg.MegatronRun("h100", ":4096:8"))
    one_layer = layer.layer_bytes(cfg, mg.MegatronRun("h100"))
    assert peak.items["activations of the other micro-batches in flight"] == 28 * one_layer


def test_estimate_framework_megatron_json_carries_every_stage():
    result = invoke("estimate", "-w", "llama3-8b", "--pp", "4", "--set", "parallel.virtual_pipeline_model_parallel_size=2",
                    "--framework", "megatron", "--gpu", "a100", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["framework"] == "megatron" and report["gpu"] == "a100" and report["attention_kernel"] == "flash"
    stages = report["stages"]
    assert [s["stage"] for s in stages] == [0, 1, 2, 3]
    for s in stages:
        assert s["peak_allocated_bytes"] == pytest.approx(sum(s["breakdown"].values()))
    assert report["setting"]["peak_allocated_bytes"] == max(s["peak_allocated_bytes"] for s in stages)
    assert "TE" in " ".join(report["paper"]["differences"]) or "Transformer Engine" in " ".join(report["paper"]["differences"])


@pytest.mark.parametrize("argv,words", [
    (["--framework", "megatron", "--device", "cpu"], "Megatron runs on CUDA"),
    (["--framework", "megatron", "--gpu", "tpu"], "unknown GPU kind"),
    (["-w", "tiny-moe", "--framework", "megatron", "--set", "model.moe_token_dispatcher_type=ring"],
     "moe_token_dispatcher_type 'ring' is not one of allgather, alltoall, flex"),
    (["-w", "tiny-moe", "--framework", "megatron", "--tp", "2"], "pass --sequence-parallel"),
    (["-w", "tiny-moe", "--framework", "megatron", "--ep", "2", "--dp", "1"], "must divide the 1 ranks"),
    (["-w", "tiny-moe", "--framework", "megatron", "--set", "model.moe_router_topk=1"], "--moe-router-pre-softmax"),
])
def test_framework_megatron_bad_input(argv, words):
    result = invoke("estimate", *argv)
    assert result.exit_code == 2 and words in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_selective_layernorm_frees_the_local_norms_and_nothing_with_te():
    base = {"--num-layers": 2, "--hidden-size": 64, "--num-attention-heads": 4, "--seq-length": 128,
            "--max-position-embeddings": 128, "--micro-batch-size": 2, "--global-batch-size": 2}
    run = mg.MegatronRun("h100")
    te = config_from_megatron(base)
    local = config_from_megatron({**base, "--transformer-impl": "local"})
    assert layer.layer_saved_bytes(te, run, ["layernorm"]) == layer.layer_saved_bytes(te, run)  # IdentityOp norms
    dropped = set(layer.layer_saved_bytes(local, run)) - set(layer.layer_saved_bytes(local, run, ["layernorm"]))
    assert dropped == {"input_layernorm.norm_stats", "linear_qkv.input", "pre_mlp_layernorm.norm_stats", "linear_fc1.input"}


def test_an_imported_megatron_golden_carries_megatrons_estimate(tmp_path):
    # `import` puts framework megatron's estimate beside the measured peak: for this case (full
    # recompute, H100) within 0.3% of what the last rank logged.
    golden = (Path(__file__).parent / "data" / "ingest" / "megatron-golden"
              / "gpt3_mcore_te_tp1_pp1_resume_torch_dist_uniform_full_recompute" / "golden_values_dev_dgx_h100.json")
    out = tmp_path / "cluster.jsonl"
    result = invoke("import", str(golden), "--results", str(out), "--world-size", "8")
    assert result.exit_code == 0, result.output
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    (rank,) = record["ranks"]
    cfg = config_from_megatron({"--" + k: v for k, v in _yaml_args(golden.parent / "model_config.yaml").items()},
                               world_size=8)
    assert rank["estimated_peak_allocated_bytes"] == mg.stage_peak(cfg, 0, mg.MegatronRun("h100")).peak_allocated_bytes
    assert rank["estimated_peak_allocated_bytes"] == pytest.approx(rank["peak_allocated_bytes"], rel=0.003)
    assert record["metrics"]["estimated_peak_allocated_bytes"] == rank["estimated_peak_allocated_bytes"]


def _yaml_args(path):
    from recompute_bench.ingest.megatron_golden import read_model_config_file
    return read_model_config_file(path)[0]


@pytest.mark.parametrize("category,words,goldens", [
    ("FP8", ("fp8", "first-last-layers"), 11), ("CUDA graphs", ("cuda-graph", "cuda_graph"), 10),
    ("offload", ("offload",), 4), ("MLA", ("lora-rank", "multi-latent", "mla"), 19),
])
def test_fp8_graph_offload_and_mla_goldens_meet_the_goal_or_miss_as_explained(checked, category, words, goldens):
    # Every golden of these categories is checked, or skipped for another category's argument (FSDP,
    # the pipelined combined 1F1B schedule, ...), an unknown GPU count or its mode: none for its own.
    rows, skipped = checked
    figures = summary(rows, category)
    assert figures["rows"] + skipped_in(skipped, category) == goldens
    for reason, entries in skipped.items():
        if any(category in entry.rsplit("[", 1)[1] for entry in entries):
            assert not any(word in reason.split(" cannot be expressed")[0] for word in words), reason
    if category != "offload":
        assert meets_goal(figures), figures
        return
    # offload: its 2 goldens (one case, MoE + MLA, fine-grained offloading) are within 5% at the
    # peak and 2.3% after the step; the median misses 3%: what stays is explained in docs/megatron.md
    # (the MoE + MLA family's after-step remainder, 95.5 MiB here, and 180 to 225 MiB of a backward)
    assert figures["peak_within_5_percent"] == 1.0 and figures["median_static_error"] <= GOAL["median_static_error"]
    offload = [r for r in rows if category in r.categories]
    assert {r.case for r in offload} == {"gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_no_mtp_no_a2a_ovlp_fine_grained_offloading"}
    assert all(-0.05 < r.peak_error < -0.04 and r.phase == "backward of model chunk 2" for r in offload)
    assert all(r.measured_static_bytes - r.estimated_static_bytes == pytest.approx(95.5 * MiB, abs=0.1 * MiB)
               for r in offload)


def test_moe_meets_the_goal_over_every_moe_golden(checked):
    # All 86 checked MoE goldens, those that also run FP8, MLA, CUDA graphs, offload or multi-token
    # prediction included: 8 misses, each explained (test_moe_meets_the_median_goals_and_every_miss_is_explained)
    figures = summary(checked[0], "MoE")
    assert figures["rows"] >= 86 and meets_goal(figures)


def test_the_fp8_goldens_activations_follow_the_fp8_terms(data):
    # gpt3_weekly_mcore_tp2_pp2_current_scaling_native_fp8 (tensorwise, FP8 weights): its last rank
    # peaks at the loss's forward; what it holds beyond the after-step bytes is the FP8 layers'
    # activations and the loss: the estimate is 1.2% (H100) and 2.0% (GB200) under it, and with
    # bf16 layers would be 3.4% and 2.6% over.
    case = _case(data, "gpt3_weekly_mcore_tp2_pp2_current_scaling_native_fp8_tp_pp_sp_tp_overlap")
    cfg = config_from_megatron(case["args"], world_size=8)
    bf16 = config_from_megatron({k: v for k, v in case["args"].items() if not k.startswith("--fp8")}, world_size=8)
    for golden, fp8_error, bf16_error in (("dev_h100", -0.012, 0.034), ("dev_gb200", -0.020, 0.026)):
        g = case["goldens"][golden]
        measured = g["max_allocated_bytes"] - g["allocated_bytes"]
        run = mg.MegatronRun(golden.split("_")[1], case["env"].get("CUBLAS_WORKSPACE_CONFIG"))
        for c, error in ((cfg, fp8_error), (bf16, bf16_error)):
            peak = mg.stage_peak(c, 1, run)
            assert peak.phase == "the loss's forward"
            assert (peak.peak_allocated_bytes - peak.static_bytes) / measured - 1 == pytest.approx(error, abs=0.002)


def test_tp_comm_overlap_keeps_the_userbuffers_gemms_own_workspace(data):
    # --tp-comm-overlap: TE's userbuffer GEMMs take get_cublas_workspace(ub=True), 3 streams x
    # (32 MiB + 1 KiB) on sm90 and newer, beside the ordinary GEMMs' workspace. The tp2 pp2 FP8 case
    # sets it: without that term its goldens hold 101.2 (GB200) and 102.2 MiB (H100) more after the
    # step than the estimate; with it 5.2 and 6.2 MiB, as the tp4 cp2 FP8 case without the overlap
    # (same model, same recipe) holds 2.1 MiB more.
    case = _case(data, "gpt3_weekly_mcore_tp2_pp2_current_scaling_native_fp8_tp_pp_sp_tp_overlap")
    cfg = config_from_megatron(case["args"], world_size=8)
    assert cfg.parallel.tp_comm_overlap
    for golden in ("dev_h100", "dev_gb200"):
        cfg, run, peak, g = _estimate(data, case["case"], golden)
        assert peak.items["Transformer Engine userbuffers GEMM workspace"] == 3 * (32 * MiB + 1024)
        remainder = g["allocated_bytes"] - peak.static_bytes
        assert 0 < remainder < 7 * MiB
        assert remainder + 3 * (32 * MiB + 1024) > 100 * MiB
        assert abs(peak.peak_allocated_bytes / g["max_allocated_bytes"] - 1) < 0.02
    _, _, without, _ = _estimate(data, "gpt3_weekly_mcore_tp4_cp2_current_scaling_native_fp8_tp_sp_cp_tp_overlap", "dev_h100")
    assert "Transformer Engine userbuffers GEMM workspace" not in without.items


def test_the_offload_goldens_peak_in_a_backward_that_holds_the_unfused_score_gradient(data):
    # The fine-grained offloading case (MoE + MLA, unfused attention, layout Et*3|(tt|)*6L): its last
    # rank's loss chunk has no layers, so it peaks in the backward of model chunk 2, where the unfused
    # attention's backward holds the probabilities' gradient [b, a/t, s, s] in bf16 (1 x 16 x 4096^2
    # x 2 = 512 MiB, the fused softmax kernel writing its gradient in place), q, k and v's gradients
    # and, under mla_up_proj recompute, the q, k and v it rebuilds (64 MiB each). Without those terms
    # the estimate is 13% under both goldens; with them 4.0% (GB200) and 4.7% (H100).
    from recompute_bench.analysis.megatron.attention import score_backward_bytes
    from recompute_bench.analysis.megatron.mla import up_proj_rebuilt_bytes
    name = "gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_no_mtp_no_a2a_ovlp_fine_grained_offloading"
    for golden, error in (("dev_gb200", -0.0405), ("dev_h100", -0.0469)):
        cfg, run, peak, g = _estimate(data, name, golden)
        assert peak.phase == "backward of model chunk 2"
        assert score_backward_bytes(cfg, run) == 512 * MiB + 64 * MiB and up_proj_rebuilt_bytes(cfg) == 64 * MiB
        assert peak.peak_allocated_bytes / g["max_allocated_bytes"] - 1 == pytest.approx(error, abs=0.001)
        without = peak.peak_allocated_bytes - 640 * MiB + 48 * MiB  # the MoE MLP's backward instead
        assert without / g["max_allocated_bytes"] - 1 < -0.12
