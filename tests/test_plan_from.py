"""`plan --framework megatron --from PATH`: every format `estimate --from` reads plans the Config
`read_run` makes of it (the same rows as planning that Config directly), the flags beside the file
override it and are echoed, and bad input is one line, exit 2."""

import json
from pathlib import Path

import pytest
from helpers import invoke

from recompute_bench.analysis import gpu_rates
from recompute_bench.analysis.megatron.plan import megatron_plan
from recompute_bench.ingest.run_source import read_run

DATA = Path(__file__).parent / "data"
SEED_YAML = DATA / "seed" / "LLAMA3_70B_SFT_CONFIG_H100_FP8_CS_V1.yaml"
SEED_ARGS = DATA / "seed" / "LLAMA3_70B_SFT_CONFIG_H100_FP8_CS_V1.sh"
MODEL_CONFIG = DATA / "ingest" / "megatron-golden" / "gpt3_mcore_te_tp1_pp1_resume_torch_dist_uniform_full_recompute" / \
    "model_config.yaml"
MEGATRON_LOG = DATA / "ingest" / "megatron-lm" / "gpt-tp2-pp2.log"
BRIDGE_LOG = DATA / "ingest" / "bridge-seed" / "Golden.log"
GiB = 2**30


def _one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.mark.parametrize("path,extra,fmt", [
    (SEED_YAML, ["--gpus", "32"], "bridge-config"),
    (SEED_ARGS, [], "megatron-args"),  # torchrun's 4 nodes x 8 GPUs
    (MODEL_CONFIG, ["--gpus", "8"], "model-config"),
    (MEGATRON_LOG, [], "megatron-lm"),  # its argument dump states world_size 8
    (BRIDGE_LOG, ["-w", "llama3-70b", "--gpus", "32"], "megatron-bridge"),
], ids=["bridge-config", "argument-list", "model-config", "megatron-lm-log", "bridge-log"])
def test_each_format_plans_the_config_read_run_makes_of_it(path, extra, fmt):
    result = invoke("plan", "--framework", "megatron", "--from", str(path), *extra, "--memory-gb", "80", "--json")
    assert result.exit_code in (0, 1), result.output
    data = json.loads(result.stdout)
    assert data["source"]["format"] == fmt and data["source"]["file"] == str(path)
    gpus = next((int(x) for x, flag in zip(extra[1:], extra) if flag == "--gpus"), None)
    source = read_run(path, gpus=gpus, workload=extra[1] if extra[:1] == ["-w"] else None)
    direct = megatron_plan(source.config, source.run, gpu_rates.achieved_rates(source.run.gpu), 80 * GiB, 0.1, GiB,
                           gpus)
    assert data["config"] == source.config.to_dict()
    assert [(r["label"], r["peak_allocated_bytes"], r["step_seconds"]) for r in data["settings"]] == \
        [(r["label"], r["peak_allocated_bytes"], r["step_seconds"]) for r in direct["settings"]]
    assert data["recommended"] == direct["recommended"]
    text = " ".join(result.stderr.split())
    assert f"from {path.name} ({fmt}):" in text


def test_the_seeds_bridge_config_and_its_command_line_plan_alike():
    from_yaml = invoke("plan", "--from", str(SEED_YAML), "--gpus", "32", "--memory-gb", "80", "--json")
    from_args = invoke("plan", "--from", str(SEED_ARGS), "--memory-gb", "80", "--json")
    assert from_yaml.exit_code == from_args.exit_code == 0, from_yaml.output + from_args.output
    a, b = json.loads(from_yaml.stdout), json.loads(from_args.stdout)
    assert [r["label"] for r in a["fits"]] == [r["label"] for r in b["fits"]]
    assert a["recommended"] == b["recommended"] and a["config"]["training"]["precision"] == "fp8"


def test_flags_beside_from_override_it_and_are_echoed():
    result = invoke("plan", "--framework", "megatron", "--from", str(SEED_YAML), "--gpus", "32", "--tp", "8",
                    "--memory-gb", "80", "--json")
    assert result.exit_code == 0, result.output
    assert "override: beside --from LLAMA3_70B_SFT_CONFIG_H100_FP8_CS_V1.yaml: --tensor-model-parallel-size 8 (the file: 4)" in \
        " ".join(result.stderr.split())
    data = json.loads(result.stdout)
    assert data["config"]["parallel"]["tensor_model_parallel_size"] == 8
    assert data["config"]["parallel"]["data_parallel_size"] == 1  # 32 GPUs / (tp 8 x pp 4)
    assert data["source"]["origins"]["parallel.tensor_model_parallel_size"] == "--tensor-model-parallel-size"


