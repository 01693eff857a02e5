"""Workload presets (`workloads/*.toml`) plus command-line overrides -> the Config of a point
(resolved and validated by `recompute_bench.workload.resolve`).

A preset is data: `[model]`, `[training]`, `[parallel]` and `[recompute]` tables whose keys are
the fields of the dataclasses in `config/schema.py`, and optional `[recompute.gpu.<type>]` tables that
replace the recompute setting on one kind of GPU (`h100`, `h200`, `a100`, `b200`, `gb200`, ...).

Overrides apply in this order: preset, the preset's per-GPU recompute, `--set section.key=value`,
then the dedicated flags (`--num-layers`, `--recompute-granularity`, ...). Recompute flags replace
the preset's recompute setting as a whole, so a preset with full recompute and a command line that
asks for selective recompute never mix into a setting Megatron would reject.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any

from recompute_bench.config.gpus import NAMED_KINDS
from recompute_bench.config.choices import MEGATRON_MOE_DEFAULTS
from recompute_bench.config.schema import SECTIONS, Config, BadInput
from recompute_bench.config.labels import canonical_modules

# A checkout keeps the presets at the top level (workloads/); a wheel carries them inside the
# package (recompute_bench/workloads/, mapped in pyproject.toml).
_PACKAGED_WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"
WORKLOADS_DIR = Path(os.environ.get("RECOMPUTE_BENCH_WORKLOADS") or (
    _PACKAGED_WORKLOADS if _PACKAGED_WORKLOADS.is_dir() else Path(__file__).resolve().parents[2] / "workloads"))
DEFAULT_WORKLOAD = "tiny"
# Framework megatron: Megatron's defaults of the implementation fields (megatron/training/arguments.py
# `--transformer-impl`, megatron/core/transformer/transformer_config.py `attention_backend`).
MEGATRON_DEFAULTS = {"transformer_impl": "transformer_engine", "attention_backend": "auto"}


def workload_names() -> list[str]:
    """Names of the built-in presets."""
    return sorted(p.stem for p in WORKLOADS_DIR.glob("*.toml"))


def preset_path(workload: str) -> Path:
    """The TOML file of a preset name, or a user's own file path."""
    path = Path(workload)
    if path.suffix == ".toml" or os.sep in workload:
        if not path.is_file():
            raise BadInput(f"workload file {workload} does not exist; pass a preset name ({', '.join(workload_names())}) or a .toml path")
        return path
    path = WORKLOADS_DIR / f"{workload}.toml"
    if not path.is_file():
        raise BadInput(f"unknown workload {workload!r}; choose one of {', '.join(workload_names())} "
                          f"(see `recompute-bench workloads`) or pass a path to a .toml preset")
    return path


def load_preset(workload: str) -> dict[str, Any]:
    """The raw tables of a preset."""
    path = preset_path(workload)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"workload file {path} is not valid TOML ({e}); fix the file") from None


def parse_set(item: str) -> tuple[str, Any]:
    """`section.key=value` -> ("section.key", value); the value is read as TOML, else as a string."""
    key, sep, raw = item.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or "." not in key:
        raise BadInput(f"--set {item!r} is not section.key=value; for example --set model.hidden_dropout=0.1")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key, value


def gpu_type(device_name: str) -> str:
    """Short GPU kind used for per-GPU preset tables and golden file names ("cpu" without CUDA)."""
    name = device_name.lower()
    for kind in NAMED_KINDS:
        if kind in name:
            return kind
    return "cpu" if name in ("", "cpu") or "cpu" in name else name.split()[-1]


def read_point(workload: str = DEFAULT_WORKLOAD, *, overrides: dict[str, Any] | None = None,
               sets: list[str] | tuple[str, ...] = (), gpu: str | None = None) -> tuple[Config, list[str]]:
    """The Config of one point (not yet resolved nor validated: `recompute_bench.workload.resolve`
    does both), and the notes to show the user about it.

    `overrides` maps "section.key" to a value from a dedicated flag; None values are ignored.
    """
    raw = load_preset(workload)
    unknown = set(raw) - set(SECTIONS) - {"description"}
    if unknown:
        raise BadInput(f"workload {workload} has unknown table(s) {', '.join(sorted(unknown))}; "
                          f"use {', '.join(SECTIONS)}")
    tables: dict[str, dict[str, Any]] = {s: dict(raw.get(s, {})) for s in SECTIONS}
    per_gpu = tables["recompute"].pop("gpu", {})
    if gpu and gpu in per_gpu:
        tables["recompute"] = dict(per_gpu[gpu])

    notes: list[str] = []
    apply_overrides(tables, overrides or {}, sets, notes)
    if tables["training"].get("framework") == "megatron":
        # What the preset and the flags leave unset takes Megatron's defaults, not this harness's.
        for key, value in MEGATRON_DEFAULTS.items():
            tables["model"].setdefault(key, value)
        if tables["model"].get("num_moe_experts"):
            for key, value in MEGATRON_MOE_DEFAULTS.items():
                tables["model"].setdefault(key, value)
    name = Path(workload).stem if workload.endswith(".toml") else workload
    return config_from_tables(name, tables, notes), notes


