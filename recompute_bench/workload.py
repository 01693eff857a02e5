"""A workload resolved once, where a command (or a worker, or a reader of another framework's run)
makes its config: the validated Config with its model spec (`Config.spec`), which analysis,
measure and render then take as it is. `models.spec_for` is called here and nowhere below.

    cfg, notes = resolve("llama3-8b", overrides={"parallel.tensor_model_parallel_size": 2})
    cfg.spec.layer_flops(cfg)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from recompute_bench.config.presets import DEFAULT_WORKLOAD, read_point
from recompute_bench.config.rules import validate
from recompute_bench.config.schema import Config
from recompute_bench.models import spec_for


def resolved(cfg: Config) -> Config:
    """cfg with its model spec: the spec of the architecture its model describes (`spec_for`)."""
    return dataclasses.replace(cfg, _resolved=(cfg.model, spec_for(cfg.model)))


def resolve(workload: str = DEFAULT_WORKLOAD, *, overrides: dict[str, Any] | None = None,
            sets: list[str] | tuple[str, ...] = (), gpu: str | None = None) -> tuple[Config, list[str]]:
    """The validated, resolved Config of one point of `workload` (a preset name or a TOML path) with
    the command line's `overrides` ("section.key" -> value) and `--set` items, and the notes to
    show the user; BadInput for anything the rules refuse."""
    cfg, notes = read_point(workload, overrides=overrides, sets=sets, gpu=gpu)
    cfg = resolved(cfg)
    validate(cfg)
    return cfg, notes


def config_from_dict(data: dict[str, Any]) -> Config:
    """A config written with `Config.to_dict` (a sweep's plan, a worker's stdin, a rank's pieces),
    resolved and validated again; BadInput if it is not one."""
    cfg = resolved(Config.from_dict(data))
    validate(cfg)
    return cfg
