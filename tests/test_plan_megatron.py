"""`plan --framework megatron`: the search over what Megatron runs, each setting's stage peaks from
the Megatron memory model and its time from the time model, what fits (and what is tight), the flags
to paste, what would fit, `--auto`'s comparison, and bad input (one line, exit 2)."""

import dataclasses
import json

import pytest
from helpers import config, invoke

from recompute_bench.analysis import gpu_rates
from recompute_bench.analysis.allowance import FITS, OVER, TIGHT, device_bytes_needed, fit
from recompute_bench.analysis.megatron import MegatronRun, flags, stage_peaks
from recompute_bench.analysis.megatron.plan import candidate_settings, megatron_plan, speed_order
from recompute_bench.analysis.megatron.time_model import step_time
from recompute_bench.config.schema import RecomputeConfig
from recompute_bench.recompute.policy import megatron_flags

RUN = MegatronRun("h100")
H100 = gpu_rates.datasheet_rates("h100")
GiB = 2**30
# Llama 3 70B as the seeds ran it (bf16 here: the memory model takes no FP8 yet), 32 GPUs.
LAYOUT = ["plan", "--framework", "megatron", "-w", "llama3-70b", "--tp", "4", "--pp", "4", "--sequence-parallel",
          "--set", "parallel.virtual_pipeline_model_parallel_size=5", "--seq-length", "4096", "--global-batch-size", "32",
          "--use-distributed-optimizer", "--gpu", "h100"]
SEEDS = [*LAYOUT, "--gpus", "32"]


def seeds_config():
    return config("llama3-70b", training__framework="megatron", parallel__tensor_model_parallel_size=4,
                  parallel__pipeline_model_parallel_size=4, parallel__sequence_parallel=True,
                  parallel__virtual_pipeline_model_parallel_size=5, training__seq_length=4096,
                  training__global_batch_size=32, parallel__data_parallel_size=2, parallel__use_distributed_optimizer=True)


def test_every_row_is_the_megatron_model_s_stage_peaks_and_the_time_model_s_step():
    cfg = seeds_config()
    result = megatron_plan(cfg, RUN, H100, 80 * GiB, 0.1, GiB, 32)
    rows = {r["label"]: r for r in result["settings"]}
    none = step_time(cfg, RUN, H100, [s.parameters for s in stage_peaks(cfg, RUN)]).step_seconds
    for label, r in (("selective[mlp]", RecomputeConfig("selective", ["mlp"])), ("full block 3", RecomputeConfig("full", [], "block", 3))):
        c = dataclasses.replace(cfg, recompute=r)
        peaks = [s.peak_allocated_bytes for s in stage_peaks(c, RUN)]
        assert [s["peak_allocated_bytes"] for s in rows[label]["stages"]] == peaks
        assert rows[label]["peak_allocated_bytes"] == max(peaks)
        assert rows[label]["device_bytes_needed"] == device_bytes_needed(max(peaks), 0.1, GiB)
        step = step_time(c, RUN, H100, [s.parameters for s in stage_peaks(cfg, RUN)]).step_seconds
        assert rows[label]["relative_throughput"] == pytest.approx(none / step)


