"""A per-layer recompute policy as a file: what `plan --auto` writes and `run`/`verify --policy` read.

TOML, one line per layer, with the planner's predicted figures as comments and a table:

    schema = "recompute-bench/policy/v1"
    workload = "llama3-8b"
    num_layers = 8
    layers = [
      "full:0",                     # layer 0: checkpointed with the other layers of chunk 0
      "selective[layernorm,mlp]",   # layer 1
      "none",                       # layer 2
    ]

A layer is `none`, `selective[MODULES]` (Megatron's recompute_modules for this layer), `full:CHUNK`
(checkpointed whole; consecutive layers with the same CHUNK form one checkpoint) or `offload`.

With pipeline parallelism (`--pp`) the file may instead hold one section per pipeline stage, each
listing that stage's layers in order (stage s of p holds layers s n/p to (s + 1) n/p - 1); CHUNK
numbers count within a section. What `plan --auto --pp` writes:

    [stage.0]
    layers = ["full:0", "full:0", "selective[mlp]", "none"]   # layers 0-3
    [stage.1]
    layers = ["none", "none", "none", "none"]                 # layers 4-7

Every stage has one section, and no `layers` list beside them. Sections need `--pp` above 1 and no
virtual stages (write one `layers` list over the whole model there).
Pure Python (tomllib); every problem is a BadInput of one line that names the fix.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from recompute_bench.recompute.policy import LayerPolicy, chunks, kind_targets, layer_kind, parse_entry
from recompute_bench.config.choices import RECOMPUTE_MODULES
from recompute_bench.config.schema import Config, BadInput, RecomputeConfig

POLICY_SCHEMA = "recompute-bench/policy/v1"
FIX = "write it with `recompute-bench plan --auto --output FILE` or fix that line"


def read_policy(path: Path, cfg: Config) -> list[str]:
    """The layer entries of the policy file at `path`, checked against cfg's model."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise BadInput(f"policy file {path} does not exist; pass a file written by `recompute-bench plan --auto`") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"policy file {path} cannot be read ({e}); pass a readable TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"policy file {path} is not valid TOML ({e}); {FIX}") from None
    if data.get("schema") != POLICY_SCHEMA:
        raise BadInput(f"policy file {path} has schema {data.get('schema')!r}, not {POLICY_SCHEMA!r}; {FIX}")
    if "stage" in data:
        layers = stage_sections(data, cfg, f"policy file {path}")
    else:
        layers = data.get("layers")
        if not isinstance(layers, list) or not all(isinstance(x, str) for x in layers):
            raise BadInput(f"policy file {path} needs `layers`, a list of one string per layer; {FIX}")
    check(layers, cfg, str(path))
    return [parse_entry(x).entry for x in layers]


def stage_sections(data: dict[str, Any], cfg: Config, where: str) -> list[str]:
    """The whole model's layer entries from a policy file's per-stage sections (`[stage.S]`, each
    with its stage's `layers`), chunk numbers made distinct across stages; a BadInput naming the
    fix for sections without pipeline stages or with virtual ones, beside a `layers` list, for a
    stage that does not exist or has no section, or a section that does not list its stage's layers."""
    par = cfg.parallel
    p, sections = par.pipeline_model_parallel_size, data["stage"]
    if p == 1:
        raise BadInput(f"{where} has per-stage sections but runs one pipeline stage; pass --pp {len(sections)} "
                          "or write one `layers` list")
    if par.virtual_pipeline_model_parallel_size:
        raise BadInput(f"{where} has per-stage sections, which do not go with virtual pipeline stages; write one "
                          "`layers` list over the whole model")
    if "layers" in data:
        raise BadInput(f"{where} has both `layers` and per-stage sections; keep one of them")
    if not isinstance(sections, dict) or not all(isinstance(v, dict) for v in sections.values()):
        raise BadInput(f"{where}: write each stage's section as [stage.S] with `layers = [...]`; {FIX}")
    for name in sections:
        if not name.isdigit() or int(name) >= p:
            raise BadInput(f"{where} has a section for stage {name}, but --pp {p} has stages 0 to {p - 1}; "
                              f"drop [stage.{name}] or pass the --pp the file was written for")
    n = cfg.model.num_layers // p
    missing = [s for s in range(p) if str(s) not in sections]
    if missing:
        raise BadInput(f"{where} has no section for stage {', '.join(map(str, missing))}; write one [stage.S] "
                          f"per pipeline stage (each lists its {n} layers)")
    entries: list[str] = []
    offset = 0  # the first chunk number of this stage in the whole model's list
    for s in range(p):
        layers = sections[str(s)].get("layers")
        if not isinstance(layers, list) or not all(isinstance(x, str) for x in layers):
            raise BadInput(f"{where}, stage {s}: needs `layers`, a list of one string per layer; {FIX}")
        if len(layers) != n:
            raise BadInput(f"{where}, stage {s} lists {len(layers)} layers but stage {s} holds {n} "
                              f"(layers {s * n} to {(s + 1) * n - 1}); write one entry per layer of the stage")
        policies = []
        for i, entry in enumerate(layers):
            try:
                policies.append(parse_entry(entry))
            except ValueError as e:
                raise BadInput(f"{where}, stage {s}, layer {s * n + i}: {e}; {FIX}") from None
        entries += [dataclasses.replace(x, chunk=None if x.chunk is None else x.chunk + offset).entry for x in policies]
        offset += 1 + max((x.chunk for x in policies if x.chunk is not None), default=-1)
    return entries