# ----- bad input: one line, exit 2 ------------------------------------------------------------------

def test_a_file_that_states_no_gpu_count_and_no_gpus():
    line = _one_error_line(invoke("plan", "--framework", "megatron", "--from", str(SEED_YAML), "--memory-gb", "80"))
    assert line == f"error: {SEED_YAML}: states no GPU count; pass --gpus N (the run's world size), or --dp N"


def test_a_budget_below_the_static_memory():
    line = _one_error_line(invoke("plan", "--framework", "megatron", "--from", str(SEED_YAML), "--gpus", "32",
                                  "--memory-gb", "10"))
    assert line.startswith("error: --memory-gb 10 is below what stage ")
    assert line.endswith("GiB of parameters, gradients, optimizer state and buffers plus the 1 GiB fixed allowance; "
                         "pass a larger --memory-gb or shard more (--tp, --pp, --set parallel.use_distributed_optimizer=true)")


def test_an_argument_megatron_cannot_express_in_the_file(tmp_path):
    path = tmp_path / "model_config.yaml"
    path.write_text(MODEL_CONFIG.read_text().replace("  --bf16: true\n", "  --bf16: true\n  --optimizer: sgd\n"))
    line = _one_error_line(invoke("plan", "--framework", "megatron", "--from", str(path), "--gpus", "8",
                                  "--memory-gb", "80"))
    assert line == (f"error: {path}: the estimate cannot express setting of this run: --optimizer sgd (line 54): "
                    "optimizers other than Adam are not modelled; remove them from the run, or give a flag for the "
                    "field one sets beside --from, to estimate the rest")


def test_an_argument_megatron_cannot_run_beside_the_file():
    line = _one_error_line(invoke("plan", "--framework", "megatron", "--from", str(SEED_YAML), "--gpus", "32",
                                  "--memory-gb", "80", "--pp-schedule", "InterleavedZeroBubble"))
    # a rule of the config read (with the flags beside it), so the file is named as for every other
    assert line == (f"error: {SEED_YAML}: Megatron runs the 1F1B schedule (interleaved with virtual stages), not "
                    "InterleavedZeroBubble; drop --pp-schedule")


@pytest.mark.parametrize("args,words", [
    (["--from", str(SEED_YAML), "--gpus", "32", "--framework", "recompute-bench"], "drop --framework recompute-bench"),
    (["--from", str(SEED_YAML), "--gpus", "32", "-w", "tiny"], "states the run's whole configuration; drop --workload"),
    (["--from", str(SEED_YAML), "--gpus", "24"],
     "24 GPUs are not a positive multiple of tensor x pipeline x context parallel = 4 x 4 x 1 = 16"),
    (["--from", str(BRIDGE_LOG), "--gpus", "32"], "pass --workload PRESET for them"),
])
def test_other_bad_input_beside_from(args, words):
    assert words in _one_error_line(invoke("plan", *args, "--memory-gb", "80"))


def test_the_time_check_plans_the_config_the_seeds_bridge_config_states():
    from recompute_bench.analysis.megatron.time_checks import seeds_config

    read = read_run(SEED_YAML, gpus=32).config.to_dict()
    checked = seeds_config().to_dict()
    # what only this harness's measurement reads (warm-up, steps, seed) and the name aside
    for cfg in (read, checked):
        cfg.pop("workload")
        for name in ("warmup_steps", "measured_steps", "seed"):
            cfg["training"].pop(name)
    assert checked == read


def test_the_seeds_run_plans_with_its_cuda_graphs_and_fp8_and_says_what_time_leaves_out():
    result = invoke("plan", "--from", str(SEED_YAML), "--gpus", "32", "--memory-gb", "80", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["config"]["training"]["precision"] == "fp8" and data["config"]["training"]["fp8_recipe"] == "tensorwise"
    assert data["config"]["training"]["cuda_graph_impl"] == "transformer_engine"
    assert data["time_notes"][0].startswith("CUDA graphs (transformer_engine): the time model prices no kernel launch "
                                            "overhead")
    assert "time model: CUDA graphs (transformer_engine)" in " ".join(result.stderr.split())
    # Megatron runs full recompute with full-iteration graphs only: none of it is planned here
    assert not any(r["recompute"]["granularity"] == "full" for r in data["settings"])
    assert any(x["reason"].startswith("full recompute is only supported with full iteration CUDA graph")
               for x in data["excluded"])
