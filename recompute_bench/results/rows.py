"""Result records as rows: the key of a point, and one DataFrame for your own analysis.

A point's key is what makes two measurements comparable: the workload and every resolved field
that changes what is measured: each field of the model, training, parallel and recompute
dataclasses of `config/schema.py` except the measurement protocol (warm-up and measured steps).
`KEY_COLUMNS` is derived from the field registry (`config/fields.py`), so a new config field
becomes a key column by itself; each value is rendered as a string, the way the golden CSV holds
it. `config_hash` hashes the record's model/training/parallel tables as written, so a record whose
config has fields this version does not know (or lacks ones it does) is noticed instead of compared.

    >>> from recompute_bench.results.rows import load_results
    >>> df = load_results("results/20250101-120000-ab12")   # a run folder, or a .jsonl file
    >>> df[["experiment", "setting", "status", "tflops_per_gpu", "activation_bytes"]]
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from recompute_bench.config.schema import SECTIONS, BadInput
from recompute_bench.config.labels import recompute_label
from recompute_bench.config.fields import LATER_KEYS, PROTOCOL_KEYS, REQUIRED, fields
from recompute_bench.results.store import load_records

ENV_COLUMNS = ("device", "device_name", "torch_version", "package_version", "git_sha", "hostname", "time")
# The key: every registered field that changes what is measured (config/fields.py), in section and
# field order, each column under the field's Megatron name. This is what identifies a point.
KEY_FIELDS = tuple(f for f in fields() if f.in_key)
KEY_COLUMNS = ("workload", *(k.key for k in KEY_FIELDS))
# The columns that say which model and batch were measured, i.e. everything but the recompute setting:
# points with equal shape columns share a baseline.
SHAPE_COLUMNS = ("workload", *(k.key for k in KEY_FIELDS if k.section != "recompute"))


def key_text(value: Any) -> str:
    """A key value as the golden CSV spells it: "" for None, true/false, "+"-joined module lists."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "+".join(map(str, value))
    return str(value)


def key_fields(record: dict) -> dict[str, str]:
    """The KEY_COLUMNS of a result record, as strings. A field the record predates takes its
    default, so records written by earlier versions of the v1 schema keep their key."""
    try:
        tables = {s: (record["recompute"] if s == "recompute" else record["config"][s]) for s in SECTIONS}
        values = {"workload": record["workload"]}
        for k in KEY_FIELDS:
            table = tables[k.section]
            value = table[k.attribute] if k.default is REQUIRED else table.get(k.attribute, k.default)
            if k.is_float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            values[k.key] = value
    except (KeyError, TypeError, AttributeError) as e:
        raise BadInput(f"a record lacks {e} and is not a recompute-bench/result/v1 record; "
                          "pass results written by `recompute-bench run` or `sweep`") from None
    return {k: key_text(v) for k, v in values.items()}


