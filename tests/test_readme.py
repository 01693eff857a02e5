"""Every `recompute-bench` command the README prints runs as printed, and the output it shows under
each command is what the command prints now (the table cells of its excerpt)."""

import re
import shlex
from pathlib import Path

import pytest

from helpers import invoke

README = Path(__file__).resolve().parents[1] / "README.md"
# Cells whose value depends on the machine or the terminal's width, not on the program.
ELIDED = {"...", ""}


def tour() -> list[tuple[str, list[str]]]:
    """(command, cells of the output block printed right after it) for each `recompute-bench` line
    inside the README's code blocks; `make ...` lines are not commands of the CLI."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", README.read_text(), re.M | re.S)
    found = []
    for i, block in enumerate(blocks):
        for line in block.splitlines():
            if line.startswith("recompute-bench "):
                after = blocks[i + 1] if i + 1 < len(blocks) else ""
                cells = [c.strip() for row in after.splitlines() if row.startswith(("│", "┃"))
                         for c in re.split(r"[│┃]", row)]
                found.append((line, [c for c in cells if c not in ELIDED]))
    return found


def test_the_readme_has_a_six_command_tour():
    assert len(tour()) == 6


def cases() -> list:
    """The tour as test cases; `run` measures eight steps (17 to 52 s on the loaded 2-core machine),
    so it is left to the full suite."""
    return [pytest.param(c, cells, id=c.split()[1], marks=[pytest.mark.slow] if c.split()[1] == "run" else [])
            for c, cells in tour()]


@pytest.mark.parametrize("command,cells", cases())
def test_each_readme_command_runs_as_printed_and_prints_its_excerpt(command, cells, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what a command writes (results/plans/...) lands here
    argv = shlex.split(command)[1:]
    result = invoke(*argv)
    assert result.exit_code == 0, f"{command}\n{result.output}"
    printed = " ".join(result.output.split())
    missing = [c for c in cells if " ".join(c.split()) not in printed]
    assert not missing, f"{command}: the README shows cells this command no longer prints: {missing}"
