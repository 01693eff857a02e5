"""A Megatron run as its user has it -> the Config and the MegatronRun that `estimate --from` (and
`plan --from`) model, with where each value came from.

The file is one of (detected from its content):

- a Megatron-LM functional test's `model_config.yaml` (`MODEL_ARGS`, `ENV_VARS`);
- a Megatron-LM command line in a text file (`ingest.argument_list`);
- a Megatron-LM training log (its argument dump, `ingest.megatron_log`), or a functional test's
  golden values beside their `model_config.yaml`;
- Megatron Bridge's run config, the `ConfigContainer` YAML (`ingest.bridge_config`);
- a Megatron Bridge log (`ingest.bridge_log`): its summary states what differs from Megatron Core's
  defaults but none of the GPT model's own fields, which a preset (`--workload`) gives.

Megatron's defaults fill what the file leaves out, as Megatron itself does (`megatron_args`). The
flags given beside the file override it, as they override a preset (`config.presets.apply_overrides`),
and each is echoed with the file's value. The GPU count comes from the file (a log's `world_size`,
torchrun's `--nproc-per-node` x `--nnodes`, Bridge's data-parallel size once set) or `gpus`; the GPU
kind from the file (a golden file's platform) or `gpu`; torch's CUBLAS_WORKSPACE_CONFIG from the
file's environment or the one given. Every argument the estimate cannot express is named, all in one
line of bad input. Pure Python (PyYAML).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from recompute_bench.analysis.megatron.gpu import COMPUTE_CAPABILITY, DEFAULT_GPU, MegatronRun
from recompute_bench.ingest import (argument_list, bridge_config, bridge_log, formats, megatron_golden, megatron_log,
                                    torchtitan_log)
from recompute_bench.ingest.config import GPT_MODEL_FIELDS, bridge_arguments, bridge_tables
from recompute_bench.ingest.megatron_argv import ALIASES, FLAG_NAMES, normalize
from recompute_bench.ingest.megatron_args import SAME_NAME, CannotExpress, field_arguments, normalized_overrides
from recompute_bench.ingest.parsed import ParsedRun, bad
from recompute_bench.config.schema import SECTIONS, BadInput, Config, data_parallel_size
from recompute_bench.config.presets import apply_overrides, command_line_values, config_from_tables, gpu_type
from recompute_bench.workload import resolve, resolved
from recompute_bench.config.rules import validate

FORMATS = ("model-config", argument_list.FORMAT, megatron_log.FORMAT, megatron_golden.FORMAT, bridge_config.FORMAT,
           bridge_log.FORMAT)
"""What `--from` reads: a model_config.yaml, a command line, a Megatron-LM log, a Megatron-LM golden
file (with its model_config.yaml), Bridge's ConfigContainer YAML, a Bridge log."""
MODEL_CONFIG = "model-config"
WHAT = ("pass a Megatron-LM model_config.yaml, a text file holding its command line, a Megatron-LM or Megatron "
        "Bridge log, or Bridge's ConfigContainer YAML")
HEAD_BYTES = formats.HEAD_BYTES


@dataclass
class RunSource:
    """A run read from a file: what `estimate --from` models, and where every value came from."""

    path: Path
    format: str
    config: Config
    """The run's Config (validated unless `refusals` name something it cannot express)."""
    run: MegatronRun
    origins: dict[str, str]
    """Config field path ("parallel.tensor_model_parallel_size") -> where its value came from:
    "FILE:LINE (the file's name for it)", a flag given beside the file, or "Megatron's default";
    also "gpu" and "cublas_workspace_config" for the MegatronRun's two."""
    overridden: list[tuple[str, Any, Any]] = field(default_factory=list)
    """(flag as given, its value, the file's value) for every flag that changed what the file says."""
    notes: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    """What the estimate cannot express, each as "NAME VALUE (line N): why"; empty when it can."""
    refused_arguments: list[str] = field(default_factory=list)
    """The Megatron-LM flags among `refusals` (`--fp8-format`), whatever the file's spelling."""
    parsed: ParsedRun | None = None
    invalid: str | None = None
    """Why the Config breaks Megatron's rules (`config.rules.validate`), when it does."""

    def overrides_line(self) -> str | None:
        """The one line echoing the flags that override the file (None when none did)."""
        if not self.overridden:
            return None
        said = ", ".join(f"{flag} {_text(new)} (the file: {_text(old)})" for flag, new, old in self.overridden)
        return f"beside --from {self.path.name}: {said}"

    def refusal(self) -> str | None:
        """The one line naming everything the estimate cannot express (None when it can)."""
        if not self.refusals:
            return None
        what = "setting" if len(self.refusals) == 1 else f"{len(self.refusals)} settings"
        return (f"{self.path}: the estimate cannot express {what} of this run: " + "; ".join(self.refusals)
                + "; remove them from the run, or give a flag for the field one sets beside --from, to estimate "
                "the rest")

    def to_dict(self) -> dict[str, Any]:
        """Where the run came from, as `--json` carries it."""
        return {"file": str(self.path), "format": self.format, "origins": dict(self.origins),
                "overridden": [{"flag": f, "value": new, "file_value": old} for f, new, old in self.overridden],
                "gpu": self.run.gpu, "cublas_workspace_config": self.run.cublas_workspace_config}


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return "unset" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