def config_hash(record: dict) -> str:
    """Short hash of every resolved model/training/parallel field except the measurement protocol."""
    config = {s: dict(record["config"][s]) for s in ("model", "training", "parallel")}
    for name in PROTOCOL_KEYS:
        config["training"].pop(name, None)
    for f in fields():
        if f.section in config and f.key in LATER_KEYS and config[f.section].get(f.attribute, f.default) == f.default:
            config[f.section].pop(f.attribute, None)
    blob = json.dumps({"workload": record["workload"], **config}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def point_id(record: dict) -> tuple[str, ...]:
    """Identity of a measured point: its key values plus the config hash."""
    return (*key_fields(record).values(), config_hash(record))


def setting_label(record: dict) -> str:
    """The recompute setting in a few words ("selective[core_attn,mlp]", "full uniform 1")."""
    return recompute_label(**record["recompute"])


def record_row(record: dict) -> dict[str, Any]:
    """One flat row of a record: names are the record's own keys (metrics and env unprefixed)."""
    point = record.get("point") or {}
    failure = record.get("failure") or {}
    ranks = record.get("ranks") or []
    totals = [r.get("nvml_total_bytes") for r in ranks if r.get("nvml_total_bytes")]
    row: dict[str, Any] = {
        "run_id": point.get("run_id"),
        "experiment": point.get("name"),
        "setting": setting_label(record),
        **key_fields(record),
        "config_hash": config_hash(record),
        "status": record.get("status"),
        "failure_rank": failure.get("rank"),
        "failure_step": failure.get("step"),
        "failure_phase": failure.get("phase"),
        "failure_message": failure.get("message"),
        "num_ranks": len(ranks),
        "memory_limit_bytes": min(totals) if totals else None,
    }
    for name, value in (record.get("metrics") or {}).items():
        row[name] = value
    env = record.get("env") or {}
    for name in ENV_COLUMNS:
        row[name] = env.get(name)
    return row


def latest_per_point(records: Iterable[dict]) -> list[dict]:
    """The last record of each point, in the order the points first appear (a resumed or re-run
    point replaces its earlier record)."""
    latest: dict[tuple[str, ...], dict] = {}
    for record in records:
        latest[point_id(record)] = record
    return list(latest.values())


def results_files(path: Path) -> list[Path]:
    """The JSONL files a RESULTS argument names: a file, or a folder's results.jsonl (else its *.jsonl)."""
    path = Path(path)
    if path.is_dir():
        own = path / "results.jsonl"
        files = [own] if own.is_file() else sorted(path.glob("*.jsonl"))
        if not files:
            raise BadInput(f"folder {path} holds no results.jsonl or other .jsonl file; pass a run id, "
                              "a results folder or a JSONL file")
        return files
    if not path.is_file():
        raise BadInput(f"results {path} does not exist; pass a run id (a folder under results/), "
                          "a results folder or a JSONL file")
    return [path]


def load_result_records(path: Path, *, latest: bool = True) -> list[dict]:
    """Records from a results file or folder; by default only the latest record of each point."""
    records = [r for f in results_files(path) for r in load_records(f)]
    for n, record in enumerate(records, 1):
        if not isinstance(record, dict) or record.get("schema") != "recompute-bench/result/v1":
            raise BadInput(f"record {n} of {path} is not a recompute-bench/result/v1 record; "
                              "pass results written by `recompute-bench run` or `sweep`")
    return latest_per_point(records) if latest else records


def load_results(path: str | Path, *, latest: bool = True) -> pd.DataFrame:
    """Load results into a pandas DataFrame, one row per point.

    `path` is a JSONL file (`results/runs.jsonl`, `results/<run-id>/results.jsonl`) or a folder
    holding one. With `latest=True` (the default) a point measured more than once (a resumed run,
    a repeated `run`) keeps its last record; `latest=False` keeps every record.

    Columns: `run_id`, `experiment` (Baseline, Exp 1, ...; None for `run` records), `setting`,
    the key columns (`KEY_COLUMNS`, all strings: `workload`, then every field of the model,
    training and parallel config except `warmup_steps`/`measured_steps`, under the field's name
    (`num_layers`, `hidden_size`, ..., `seq_length`, ..., `tensor_model_parallel_size`, ...), then
    the recompute setting (`recompute_granularity`, `recompute_modules` ("+"-joined),
    `recompute_method`, `recompute_num_layers`, `activation_offload_layers`,
    `distribute_saved_activations`)), `config_hash`, `status`, `failure_rank`, `failure_step`, `failure_phase`,
    `failure_message`, `num_ranks`, `memory_limit_bytes` (device memory per rank from NVML, None
    where unknown), every metric of the record under its own name (`tflops_per_gpu`,
    `step_time_s`, `peak_allocated_bytes`, `activation_bytes`, ...; None where not measured), and
    the env fields `device`, `device_name`, `torch_version`, `package_version`, `git_sha`,
    `hostname`, `time`. Bad input raises `BadInput` with a one-line message.
    """
    rows = [record_row(r) for r in load_result_records(Path(path), latest=latest)]
    return pd.DataFrame(rows)
