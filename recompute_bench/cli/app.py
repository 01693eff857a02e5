"""The `recompute-bench` Typer app: one module per command, options generated from the field
registry (`cli/options.py`). Data goes to stdout (`--json`), people's output to stderr. Exit codes:
0 ok, 1 a failed point or check, 2 bad input.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from recompute_bench.cli import compare, estimate, ingest, plan, report, run, sweep, verify, workloads
from recompute_bench.cli.options import normalize_argv

app = typer.Typer(no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Measure, predict and gate activation-recomputation settings of GPT training. An on/off flag "
                       "(--sequence-parallel, ...) has a --no- form that turns it off.")


def _print_version(value: bool) -> None:
    if value:
        from recompute_bench import __version__
        typer.echo(f"recompute-bench {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                help="Print the package version and exit.")] = False) -> None:
    """Measure, predict and gate activation-recomputation settings of GPT training."""


app.command()(workloads.workloads)
app.command()(run.run)
app.command()(verify.verify)
app.command()(estimate.estimate)
app.command()(plan.plan)
app.command()(sweep.sweep)
app.command()(compare.compare)
golden_app = typer.Typer(no_args_is_help=True, help="Golden files: promote measured rows, explicitly.")
golden_app.command("update")(compare.golden_update)
app.add_typer(golden_app, name="golden")
app.command()(report.report)
app.command("import")(ingest.import_)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `recompute-bench`."""
    app(args=normalize_argv(sys.argv[1:] if argv is None else argv), prog_name="recompute-bench")


def run_performance_workload(argv: list[str] | None = None) -> None:
    """Entry point of `run_performance_workload`: Megatron Bridge's spelling of `recompute-bench run`."""
    args = sys.argv[1:] if argv is None else argv
    app(args=["run", *normalize_argv(args)], prog_name="run_performance_workload")
