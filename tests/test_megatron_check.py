"""Framework megatron against Megatron-LM's own measurements: the GPT functional tests' golden
memory (tests/data/megatron/cases.json, Megatron-LM d98e8a6), and the terms named after Megatron's
code, each pinned by a golden where it is the only difference."""

import json
from pathlib import Path

import pytest

from helpers import invoke
from recompute_bench.analysis import megatron as mg
from recompute_bench.analysis.megatron import attention, buffers, layer, optimizer, outside
from recompute_bench.analysis.schedule import chunk_forwards_in_flight
from recompute_bench.ingest.megatron_args import config_from_megatron
from recompute_bench.ingest.megatron_check import GOAL, check, load_cases, meets_goal, summary

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
    assert figures["cases"] >= 85 and figures["rows"] >= 200
    assert figures["median_peak_error"] <= GOAL["median_peak_error"]
    assert figures["peak_within_5_percent"] >= GOAL["peak_within_5_percent"]
    assert figures["median_static_error"] <= GOAL["median_static_error"]
    assert meets_goal(figures)


def test_what_is_skipped_says_why(checked):
    _, skipped = checked
    reasons = " ".join(skipped)
    for words in ("context parallelism", "FP8", "FSDP", "multi-latent attention", "not a training run (rl)"):
        assert words in reasons
    assert all(r.startswith(("Megatron argument --", "not a training run", "GPU count unknown")) for r in skipped)


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
    (["-w", "tiny-moe", "--framework", "megatron"], "dense GPT layers"),
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
    from recompute_bench.ingest.megatron_golden import read_model_config
    return read_model_config(path)[0]
