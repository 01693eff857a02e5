"""What every command shares: the stderr console, bad input as one line, notes, resolving a point."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from recompute_bench.cli.options import PointOptions
from recompute_bench.config.schema import Config, BadInput
from recompute_bench.config.presets import DEFAULT_WORKLOAD
from recompute_bench.workload import resolve

# People's output goes to stderr; stdout carries data (--json) only. Off a terminal the width is
# fixed, so CI logs do not wrap tables at 80 columns.
err = Console(stderr=True, width=None if sys.stderr.isatty() else 140)



def workload_flag(help: str, kind: type = str):
    """The --workload/-w option, declared once; `help` says what it is for in a command."""
    return Annotated[kind, typer.Option("--workload", "-w", help=help, rich_help_panel="Workload")]


def json_flag(what: str):
    """The --json flag, declared once: the command prints `what` as JSON on stdout."""
    return Annotated[bool, typer.Option("--json", help=f"Print {what} as JSON on stdout.", rich_help_panel="Output")]


Workload = workload_flag("Preset name (see `workloads`) or path to a .toml preset.")
ResultsDir = Annotated[Path, typer.Option(help="Folder holding run folders (results/<run-id>/) and golden/.",
                                          rich_help_panel="Output")]
ResultsArg = Annotated[str, typer.Argument(help="A run id (folder under --results-dir), a results folder or a JSONL file.",
                                           show_default=False)]
GoldenFile = Annotated[Optional[Path], typer.Option(help="Golden CSV; default: <results-dir>/golden/<device kind>.csv "
                                                    "(cpu.csv, h100.csv, ...).", rich_help_panel="Golden")]
Strict = Annotated[bool, typer.Option(help="Also fail on unexpected improvements, now-fits and new rows (goldens stay honest).",
                                      rich_help_panel="Golden")]
PolicyFile = Annotated[Optional[Path], typer.Option("--policy", help="A per-layer recompute policy file (written by "
                                                   "`plan --auto`) instead of the recompute flags.",
                                                   rich_help_panel="Recompute")]
JsonOut = json_flag("the result")

__all__ = ["DEFAULT_WORKLOAD", "err", "fail", "show_notes", "resolve_point", "this_gpu", "hardware_kind", "records_kind"]


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one line naming the problem and the fix; the caller raises what this returns."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def show_notes(notes: list[str]) -> None:
    for note in notes:
        err.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)


def this_gpu() -> str:
    """This machine's GPU kind (h100, ...) or "cpu", read through NVML: the CLI process holds no
    CUDA context while its workers measure."""
    from recompute_bench.launch.devices import visible_gpu_name
    from recompute_bench.config.presets import gpu_type
    return gpu_type(visible_gpu_name())


def hardware_kind(device: str | None, gpu: str | None) -> str:
    """The hardware kind a run on `device` measures (golden file names)."""
    return "cpu" if (device or "").startswith("cpu") else (gpu or this_gpu())


def records_kind(rows: list[dict]) -> str:
    """The hardware kind of result rows (golden file names)."""
    from recompute_bench.config.presets import gpu_type
    return gpu_type(str(rows[0].get("device_name") or "cpu")) if rows else "cpu"


def resolve_point(workload: str, point: PointOptions, gpu: str | None = None) -> tuple[Config, list[str]]:
    """A command's workload and options -> (validated Config, notes); BadInput on bad input."""
    return resolve(workload, overrides=point.overrides, sets=point.sets, gpu=gpu or point.gpu or this_gpu())


def with_policy_file(cfg: Config, point: PointOptions, path: Path | None) -> Config:
    """cfg running the policy file `path` (when given); BadInput for a bad file or when recompute
    flags were given too."""
    if path is None:
        return cfg
    if point.given("recompute"):
        raise BadInput(f"--policy replaces the recompute setting; drop {' '.join(point.flags())} or --policy")
    from recompute_bench.recompute.policy_file import with_policy
    return with_policy(cfg, path)