# ----- reading the file ---------------------------------------------------------------------------------

def read_file(path: Path) -> ParsedRun:
    """The file read by the reader its content needs; bad input (one line) when it is none of FORMATS."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise bad(path, None, f"does not exist; {WHAT}")
    try:
        with path.open("rb") as f:
            head = f.read(HEAD_BYTES).decode("utf-8", errors="replace")
    except OSError as e:
        raise bad(path, None, f"cannot be read ({e.strerror}); {WHAT}") from None
    log = next((r.FORMAT for r in (bridge_log, megatron_log) if r.detect(head)), None)  # Bridge's lines first
    if log is not None:
        return formats.read(path, log)
    if head.lstrip().startswith("{"):
        fmt, data = formats.detect_head(path, head)
        if fmt != megatron_golden.FORMAT:
            raise bad(path, None, f"is a {fmt} file, which states no run configuration; {WHAT}")
        return formats.read(path, fmt, data)
    text = path.read_text(encoding="utf-8", errors="replace")
    # The readers below refuse a file that is no UTF-8 text: only text read without a replacement is handed on.
    whole = "\ufffd" not in text
    data = node = None
    try:
        node, data = yaml.compose(text, Loader=yaml.SafeLoader), yaml.safe_load(text)
    except yaml.YAMLError as e:
        if path.suffix in (".yaml", ".yml"):
            mark = getattr(e, "problem_mark", None)
            raise bad(path, mark.line + 1 if mark else None,
                      f"is not valid YAML ({getattr(e, 'problem', e)}); repair that line") from None
    if isinstance(data, dict) and "MODEL_ARGS" in data:
        arguments, lines, env = (megatron_golden.model_config(path, data, node) if whole else
                                 megatron_golden.read_model_config_file(path))
        return ParsedRun(MODEL_CONFIG, path, timing="megatron", complete=True, arguments=arguments,
                         argument_lines=lines, env=env)
    if bridge_config.detect_yaml(data):
        return bridge_config.read(path, data, node)
    if path.suffix in (".yaml", ".yml") and data is not None:
        raise bad(path, None, "is YAML but neither Megatron Bridge's ConfigContainer (`_target_: "
                              "megatron.bridge.training.config.ConfigContainer`) nor a Megatron-LM model_config.yaml "
                              f"(MODEL_ARGS); {WHAT}")
    tokens = argument_list.command_words(text)
    if tokens is not None:
        return argument_list.read(path, tokens if whole else None)
    if torchtitan_log.detect(head):
        raise bad(path, None, "is a torchtitan log, which is no Megatron run; estimate it with -w PRESET and flags")
    raise bad(path, None, f"is in no known format (none of {', '.join(FORMATS)}); {WHAT}")


def _lines(parsed: ParsedRun) -> dict[str, int]:
    """The line of each argument under its normalized name (ALIASES, negative flags)."""
    out: dict[str, int] = {}
    for name, line in parsed.argument_lines.items():
        name = ALIASES.get(name, name)
        out.setdefault(name, line)
        if name.startswith("no_"):
            out.setdefault(name[3:], line)
    return out


def _spelling(parsed: ParsedRun, name: str) -> str:
    """How the file says Megatron argument `name`: Bridge's "key: value", or Megatron-LM's flag."""
    if name in parsed.argument_keys:
        return parsed.argument_keys[name]
    return "--" + FLAG_NAMES.get(name, name).replace("_", "-")


def _refusal(parsed: ParsedRun, e: CannotExpress, lines: dict[str, int]) -> str:
    name = e.name
    line = lines.get(name)
    where = f" (line {line})" if line else ""
    if e.why is None:
        return f"{_spelling(parsed, name)}{where}: {e}"
    said = parsed.argument_keys.get(name) or f"{_spelling(parsed, name)} {_text(e.value)}"
    return f"{said}{where}: {e.why}"


# ----- the Config ---------------------------------------------------------------------------------------

def read_run(path: Path | str, *, overrides: Mapping[str, Any] | None = None, sets: list[str] | tuple[str, ...] = (),
             gpus: int | None = None, gpu: str | None = None, here_gpu: str | None = None,
             cublas_workspace_config: str | None = None, workload: str | None = None, strict: bool = True) -> RunSource:
    """The run in `path` as a Config and a MegatronRun, with the origin of every value.

    - `overrides` ({"section.attribute": value}, the registry's flags) and `sets` (`--set` items)
      override what the file says; each that changes a value is echoed (`RunSource.overridden`).
    - `gpus`: the GPU count where the file does not state it (it overrides the file's when it does).
    - `gpu`: the GPU kind (h100, a100, ...), else the file's, else `here_gpu` (this machine's), else
      h100 with a note. `cublas_workspace_config`: torch's CUBLAS_WORKSPACE_CONFIG where the file's
      environment does not set it (the caller's environment).
    - `workload`: the preset that gives a Bridge log's GPT-model fields.

    BadInput (one line naming the file) for a file in no known format, a missing GPU count, or, with
    `strict`, anything the estimate cannot express (all of it, in `RunSource.refusal()`); without
    `strict` the RunSource carries `refusals` and the Config read so far, unvalidated."""
    path = Path(path)
    parsed = read_file(path)
    source_path = parsed.config_file or parsed.path
    lines = _lines(parsed)
    refused: list[CannotExpress] = []
    notes: list[str] = []
    if parsed.format == bridge_log.FORMAT:
        args, tables = _bridge_log_tables(parsed, workload, refused, notes)
    else:
        if workload:
            raise bad(path, None, "states the run's whole configuration; drop --workload")
        args = normalize(parsed.arguments)
        try:
            tables = normalized_overrides(args, refused=refused)
        except CannotExpress as e:
            raise bad(source_path, None, "the estimate cannot express " + _refusal(parsed, e, lines)) from None
        except BadInput as e:
            raise bad(source_path, None, f"{e}") from None
    _unexpanded(parsed, args, lines, source_path)
    stated_world = _stated_world(parsed, args)
    before = {s: dict(t) for s, t in tables.items()}

    overrides = dict(overrides or {})
    try:
        apply_overrides(tables, overrides, sets, notes)
    except BadInput as e:
        raise bad(source_path, None, f"{e}") from None
    given = command_line_values(overrides, sets)  # once, for every step below
    # A flag for the field a refused argument sets replaces it: what runs is the flag's value.
    replaced = {a: key for key in given for a in field_arguments(key)}
    overridden = _overridden(before, tables, overrides, sets, given, args)
    for e in refused:
        key = replaced.get(e.name)
        if key is not None and not any(flag == _flag(key, overrides) for flag, _, _ in overridden):
            overridden.append((_flag(key, overrides), given[key], e.value))
    refused = [e for e in refused if e.name not in replaced]
    world = gpus if gpus is not None else stated_world
    if gpus is not None and stated_world is not None and gpus != stated_world:
        overridden.append(("--gpus", gpus, stated_world))
    _layout(tables, args, world, given, source_path)

    name = path.stem if parsed.format != megatron_golden.FORMAT else (parsed.name or path.stem)
    try:
        cfg = resolved(config_from_tables(name, tables, notes))
    except BadInput as e:
        raise bad(source_path, None, f"{e}") from None
    refusals = [_refusal(parsed, e, lines) for e in refused]
    invalid = None
    if not refusals:  # what is refused is missing from the Config: its rules would judge the rest
        try:
            validate(cfg)
        except BadInput as e:
            invalid = f"{source_path}: {e}"
    run, run_origins = _megatron_run(parsed, gpu, here_gpu, cublas_workspace_config, overridden, notes)
    origins = {**_origins(parsed, tables, args, lines, overrides, given, world, gpus, source_path), **run_origins}
    source = RunSource(path, parsed.format, cfg, run, origins, overridden, notes, refusals,
                       [e.argument for e in refused], parsed)
    source.invalid = invalid
    if strict and (refusals or invalid):
        raise BadInput(source.refusal() or invalid)
    return source


def _bridge_log_tables(parsed: ParsedRun, workload: str | None, refused: list, notes: list[str]):
    """A Bridge log's tables: its summary over the preset's GPT-model fields."""
    if not workload:
        raise bad(parsed.path, None, "is a Megatron Bridge log, whose summary does not state the GPT model's own fields "
                                     f"({', '.join(GPT_MODEL_FIELDS)}); pass --workload PRESET for them")
    base, _ = resolve(workload, overrides={"training.framework": "megatron"})
    notes.append(f"the GPT model's own fields ({', '.join(GPT_MODEL_FIELDS)}) come from preset {workload}: "
                 "Bridge's summary does not print them")
    args = bridge_arguments(parsed)
    try:
        tables = bridge_tables(args, base, refused)
    except BadInput as e:
        raise bad(parsed.path, None, f"{e}") from None
    tables["parallel"].pop("data_parallel_size", None)  # the GPU count is the file's or --gpus, not the preset's
    return args, tables


def _read_names() -> set[str]:
    """Every argument whose value becomes a Config field: a shell variable left in one is no value."""
    from recompute_bench.ingest.megatron_args import FIELD_ARGUMENTS

    names = {n for section in SAME_NAME.values() for n in section}
    return names | {n for args in FIELD_ARGUMENTS.values() for n in args}


def _unexpanded(parsed: ParsedRun, args: Mapping[str, Any], lines: dict[str, int], path: Path) -> None:
    for name in sorted(_read_names() & set(args)):
        value = args[name]
        if isinstance(value, str) and "$" in value:
            raise bad(path, lines.get(name), f"{_spelling(parsed, name)} is {value}, a shell variable the file does "
                                             "not set; write its value there")


def _stated_world(parsed: ParsedRun, args: Mapping[str, Any]) -> int | None:
    """The GPU count the file states: a log's world_size, torchrun's, Bridge's data-parallel size."""
    world = args.get("world_size") or parsed.world_size
    return world if isinstance(world, int) and not isinstance(world, bool) and world > 0 else None


def _flag(path: str, overrides: Mapping[str, Any]) -> str:
    """How the command line gave the field at `path`: its flag, or --set."""
    from recompute_bench.config.fields import field, key_of

    section, _, attribute = path.partition(".")
    try:
        f = field(key_of(section, attribute))
        f = f if f.path == path else None  # another section's field of that name is not this one
    except KeyError:
        f = None
    # recompute flags replace the whole setting: the fields they imply are theirs too
    flagged = path in overrides or (path.startswith("recompute.") and any(k.startswith("recompute.") for k in overrides))
    return f.option if flagged and f is not None and f.flag is not None else f"--set {path}"


def _overridden(before: dict, after: dict, overrides: Mapping[str, Any], sets, given: Mapping[str, Any],
                args: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(flag, value, the file's value) for every value a flag changed (the file's argument where the
    Config held none: one it could not express); `given`: the command line's values
    (`command_line_values`)."""
    set_paths = {key for key in command_line_values({}, sets)}
    out = []
    for section in SECTIONS:
        for name in sorted(set(before[section]) | set(after[section])):
            old, new = before[section].get(name), after[section].get(name)
            path = f"{section}.{name}"
            if old is None:
                old = next((args[a] for a in field_arguments(path) if args.get(a) is not None), None)
            if old == new or (path not in given and section != "recompute"):
                continue
            if section == "recompute" and not any(k.startswith("recompute.") for k in given):
                continue
            out.append((_flag(path, {} if path in set_paths else overrides), new, old))
    return out


def _layout(tables: dict, args: Mapping[str, Any], world: int | None, given: Mapping[str, Any], path: Path) -> None:
    """The data-parallel size from the GPU count (arguments.py validate_args: world / (tp x pp x cp)),
    unless a flag gives it (`given`: the command line's values), and the global batch Megatron
    defaults to when the file does not state one (micro-batch x data-parallel)."""
    par, tr = tables["parallel"], tables["training"]
    if "parallel.data_parallel_size" not in given:
        if world is None:
            raise bad(path, None, "states no GPU count; pass --gpus N (the run's world size), or --dp N")
        sizes = (par.get(key) or 1 for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                "context_parallel_size"))
        try:
            par["data_parallel_size"] = data_parallel_size(world, *sizes)
        except BadInput as e:
            raise bad(path, None, f"{e}") from None
    if "global_batch_size" not in args and "training.global_batch_size" not in given:
        tr["global_batch_size"] = (tr.get("micro_batch_size") or 1) * par["data_parallel_size"]


def pick_gpu(gpu: str | None, stated: str | None, here_gpu: str | None) -> tuple[str, str]:
    """The GPU kind framework megatron models and where it came from: `gpu` (--gpu), else the one
    the file states ("the file"), else this machine's (`here_gpu`, unless "cpu"), else DEFAULT_GPU
    ("the default"); BadInput for a kind Megatron's terms do not know."""
    if gpu is not None:
        kind, origin = gpu, "--gpu"
    elif stated is not None:
        kind, origin = stated, "the file"
    elif here_gpu and here_gpu != "cpu":
        kind, origin = here_gpu, "this machine's GPU"
    else:
        kind, origin = DEFAULT_GPU, "the default"
    if kind not in COMPUTE_CAPABILITY:
        raise BadInput(f"unknown GPU kind {kind!r} for framework megatron; pass --gpu with one of "
                       f"{', '.join(COMPUTE_CAPABILITY)}")
    return kind, origin


def _megatron_run(parsed: ParsedRun, gpu: str | None, here_gpu: str | None, cublas: str | None,
                  overridden: list, notes: list[str]) -> tuple[MegatronRun, dict[str, str]]:
    """The GPU kind and CUBLAS_WORKSPACE_CONFIG, and where each came from."""
    stated = gpu_type(parsed.device_name) if parsed.device_name else None
    kind, origin = pick_gpu(gpu, stated, here_gpu)
    if origin == "--gpu" and stated is not None and stated != gpu:
        overridden.append(("--gpu", gpu, stated))
    if origin == "the file":
        origin = f"{parsed.path.name} (its platform)"
    if origin == "the default":
        notes.append(f"the file names no GPU and there is none here: Megatron's GPU-dependent terms (workspaces, TE's "
                     f"attention kernel) are {DEFAULT_GPU}'s; pass --gpu a100, gb200, ... for another")
    env = parsed.env.get("CUBLAS_WORKSPACE_CONFIG")
    workspace, where = (str(env), f"{(parsed.config_file or parsed.path).name}'s environment") if env is not None else \
        (cublas, "this environment") if cublas is not None else (None, "torch's default")
    return MegatronRun(kind, workspace), {"gpu": origin, "cublas_workspace_config": where}


def _origins(parsed: ParsedRun, tables: dict, args: Mapping[str, Any], lines: dict[str, int],
             overrides: Mapping[str, Any], given: Mapping[str, Any], world: int | None, gpus: int | None,
             path: Path) -> dict[str, str]:
    """Field path -> where its value came from (`given`: the command line's values)."""
    from recompute_bench.config.fields import fields

    by_path = {f.path: f for f in fields()}
    recompute_given = any(k.startswith("recompute.") for k in given)
    out = {}
    for section, values in tables.items():
        for name in values:
            key = f"{section}.{name}"
            if key in given or (section == "recompute" and recompute_given):
                f = by_path.get(key)
                out[key] = "--set" if key not in overrides or f is None or f.flag is None else f.option
                continue
            stated = [a for a in field_arguments(key) if a in args]
            if key == "training.framework":
                out[key] = "a Megatron run"
            elif stated:
                line = lines.get(stated[0])
                out[key] = f"{path.name}{':' + str(line) if line else ''} ({_spelling(parsed, stated[0])})"
            elif key == "parallel.data_parallel_size" and world is not None:
                out[key] = ("--gpus" if gpus is not None else f"{path.name} (its GPU count)") + " / (tp x pp x cp)"
            elif parsed.format == bridge_log.FORMAT and name in GPT_MODEL_FIELDS:
                out[key] = "the preset (--workload)"
            else:
                out[key] = "Megatron's default"
    return out
