"""The estimate of framework megatron against the memory Megatron-LM's own functional tests measured.

`tests/data/megatron/cases.json` (written by bench/megatron_cases.py from a Megatron-LM checkout)
holds each GPT case's arguments, environment, GPU count and, per golden file (dev or lts, DGX A100,
H100 or GB200), the last step's `mem-allocated-bytes` (after the optimizer step) and
`mem-max-allocated-bytes` (the peak since the process started), both logged by the last rank. Each
case whose arguments the estimate can express is mapped onto a Config (`megatron_args`) and
estimated on the last pipeline stage (`analysis.megatron.stage_peak`): its peak against the
golden's peak, and what it holds after the step (parameters, gradients, optimizer state, buffers)
against the golden's allocated bytes. The rest are skipped, each with the reason.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recompute_bench.analysis.megatron import MegatronRun, stage_peak
from recompute_bench.ingest.megatron_args import config_from_megatron
from recompute_bench.ingest.megatron_argv import normalize
from recompute_bench.config.schema import BadInput

GOAL = {"median_peak_error": 0.03, "peak_within_5_percent": 0.90, "median_static_error": 0.05}
"""The goal the check is held to, overall and in every category."""

CATEGORIES = ("dense", "MoE", "context parallel", "FP8", "MLA", "CUDA graphs", "offload")
"""What a case exercises beyond a dense GPT; a case is counted in each of its categories, and in
"dense" when it has none of the others."""


def categories(args: dict[str, Any]) -> tuple[str, ...]:
    """The categories of a case, from its Megatron arguments (names as the yaml spells them)."""
    a = normalize(args)
    found = []
    if a.get("num_experts"):
        found.append("MoE")
    if (a.get("context_parallel_size") or 1) > 1:
        found.append("context parallel")
    if a.get("fp8") or a.get("fp8_format") or a.get("fp8_recipe"):
        found.append("FP8")
    if a.get("multi_latent_attention"):
        found.append("MLA")
    if a.get("cuda_graph_impl") not in (None, "none") or a.get("enable_cuda_graph") or a.get("external_cuda_graph"):
        found.append("CUDA graphs")
    if a.get("cpu_offloading") or a.get("fine_grained_activation_offloading"):
        found.append("offload")
    return tuple(found) or ("dense",)


@dataclass(frozen=True)
class CheckRow:
    """One golden file of one case: the estimate beside what Megatron measured."""

    case: str
    golden: str
    """dev_h100, lts_a100, ...: the environment and GPU kind of the golden file."""
    gpus: int
    layout: str
    estimated_peak_bytes: float
    measured_peak_bytes: float
    estimated_static_bytes: float
    measured_static_bytes: float
    phase: str
    categories: tuple[str, ...] = ("dense",)

    @property
    def peak_error(self) -> float:
        return self.estimated_peak_bytes / self.measured_peak_bytes - 1

    @property
    def static_error(self) -> float:
        return self.estimated_static_bytes / self.measured_static_bytes - 1


def load_cases(path: Path | str) -> dict[str, Any]:
    """Case data as bench/megatron_cases.py writes it (source repository, commit, cases)."""
    return json.loads(Path(path).read_text())


def check(data: dict[str, Any]) -> tuple[list[CheckRow], dict[str, list[str]]]:
    """Every golden of every case: a CheckRow where the estimate can express the case, else the
    reason it is skipped (reason -> ["case golden [categories]", ...])."""
    rows, skipped = [], {}
    for case in data["cases"]:
        kinds = categories(case["args"])
        for name, golden in case["goldens"].items():
            reason = None
            if case["mode"] != "training":
                reason = f"not a training run ({case['mode']})"
            elif not golden["gpus"]:
                reason = "GPU count unknown (no recipe runs the case)"
            else:
                try:
                    cfg = config_from_megatron(case["args"], world_size=golden["gpus"], workload=case["case"])
                except BadInput as e:
                    reason = str(e)
            if reason:
                skipped.setdefault(reason, []).append(f"{case['case']} {name} [{', '.join(kinds)}]")
                continue
            run = MegatronRun(name.split("_")[1], case["env"].get("CUBLAS_WORKSPACE_CONFIG"))
            par = cfg.parallel
            peak = stage_peak(cfg, par.pipeline_model_parallel_size - 1, run)
            layout = (f"tp{par.tensor_model_parallel_size} pp{par.pipeline_model_parallel_size}"
                      + (f" vp{par.virtual_pipeline_model_parallel_size}" if par.virtual_pipeline_model_parallel_size else "")
                      + (f" cp{par.context_parallel_size}" if par.context_parallel_size > 1 else "")
                      + f" dp{par.data_parallel_size}")
            rows.append(CheckRow(case["case"], name, golden["gpus"], layout, peak.peak_allocated_bytes,
                                 golden["max_allocated_bytes"], peak.static_bytes, golden["allocated_bytes"], peak.phase, kinds))
    return rows, skipped


def summary(rows: list[CheckRow], category: str | None = None) -> dict[str, float]:
    """The figures the goal is stated in: median |peak error|, the share of rows within 5%, the
    median |static error|, and how many rows and cases; of one category's rows when given (an
    empty category has 0 rows and no figures)."""
    if category is not None:
        rows = [r for r in rows if category in r.categories]
        if not rows:
            return {"rows": 0, "cases": 0}
    peak = [abs(r.peak_error) for r in rows]
    return {"rows": len(rows), "cases": len({r.case for r in rows}),
            "median_peak_error": statistics.median(peak),
            "peak_within_5_percent": sum(e <= 0.05 for e in peak) / len(peak),
            "worst_peak_error": max(peak),
            "median_static_error": statistics.median(abs(r.static_error) for r in rows)}


def skipped_in(skipped: dict[str, list[str]], category: str) -> int:
    """How many skipped goldens belong to `category`."""
    return sum(entry.endswith("]") and category in entry.rsplit("[", 1)[1][:-1].split(", ")
               for entries in skipped.values() for entry in entries)


def meets_goal(figures: dict[str, float]) -> bool:
    """Whether `summary`'s figures meet GOAL (a category without rows does not)."""
    return bool(figures["rows"]) and (figures["median_peak_error"] <= GOAL["median_peak_error"]
            and figures["peak_within_5_percent"] >= GOAL["peak_within_5_percent"]
            and figures["median_static_error"] <= GOAL["median_static_error"])
