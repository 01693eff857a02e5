"""estimate --from: a Megatron run as its user has it (a model_config.yaml, a command line, a Megatron-LM
or Bridge log, Bridge's ConfigContainer YAML) -> the Config and MegatronRun the estimate models, with
where each value came from; flags beside it override it; what it cannot express is refused in one
line. Also: the first iteration's peak beside the steady state's, and each stage's peak as Megatron's
terms."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from helpers import config, invoke
from recompute_bench.analysis.megatron import MegatronRun, stage_peak, stage_peaks
from recompute_bench.analysis.megatron.terms import stage_terms
from recompute_bench.ingest import formats
from recompute_bench.ingest.config import run_config
from recompute_bench.ingest.megatron_args import config_from_megatron
from recompute_bench.ingest.megatron_golden import read_model_config_file
from recompute_bench.ingest.record import FIRST_ITERATION, STEADY, import_record
from recompute_bench.ingest.run_source import read_run
from recompute_bench.models import FP32_BYTES
from recompute_bench.config.schema import BadInput

DATA = Path(__file__).parent / "data"
SEED_YAML = DATA / "seed" / "LLAMA3_70B_SFT_CONFIG_H100_FP8_CS_V1.yaml"
SEED_ARGS = DATA / "seed" / "LLAMA3_70B_SFT_CONFIG_H100_FP8_CS_V1.sh"
GOLDEN_CASE = DATA / "ingest" / "megatron-golden" / "gpt3_mcore_te_tp1_pp1_resume_torch_dist_uniform_full_recompute"
MODEL_CONFIG = GOLDEN_CASE / "model_config.yaml"
MEGATRON_LOG = DATA / "ingest" / "megatron-lm" / "gpt-tp2-pp2.log"
BRIDGE_LOG = DATA / "ingest" / "bridge-seed" / "Golden.log"


def _one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in result.output, result.output
    return lines[0]


# ----- the seeds' configuration --------------------------------------------------------------------

def test_the_seeds_bridge_config_and_its_command_line_read_to_the_same_config():
    from_yaml = read_run(SEED_YAML, gpus=32, strict=False)  # Bridge's dump states no GPU count before the run
    from_argv = read_run(SEED_ARGS, strict=False)  # torchrun --nproc-per-node 8 --nnodes 4
    assert from_yaml.config == from_argv.config
    assert from_yaml.refused_arguments == from_argv.refused_arguments == []  # every setting is modelled
    m, t, p, r = (getattr(from_yaml.config, s) for s in ("model", "training", "parallel", "recompute"))
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups) == \
        (80, 8192, 28672, 64, 8)
    assert (m.activation, m.normalization, m.position_embedding_type, m.rotary_base) == ("swiglu", "RMSNorm", "rope", 500000)
    assert not m.share_embeddings_and_output_weights and not m.add_bias_linear and m.cross_entropy_loss_fusion
    # Bridge uses a vocabulary set on the model unpadded (setup.py _validate_and_set_vocab_size)
    assert m.padded_vocab_size(p.tensor_model_parallel_size) == 128256
    assert (t.seq_length, t.micro_batch_size, t.global_batch_size, t.seed, t.framework) == (4096, 1, 32, 5678, "megatron")
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size,
            p.data_parallel_size) == (4, 4, 5, 2)
    assert p.sequence_parallel and p.use_distributed_optimizer and r.granularity == "none"  # the recipe recomputes nothing
    assert from_argv.parsed.env["PYTORCH_CUDA_ALLOC_CONF"] == from_yaml.parsed.env["PYTORCH_CUDA_ALLOC_CONF"]


def test_the_seeds_configuration_is_estimated_from_either_file():
    for argv in (("--from", str(SEED_YAML), "--gpus", "32"), ("--from", str(SEED_ARGS))):
        result = invoke("estimate", *argv, "--json")
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert [s["stage"] for s in report["stages"]] == [0, 1, 2, 3]
        assert report["config"]["training"]["precision"] == "fp8"


SEED_TABLE = ((["core_attn"], 58.8e9), (["mlp"], 55.6e9), (["mlp", "core_attn"], 55.6e9),
              (["core_attn", "layernorm"], 59.6e9))
"""The seeds' table (shared/seeds/003, Bridge PR #3107): rank 0's mem-max-allocated per recompute setting."""
SEED_UNEXPLAINED = {("core_attn",): 10.76e9, ("core_attn", "layernorm"): 9.96e9}
"""Bytes the estimate holds beyond the measured figure that no term read from the source accounts
for (docs/megatron.md, "The seeds' table"): the rows stay unmet until a term explains them."""


def test_the_seeds_table_row_by_row():
    """Bridge prints each rank's max allocated after iterations 1 and 2 only (train_utils.py
    `training_log`: `report_memory_flag` goes off after iteration 2), a peak since the process
    started: the table's figure is `peak_after(2)`, the most of iteration 1 (no Adam moments yet, its
    optimizer step creating them) and iteration 2 (eager too: TE's MLP graphs are captured before
    iteration 4, Bridge train.py `step - start_iteration == cuda_graph_warmup_steps`). [mlp] and
    [mlp, core_attn] are held within 5%. [core_attn] and [core_attn, layernorm] are not: iteration 2's
    first backward on stage 0 holds 23 chunks' saved tensors beside the moments, and the estimate
    exceeds the measured figure by SEED_UNEXPLAINED, as much as the SwiGLU input those 92 layers keep
    (linear_fc1.output: fused_bias_swiglu.py BiasSwiGLUFunction saves it in bf16); no source read
    here drops it, so the excess stays named, not fitted."""
    for modules, measured in SEED_TABLE:
        source = read_run(SEED_YAML, gpus=32, strict=False, overrides={"recompute.modules": modules})
        assert not source.refusals and not source.invalid
        peaks = stage_peaks(source.config, source.run)
        for peak in peaks:
            assert sum(t["bytes"] for t in stage_terms(source.config, peak)) == \
                pytest.approx(peak.peak_allocated_bytes, rel=1e-12)
        stage0 = peaks[0]  # rank 0's line (the last stage, with the loss, may hold more)
        logged = stage0.peak_after(2)
        assert stage0.peak_after(1) == stage0.first_iteration_peak_allocated_bytes
        assert stage0.first_iteration_phase == "the optimizer step (it creates the Adam moments)"
        assert stage0.first_iteration_peak_allocated_bytes == pytest.approx(55.12e9, abs=0.01e9)  # same for all
        assert [first for first, _, _ in stage0.iteration_peaks] == [1, 2, 4]
        unexplained = SEED_UNEXPLAINED.get(tuple(modules))
        if unexplained is None:
            assert logged == pytest.approx(measured, rel=0.05), modules
            continue
        assert logged / measured - 1 > 0.05, f"{modules} now within 5%: move it out of SEED_UNEXPLAINED"
        assert logged - measured == pytest.approx(unexplained, abs=0.01e9), modules
        fc1 = next(t for t in stage_terms(source.config, stage0) if t["term"] == "linear_fc1.output")
        assert fc1["layers"] == 92 and fc1["bytes"] == pytest.approx(10.805e9, abs=0.001e9)


def test_a_memory_line_before_the_cuda_graph_capture_reports_the_eager_iterations():
    """With TE's per-layer graphs captured after cuda_graph_warmup_steps eager iterations, a memory
    line after iteration 2 reports those iterations, not the capture or the replays that come later
    (the steady state's peak): [mlp]'s steady peak is the optimizer step beside the graphs' static
    buffers, which iteration 2 does not yet hold."""
    source = read_run(SEED_YAML, gpus=32, strict=False, overrides={"recompute.modules": ["mlp"]})
    stage0 = stage_peaks(source.config, source.run)[0]
    static = sum(v for k, v in stage0.items.items() if k.startswith("CUDA graph static"))
    assert stage0.phase == "the optimizer step" and static > 1e9
    assert stage0.peak_after(1) < stage0.peak_after(2) == stage0.peak_after(3) < stage0.peak_allocated_bytes
    assert stage0.peak_after(4) == stage0.peak_allocated_bytes == stage0.peak_after(50)
    # without CUDA graphs a line after iteration 2 is the steady state already
    plain = read_run(SEED_YAML, gpus=32, strict=False, overrides={"training.cuda_graph_impl": "none",
                                                                  "training.cuda_graph_modules": []})
    for peak in stage_peaks(plain.config, plain.run):
        assert peak.peak_after(2) == peak.peak_allocated_bytes > peak.peak_after(1)
    result = invoke("estimate", "--from", str(SEED_YAML), "--gpus", "32", "--recompute-granularity", "selective",
                    "--recompute-modules", "mlp", "--json")
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["stages"][0]
    assert row["peak_after_iteration"] == {"1": stage0.peak_after(1), "2": stage0.peak_after(2)}
    assert [p["from_iteration"] for p in row["iteration_peaks"]] == [1, 2, 4]


# ----- each format -------------------------------------------------------------------------------

def test_a_model_config_yaml_reads_its_env_and_the_recipes_list_form(tmp_path):
    text = MODEL_CONFIG.read_text().replace("--recompute-granularity: full\n  --recompute-method: uniform\n"
                                            "  --recompute-num-layers: 1\n",
                                            '--recompute-granularity: selective\n  --recompute-modules: "[mlp core_attn]"\n')
    path = tmp_path / "model_config.yaml"
    path.write_text(text)
    args, lines, env = read_model_config_file(path)
    assert args["recompute_modules"] == "[mlp core_attn]" and env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    source = read_run(path, gpus=8)
    # _run_training.sh strips the brackets and passes the words: two modules, not one named "[mlp core_attn]"
    assert (source.config.recompute.granularity, source.config.recompute.modules) == ("selective", ["core_attn", "mlp"])
    assert source.run == MegatronRun("h100", ":4096:8")
    assert source.origins["cublas_workspace_config"] == "model_config.yaml's environment"
    assert source.origins["recompute.modules"] == f"model_config.yaml:{lines['recompute_modules']} (--recompute-modules)"
    assert source.origins["parallel.data_parallel_size"] == "--gpus / (tp x pp x cp)"
    assert source.origins["model.hidden_dropout"] == "Megatron's default"


def test_a_command_line_gives_its_gpu_count_environment_and_lines(tmp_path):
    path = tmp_path / "train.sh"
    path.write_text("#!/bin/bash\nexport CUBLAS_WORKSPACE_CONFIG=:4096:2\n"
                    "torchrun --nproc_per_node=4 --nnodes 2 pretrain_gpt.py \\\n"
                    "    --num-layers 12 --hidden-size 512 --num-attention-heads 8 \\\n"
                    "    --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 2 \\\n"
                    "    --tensor-model-parallel-size 2 --bf16  # two ranks per layer\n")
    source = read_run(path)
    cfg = source.config
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.data_parallel_size) == (2, 4)  # 8 GPUs / tp 2
    assert cfg.training.global_batch_size == 8  # Megatron's default: micro-batch x data parallel
    assert source.run.cublas_workspace_config == ":4096:2"
    assert source.origins["model.num_layers"] == "train.sh:4 (--num-layers)"
    assert source.origins["parallel.data_parallel_size"] == "train.sh (its GPU count) / (tp x pp x cp)"
    assert source.origins["training.global_batch_size"] == "Megatron's default"


def test_a_megatron_log_reads_to_what_import_estimates():
    source = read_run(MEGATRON_LOG)  # its dump states world_size 8
    imported = run_config(formats.read(MEGATRON_LOG), workload=None, overrides={}, sets=[], gpu=None, world_size=None,
                          name="gpt-tp2-pp2")
    assert source.config == imported
    assert source.format == "megatron-lm" and source.config.parallel.data_parallel_size == 2


def test_a_bridge_log_takes_the_gpt_models_fields_from_a_preset():
    with pytest.raises(BadInput, match="pass --workload PRESET"):
        read_run(BRIDGE_LOG, gpus=32)
    source = read_run(BRIDGE_LOG, workload="llama3-70b", gpus=32)
    imported = run_config(formats.read(BRIDGE_LOG), workload="llama3-70b", overrides={"parallel.data_parallel_size": 2},
                          sets=[], gpu=None, world_size=None, name="Golden")
    assert source.config == imported
    assert source.origins["model.vocab_size"].startswith("Golden.log:")  # "Using preset vocab_size: 128256 ..."
    assert source.origins["model.rotary_base"] == "the preset (--workload)"


BRIDGE_FLAT = """\
_target_: megatron.bridge.training.config.ConfigContainer
comm_overlap:
  _target_: megatron.bridge.training.comm_overlap.CommOverlapConfig
  data_parallel_size: 4
  tp_comm_overlap: false
ddp:
  grad_reduce_in_fp32: true
  use_distributed_optimizer: true
env_vars:
  CUBLAS_WORKSPACE_CONFIG: ":4096:8"
mixed_precision: bf16_mixed
model:
  _target_: megatron.bridge.models.llama.llama_provider.Llama3ModelProvider8B
  activation_func:
    _call_: false
    _target_: torch.nn.functional.silu
  attention_backend:
    _args_: [5]
    _call_: true
    _name_: flash
    _target_: megatron.core.transformer.enums.AttnBackend
  ffn_hidden_size: 14336
  gated_linear_unit: true
  hidden_size: 4096
  num_attention_heads: 32
  num_layers: 32
  num_query_groups: 8
  pipeline_model_parallel_size: 1
  position_embedding_type: rope
  recompute_granularity: selective
  recompute_modules: [core_attn, layernorm]
  seq_length: 8192
  share_embeddings_and_output_weights: false
  tensor_model_parallel_size: 2
  vocab_size: 128256
train:
  global_batch_size: 64
  micro_batch_size: 1
"""


def test_a_flat_bridge_config_with_a_recipe_name_and_its_data_parallel_size(tmp_path):
    path = tmp_path / "run_config.yaml"
    path.write_text(BRIDGE_FLAT)
    source = read_run(path)
    cfg = source.config
    assert source.format == "bridge-config" and cfg.parallel.data_parallel_size == 4  # set by the run: 8 GPUs
    assert cfg.training.precision == "bf16"  # bf16_mixed, copied onto the model at setup
    assert (cfg.model.activation, cfg.model.attention_backend) == ("swiglu", "flash")
    assert (cfg.recompute.granularity, cfg.recompute.modules) == ("selective", ["core_attn", "layernorm"])
    assert source.run.cublas_workspace_config == ":4096:8"
    assert source.origins["model.activation"] == "run_config.yaml:23 (model.gated_linear_unit: true)"
    # the recipes' string form of a list reads the same in Bridge's YAML
    path.write_text(BRIDGE_FLAT.replace("[core_attn, layernorm]", '"[layernorm core_attn]"'))
    assert read_run(path).config.recompute.modules == ["core_attn", "layernorm"]


# ----- flags beside --from -------------------------------------------------------------------------

def test_flags_beside_from_override_it_and_are_echoed():
    result = invoke("estimate", "--from", str(MODEL_CONFIG), "--gpus", "8", "--micro-batch-size", "2",
                    "--set", "model.hidden_dropout=0.0", "--json")
    assert result.exit_code == 0, result.output
    assert ("override: beside --from model_config.yaml: --set model.hidden_dropout 0.0 (the file: 0.1), "
            "--micro-batch-size 2 (the file: 4)") in result.stderr
    report = json.loads(result.stdout)
    assert report["config"]["training"]["micro_batch_size"] == 2 and report["config"]["model"]["hidden_dropout"] == 0.0
    assert report["source"]["origins"]["training.micro_batch_size"] == "--micro-batch-size"
    assert report["source"]["origins"]["model.num_layers"] == "model_config.yaml:7 (--num-layers)"
    direct = config_from_megatron({**{"--" + k: v for k, v in read_model_config_file(MODEL_CONFIG)[0].items()},
                                   "--micro-batch-size": 2, "--hidden-dropout": 0.0}, world_size=8)
    assert report["stages"][0]["peak_allocated_bytes"] == \
        stage_peak(direct, 0, MegatronRun("h100", ":4096:8")).peak_allocated_bytes
    # the recompute flags replace the file's recompute setting as a whole
    result = invoke("estimate", "--from", str(MODEL_CONFIG), "--gpus", "8", "--recompute-modules", "core_attn", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["recompute"]["granularity"] == "selective"
    assert "--recompute-granularity selective (the file: full)" in result.stderr


def test_a_flag_for_the_field_a_refused_argument_sets_replaces_it(tmp_path):
    path = tmp_path / "model_config.yaml"
    path.write_text(MODEL_CONFIG.read_text().replace("  --bf16: true\n", "  --fp16: true\n  --fp8-format: hybrid\n"))
    assert "--fp8-format hybrid (line 54): FP8 is modelled on bf16 runs" in \
        _one_error_line(invoke("estimate", "--from", str(path), "--gpus", "8"))
    result = invoke("estimate", "--from", str(path), "--gpus", "8", "--precision", "bf16", "--json")
    assert result.exit_code == 0, result.output
    assert "override: beside --from model_config.yaml: --precision bf16 (the file: fp16)" in result.stderr
    assert json.loads(result.stdout)["config"]["training"]["precision"] == "bf16"


def test_a_stated_gpu_count_is_overridden_and_echoed():
    result = invoke("estimate", "--from", str(MEGATRON_LOG), "--gpus", "16", "--json")
    assert result.exit_code == 0, result.output
    assert "--gpus 16 (the file: 8)" in result.stderr
    assert json.loads(result.stdout)["config"]["parallel"]["data_parallel_size"] == 4


# ----- bad input: one line, exit 2 ------------------------------------------------------------------

def test_a_file_in_no_known_format(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello\n")
    assert f"{path}: is in no known format" in _one_error_line(invoke("estimate", "--from", str(path)))


def test_a_file_that_states_no_gpu_count():
    line = _one_error_line(invoke("estimate", "--from", str(MODEL_CONFIG)))
    assert line == f"error: {MODEL_CONFIG}: states no GPU count; pass --gpus N (the run's world size), or --dp N"


def test_an_argument_it_cannot_express(tmp_path):
    path = tmp_path / "model_config.yaml"
    path.write_text(MODEL_CONFIG.read_text().replace("  --bf16: true\n", "  --bf16: true\n  --optimizer: sgd\n"))
    line = _one_error_line(invoke("estimate", "--from", str(path), "--gpus", "8"))
    assert line == (f"error: {path}: the estimate cannot express setting of this run: --optimizer sgd (line 54): "
                    "optimizers other than Adam are not modelled; remove them from the run, or give a flag for the "
                    "field one sets beside --from, to estimate the rest")


def test_a_missing_file(tmp_path):
    path = tmp_path / "absent.yaml"
    assert _one_error_line(invoke("estimate", "--from", str(path))).startswith(f"error: {path}: does not exist;")


def test_a_yaml_that_is_not_a_config_container(tmp_path):
    path = tmp_path / "hydra.yaml"
    path.write_text("trainer:\n  devices: 8\nmodel:\n  num_layers: 4\n")
    line = _one_error_line(invoke("estimate", "--from", str(path), "--gpus", "8"))
    assert f"{path}: is YAML but neither Megatron Bridge's ConfigContainer" in line


def test_a_shell_variable_in_an_argument_the_estimate_reads(tmp_path):
    path = tmp_path / "train.sh"
    path.write_text("torchrun --nproc-per-node 2 pretrain_gpt.py --num-layers 4 --hidden-size 256 \\\n"
                    "  --num-attention-heads 4 --seq-length 128 --tensor-model-parallel-size ${TP} --bf16\n")
    assert _one_error_line(invoke("estimate", "--from", str(path))) == \
        (f"error: {path}:2: --tensor-model-parallel-size is ${{TP}}, a shell variable the file does not set; "
         "write its value there")


@pytest.mark.parametrize("args,words", [
    (["--gpus", "8"], "--gpus goes with --from"),
    (["--from", str(MODEL_CONFIG), "--gpus", "6", "--tp", "4"], "6 GPUs are not a positive multiple"),
    (["--from", str(MODEL_CONFIG), "--gpus", "8", "--framework", "recompute-bench"], "drop --framework"),
    (["--from", str(MODEL_CONFIG), "--gpus", "8", "-w", "tiny"], "drop --workload"),
    (["--from", str(MODEL_CONFIG), "--gpus", "8", "--gpu", "v99"], "unknown GPU kind 'v99'"),
])
def test_other_bad_input_beside_from(args, words):
    assert words in _one_error_line(invoke("estimate", *args))


# ----- the first iteration and the terms ------------------------------------------------------------

def test_the_first_iteration_peaks_before_the_adam_moments_exist():
    cfg = config_from_megatron({"--" + k: v for k, v in read_model_config_file(MODEL_CONFIG)[0].items()}, world_size=8)
    peak = stage_peak(cfg, 0, MegatronRun("h100"))
    # the loss's forward is the peak either way; iteration 1 runs it without exp_avg and exp_avg_sq
    assert peak.peak_allocated_bytes - peak.first_iteration_peak_allocated_bytes == peak.items["Adam moments"]
    assert peak.items["Adam moments"] == 2 * FP32_BYTES * peak.parameters
    # with little activation per rank the first step, which creates the moments, is iteration 1's peak
    small = config_from_megatron({"--num-layers": 4, "--hidden-size": 1024, "--num-attention-heads": 8,
                                  "--seq-length": 64, "--micro-batch-size": 1, "--bf16": True}, world_size=1)
    peak = stage_peak(small, 0, MegatronRun("h100"))
    assert peak.first_iteration_phase.startswith("the optimizer step")
    assert peak.first_iteration_peak_allocated_bytes == peak.static_bytes


def test_import_compares_a_line_after_iteration_1_with_the_first_iterations_peak(tmp_path):
    text = BRIDGE_LOG.read_text().splitlines()
    first_only = tmp_path / "first.log"
    first_only.write_text("\n".join(line for line in text if "(after 2 iterations)" not in line) + "\n")
    records = {}
    for path in (BRIDGE_LOG, first_only):
        run = formats.read(path)
        cfg = run_config(run, workload="llama3-70b", overrides={"parallel.data_parallel_size": 2}, sets=[], gpu=None,
                         world_size=None, name=None)
        records[path] = import_record(run, cfg, device_name="NVIDIA H100 80GB HBM3")
    peaks = stage_peaks(cfg, MegatronRun("h100"))
    steady, first = records[BRIDGE_LOG]["ranks"][0], records[first_only]["ranks"][0]
    assert (steady["after_step"], steady["estimate_describes"]) == (2, STEADY)
    assert (first["after_step"], first["estimate_describes"]) == (1, FIRST_ITERATION)
    assert steady["estimated_peak_allocated_bytes"] == peaks[0].peak_allocated_bytes
    assert first["estimated_peak_allocated_bytes"] == peaks[0].first_iteration_peak_allocated_bytes
    assert first["estimated_peak_allocated_bytes"] < steady["estimated_peak_allocated_bytes"]
    assert records[first_only]["metrics"]["estimated_peak_allocated_bytes"] == \
        max(p.first_iteration_peak_allocated_bytes for p in peaks)


@pytest.mark.parametrize("flags", [
    {},
    {"--recompute-granularity": "selective", "--recompute-modules": ["core_attn", "mlp"]},
    {"--recompute-granularity": "full", "--recompute-method": "block", "--recompute-num-layers": 2},
    {"--fp16": True, "--bf16": False, "--hidden-dropout": 0.1},
    {"--transformer-impl": "local"},
])
def test_every_stages_terms_add_up_to_its_peak(flags):
    args = {"--num-layers": 16, "--hidden-size": 1024, "--num-attention-heads": 16, "--seq-length": 2048,
            "--micro-batch-size": 1, "--global-batch-size": 32, "--tensor-model-parallel-size": 2,
            "--pipeline-model-parallel-size": 4, "--num-layers-per-virtual-pipeline-stage": 2,
            "--sequence-parallel": True, "--use-distributed-optimizer": True, "--bf16": True, **flags}
    cfg = config_from_megatron({k: v for k, v in args.items() if v is not False}, world_size=16)
    run = MegatronRun("h100")
    for peak in stage_peaks(cfg, run):
        terms = stage_terms(cfg, peak)
        assert sum(t["bytes"] for t in terms) == pytest.approx(peak.peak_allocated_bytes, rel=1e-12)
        assert len({t["term"] for t in terms}) == len(terms) and all(t["megatron"] and t["knobs"] for t in terms)


@pytest.mark.parametrize("workload, overrides", [
    ("tiny-mla", {}),  # stage 0 a dense layer, stage 1 a MoE layer
    ("tiny", {"parallel__decoder_first_pipeline_num_layers": 1}),  # 1 layer on stage 0, 3 on stage 1
    ("tiny", {"model__mtp_num_layers": 1}),  # the last stage's chunk also holds the MTP layer
])
def test_a_stages_terms_are_its_own_chunks_and_add_up_to_its_peak(workload, overrides):
    """The saved-tensor terms are those of the model chunks the stage holds at its peak (their
    first layer, their layers' kinds, their multi-token-prediction layers), not a chunk from
    layer 0: every stage's terms add up to its peak."""
    cfg = config(workload, training__framework="megatron", parallel__pipeline_model_parallel_size=2, **overrides)
    run = MegatronRun("h100")
    for peak in stage_peaks(cfg, run):
        terms = stage_terms(cfg, peak)
        assert sum(t["bytes"] for t in terms) == pytest.approx(peak.peak_allocated_bytes, rel=1e-12), peak.stage


def test_the_terms_name_what_allocates_them_and_the_layers_they_hold():
    result = invoke("estimate", "--from", str(MEGATRON_LOG), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    first, last = report["stages"]
    names = {t["term"]: t for t in first["terms"]}
    assert names["weights"]["megatron"].startswith("the modules' parameters") or \
        names["weights"]["megatron"].startswith("DDP param buffer")
    assert "exp_avg" in names["Adam moments"]["megatron"]
    # selective core_attn on a TE layer: the layer's saved tensors, each over every layer held at the peak
    layer_terms = [t for t in first["terms"] if t.get("layers")]
    assert layer_terms and all(t["layers"] == layer_terms[0]["layers"] for t in layer_terms)
    assert "cross-entropy's saved softmax" in {t["term"] for t in last["terms"]}
    assert "cross-entropy's saved softmax" not in names
    assert "each stage's peak, term by term" in result.stderr
    assert dataclasses.asdict(MegatronRun("h100"))["gpu"] == report["gpu"]


def test_estimate_from_a_log_sets_each_memory_line_beside_what_it_reports():
    """A Bridge log prints every data-parallel-rank-0 rank's memory after iterations 1 and 2:
    `estimate --from` it keeps every line and sets each beside its stage's peak as of that iteration
    (`peak_after`: iteration 1's without the Adam moments, then the most so far)."""
    parsed = formats.read(BRIDGE_LOG)
    assert len(parsed.memory_lines) == 32 and {m.after_step for m in parsed.memory_lines} == {1, 2}
    assert parsed.ranks[0] is parsed.memory_lines[16]  # the rank's last line
    result = invoke("estimate", "--from", str(BRIDGE_LOG), "-w", "llama3-70b", "--gpus", "32", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    lines = report["logged_memory"]
    assert [(x["rank"], x["after_iteration"]) for x in lines] == [(m.rank, m.after_step) for m in parsed.memory_lines]
    source = read_run(BRIDGE_LOG, workload="llama3-70b", gpus=32)
    peaks = stage_peaks(source.config, source.run)
    for x in lines:
        peak = peaks[x["stage"]]
        assert x["stage"] == x["rank"] // 8
        assert x["estimated_peak_allocated_bytes"] == peak.peak_after(x["after_iteration"])
        assert x["peak_allocated_bytes"] == next(m.peak_allocated_bytes for m in parsed.memory_lines
                                                 if m.line == x["line"])
    first = next(x for x in lines if x["after_iteration"] == 1)
    assert first["estimate_describes"] == FIRST_ITERATION
    assert first["estimated_peak_allocated_bytes"] == peaks[first["stage"]].first_iteration_peak_allocated_bytes
    assert "the log's memory lines beside the estimate" in result.stderr
