"""The command line: flag spellings, every validation rule (exit 2, one line, no traceback), run, verify."""

import json
from types import SimpleNamespace

import pytest
import torch

from helpers import FAST, config, invoke
from recompute_bench.cli import run_performance_workload
from recompute_bench.cli.app import normalize_argv


def _recompute(*args):
    """The recompute setting and notes `run` itself resolves from argv (one fast measured step)."""
    result = invoke("run", "--no-save", "--json", *[a for s in FAST for a in ("--set", s)], *args)
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)["recompute"]
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    return SimpleNamespace(**r, recomputes=r["granularity"] == "full" or bool(r["modules"])), notes


@pytest.mark.parametrize("argv", [
    ["--recompute_modules", "core_attn", "layernorm"],
    ["--recompute-modules", "core_attn,layernorm"],
    ["--recompute-modules", "layernorm", "--recompute-modules", "core_attn"],
    ["--recompute_granularity", "selective", "--recompute-modules=core_attn,layernorm"],
    ["--recompute-granularity=selective", "--recompute_modules", "layernorm,", "core_attn"],
])
def test_every_spelling_of_a_module_list_gives_one_setting(argv):
    r, _ = _recompute(*argv)
    assert (r.granularity, r.modules, r.method, r.num_layers) == ("selective", ["core_attn", "layernorm"], None, None)


def test_bridge_short_flag_means_full_block():
    r, notes = _recompute("-rl", "2")
    assert (r.granularity, r.method, r.num_layers) == ("full", "block", 2)
    assert any("block" in n for n in notes)


@pytest.mark.slow
def test_explicit_empty_module_list_recomputes_nothing_and_says_so():
    r, notes = _recompute("--recompute-granularity", "selective", "--recompute-modules", "[]")
    assert r.modules == [] and not r.recomputes
    assert any("nothing is recomputed" in n for n in notes)
    r, notes = _recompute("--recompute-granularity", "selective")
    assert r.modules == ["core_attn"] and any("default" in n for n in notes)


def test_normalize_argv_leaves_values_and_tokens_after_double_dash_alone():
    assert normalize_argv(["--set", "model.hidden_dropout=0.1", "--", "--recompute_modules"]) == \
        ["--set", "model.hidden_dropout=0.1", "--", "--recompute_modules"]
    assert normalize_argv(["-tp", "8", "--num_layers=2"]) == ["--tensor-model-parallel-size", "8", "--num-layers=2"]


BAD_INPUT = [
    (["--workload", "nope"], "unknown workload"),
    (["--recompute-granularity", "sometimes"], "recompute_granularity"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "1"], "recompute_method"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], "recompute_num_layers"),
    (["--recompute-granularity", "full", "--recompute-method", "sideways", "--recompute-num-layers", "1"], "recompute_method"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "5"], "between 1 and 4"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "0"], "between 1 and 4"),
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "--recompute-num-layers", "1"], "must be unset"),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"], "not supported with recompute_granularity selective"),
    (["--recompute-modules", "attention"], "unknown recompute module"),
    (["--recompute-modules", "moe_act"], "needs mixture-of-experts"),
    (["--recompute-modules", "mla_up_proj"], "multi-latent attention"),
    (["--recompute-granularity", "none", "--recompute-num-layers", "2", "--recompute-method", "block"], "granularity is none"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
      "--activation-offload-layers", "1"], "CPU offloading does not work"),
    (["--activation-offload-layers", "4"], "between 1 and 3"),
    (["--activation-offload-layers", "1"], "no CUDA device"),
    (["--tensor-model-parallel-size", "2"], "does not divide the 1 rank(s) launched"),
    (["--sequence-parallel"], "needs tensor parallelism"),
    (["--set", "recompute.distribute_saved_activations=true"], "distribute_saved_activations"),
    (["--num-layers", "0"], "num_layers must be a positive integer"),
    (["--seq-length", "4096"], "max_position_embeddings"),
    (["--global-batch-size", "3"], "not divisible"),
    (["--precision", "fp8"], "precision"),
    (["--attention-backend", "flash"], "attention_backend"),
    (["--set", "model.hidden_size"], "section.key=value"),
    (["--set", "model.depth=3"], "unknown setting model.depth"),
    (["--set", "model.hidden_size=\"big\""], "must be int"),
    (["--set", "model.num_query_groups=3"], "num_query_groups"),
]


@pytest.mark.parametrize("argv,words", BAD_INPUT, ids=[w for _, w in BAD_INPUT])
def test_bad_input_is_one_clear_line_and_exit_2(argv, words, tmp_path):
    results = tmp_path / "runs.jsonl"
    results.write_text('{"kept": true}\n')
    result = invoke("run", "--results", str(results), *argv)
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err.startswith("error:") and words in err
    assert len(err.splitlines()) == 1 and "Traceback" not in result.output
    assert results.read_text() == '{"kept": true}\n'  # nothing already written is touched


