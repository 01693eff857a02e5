"""The config an imported run used: what its file states, mapped with `megatron_args`, and, where
the file states only part of it, a preset (`--workload` and its flags) for the rest.

- A Megatron-LM log's argument dump and a functional test's `model_config.yaml` state the whole run
  (Megatron's defaults fill what they leave out, as Megatron itself does): `config_from_megatron`.
- A Megatron Bridge log's configuration summary states every Megatron Core `TransformerConfig` value
  that differs from its default, the batch and the sequence length, so Megatron's defaults fill the
  rest of those too; it never states the GPT model's own fields (`GPT_MODEL_FIELDS`: vocabulary,
  position embedding, tied output layer, ...) nor the GPU count, which come from the preset.
- A Bridge golden file and a torchtitan log state no config: the preset is the config, checked
  against what the log does state (torchtitan's tokens per step and context length).

A flag given for a value the file states is refused: the file says what ran. (For a Bridge log that
is every value but the GPT model's own fields and the data-parallel size.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from recompute_bench.ingest.bridge_config import SPELLINGS
from recompute_bench.ingest.megatron_args import CannotExpress, config_from_megatron, normalized_overrides
from recompute_bench.ingest.megatron_argv import normalize
from recompute_bench.ingest.parsed import ParsedRun, bad
from recompute_bench.config.schema import SECTIONS, Config, BadInput
from recompute_bench.workload import resolve, resolved
from recompute_bench.config.rules import validate

# Fields of Megatron's GPTModel (Bridge's GPTModelProvider) that are no TransformerConfig field, so
# Bridge's summary never prints them (`ConfigContainer.log_non_default_values` compares against
# TransformerConfig only).
GPT_MODEL_FIELDS = ("vocab_size", "position_embedding_type", "share_embeddings_and_output_weights",
                    "max_position_embeddings", "rotary_base", "make_vocab_size_divisible_by")
FRAMEWORK = {"megatron-lm": "megatron", "megatron-golden": "megatron", "megatron-bridge": "megatron",
             "bridge-golden": "megatron", "torchtitan": "recompute-bench"}


def _cannot(run: ParsedRun, e: CannotExpress) -> BadInput:
    line = run.argument_lines.get(e.name)
    return bad(run.config_file or run.path, line, f"{e}; import only runs the estimate can express")


def run_config(run: ParsedRun, *, workload: str | None, overrides: dict[str, Any], sets: list[str],
               gpu: str | None, world_size: int | None, name: str | None) -> Config:
    """The Config `run` used (see the module docstring); bad input names the file (and line)."""
    label = name or run.name or workload or run.format
    if run.complete:
        if workload or overrides or sets:
            raise bad(run.path, None, "states the run's whole configuration; drop --workload and the workload flags "
                                      "(pass --world-size where the GPU count is missing)")
        try:
            return config_from_megatron(run.arguments, world_size=run.world_size or world_size, workload=label)
        except CannotExpress as e:
            raise _cannot(run, e) from None
        except BadInput as e:
            raise bad(run.config_file or run.path, None, f"{e}") from None
    if not workload:
        raise bad(run.path, None, f"a {run.format} file does not state the whole run (the model's vocabulary, position "
                                  "embedding and GPU count are missing); pass --workload PRESET and flags such as --dp "
                                  "for what it leaves out")
    preset_overrides = {"training.framework": FRAMEWORK[run.format], **overrides}
    base, _ = resolve(workload, overrides=preset_overrides, sets=sets, gpu=gpu)
    if run.format == "torchtitan":
        _check_torchtitan(run, base)
    if not run.arguments or run.format != "megatron-bridge":
        return dataclasses.replace(base, workload=label)
    return _bridge_config(run, base, overrides, label)


def bridge_arguments(run: ParsedRun) -> dict[str, Any]:
    """A Bridge log summary's TransformerConfig values as Megatron-LM's arguments."""
    args = {SPELLINGS.get(k, k): v for k, v in run.arguments.items()}
    if args.get("num_query_groups") is not None:
        args["group_query_attention"] = True
    return normalize(args)


def bridge_tables(args: dict[str, Any], base: Config,
                  refused: list[CannotExpress] | None = None) -> dict[str, dict[str, Any]]:
    """Bridge's stated TransformerConfig values (`args`, as `bridge_arguments` reads them; Megatron's
    defaults for the rest) over the preset's GPT-model fields, data-parallel size and (where the
    summary omits it) global batch: one table per Config section. CannotExpress for what the
    estimate cannot express (collected in `refused` when given, as `megatron_overrides` does)."""
    tables = normalized_overrides(args, refused=refused)
    for field in GPT_MODEL_FIELDS:
        if not (field == "vocab_size" and "padded_vocab_size" in args):
            tables["model"][field] = getattr(base.model, field)
    tables["parallel"]["data_parallel_size"] = base.parallel.data_parallel_size
    if "global_batch_size" not in args:
        tables["training"]["global_batch_size"] = base.training.global_batch_size
    return tables


def _bridge_config(run: ParsedRun, base: Config, overrides: dict[str, Any], label: str) -> Config:
    """Bridge's stated TransformerConfig values (Megatron's defaults for the rest) over the preset's
    GPT-model fields and data-parallel size."""
    try:
        tables = bridge_tables(bridge_arguments(run), base)
    except CannotExpress as e:
        raise _cannot(run, e) from None
    except BadInput as e:
        raise bad(run.path, None, f"{e}") from None
    # The summary states every other value, a value it omits being Megatron Core's default.
    open_fields = {f"model.{f}" for f in GPT_MODEL_FIELDS} | {"parallel.data_parallel_size"}
    clash = sorted(k for k in overrides if k not in open_fields)
    if clash:
        raise bad(run.path, None, f"states {', '.join(clash)} itself (a value its summary omits is Megatron Core's "
                                  "default); drop the flag(s) for it")
    try:
        cfg = resolved(Config(label, **{s: SECTIONS[s](**tables[s]) for s in SECTIONS}))
        validate(cfg)
    except (TypeError, BadInput) as e:
        raise bad(run.path, None, f"the stated configuration with preset {base.workload} is invalid: {e}") from None
    return cfg


def _check_torchtitan(run: ParsedRun, cfg: Config) -> None:
    """torchtitan states its tokens per step and context length: the preset must say the same."""
    tr = cfg.training
    expected = {"tokens_per_train_step": tr.global_batch_size * tr.seq_length, "max_context_length": tr.seq_length}
    for key, value in expected.items():
        stated = run.arguments.get(key)
        if stated is not None and stated != value:
            raise bad(run.path, run.argument_lines.get(key),
                      f"the log's {key.replace('_', ' ')} is {stated}, the preset's {value} (global batch x sequence "
                      "length); pass the workload and flags (--gbs, --seq-length) of the run that wrote this log")