def command_line_values(overrides: dict[str, Any], sets: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The values a command line gives, "section.key" -> value: `--set` items, then the dedicated
    flags (None: not given)."""
    cli: dict[str, Any] = {}
    for item in sets:
        key, value = parse_set(item)
        cli[key] = value
    cli.update({k: v for k, v in overrides.items() if v is not None})
    return cli


def apply_overrides(tables: dict[str, dict[str, Any]], overrides: dict[str, Any],
                    sets: list[str] | tuple[str, ...] = (), notes: list[str] | None = None) -> None:
    """A command line's values over `tables` (one dict per section, changed in place): recompute
    flags replace the recompute table as a whole (`_implied_recompute`), every other value its key."""
    cli = command_line_values(overrides, sets)
    recompute_cli = {k.split(".", 1)[1]: v for k, v in cli.items() if k.startswith("recompute.")}
    if recompute_cli:
        tables["recompute"] = _implied_recompute(recompute_cli, notes if notes is not None else [])
    for key, value in cli.items():
        section, _, name = key.partition(".")
        if section == "recompute":
            continue
        if section not in SECTIONS:
            raise BadInput(f"unknown section {section!r} in {key}; use one of {', '.join(SECTIONS)}")
        tables[section][name] = value


def config_from_tables(name: str, tables: dict[str, dict[str, Any]], notes: list[str]) -> Config:
    """The Config of one table per section (each key checked against its dataclass; not yet
    validated: pass it to `rules.validate`)."""
    cfg = Config(workload=name, **{s: _build(s, tables[s]) for s in SECTIONS})
    cfg.recompute.modules = canonical_modules(list(cfg.recompute.modules))
    if cfg.recompute.granularity == "selective" and not cfg.recompute.modules:
        notes.append("recompute_modules is empty: nothing is recomputed (Megatron would silently use [core_attn])")
    return cfg


def _implied_recompute(cli: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """Megatron Bridge's implied forms: modules alone mean selective; a layer count alone means full/block."""
    r = dict(cli)
    if isinstance(r.get("modules"), str):
        r["modules"] = [m for m in r["modules"].split(",") if m.strip()]
    if r.get("granularity") is None:
        if r.get("num_layers") is not None:
            r["granularity"] = "full"
            if r.get("method") is None:
                r["method"] = "block"
                notes.append("recompute_num_layers alone means full recompute with method block (as Megatron Bridge's -rl)")
        elif "modules" in r:
            r["granularity"] = "selective"
    if r.get("granularity") == "selective" and "modules" not in r:
        r["modules"] = ["core_attn"]
        notes.append("recompute_modules not given: using Megatron's default [core_attn]")
    return r


def _build(section: str, values: dict[str, Any]):
    cls = SECTIONS[section]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in values:
        if key not in fields:
            raise BadInput(f"unknown setting {section}.{key}; known: {', '.join(fields)}")
    try:
        obj = cls(**values)
    except TypeError as e:
        missing = str(e).split("argument")[-1].strip(": ")
        raise BadInput(f"[{section}] is missing {missing}; add it to the preset or pass --set {section}.KEY=VALUE") from None
    for name, f in fields.items():
        value = getattr(obj, name)
        expected = {"int": int, "float": (int, float), "bool": bool, "str": str}.get(str(f.type).replace("Optional[", "").rstrip("]"))
        if value is not None and expected is not None and (not isinstance(value, expected) or
                                                          (expected is int and isinstance(value, bool))):
            raise BadInput(f"{section}.{name} must be {str(f.type).replace('Optional[', '').rstrip(']')}, got {value!r}")
    return obj
