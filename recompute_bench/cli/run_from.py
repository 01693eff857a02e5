"""`--from PATH`, shared by `estimate` and `plan`: the option, reading the run a user has
(`ingest.run_source.read_run`: a Bridge ConfigContainer YAML, a model_config.yaml, an argument list,
a Megatron-LM or Bridge log) with the flags given beside it over it, and the lines that say what
was read: the flags that overrode the file (echoed with the file's value) and where the GPU count,
the GPU kind and CUBLAS_WORKSPACE_CONFIG came from. Declared and handled here once, so the two
commands read a file the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from recompute_bench.cli.common import err
from recompute_bench.cli.options import PointOptions
from recompute_bench.config.schema import BadInput

FromFile = Annotated[Optional[Path], typer.Option(
    "--from", help="A Megatron run as you have it: a Megatron-LM model_config.yaml, a text file holding its command "
    "line, a Megatron-LM or Megatron Bridge log, or Bridge's ConfigContainer YAML. Flags given beside it override it "
    "(and are echoed).", rich_help_panel="Workload", show_default=False)]


def read_from(path: Path, workload: Optional[str], gpus: Optional[int], point: PointOptions, device: str = "cuda"):
    """The run in `path` (`ingest.run_source.RunSource`), the flags beside it over it; BadInput
    (one line) for a file in no known format, a missing GPU count, an argument the Megatron model
    cannot express, a framework other than megatron or a CPU device."""
    import os

    from recompute_bench.cli.common import this_gpu
    from recompute_bench.ingest.run_source import read_run

    if device.split(":")[0] != "cuda":
        raise BadInput("Megatron runs on CUDA; drop --device cpu with --from")
    framework = point.overrides.get("training.framework")
    if framework not in (None, "megatron"):
        raise BadInput(f"--from reads a Megatron run, which framework megatron models; drop --framework {framework}")
    if gpus is not None and gpus < 1:
        raise BadInput(f"--gpus must be a positive integer, got {gpus}; pass the run's GPU count")
    return read_run(path, overrides=point.overrides, sets=point.sets, gpus=gpus, gpu=point.gpu, here_gpu=this_gpu(),
                    cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"), workload=workload)


def source_line(source) -> str:
    """One line saying what was read and where the GPU count and kind came from."""
    o = source.origins
    other = ("--", "Megatron's default", "a Megatron run", "the preset")
    stated = sum(1 for k, v in o.items() if k not in ("gpu", "cublas_workspace_config") and not v.startswith(other))
    return (f"from {source.path.name} ({source.format}): {stated} values from the file, Megatron's defaults for what "
            f"it leaves out; data-parallel size from {o.get('parallel.data_parallel_size')}; GPU {source.run.gpu} "
            f"from {o['gpu']}; CUBLAS_WORKSPACE_CONFIG from {o['cublas_workspace_config']} (--json: every value's origin)")


def show_source(source) -> None:
    """Print the flags that overrode the file (with the file's values) and where the run came from."""
    echoed = source.overrides_line()
    if echoed:
        err.print(f"[yellow]override:[/] {escape(echoed)}", highlight=False, soft_wrap=True)
    err.print(escape(source_line(source)), highlight=False, soft_wrap=True)