def test_the_search_covers_what_megatron_accepts_and_says_what_it_refuses():
    cfg = seeds_config()  # sequence parallel: no distribute_saved_activations; pp 4: no CPU offloading
    settings = {r.label for r in candidate_settings(cfg)}
    per_chunk = 4
    assert {f"full block {k}" for k in range(1, per_chunk + 1)} | {f"full uniform {k}" for k in range(1, per_chunk + 1)} <= settings
    assert len([s for s in settings if s.startswith("selective[")]) == 7  # every subset of core_attn, mlp, layernorm
    result = megatron_plan(cfg, RUN, H100, 80 * GiB, 0.1, GiB, 32)
    priced = {r["label"] for r in result["settings"]}
    assert not any("+distribute" in p or p.startswith("offload ") for p in priced)
    attn_proj = ("attn_proj cannot be set to offload_modules alone without core_attn (Megatron's rule: its input is "
                 "core_attn's output, which core_attn's backward needs)")
    reasons = {x["reason"] for x in result["excluded"]}
    assert reasons == {"distribute_saved_activations must be false when sequence parallelism is enabled",
                       "Currently there is no support for Pipeline parallelism with CPU offloading (Megatron's rule)",
                       attn_proj}
    # fine-grained offloading of the groups a dense TE layer saves, beside none and every selective setting
    fine = {p for p in priced if "offload[" in p}
    assert len(fine) == 8 * 5  # (none + 7 subsets) x {qkv_linear, core_attn, qkv+core, core+proj, all three}
    assert {"offload[core_attn]", "selective[mlp] offload[qkv_linear,core_attn,attn_proj]"} <= fine
    no_sp = config("gpt3-22b", training__framework="megatron", parallel__tensor_model_parallel_size=8)
    plain = megatron_plan(no_sp, RUN, H100, 80 * GiB, 0.1, GiB)
    assert "full uniform 2 +distribute" in {r["label"] for r in plain["settings"]}
    # cpu_offloading_num_layers is priced now that the estimate models it (analysis/megatron/offload.py)
    assert {"offload 1", "offload 2"} <= {r["label"] for r in plain["settings"]}
    assert {x["reason"] for x in plain["excluded"]} == {attn_proj}


def test_the_answer_is_what_fits_fastest_first_with_the_fastest_that_fits_on_top():
    result = megatron_plan(seeds_config(), RUN, H100, 80 * GiB, 0.1, GiB, 32)
    classes = [r["fit"] for r in result["fits"]]
    assert classes == sorted(classes, key=[FITS, TIGHT].index)  # what fits, then what is tight
    for kind in (FITS, TIGHT):
        shown = [r for r in result["fits"] if r["fit"] == kind]
        assert [r["step_seconds"] for r in shown] == sorted(r["step_seconds"] for r in shown)
        # a slower row is listed only where it needs less memory than every faster one
        assert all(b["peak_allocated_bytes"] < a["peak_allocated_bytes"] for a, b in zip(shown, shown[1:]))
    fastest_fit = speed_order([r for r in result["settings"] if r["fit"] == FITS])[0]
    assert result["recommended"] == result["fits"][0]["label"] == fastest_fit["label"]
    # no recompute with the attention's saved tensors offloaded (the model finds the copies hidden
    # behind the layers' compute) fits where plain none is tight
    assert result["recommended"] == "offload[qkv_linear,core_attn]" and fastest_fit["relative_throughput"] == 1.0
    rows = {r["label"]: r for r in result["settings"]}
    assert rows["none"]["fit"] == TIGHT and rows["none"]["step_seconds"] == fastest_fit["step_seconds"]
    assert OVER not in classes
    assert {"setting": "selective[layernorm]", "same_as": "none"} in result["same_as_shown"]  # TE fuses the norms
    # each setting left out as dominated runs no faster than a listed one of its class that peaks no higher
    for label in result["dominated"]:
        row = rows[label]
        assert any(x["fit"] == row["fit"] and x["step_seconds"] <= row["step_seconds"]
                   and x["peak_allocated_bytes"] <= row["peak_allocated_bytes"] for x in result["fits"]), label


def test_tight_is_inside_the_allowance_and_over_is_beyond_the_fixed_part():
    assert fit(60 * GiB, 80 * GiB, 0.1, GiB) == FITS
    assert fit(75 * GiB, 80 * GiB, 0.1, GiB) == TIGHT  # 75 + 1 fits, 75 x 1.1 + 1 does not
    assert fit(79.5 * GiB, 80 * GiB, 0.1, GiB) == OVER


