"""The declared floors are what the code needs and what it enforces: Python 3.11 (tomllib), torch
2.9 (`launch.devices.TORCH_FLOOR`), the same in pyproject.toml, the README and the check that
`run`, `sweep` and `verify` make before anything starts."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

from helpers import invoke
from recompute_bench.launch import devices

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_pyproject_declares_the_floors_the_code_enforces():
    floor = ".".join(map(str, devices.TORCH_FLOOR))
    torch_spec = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    assert torch_spec == f"torch>={floor},<3"
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"
    assert f"Python 3.11+ (`tomllib`), torch `>={floor},<3`" in " ".join((ROOT / "README.md").read_text().split())


def test_every_module_is_python_3_11_and_this_is_at_least_that():
    # The floor holds for syntax too: every module of the package parses as 3.11 source.
    assert sys.version_info >= (3, 11)
    for path in sorted((ROOT / "recompute_bench").rglob("*.py")):
        ast.parse(path.read_text(), filename=str(path), feature_version=(3, 11))


@pytest.mark.parametrize("command", [["run"], ["sweep", "--no-golden"], ["verify"]])
def test_a_torch_older_than_the_floor_is_one_line_exit_2(tmp_path, monkeypatch, command):
    monkeypatch.setattr(devices, "torch_build", lambda: ("2.8.0+cu128", "12.8"))
    monkeypatch.chdir(tmp_path)
    result = invoke(*command, "--results" if command[0] == "run" else "--results-dir", str(tmp_path / "out"))\
        if command[0] != "verify" else invoke(*command)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert " ".join(result.stderr.split()) == ("error: torch 2.8.0+cu128 is older than 2.9, the oldest this harness "
                                               "measures with (its pipeline schedules and FSDP2); pip install "
                                               "'torch>=2.9,<3'")
    assert list(tmp_path.iterdir()) == []  # nothing written, in the results folder or beside it
    monkeypatch.setattr(devices, "torch_build", lambda: ("2.9.0", None))
    devices.check_torch()  # the floor itself passes
