"""Options that launch a point over many ranks (torchrun's words), shared by `run` and `sweep`:
`@launch_options` adds them to a command, which receives one `launch: Launch`."""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Annotated, Any, Callable, Optional

import typer

from recompute_bench.launch.torchrun import DATA_PARALLEL, Launch

PANEL = "Ranks (torchrun)"

OPTIONS: dict[str, tuple[Any, Any]] = {
    "nproc_per_node": (Annotated[int, typer.Option(help="Ranks on this node; above 1 (or with --nnodes) each point "
                                                   "runs under torchrun.", rich_help_panel=PANEL)], 1),
    "nnodes": (Annotated[int, typer.Option(help="Nodes; each runs this command with its own --node-rank.",
                                           rich_help_panel=PANEL)], 1),
    "node_rank": (Annotated[int, typer.Option(help="This node's rank among --nnodes.", rich_help_panel=PANEL)], 0),
    "rdzv_endpoint": (Annotated[Optional[str], typer.Option(help="HOST:PORT of the c10d rendezvous (node 0); default: "
                                                            "a free local port (one node).", rich_help_panel=PANEL)], None),
    "rdzv_id": (Annotated[Optional[str], typer.Option(help="Rendezvous id, the same on every node.",
                                                      rich_help_panel=PANEL)], None),
    "data_parallel": (Annotated[str, typer.Option(help=f"Data-parallel engine: {' or '.join(DATA_PARALLEL)} (FSDP2 per "
                                                  "layer shards weights, gradients and optimizer state).",
                                                  rich_help_panel=PANEL)], "ddp"),
    "memory_limit_gb": (Annotated[Optional[float], typer.Option(help="Cap each rank's CUDA allocator at this many GiB, "
                                                                "to see whether a point fits a smaller card.",
                                                                rich_help_panel=PANEL)], None),
    "watchdog_s": (Annotated[float, typer.Option(help="Time limit of one collective in seconds: a rank waiting longer "
                                                 "for a peer fails instead of hanging.", rich_help_panel=PANEL)], 300.0),
}


def launch_options(command: Callable) -> Callable:
    """Decorator: add the launch options to `command`, which receives them as `launch: Launch`."""
    hints = typing.get_type_hints(command, include_extras=True)
    own = [p.replace(annotation=hints.get(p.name, p.annotation))
           for p in inspect.signature(command).parameters.values() if p.name != "launch"]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
             for name, (annotation, default) in OPTIONS.items()]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        launch = Launch(**{name: kwargs.pop(name) for name in OPTIONS})
        return command(launch=launch, **kwargs)

    params = sorted(own + added, key=lambda p: p.kind)
    wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper
