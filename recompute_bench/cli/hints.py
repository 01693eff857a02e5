"""Commands printed for the user to run next: each runs as printed (every option that locates the
run, shell-quoted) and sits on a line of its own that rich never wraps, so it can be copied from
a CI log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.markup import escape

from recompute_bench.cli.common import err


def command_line(*words: Any) -> str:
    """Words as one shell command line, each quoted where the shell needs it."""
    import shlex
    return " ".join(shlex.quote(str(w)) for w in words)


def run_locator(results_dir: Path) -> list[str]:
    """The options that find a run id again besides the id: --results-dir unless it is the default."""
    return [] if Path(results_dir) == Path("results") else ["--results-dir", str(results_dir)]


def print_command(lead: str, command: str) -> None:
    """A hint and the command it names. The command has a line of its own that rich never wraps
    (a CI log is no terminal, and wrapping there splits the command), so it runs as printed."""
    err.print(escape(lead), highlight=False, soft_wrap=True)
    err.print(f"  {command}", highlight=False, soft_wrap=True, markup=False)


def update_command(results: str, golden_file: Path, selection: list[str] | None, results_dir: Path) -> str:
    words = ["recompute-bench", "golden", "update", results, "--golden", str(golden_file), *run_locator(results_dir)]
    for name in selection or []:
        words += ["--select", name]
    return command_line(*words)