def test_the_cli_prints_the_plan_the_flags_and_the_allowance(tmp_path):
    result = invoke(*SEEDS, "--memory-gb", "70", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["recommended"] == "selective[mlp]" and data["gpus"] == 32
    assert data["config"]["parallel"]["data_parallel_size"] == 2
    text = " ".join(result.stderr.split())
    assert "use: selective[mlp]: fastest setting that fits" in text
    assert "Megatron-LM: --recompute-granularity selective --recompute-modules mlp" in text
    assert 'Megatron Bridge: cfg.model.recompute_granularity = "selective"; cfg.model.recompute_modules = ["mlp"]' in text
    assert "Bridge perf script: --recompute_modules mlp" in text
    assert 'NeMo 2.0: recipe.model.config.recompute_granularity = "selective"' in text
    offloading = invoke(*SEEDS, "--memory-gb", "80", "--json")
    assert json.loads(offloading.stdout)["recommended"] == "offload[qkv_linear,core_attn]"
    assert "Megatron-LM: --fine-grained-activation-offloading --offload-modules qkv_linear core_attn" in \
        " ".join(offloading.stderr.split())
    assert "expandable_segments:True" in text and "'tight' fits only if the allocator stays inside it" in text
    assert data["allowance"]["derived"] is False


def test_explain_shows_the_step_op_by_op_and_json_carries_the_parts():
    result = invoke(*SEEDS, "--memory-gb", "70", "--explain", "--json")
    assert result.exit_code == 0, result.output
    parts = json.loads(result.stdout)["time_parts"]
    assert {"linear_fc1", "linear_fc1.dgrad", "core_attention", "cross_entropy"} <= {p["op"] for p in parts["parts"]}
    # the micro-batches' ops, and the optimizer step's passes listed after them (each an op of its own)
    assert sum(p["seconds"] for p in parts["parts"] if p["pass"] != "optimizer") == pytest.approx(
        parts["num_microbatches"] * parts["microbatch_seconds"][parts["pacing_stage"]])
    assert sum(p["seconds"] for p in parts["parts"] if p["pass"] == "optimizer") == pytest.approx(
        parts["optimizer_seconds"])
    assert {"optimizer.adam", "optimizer.grad_norm", "optimizer.clip_grad"} <= {p["op"] for p in parts["parts"]}
    recomputed = {p["op"] for p in parts["parts"] if p["pass"] == "recompute"}
    # the MLP's checkpoint holds TE's pre-MLP norm (fused into fc1) and the sequence-parallel collectives
    assert recomputed == {"pre_mlp_layernorm", "linear_fc1", "linear_fc1.all_gather", "activation", "linear_fc2",
                          "linear_fc2.reduce_scatter"}
    text = " ".join(result.stderr.split())
    assert "predicted step of selective[mlp]" in text and "linear_fc1.wgrad" in text


def test_flags_for_each_kind_of_setting():
    assert flags.pasteable(RecomputeConfig("selective", ["mlp"])) == {
        "megatron_lm": ["--recompute-granularity", "selective", "--recompute-modules", "mlp"],
        "bridge": ['cfg.model.recompute_granularity = "selective"', 'cfg.model.recompute_modules = ["mlp"]'],
        "bridge_perf_script": ["--recompute_modules", "mlp"],
        "nemo2": ['recipe.model.config.recompute_granularity = "selective"', 'recipe.model.config.recompute_modules = ["mlp"]']}
    assert flags.bridge_perf_script(RecomputeConfig("selective", ["core_attn", "layernorm"])) == \
        ["--recompute_modules", "core_attn,layernorm"]
    assert flags.bridge_perf_script(RecomputeConfig("full", [], "block", 4)) == ["-rl", "4"]
    assert flags.bridge_perf_script(RecomputeConfig("full", [], "uniform", 2)) == \
        ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=2"]
    none = RecomputeConfig()
    assert megatron_flags(none) == []
    assert flags.bridge_overrides(none) == ["cfg.model.recompute_granularity = None", "cfg.model.recompute_modules = []"]
    assert flags.bridge_perf_script(none) == ["model.recompute_granularity=null", "model.recompute_modules=[]"]
    distributed = RecomputeConfig("full", [], "uniform", 1, distribute_saved_activations=True)
    assert megatron_flags(distributed)[-1] == "--distribute-saved-activations"
    assert "cfg.model.distribute_saved_activations = True" in flags.bridge_overrides(distributed)
    offload = RecomputeConfig(activation_offload_layers=3)
    # Megatron-LM switches layer offload on with --cpu-offloading (newer releases also from N > 0)
    assert megatron_flags(offload) == ["--cpu-offloading", "--cpu-offloading-num-layers", "3"]
    assert flags.pasteable(offload)["megatron_lm"] == megatron_flags(offload)
    assert flags.bridge_perf_script(offload) == ["-ol", "3"]
    fine = RecomputeConfig("selective", ["mlp"], fine_grained_activation_offloading=True,
                           offload_modules=["qkv_linear", "core_attn"])
    assert megatron_flags(fine) == ["--recompute-granularity", "selective", "--recompute-modules", "mlp",
                                    "--fine-grained-activation-offloading", "--offload-modules", "qkv_linear", "core_attn"]


def test_nothing_fits_exits_1_and_says_which_layouts_would():
    result = invoke(*SEEDS, "--memory-gb", "53", "--json")
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    assert data["recommended"] is None and data["reason"].startswith("nothing fits: the smallest setting")
    changes = {w["change"]: w for w in data["would_fit"]}
    assert set(changes) == {"--tp 8 --sequence-parallel", "--pp 8", "--set parallel.virtual_pipeline_model_parallel_size=10"}
    assert changes["--tp 8 --sequence-parallel"]["fits"]  # dp 2 -> 1 on the same 32 GPUs
    assert "what would fit" in result.stderr


def test_auto_compares_per_stage_and_per_layer_choice_and_says_megatron_cannot_run_them():
    result = invoke(*SEEDS, "--memory-gb", "70", "--auto", "--json")
    assert result.exit_code == 0, result.output
    auto = json.loads(result.stdout)["auto"]
    assert auto["uniform"]["setting"] == "selective[mlp]"
    # Stage 0 holds the most micro-batches and needs the most recompute; the others need less.
    stages = [s["setting"] for s in auto["per_stage"]["stages"]]
    assert stages[0] == "selective[mlp]" and all(s != "selective[mlp]" for s in stages[1:])
    assert auto["per_stage"]["gain"] > 0 and auto["per_layer"]["step_seconds"] <= auto["per_stage"]["step_seconds"]
    assert auto["megatron"].startswith("Megatron cannot run it: it applies one recompute setting to every layer")
    assert "run the best uniform setting instead: selective[mlp]" in " ".join(result.stderr.split())


def test_auto_plans_moe_context_parallel_and_fp8_layer_by_layer():
    # Mixtral's MoE layers (8 of them) with context parallel and FP8 current scaling, 32k tokens
    result = invoke("plan", "--framework", "megatron", "-w", "mixtral-8x7b", "--num-layers", "8", "--tp", "2",
                    "--sequence-parallel", "--cp", "2", "--pp", "2", "--ep", "4", "--precision", "fp8", "--set",
                    "training.fp8_recipe=tensorwise", "--seq-length", "32768", "--global-batch-size", "16",
                    "--gpus", "16", "--gpu", "h100", "--memory-gb", "30", "--auto", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    auto = data["auto"]
    assert auto["uniform"]["setting"] == data["recommended"]
    stages = [s["setting"] for s in auto["per_stage"]["stages"]]
    assert stages[0] != stages[1]  # stage 0 holds more micro-batches in flight than stage 1
    assert auto["per_stage"]["gain"] > 0 and auto["per_layer"]["gain"] >= auto["per_stage"]["gain"]
    # a layer-by-layer mix of whole-layer checkpoints and the MoE activation's recompute
    assert any("moe_act" in s["setting"] for s in auto["per_layer"]["stages"])
    assert auto["megatron"].startswith("Megatron cannot run it")


@pytest.mark.parametrize("argv,message", [
    (["--memory-gb", "40"], "error: --memory-gb 40 is below what stage 3 holds before any activation: 51.2 GiB of "
                            "parameters, gradients, optimizer state and buffers plus the 1 GiB fixed allowance; pass a "
                            "larger --memory-gb or shard more (--tp, --pp, --set parallel.use_distributed_optimizer=true)"),
    (["--memory-gb", "80", "--pp-schedule", "InterleavedZeroBubble"],
     "error: Megatron runs the 1F1B schedule (interleaved with virtual stages), not InterleavedZeroBubble; drop "
     "--pp-schedule"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message):
    result = invoke(*SEEDS, *argv)
    assert result.exit_code == 2, result.output
    assert " ".join(result.stderr.split()) == message


def test_estimate_refuses_a_schedule_megatron_cannot_run_as_plan_does():
    result = invoke("estimate", *LAYOUT[1:], "--pp-schedule", "InterleavedZeroBubble")
    assert result.exit_code == 2, result.output
    assert " ".join(result.stderr.split()) == ("error: Megatron runs the 1F1B schedule (interleaved with virtual "
                                               "stages), not InterleavedZeroBubble; drop --pp-schedule")


def test_a_gpu_kind_without_rates_is_one_line_and_exit_2():
    result = invoke(*SEEDS, "--gpu", "v100", "--memory-gb", "80")
    assert result.exit_code == 2
    assert " ".join(result.stderr.split()) == (
        "error: no datasheet rates for GPU kind 'v100' to price time with; pass --gpu with one of a100, h100, h200, "
        "b200, gb200, or --profile on that GPU to measure its rates")


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "40"], ("error: 40 GPUs are not a positive multiple of tensor x pipeline x context parallel = 4 x 4 x 1 = 16; "
                            "pass --gpus as a multiple of 16")),
    (["--gpus", "32", "--dp", "4"], "error: --gpus 32 makes the data-parallel size 2, but --dp says 4; drop one of them"),
])
def test_a_gpu_count_megatron_cannot_lay_out_is_one_line_and_exit_2(argv, message):
    result = invoke(*LAYOUT, *argv, "--memory-gb", "80")
    assert result.exit_code == 2
    assert " ".join(result.stderr.split()) == message


