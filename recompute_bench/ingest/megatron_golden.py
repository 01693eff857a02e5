"""Megatron-LM functional-test golden values: `tests/functional_tests/test_cases/<model>/<case>/
golden_values_<environment>_<platform>.json` beside that case's `model_config.yaml` (Megatron-LM
d98e8a64).

The JSON holds one object per metric, `{"start_step": 1, "end_step": 100, "step_interval": 1,
"values": {"1": 10.93, ...}}`, written from TensorBoard (`tests/functional_tests/python_test_utils/
get_test_results_from_tensorboard_logs.py`): `lm loss`, `iteration-time` (seconds), and with
`--log-memory-to-tensorboard` `mem-allocated-bytes` and `mem-max-allocated-bytes` (the allocator's peak
since the process started). The TensorBoard writer lives on the last rank (`megatron/training/
global_vars.py`, `_set_tensorboard_writer`: rank world_size - 1), so the memory is the last rank's.
A value that was not finite is the string "nan". The platform in the file name (`dgx_h100`) names
the GPU. `model_config.yaml` holds the run's arguments under `MODEL_ARGS` (`--num-layers: 12`).
"""

from __future__ import annotations

import re
from pathlib import Path

from recompute_bench.ingest.parsed import ParsedRun, RankMemory, Step, bad

FORMAT = "megatron-golden"
NAME = re.compile(r"^golden_values_(?P<env>[a-z]+)(?:_(?P<platform>.+?))?(?:_2nd)?\.json$")
METRIC_KEYS = {"start_step", "end_step", "step_interval", "values"}


def detect_json(data) -> bool:
    """Whether parsed JSON is Megatron-LM golden values (metric -> {start_step, ..., values})."""
    return isinstance(data, dict) and bool(data) and all(isinstance(v, dict) and "values" in v for v in data.values())


def read_model_config_file(path: Path) -> tuple[dict, dict, dict]:
    """A model_config.yaml read with PyYAML, as Megatron-LM's test runner reads it with yq
    (tests/functional_tests/shell_test_utils/_run_training.sh): `MODEL_ARGS` as {argument: value}
    (underscored names; a value is what YAML makes of it, a list such as "[mlp core_attn]" is left
    to `megatron_argv.normalize`), the line of each, and `ENV_VARS` (the environment of the run).
    Bad input names the file (and line) when it is no such file."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise bad(path, None, f"cannot be read ({e}); restore the test case's model_config.yaml") from None
    try:
        node, data = yaml.compose(text, Loader=yaml.SafeLoader), yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise bad(path, mark.line + 1 if mark else None, f"is not valid YAML ({getattr(e, 'problem', e)}); "
                                                          "repair that line") from None
    return model_config(path, data, node)


def model_config(path: Path, data, node) -> tuple[dict, dict, dict]:
    """`read_model_config_file` of a model_config.yaml already parsed: `data` as PyYAML loads it,
    `node` as it composes it (for the lines)."""
    section = data.get("MODEL_ARGS") if isinstance(data, dict) else None
    if not isinstance(section, dict) or not section:
        raise bad(path, None, "has no MODEL_ARGS; pass the model_config.yaml of a Megatron-LM functional-test case")
    lines = _key_lines(node, "MODEL_ARGS")
    arguments, where = {}, {}
    for key, value in section.items():
        if not str(key).startswith("--"):
            raise bad(path, lines.get(key), f"MODEL_ARGS holds {key!r}, which is no --argument; repair that line")
        name = str(key)[2:].replace("-", "_")
        arguments[name] = value
        if key in lines:
            where[name] = lines[key]
    env = data.get("ENV_VARS") or {}
    if not isinstance(env, dict):
        raise bad(path, None, "ENV_VARS is not a mapping of variable: value; repair it")
    return arguments, where, {str(k): v for k, v in env.items()}


def _key_lines(node, section: str) -> dict:
    """The line (from 1) of each key of the mapping `section` of a composed YAML document."""
    for key, value in getattr(node, "value", None) or []:
        if getattr(key, "value", None) == section and hasattr(value, "value"):
            return {k.value: k.start_mark.line + 1 for k, _ in value.value if hasattr(k, "value")}
    return {}


def _number(value, path: Path, metric: str, step: str) -> float | None:
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf"):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(path, None, f"{metric} at step {step} is {value!r}, not a number; restore the golden file")
    return float(value)


def read(path: Path, data: dict) -> ParsedRun:
    """Read golden values (already parsed JSON) and the model_config.yaml beside them."""
    path = Path(path)
    config = path.parent / "model_config.yaml"
    if not config.is_file():
        raise bad(path, None, f"has no model_config.yaml beside it ({config}); keep the golden file in its test-case "
                              "folder, next to the model_config.yaml that ran it")
    m = NAME.match(path.name)
    run = ParsedRun(FORMAT, path, timing="megatron", complete=True, config_file=config, name=path.parent.name,
                    device_name=(m.group("platform") if m else None),
                    memory_rule="the last step's mem-max-allocated-bytes (the last rank, peak since the process "
                                "started; TensorBoard is written by rank world_size - 1)")
    run.arguments, run.argument_lines, run.env = read_model_config_file(config)
    series = {name: {int(step): _number(v, path, name, step) for step, v in (metric.get("values") or {}).items()}
              for name, metric in data.items()}
    steps = sorted(set().union(*(s.keys() for s in series.values())))
    get = lambda name, step: series.get(name, {}).get(step)  # noqa: E731
    run.steps = [Step(s, 0, step_time_s=get("iteration-time", s), loss=get("lm loss", s)) for s in steps
                 if get("iteration-time", s) is not None or get("lm loss", s) is not None]
    if not any(s.step_time_s is not None for s in run.steps):
        raise bad(path, None, "has no iteration-time values, so there is no step time to import; pass a golden file "
                              "of a test case whose METRICS include iteration-time")
    peaks = series.get("mem-max-allocated-bytes") or {}
    finite = [s for s, v in peaks.items() if v is not None]
    if finite:
        last = max(finite)
        # The rank is the last one; its number needs the world size, which record.py knows. -1 marks it.
        run.ranks[-1] = RankMemory(-1, 0, after_step=last, peak_allocated_bytes=peaks[last],
                                   allocated_bytes=get("mem-allocated-bytes", last))
    return run
