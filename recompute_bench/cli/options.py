"""Command-line options generated from the field registry (`config.fields`), so that no command
re-declares them: `@point_options()` adds one Typer option per flagged field (plus `--set` and
`--gpu`) to a command and hands the command one `PointOptions` with what was given.

Also here: the argv normalisation every entry point applies before Typer parses, so each spelling a
Megatron user types works: `--recompute_modules core_attn layernorm` (underscores, space-separated
list), `--recompute-modules core_attn,layernorm` (comma list), repeated flags, and Megatron
Bridge's short flags (`-rl N`, `-ol N`, `-tp`, `-pp`, `-mb`, `-gb`, `-sl`).
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Optional

import typer

from recompute_bench.config import fields as registry

# Sweep options that take lists too; the registry's list fields are added to these.
SWEEP_LIST_OPTIONS = ("--modules", "--methods", "--num-layers-recompute")


def list_options() -> set[str]:
    """Options after which each following word up to the next flag is one more value."""
    return {f.option for f in registry.flagged() if f.is_list} | set(SWEEP_LIST_OPTIONS)


def normalize_argv(argv: list[str]) -> list[str]:
    """Rewrite Megatron-style spellings into the repeated dashed flags Typer parses."""
    shorts, lists = registry.other_spellings(), list_options()
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--":
            out += argv[i - 1:]
            break
        token = shorts.get(token, token)
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            name = name.replace("_", "-")
            if name in lists:
                values = [value] if eq else []
                while i < len(argv) and not argv[i].startswith("-"):
                    values.append(argv[i])
                    i += 1
                for v in values or [""]:
                    out += [name, v]
                continue
            token = name + eq + value
        out.append(token)
    return out


def split_list(values: Optional[list[str]]) -> Optional[list[str]]:
    """Flatten comma lists; "[]" or "" mean an explicitly empty list; None means not given."""
    if values is None:
        return None
    return [v.strip() for item in values for v in item.strip().strip("[]").split(",") if v.strip()]


@dataclass
class PointOptions:
    """What a command was given about its point(s): field values by override path ("section.key",
    only those given), `--set` items and the GPU kind for per-GPU preset tables."""

    overrides: dict[str, Any] = field(default_factory=dict)
    sets: list[str] = field(default_factory=list)
    gpu: Optional[str] = None

    def given(self, section: str) -> dict[str, Any]:
        """The overrides of one section."""
        return {k: v for k, v in self.overrides.items() if k.startswith(section + ".")}

    def flags(self) -> list[str]:
        """The flags that were given, as a user typed them (for messages)."""
        by_path = {f.path: f.option for f in registry.flagged()}
        return [by_path[k] for k in self.overrides] + (["--set"] if self.sets else [])


def _option(f: registry.Field) -> list[inspect.Parameter]:
    """The Typer parameter(s) of one field. A boolean field is two options, `--x` and a hidden
    `--no-x`, so its help shows one name (a `--x/--no-x` pair takes a column of its own, which
    squeezes the names at 80 columns until rich cuts them)."""
    flag = f.flag
    others = [o for o in (*flag.aliases, flag.short) if o]
    # The other spellings are named in the help, not declared: each declared name widens the names'
    # column, which rich then cuts at 80 columns; normalize_argv rewrites them before parsing.
    help_text = (f.help or f.path) + (f" Also {', '.join(others)}." if others else "")
    if f.value_type is bool:
        yes = typer.Option(f.option, help=help_text, rich_help_panel=flag.panel, show_default=False)
        no = typer.Option(f"--no-{f.option[2:]}", hidden=True)
        return [inspect.Parameter(f.key, inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[bool, yes]),
                inspect.Parameter(NO + f.key, inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[bool, no])]
    annotation = Optional[list[str]] if f.is_list else Optional[f.value_type]
    option = typer.Option(f.option, help=help_text, rich_help_panel=flag.panel, show_default=False)
    return [inspect.Parameter(f.key, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[annotation, option])]


NO = "no__"
"""Prefix of the hidden parameter that carries a boolean field's `--no-x`."""


def _extra(name: str, annotation: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


SETS = Annotated[Optional[list[str]], typer.Option("--set", help="Override any field: section.key=value (repeatable), "
                                                   "e.g. --set model.hidden_dropout=0.1.", rich_help_panel="Workload")]
GPU = Annotated[Optional[str], typer.Option(help="GPU kind for per-GPU preset tables (h100, h200, ...); default: this "
                                            "machine's.", rich_help_panel="Workload")]


def point_options(*, panels: tuple[str, ...] = ("Workload", "Parallelism", "Recompute"), exclude: tuple[str, ...] = (),
                  sets: bool = True, gpu: bool = True) -> Callable:
    """Decorator: add the registry's flagged fields of `panels` (minus `exclude`, by key) as options,
    and `--set`/`--gpu`; the command receives them as one keyword argument `point: PointOptions`."""

    def decorate(command: Callable) -> Callable:
        chosen = [f for f in registry.flagged() if f.flag.panel in panels and f.key not in exclude]
        hints = typing.get_type_hints(command, include_extras=True)
        own = [p.replace(annotation=hints.get(p.name, p.annotation))
               for p in inspect.signature(command).parameters.values() if p.name != "point"]
        added = [p for f in chosen for p in _option(f)]
        if sets:
            added.append(_extra("sets", SETS))
        if gpu:
            added.append(_extra("gpu", GPU))

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            point = PointOptions(sets=list(kwargs.pop("sets", None) or ()), gpu=kwargs.pop("gpu", None))
            for f in chosen:
                value = kwargs.pop(f.key)
                if f.value_type is bool:  # --x: True, --no-x: False (it wins over --x); neither: None
                    off = kwargs.pop(NO + f.key)
                    value = True if value and not off else (False if off else None)
                if f.is_list:
                    value = split_list(value)
                if value is not None:
                    point.overrides[f.path] = value
            return command(point=point, **kwargs)

        params = sorted(own + added, key=lambda p: p.kind)  # positional arguments first
        wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return decorate
