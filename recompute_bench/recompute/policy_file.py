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
Pure Python (tomllib); every problem is a ConfigError of one line that names the fix.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from recompute_bench.models import spec_for
from recompute_bench.recompute.policy import LayerPolicy, chunks, kind_targets, layer_kind, parse_entry
from recompute_bench.spec.config import RECOMPUTE_MODULES, Config, ConfigError, RecomputeConfig

POLICY_SCHEMA = "recompute-bench/policy/v1"
FIX = "write it with `recompute-bench plan --auto --output FILE` or fix that line"


def read_policy(path: Path, cfg: Config) -> list[str]:
    """The layer entries of the policy file at `path`, checked against cfg's model."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"policy file {path} does not exist; pass a file written by `recompute-bench plan --auto`") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"policy file {path} cannot be read ({e}); pass a readable TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"policy file {path} is not valid TOML ({e}); {FIX}") from None
    if data.get("schema") != POLICY_SCHEMA:
        raise ConfigError(f"policy file {path} has schema {data.get('schema')!r}, not {POLICY_SCHEMA!r}; {FIX}")
    layers = data.get("layers")
    if not isinstance(layers, list) or not all(isinstance(x, str) for x in layers):
        raise ConfigError(f"policy file {path} needs `layers`, a list of one string per layer; {FIX}")
    check(layers, cfg, str(path))
    return [parse_entry(x).entry for x in layers]


def with_policy(cfg: Config, path: Path) -> Config:
    """cfg running the policy file at `path` instead of its uniform recompute setting."""
    return dataclasses.replace(cfg, recompute=RecomputeConfig(layer_policy=read_policy(path, cfg)))


def check(entries: list[str], cfg: Config, where: str = "the policy") -> list[LayerPolicy]:
    """The policies of `entries`, or a ConfigError naming the first problem: a malformed entry, a
    module no model has, this model lacks or this layer's kind lacks (MoE modules on a dense layer,
    `mlp` on a MoE layer), the wrong number of layers, a split chunk."""
    n = cfg.model.num_layers
    if len(entries) != n:
        raise ConfigError(f"{where} lists {len(entries)} layers but {cfg.workload} has {n}; write one entry per "
                          f"layer or pass --num-layers {len(entries)}")
    offered = spec_for(cfg.model).recompute_targets
    policies = []
    for i, entry in enumerate(entries):
        try:
            p = parse_entry(entry)
        except ValueError as e:
            raise ConfigError(f"{where}, layer {i}: {e}; {FIX}") from None
        for module in sorted(p.modules):
            if module not in RECOMPUTE_MODULES:
                raise ConfigError(f"{where}, layer {i}: unknown module {module!r}; use one of {', '.join(offered)}")
            if module not in offered:
                raise ConfigError(f"{where}, layer {i}: {cfg.workload}'s model has no {module} to recompute; "
                                  f"use one of {', '.join(offered)}")
            kind = layer_kind(cfg.model, i)
            if module not in kind_targets(offered, kind):
                raise ConfigError(f"{where}, layer {i} is a {kind} layer (moe_layer_freq {cfg.model.moe_layer_freq}) and "
                                  f"has no {module}; use one of {', '.join(kind_targets(offered, kind))}")
        if p.offload and (p.modules or p.chunk is not None):
            raise ConfigError(f"{where}, layer {i}: offload goes with no recompute (Megatron's rule); write offload alone")
        policies.append(p)
    seen: set[int] = set()
    for start, _stop in chunks(policies):
        chunk = policies[start].chunk
        if chunk is not None:
            if chunk in seen:
                raise ConfigError(f"{where}: full:{chunk} is split by other layers; a chunk is consecutive layers, "
                                  "so give each run of full layers its own number")
            seen.add(chunk)
    return policies


def write_policy(path: Path, cfg: Config, entries: list[str], predicted: dict[str, Any] | None = None) -> None:
    """Write `entries` as a policy file for cfg's workload, with the predicted figures beside them."""
    lines = [f'schema = "{POLICY_SCHEMA}"', f'workload = "{cfg.workload}"', f"num_layers = {len(entries)}",
             "# one entry per layer: none, selective[MODULES], full:CHUNK (consecutive layers of one CHUNK",
             "# are checkpointed together) or offload", "layers = ["]
    width = max(len(e) for e in entries) + 4
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