def with_policy(cfg: Config, path: Path) -> Config:
    """cfg running the policy file at `path` instead of its uniform recompute setting."""
    return dataclasses.replace(cfg, recompute=RecomputeConfig(layer_policy=read_policy(path, cfg)))


def check(entries: list[str], cfg: Config, where: str = "the policy") -> list[LayerPolicy]:
    """The policies of `entries`, or a BadInput naming the first problem: a malformed entry, a
    module no model has, this model lacks or this layer's kind lacks (MoE modules on a dense layer,
    `mlp` on a MoE layer), the wrong number of layers, a split chunk."""
    n = cfg.model.num_layers
    if len(entries) != n:
        raise BadInput(f"{where} lists {len(entries)} layers but {cfg.workload} has {n}; write one entry per "
                          f"layer or pass --num-layers {len(entries)}")
    offered = cfg.spec.recompute_targets
    policies = []
    for i, entry in enumerate(entries):
        try:
            p = parse_entry(entry)
        except ValueError as e:
            raise BadInput(f"{where}, layer {i}: {e}; {FIX}") from None
        for module in sorted(p.modules):
            if module not in RECOMPUTE_MODULES:
                raise BadInput(f"{where}, layer {i}: unknown module {module!r}; use one of {', '.join(offered)}")
            if module not in offered:
                raise BadInput(f"{where}, layer {i}: {cfg.workload}'s model has no {module} to recompute; "
                                  f"use one of {', '.join(offered)}")
            kind = layer_kind(cfg.model, i)
            if module not in kind_targets(offered, kind):
                raise BadInput(f"{where}, layer {i} is a {kind} layer (moe_layer_freq {cfg.model.moe_layer_freq}) and "
                                  f"has no {module}; use one of {', '.join(kind_targets(offered, kind))}")
        if p.offload and (p.modules or p.chunk is not None):
            raise BadInput(f"{where}, layer {i}: offload goes with no recompute (Megatron's rule); write offload alone")
        policies.append(p)
    seen: set[int] = set()
    for start, _stop in chunks(policies):
        chunk = policies[start].chunk
        if chunk is not None:
            if chunk in seen:
                raise BadInput(f"{where}: full:{chunk} is split by other layers; a chunk is consecutive layers, "
                                  "so give each run of full layers its own number")
            seen.add(chunk)
    return policies


def write_policy(path: Path, cfg: Config, entries: list[str], predicted: dict[str, Any] | None = None,
                 stages: list[list[str]] | None = None) -> None:
    """Write `entries` as a policy file for cfg's workload, with the predicted figures beside them;
    with `stages` (more than one: each pipeline stage's entries, chunks numbered within it) as one
    section per stage instead."""
    lines = [f'schema = "{POLICY_SCHEMA}"', f'workload = "{cfg.workload}"', f"num_layers = {len(entries)}",
             "# one entry per layer: none, selective[MODULES], full:CHUNK (consecutive layers of one CHUNK",
             "# are checkpointed together) or offload"]
    width = max(len(e) for e in entries) + 4
    if stages and len(stages) > 1:
        lines += [f"# one section per pipeline stage (--pp {len(stages)}); CHUNK numbers count within a stage"]
        first = 0
        for s, stage in enumerate(stages):
            lines += [f"[stage.{s}]", "layers = ["]
            lines += [f'  {(chr(34) + e + chr(34) + ","):<{width}} # layer {first + i}' for i, e in enumerate(stage)]
            lines.append("]")
            first += len(stage)
    else:
        lines.append("layers = [")
        lines += [f'  {(chr(34) + e + chr(34) + ","):<{width}} # layer {i}' for i, e in enumerate(entries)]
        lines.append("]")
    if predicted:
        lines += ["", "[predicted]"] + [f"{k} = {_toml(v)}" for k, v in predicted.items()]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