@pytest.mark.parametrize("flag", [["--gpu", "h100"], ["--explain"], ["--all"]])
def test_the_megatron_options_need_framework_megatron(flag):
    result = invoke("plan", "-w", "tiny", "--memory-gb", "8", *flag)
    assert result.exit_code == 2
    assert f"{flag[0]} goes with --framework megatron" in result.stderr


def test_the_harness_s_policy_file_options_are_refused_for_megatron():
    result = invoke(*SEEDS, "--memory-gb", "80", "--auto", "--output", "x.toml")
    assert result.exit_code == 2
    assert "Megatron runs no per-layer policy: drop --output" in result.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on a GPU --profile measures (tests/gpu)")
def test_profile_without_a_gpu_reads_a_shipped_profile_or_says_there_is_none(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no results/profiles/ here: only the shipped profiles
    result = invoke(*SEEDS, "--memory-gb", "80", "--profile")
    assert result.exit_code == 2
    assert " ".join(result.stderr.split()) == (
        "error: --profile measures this machine's GPU, and there is none here, nor a cached or shipped h100 profile; "
        "drop --profile (the GPU table's rates price the plan) or profile on a h100")
    result = invoke("plan", "--framework", "megatron", "-w", "llama3-8b", "--gpu", "h200", "--memory-gb", "400",
                    "--profile", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["rates"]["matrix_flops"]["bf16"] == 771e12 and plan["rates"]["source"].startswith("measured on NVIDIA H200")
    assert "h200's profile read from" in result.stderr


def test_when_only_tight_settings_fit_the_fastest_is_recommended_with_expandable_segments():
    result = invoke(*SEEDS, "--memory-gb", "57", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {r["fit"] for r in data["fits"]} == {TIGHT}
    best = data["fits"][0]
    assert data["recommended"] == best["label"] == speed_order([r for r in data["settings"] if r["fit"] == TIGHT])[0]["label"]
    assert best["relative_throughput"] == max(r["relative_throughput"] for r in data["settings"] if r["fit"] == TIGHT)
    peak = best["peak_allocated_bytes"] / GiB
    assert data["reason"] == (f"tight: nothing fits with the allowance; {best['label']} fits only if the caching allocator "
                              f"holds under {57 - peak - 1:.1f} GiB above its {peak:.1f} GiB allocated peak: run with "
                              "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
