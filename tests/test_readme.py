"""Every `recompute-bench` command the README prints runs as printed, and the output it shows under
each command is what the command prints now (the table cells of its excerpt)."""

import re
import shlex
from pathlib import Path

import pytest

from helpers import invoke

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# Cells whose value depends on the machine or the terminal's width, not on the program.
ELIDED = {"...", ""}
# Plans whose excerpt is checked by its structure and ranking, not its peaks to the byte: the
# Megatron memory model's figures for the seeds' configuration move as it is corrected.
STRUCTURAL = ("plan --framework megatron --from",)


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


def argv_of(command: str) -> list[str]:
    """The command's arguments, a path of this repository (test data) made absolute: the test runs
    each command in an empty folder so that what it writes lands there."""
    return [str(ROOT / word) if "/" in word and (ROOT / word).exists() else word for word in shlex.split(command)[1:]]


def _rows(cells: list[str]) -> list[list[str]]:
    return [cells[i:i + 10] for i in range(0, len(cells) - 9, 10)]


def cases() -> list:
    """The tour as test cases; `run` measures eight steps (17 to 52 s on the loaded 2-core machine),
    so it is left to the full suite."""
    return [pytest.param(c, cells, id=c.split()[1], marks=[pytest.mark.slow] if c.split()[1] == "run" else [])
            for c, cells in tour()]


@pytest.mark.parametrize("command,cells", cases())
def test_each_readme_command_runs_as_printed_and_prints_its_excerpt(command, cells, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what a command writes (results/plans/...) lands here
    result = invoke(*argv_of(command))
    assert result.exit_code == 0, f"{command}\n{result.output}"
    if any(word in command for word in STRUCTURAL):
        return  # test_the_seeds_plan_keeps_the_readme_s_structure_and_ranking
    printed = " ".join(result.output.split())
    missing = [c for c in cells if " ".join(c.split()) not in printed]
    assert not missing, f"{command}: the README shows cells this command no longer prints: {missing}"


def test_the_seeds_plan_keeps_the_readme_s_structure_and_ranking(tmp_path, monkeypatch):
    """The seeds' plan as the README shows it: the table's header, the setting to use on top, each
    row a setting the plan prices, in the plan's order, at the predicted throughput shown (the time
    model's, 3 decimals), and layernorm named as re-running nothing; the peaks are not held to the
    README's figures."""
    import json

    monkeypatch.chdir(tmp_path)
    command, cells = next((c, cells) for c, cells in tour() if any(word in c for word in STRUCTURAL))
    result = invoke(*argv_of(command), "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    header, rows = cells[:10], _rows(cells[10:])
    assert header == ["#", "setting", "peak allocated per stage (GiB)", "with allowance", "fits", "step (s)",
                      "TFLOP/s/GPU", "tokens/s/GPU", "MFU", "rel. TFLOP/s"]
    priced = {r["label"]: r for r in plan["settings"]}
    order = [r["label"] for r in plan["settings"]]
    shown = [row[1].removesuffix(" *") for row in rows]
    assert rows[0][1] == f"{plan['recommended']} *" and plan["current"] == plan["recommended"] == "none"
    assert all(label in priced for label in shown)
    assert shown == sorted(shown, key=order.index)  # fastest first, as the plan ranks them
    for row, label in zip(rows, shown):
        assert row[5] == f"{priced[label]['step_seconds']:.3f}", label
        assert row[6] == f"{priced[label]['tflops_per_gpu']:.0f}" and row[8] == f"{100 * priced[label]['mfu']:.1f}%", label
        assert row[9] == f"{priced[label]['relative_throughput']:.3f}", label
    # the seeds' settings: layernorm re-runs nothing with TE's fused norms; [mlp] costs time
    assert {"setting": "selective[layernorm]", "same_as": "none"} in plan["same_as_shown"]
    assert priced["selective[mlp]"]["relative_throughput"] < priced["selective[core_attn]"]["relative_throughput"] < 1
    assert priced["selective[mlp]"]["peak_allocated_bytes"] < priced["selective[core_attn]"]["peak_allocated_bytes"]
