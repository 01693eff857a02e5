"""`--compile`: torch.compile per transformer layer (`measure.compile`), its rules, and what it keeps
of each recompute setting, measured on the CPU against the eager layers."""

from __future__ import annotations

import pytest
import torch

from helpers import SETTINGS, invoke, saved_step
from recompute_bench.config.fields import field
from recompute_bench.gate.verdicts import row_key
from recompute_bench.launch.compiler import compile_problem
from recompute_bench.measure.compile import compiled
from recompute_bench.measure.layout import SingleRank
from recompute_bench.results.rows import KEY_COLUMNS
from recompute_bench.workload import resolve

SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
         "model.ffn_hidden_size=128", "model.vocab_size=256", "training.seq_length=32", "training.global_batch_size=1",
         "model.max_position_embeddings=64", "training.precision=fp32"]


def _step(sets: list[str], compile_: bool, device: str = "cpu") -> tuple[float, int, dict[str, torch.Tensor]]:
    cfg, _ = resolve("llama3-8b", sets=[*SMALL, *sets, f"training.compile={str(compile_).lower()}"], gpu="cpu")
    return saved_step(cfg, device)[:3]


@pytest.mark.slow
@pytest.mark.skipif(compile_problem("cpu") is not None, reason=str(compile_problem("cpu")))
def test_every_recompute_setting_applies_inside_and_around_the_compiled_layers():
    """Same loss and gradients as the eager layers (to fp32 rounding: inductor fuses), and each
    setting's saving: mlp and full recompute save what the eager layers save; with nothing or core
    attention recomputed inductor's partitioner recomputes the norms' outputs on its own (saves
    less), and core_attn and layernorm still save what they save eagerly below that."""
    eager = {name: _step(sets, False) for name, sets in SETTINGS.items()}
    comp = {name: _step(sets, True) for name, sets in SETTINGS.items()}
    for name in SETTINGS:
        assert comp[name][0] == pytest.approx(eager[name][0], rel=1e-5)
        for key, g in eager[name][2].items():
            torch.testing.assert_close(comp[name][2][key], g, rtol=1e-4, atol=1e-6)
    for name in ("mlp", "full"):
        assert comp[name][1] == eager[name][1]
    assert comp["none"][1] < eager["none"][1]
    for name in ("core_attn", "layernorm"):
        assert comp["none"][1] - comp[name][1] == eager["none"][1] - eager[name][1] > 0


def test_compile_is_a_key_column_and_the_record_says_what_compiled():
    assert "compile" in KEY_COLUMNS and field("compile").option == "--compile"
    row = {c: "x" for c in KEY_COLUMNS}
    assert row_key({**row, "compile": "True"}) != row_key({**row, "compile": "False"})
    cfg, _ = resolve("tiny", sets=["training.compile=true"], gpu="cpu")
    model = SingleRank().build(cfg, torch.device("cpu"))  # compiled lazily: nothing is built before a call
    assert compiled(model) == {"compile": "inductor"}
    cfg, _ = resolve("tiny", gpu="cpu")
    assert compiled(SingleRank().build(cfg, torch.device("cpu"))) == {}


@pytest.mark.parametrize("argv,words", [
    (["--compile", "--tp", "2", "--nproc-per-node", "2"], "tensor_model_parallel_size 2"),
    (["--compile", "--activation-offload-layers", "1"], "activation offload"),
])
def test_compile_where_it_is_not_measured_is_one_line_exit_2(argv, words, tmp_path):
    result = invoke("run", "--results", str(tmp_path / "r.jsonl"), *argv)
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and words in err and "--compile" in err
    assert not (tmp_path / "r.jsonl").exists()


def test_compile_without_a_compiler_is_one_line_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    assert "no-such-c++" in compile_problem("cpu")
    result = invoke("run", "--results", str(tmp_path / "r.jsonl"), "--device", "cpu", "--compile")
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and "drop --compile" in err and "C++" in err


def test_verify_and_megatron_refuse_compile():
    result = invoke("verify", "--compile")
    assert result.exit_code == 2 and "drop --compile" in result.stderr
    result = invoke("estimate", "--compile", "--framework", "megatron", "-w", "llama3-8b")
    assert result.exit_code == 2 and "--compile" in result.stderr and len(result.stderr.strip().splitlines()) == 1