def test_verify_rejects_a_bad_backend():
    result = invoke("verify", "--attention-backend", "flash")
    assert result.exit_code == 2 and "attention_backend" in result.stderr
    result = invoke("verify", "--attention-backend", "math", "--attention-backend", "flash")
    assert result.exit_code == 2 and "attention_backend" in result.stderr


def test_run_writes_the_record_contract(tmp_path):
    results = tmp_path / "runs.jsonl"
    sets = [a for s in FAST for a in ("--set", s)]
    result = invoke("run", "--results", str(results), "--json", "--recompute_modules", "core_attn", *sets)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert json.loads(results.read_text()) == record
    assert record["schema"] == "recompute-bench/result/v1" and record["status"] == "ok"
    assert set(record) >= {"workload", "config", "recompute", "env", "status", "ranks", "metrics"}
    assert record["recompute"] == {"granularity": "selective", "modules": ["core_attn"], "method": None,
                                   "num_layers": None, "activation_offload_layers": 0,
                                   "distribute_saved_activations": False}
    assert set(record["env"]) >= {"device_name", "torch_version", "package_version", "git_sha", "hostname", "time"}
    m = record["metrics"]
    assert m["measured_flops_per_step"] == m["hardware_flops_per_step"] > m["model_flops_per_step"]
    assert m["tflops_per_gpu"] > 0 and len(m["step_times_s"]) == 1 and m["activation_bytes"] > 0
    assert m["mfu"] is None  # no known peak for a CPU
    rank = record["ranks"][0]
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "alloc_retries", "num_ooms", "nvml_used_bytes"):
        assert rank[key] is None  # not measured on CPU: never zero


@pytest.mark.parametrize("fault,status,phase", [("oom:backward:1", "oom", "backward"), ("error:forward:0", "error", "forward"),
                                                ("oom:optimizer:0", "oom", "optimizer")])
def test_a_failing_step_is_a_recorded_result(monkeypatch, tmp_path, fault, status, phase):
    monkeypatch.setenv("RECOMPUTE_BENCH_FAULT", fault)
    results = tmp_path / "runs.jsonl"
    result = invoke("run", "--results", str(results), "--set", "training.warmup_steps=1", "--set", "training.measured_steps=1")
    assert result.exit_code == 1
    record = json.loads(results.read_text())
    assert record["status"] == status == record["ranks"][0]["status"]
    assert record["failure"]["phase"] == phase and record["failure"]["step"] == int(fault[-1])
    assert record["failure"]["rank"] == 0 and record["metrics"]["step_time_s"] is None


def test_run_performance_workload_accepts_bridge_flags(capsys):
    # The installed entry point itself, with Megatron Bridge's spellings.
    with pytest.raises(SystemExit) as exit_:
        run_performance_workload(["-w", "tiny", "--num_layers", "2", "--recompute_modules", "core_attn,layernorm",
                                  "--no-save", "--json", "--set", "training.warmup_steps=0",
                                  "--set", "training.measured_steps=1"])
    assert exit_.value.code in (0, None)
    record = json.loads(capsys.readouterr().out)
    assert record["config"]["model"]["num_layers"] == 2
    assert record["recompute"]["modules"] == ["core_attn", "layernorm"]


