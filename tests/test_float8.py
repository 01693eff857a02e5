"""`--precision fp8`: torchao's float8 training in the harness (`measure.float8`), run for real on the
CPU (torch's `_scaled_mm` has CPU kernels in torch 2.13): the loss beside bf16's, what each recompute
setting saves (measured, against the estimate), the record and the golden key, and the refusals."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers import SETTINGS, invoke, saved_step
from recompute_bench.analysis.harness.stage import activation_bytes
from recompute_bench.cli.run import check_runnable
from recompute_bench.config.schema import BadInput
from recompute_bench.gate.verdicts import row_key
from recompute_bench.measure import float8
from recompute_bench.measure.layout import SingleRank
from recompute_bench.results.rows import KEY_COLUMNS
from recompute_bench.workload import resolve

NO_TORCHAO = importlib.util.find_spec("torchao") is None
needs_torchao = pytest.mark.skipif(NO_TORCHAO, reason="torchao not importable (pip install 'recompute-bench[fp8]')")

# A llama-shaped model whose every linear dimension and token count is a multiple of 16; no dropout.
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
         "model.ffn_hidden_size=128", "model.vocab_size=256", "training.seq_length=32", "training.global_batch_size=1",
         "model.max_position_embeddings=64", "model.hidden_dropout=0", "model.attention_dropout=0"]


def _step(sets: list[str], precision: str, recipe: str = "tensorwise", device: str = "cpu"):
    """(loss, measured saved bytes, estimated saved bytes, gradients, model) of one micro-batch."""
    fp8 = [f"training.fp8_recipe={recipe}"] if precision == "fp8" else []
    cfg, _ = resolve("llama3-8b", sets=[*SMALL, *sets, f"training.precision={precision}", *fp8], gpu="cpu")
    if device == "cpu":
        torch.set_num_threads(1)  # oneDNN's FP8 GEMMs on a shared 2-core machine: one thread is the fast way
    loss, saved, grads, model = saved_step(cfg, device)
    return loss, saved, activation_bytes(cfg, device)["activation_bytes"], grads, model


@needs_torchao
def test_fp8_runs_every_recompute_setting_saving_what_bf16_saves_as_the_estimate_says():
    """torchao's Float8Linear saves its bf16 input and the weight (a parameter), never an FP8 copy:
    each setting saves exactly the bytes of the bf16 model, which the estimate gives; the loss is
    bf16's within FP8's rounding, and every gradient is finite and non-zero."""
    threads = torch.get_num_threads()
    try:
        for name, sets in SETTINGS.items():
            loss16, saved16, _, _, _ = _step(sets, "bf16")
            loss8, saved8, estimate, grads, model = _step(sets, "fp8")
            assert saved8 == estimate == saved16, name
            assert loss8 == pytest.approx(loss16, rel=0.02), name
            assert loss8 != loss16  # the matmuls really ran in FP8
            for key, g in grads.items():
                assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, (name, key)
            assert float8.float8_linears(model) == 4 * 2
            assert type(model.output_layer).__name__ != "Float8Linear"  # the output layer stays bf16
        loss_row, saved_row, estimate_row, _, _ = _step([], "fp8", "rowwise")
        assert saved_row == estimate_row and loss_row == pytest.approx(_step([], "bf16")[0], rel=0.02)
    finally:
        torch.set_num_threads(threads)


@needs_torchao
def test_the_record_names_torchao_and_the_recipe_and_the_recipe_is_a_golden_key_column():
    cfg, _ = resolve("llama3-8b", sets=[*SMALL, "training.precision=fp8", "training.fp8_recipe=rowwise"], gpu="cpu")
    model = SingleRank().build(cfg, torch.device("cpu"))
    env = float8.float8_env(model, cfg.training.fp8_recipe)
    assert env["float8"].startswith("torchao ") and env["float8"].endswith(" rowwise, 8 linears")
    cfg, _ = resolve("llama3-8b", sets=SMALL, gpu="cpu")
    assert float8.float8_env(SingleRank().build(cfg, torch.device("cpu")), "delayed") == {}
    assert "fp8_recipe" in KEY_COLUMNS
    row = {c: "x" for c in KEY_COLUMNS}
    assert row_key({**row, "fp8_recipe": "tensorwise"}) != row_key({**row, "fp8_recipe": "rowwise"})


FP8 = ["--precision", "fp8", "--fp8-recipe", "tensorwise"]
REFUSED = [
    (["--precision", "fp8", "--fp8-recipe", "blockwise"], "not blockwise (Transformer Engine's)"),
    ([*FP8, "--tp", "2", "--nproc-per-node", "2"], "not with tensor_model_parallel_size 2"),
    ([*FP8, "--pp", "2", "--nproc-per-node", "2"], "not with pipeline_model_parallel_size 2"),
    ([*FP8, "-w", "tiny-moe"], "mixture-of-experts and multi-latent attention are not measured in FP8"),
    ([*FP8, "--set", "model.hidden_size=72", "--set", "model.num_attention_heads=4"], "hidden_size 72"),
    ([*FP8, "--set", "training.fp8_format=e4m3"], "training.fp8_format is Transformer Engine's"),
    (["--fp8-recipe", "rowwise"], "--fp8-recipe rowwise applies to FP8 runs only"),
]


@pytest.mark.parametrize("argv,words", REFUSED, ids=[r[1][:30] for r in REFUSED])
def test_fp8_where_the_harness_cannot_run_it_is_one_line_exit_2(argv, words, tmp_path):
    result = invoke("run", "--results", str(tmp_path / "r.jsonl"), *argv)
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "r.jsonl").exists()


def test_megatrons_estimate_refuses_torchaos_rowwise_recipe():
    result = invoke("estimate", "--framework", "megatron", "--transformer-impl", "transformer_engine", *FP8[:2],
                    "--fp8-recipe", "rowwise")
    assert result.exit_code == 2 and "rowwise is torchao's recipe" in result.stderr


def test_without_torchao_or_fp8_tensor_cores_fp8_is_refused_before_anything_runs(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(float8.importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    result = invoke("run", "--results", str(tmp_path / "r.jsonl"), *FP8)
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "torchao is not importable; pip install 'recompute-bench[fp8]'" in result.stderr
    monkeypatch.undo()
    # An A100 (8.0) has no FP8 tensor cores; an L4/L40 (8.9) and an H100 (9.0) do. NVML answers at launch.
    assert "compute capability 8.9 or later) and this GPU has 8.0" in float8.float8_problem("cuda", (8, 0))
    assert float8.float8_problem("cuda", (8, 9)) is None or NO_TORCHAO
    assert float8.float8_problem("cuda", (9, 0)) is None or NO_TORCHAO
    import recompute_bench.launch.devices as devices
    monkeypatch.setattr(devices, "default_device_type", lambda: "cuda")
    monkeypatch.setattr(devices, "visible_gpu_capability", lambda index=0: (8, 0) if index == 0 else (9, 0))
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 2)
    cfg, _ = resolve("llama3-8b", sets=[*SMALL, "training.precision=fp8", "training.fp8_recipe=tensorwise"], gpu="cpu")
    with pytest.raises(BadInput, match="this GPU has 8.0"):
        check_runnable(cfg, None)
    if not NO_TORCHAO:
        check_runnable(cfg, "cuda:1")  # the second GPU (9.0) runs it: no refusal


@needs_torchao
@pytest.mark.slow
def test_fp8_under_ddp_saves_what_bf16_saves_on_each_rank(tmp_path):
    """Two gloo ranks: DDP wraps the FP8 model as it wraps the bf16 one; each saves the same bytes."""
    import json

    base = ["run", "-w", "llama3-8b", "--nproc-per-node", "2", "--global-batch-size", "2", "--seq-length", "32",
            "--json", *[a for s in SMALL + ["training.warmup_steps=0", "training.measured_steps=1"]
                        for a in ("--set", s) if not s.startswith(("training.seq_length", "training.global_batch"))]]
    records = {}
    for name, extra in (("bf16", []), ("fp8", FP8)):
        result = invoke(*base, "--results", str(tmp_path / f"{name}.jsonl"), *extra)
        assert result.exit_code == 0, result.output
        records[name] = json.loads(result.stdout)
    assert records["fp8"]["status"] == "ok" and records["fp8"]["env"]["float8"].endswith("tensorwise, 8 linears")
    assert records["fp8"]["metrics"]["activation_bytes"] == records["bf16"]["metrics"]["activation_bytes"]
    assert records["fp8"]["metrics"]["loss"] == pytest.approx(records["bf16"]["metrics"]["loss"], rel=0.02)
