"""`--transformer-impl transformer_engine` in the harness (`backends/transformer_engine.py`): the
one-line refusal where TE cannot run, and how Megatron's TE layer takes each recompute setting (pure Python, read from
Megatron-LM). The layers built from TE's modules: tests/test_te_layers.py (a stand-in of TE on the CPU) and
tests/gpu/test_transformer_engine_cuda.py (TE itself)."""

from __future__ import annotations

import sys

import pytest

import te_standin
from helpers import invoke
from recompute_bench.backends import transformer_engine as te_backend
from recompute_bench.backends.transformer_engine import TE_MODULES, te_recompute


@pytest.mark.parametrize("case", ["absent", "broken", "no-cuda"])
def test_the_te_layers_are_refused_in_one_line_where_te_cannot_run(case, monkeypatch, tmp_path):
    real = te_backend.importlib.util.find_spec
    monkeypatch.setattr(te_backend.importlib.util, "find_spec",
                        lambda name, *a: (None if case == "absent" else object()) if name == "transformer_engine"
                        else real(name, *a))
    if case == "broken":  # installed, but its import fails (a torch or CUDA mismatch)
        monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    elif case == "no-cuda":
        te_standin.install(monkeypatch)
    monkeypatch.setattr(te_backend, "cuda_present", lambda: False)
    result = invoke("run", "--results", str(tmp_path / "r.jsonl"), "--transformer-impl", "transformer_engine")
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in result.output
    expected = {"absent": "transformer_engine is not importable; pip install",
                "broken": "transformer_engine.pytorch does not import (ModuleNotFoundError",
                "no-cuda": "torch sees no CUDA device here"}[case]
    assert expected in err and "drop --transformer-impl" in err
    assert not (tmp_path / "r.jsonl").exists()


def test_megatrons_te_layer_fuses_both_norms_so_layernorm_recompute_does_nothing():
    assert TE_MODULES["linear_qkv"][1] == TE_MODULES["linear_fc1"][1] == "LayerNormLinear"
    plan = te_recompute("selective", ["layernorm"], "bf16")
    assert plan.checkpointed == () and plan.no_effect == ("layernorm",) and plan.checkpoint == "none"


@pytest.mark.parametrize("granularity,modules,precision,checkpointed,how", [
    ("none", [], "bf16", (), "none"),
    ("selective", ["core_attn"], "fp8", ("core_attn",), "tensor_parallel.checkpoint"),  # attention.py: always Megatron's
    ("selective", ["mlp"], "bf16", ("mlp",), "tensor_parallel.checkpoint"),
    ("selective", ["mlp"], "fp8", ("mlp",), "transformer_engine.pytorch.distributed.checkpoint"),  # te_checkpoint
    ("selective", ["core_attn", "mlp", "layernorm"], "fp8", ("core_attn", "mlp"),
     "transformer_engine.pytorch.distributed.checkpoint"),
    ("full", [], "fp8", ("layers",), "transformer_engine.pytorch.distributed.checkpoint"),
    ("full", [], "bf16", ("layers",), "tensor_parallel.checkpoint"),
])
def test_each_recompute_setting_lands_on_te_modules_as_megatron_applies_it(granularity, modules, precision,
                                                                          checkpointed, how):
    plan = te_recompute(granularity, modules, precision)
    assert plan.checkpointed == checkpointed and plan.checkpoint == how