def test_run_performance_workload_refuses_bad_input_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        run_performance_workload(["-w", "tiny", "--recompute_modules", "attention", "--no-save"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith("error:") and len(err.splitlines()) == 1


def test_verify_exits_1_naming_the_setting_that_changes_a_gradient(monkeypatch):
    # A recompute setting that changed the math: here one that also nudges a norm weight by 0.1%.
    import recompute_bench.measure.verify as verify_module
    apply = verify_module.apply_recompute

    def apply_and_nudge(model, recompute, *args, **kwargs):
        model = apply(model, recompute, *args, **kwargs)
        if recompute.granularity == "full":
            with torch.no_grad():
                model.final_layernorm.weight.mul_(1.001)
        return model

    monkeypatch.setattr(verify_module, "apply_recompute", apply_and_nudge)
    result = invoke("verify", "--seq-length", "16", "--attention-backend", "math", "--json")
    assert result.exit_code == 1, result.output
    outcomes = {o["setting"]: o for o in json.loads(result.stdout)}
    differs = [name for name, o in outcomes.items() if not o["exact"]]
    assert differs and all(name.startswith("full") for name in differs)
    assert all(o["exact"] for name, o in outcomes.items() if not name.startswith("full"))
    assert all(outcomes[name]["loss_diff"] > 0 for name in differs)
    assert f"{len(differs)} of {len(outcomes)} settings change the loss or a gradient" in " ".join(result.stderr.split())


@pytest.mark.slow
def test_verify_command_passes_on_tiny():
    result = invoke("verify", "--workload", "tiny", "--attention-backend", "math", "--json")
    assert result.exit_code == 0, result.output
    outcomes = json.loads(result.stdout)
    assert len(outcomes) == 15 and all(o["exact"] for o in outcomes)


def test_workloads_lists_every_preset_with_its_shape():
    result = invoke("workloads", "--json")
    rows = {r["workload"]: r for r in json.loads(result.stdout)}
    assert set(rows) == {"tiny", "gpt3-22b", "gpt3-175b", "gpt3-530b", "gpt3-1t", "llama3-8b", "llama3-70b", "llama3-405b",
                         "tiny-moe", "mixtral-8x7b", "qwen3-30b-a3b", "tiny-mla", "deepseek-v3"}
    moe = {name: (r["num_moe_experts"], r["moe_router_topk"], r["attention_type"]) for name, r in rows.items()}
    assert (moe["deepseek-v3"], moe["qwen3-30b-a3b"], moe["tiny-mla"]) == ((256, 8, "MLA"), (128, 8, "GQA"), (8, 2, "MLA"))
    paper = {"gpt3-22b": (64, 6144, 48), "gpt3-175b": (96, 12288, 96), "gpt3-530b": (128, 20480, 105), "gpt3-1t": (160, 25600, 128)}
    for name, (a, h, L) in paper.items():
        r = rows[name]
        assert (r["num_attention_heads"], r["hidden_size"], r["num_layers"]) == (a, h, L)
        assert (r["seq_length"], r["vocab_size"], r["ffn_hidden_size"]) == (2048, 51200, 4 * h)
    for name in ("llama3-8b", "llama3-70b", "llama3-405b"):
        r = rows[name]
        assert (r["num_query_groups"], r["vocab_size"], r["seq_length"], r["normalization"], r["activation"],
                r["position_embedding_type"]) == (8, 128256, 8192, "RMSNorm", "swiglu", "rope")


def test_per_gpu_recompute_table_and_user_preset_file(tmp_path):
    assert config("llama3-70b").recompute.granularity == "none"
    from recompute_bench.workload import resolve
    cfg, _ = resolve("llama3-70b", gpu="h100")
    assert (cfg.recompute.granularity, cfg.recompute.modules) == ("selective", ["core_attn"])
    cfg, _ = resolve("llama3-70b", gpu="h100", overrides={"recompute.granularity": "full", "recompute.method": "uniform",
                                                            "recompute.num_layers": 1})
    assert (cfg.recompute.granularity, cfg.recompute.modules) == ("full", [])  # flags replace the preset's setting
    own = tmp_path / "mine.toml"
    own.write_text((__import__("pathlib").Path("workloads/tiny.toml")).read_text().replace("num_layers = 4", "num_layers = 6"))
    cfg, _ = resolve(str(own))
    assert cfg.model.num_layers == 6 and cfg.workload == "mine"


def test_help_at_80_columns_keeps_every_option_name_whole(monkeypatch):
    import typer.main
    from recompute_bench.cli.app import app

    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr("typer.rich_utils.MAX_WIDTH", 80)
    group = typer.main.get_command(app)
    commands = [[name] for name in group.commands if name != "golden"] + [["golden", "update"]]
    for words in commands:
        result = invoke(*words, "--help")
        assert result.exit_code == 0, result.output
        assert "…" not in result.output, (words, [line for line in result.output.splitlines() if "…" in line])
        command = group
        for w in words:
            command = command.commands[w]
        for param in command.params:
            if param.param_type_name == "option" and not param.hidden:
                for name in param.opts:
                    assert name in result.output, (words, name)


def test_a_boolean_field_and_the_other_spellings_parse_as_before():
    from recompute_bench.cli.options import normalize_argv

    assert normalize_argv(["--tp", "2", "-pp", "4", "--no-sequence-parallel"]) == [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4", "--no-sequence-parallel"]
    on = json.loads(invoke("estimate", "--tp", "2", "--sequence-parallel", "--json").stdout)
    off = json.loads(invoke("estimate", "--tp", "2", "--sequence-parallel", "--no-sequence-parallel", "--json").stdout)
    assert on["config"]["parallel"]["sequence_parallel"] is True and off["config"]["parallel"]["sequence_parallel"] is False
    preset = json.loads(invoke("estimate", "--tp", "2", "--json").stdout)
    assert preset["config"]["parallel"]["sequence_parallel"] is False  # neither flag: the preset's value


def test_ctrl_c_while_python_imports_is_one_line_exit_130():
    # SIGINT arrives while the command line imports typer (its first half-second): one line and 130,
    # as any interrupted command, not a KeyboardInterrupt traceback and a death by SIGINT. SIGINT's
    # handler is set first: a test run started with SIGINT ignored passes that on to its children.
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import os, signal, sys\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "class Interrupt:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'typer':\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "        return None\n"
            "sys.meta_path.insert(0, Interrupt())\n"
            "from recompute_bench.cli import main\n"
            "main(['workloads'])\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert (done.returncode, done.stderr.strip().splitlines()) == (130, ["interrupted while starting; nothing was run"])
