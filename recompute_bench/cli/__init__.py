"""The `recompute-bench` command line.

Importing this package imports nothing heavy: the entry points import the Typer app (typer, rich,
every command) inside a guard, so Ctrl-C while Python is still importing ends as any interrupted
command does, with one line and exit code 130, not a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import sys

INTERRUPTED_EXIT = 130
"""Exit code of a command stopped by Ctrl-C (128 + SIGINT, as shells report it)."""


def _app():
    """The `recompute_bench.cli.app` module, imported now."""
    try:
        from recompute_bench.cli import app
    except KeyboardInterrupt:
        sys.stderr.write("interrupted while starting; nothing was run\n")
        raise SystemExit(INTERRUPTED_EXIT) from None
    return app


def main(argv: list[str] | None = None) -> None:
    """Entry point of `recompute-bench`."""
    _app().main(argv)


def run_performance_workload(argv: list[str] | None = None) -> None:
    """Entry point of `run_performance_workload`: Megatron Bridge's spelling of `recompute-bench run`."""
    _app().run_performance_workload(argv)


__all__ = ["main", "run_performance_workload"]
