"""The report of a sweep: a Markdown page and the Pareto plot a user looks at to choose a setting.

The plot puts TFLOP/s/GPU on the x axis and memory on the y axis, one point per setting: the best
settings sit bottom right, and the Pareto front (no other setting is both faster and smaller) is
drawn as a line. Memory is the peak allocated by the allocator where it was measured (CUDA); where
it was not (CPU), the bytes saved for backward stand in, and the axis says so. The device's memory
(NVML) is drawn when known, and points that ran out of memory are marked with a red X at the left
edge (they have no TFLOP/s).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from recompute_bench import __version__
from recompute_bench.spec.config import ConfigError
from recompute_bench.render.tables import NOT_MEASURED, fmt_bytes, fmt_seconds
from recompute_bench.results.records import SHAPE_COLUMNS
from recompute_bench.render.comparison import fmt_tflops


def _num(x) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def memory_axis(df: pd.DataFrame) -> tuple[str, str]:
    """(column, axis label): peak allocated where measured, else activation bytes."""
    if "peak_allocated_bytes" in df and df["peak_allocated_bytes"].notna().any():
        return "peak_allocated_bytes", "peak allocated memory per GPU"
    return "activation_bytes", "activation bytes saved for backward"


def pareto_front(df: pd.DataFrame, memory: str) -> list[int]:
    """Index labels of the ok points no other ok point beats on both TFLOP/s (higher) and memory (lower)."""
    ok = df[(df["status"] == "ok") & df["tflops_per_gpu"].notna() & df[memory].notna()]
    front = []
    for i, r in ok.iterrows():
        dominated = ((ok["tflops_per_gpu"] >= r["tflops_per_gpu"]) & (ok[memory] <= r[memory]) &
                     ((ok["tflops_per_gpu"] > r["tflops_per_gpu"]) | (ok[memory] < r[memory]))).any()
        if not dominated:
            front.append(i)
    return front


def _baselines(df: pd.DataFrame) -> dict[tuple, pd.Series]:
    base = df[(df["recompute_granularity"] == "none") & (df["status"] == "ok")]
    return {tuple(r[c] for c in SHAPE_COLUMNS): r for _, r in base.iterrows()}


def _ratio(value, base) -> str:
    value, base = _num(value), _num(base)
    if value is None or not base:
        return ""
    return f"{value / base:.2f}x"


def _oom(r: pd.Series) -> str:
    rank = _num(r.get("failure_rank"))
    return f"OOM rank{int(rank)}" if rank is not None else "OOM"


def _label(r: pd.Series) -> str:
    return r["experiment"] if isinstance(r.get("experiment"), str) and r["experiment"] else r["setting"]


def plot_pareto(df: pd.DataFrame, path: Path, title: str) -> Path:
    """Write the Pareto plot (PNG) of the results and return its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory, ylabel = memory_axis(df)
    values = [v for v in df[memory].dropna()] + [v for v in df.get("memory_limit_bytes", pd.Series(dtype=float)).dropna()]
    scale, unit = next(((s, u) for s, u in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))
                        if values and max(values) >= s), (1, "B"))
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    ok = df[(df["status"] == "ok") & df["tflops_per_gpu"].notna() & df[memory].notna()]
    ax.scatter(ok["tflops_per_gpu"], ok[memory] / scale, s=36, color="tab:blue", zorder=3, label="setting")
    policies = ok[ok["setting"].str.startswith("policy ")]  # per-layer policies (plan --auto, --policy)
    if len(policies):
        ax.scatter(policies["tflops_per_gpu"], policies[memory] / scale, marker="*", s=160, color="tab:orange",
                   zorder=4, label="per-layer policy")
    for _, r in ok.iterrows():
        ax.annotate(f"{_label(r)}: {r['setting']}", (r["tflops_per_gpu"], r[memory] / scale), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    front = df.loc[pareto_front(df, memory)].sort_values("tflops_per_gpu")
    if len(front):
        ax.step(front["tflops_per_gpu"], front[memory] / scale, where="post", color="tab:green", lw=1.2,
                zorder=2, label="Pareto front (faster and smaller)")
    limits = df["memory_limit_bytes"].dropna() if "memory_limit_bytes" in df else pd.Series(dtype=float)
    if len(limits):
        ax.axhline(limits.min() / scale, color="tab:red", ls="--", lw=1, label="device memory (NVML)")
    oom = df[df["status"] == "oom"]
    if len(oom):
        top = limits.min() if len(limits) else (ok[memory].max() if len(ok) else 1.0)
        ys = [(_num(r[memory]) or top) / scale for _, r in oom.iterrows()]
        x0 = 0.0
        ax.scatter([x0] * len(oom), ys, marker="X", s=80, color="tab:red", zorder=4, label="out of memory")
        for (_, r), y in zip(oom.iterrows(), ys):
            ax.annotate(f"{_label(r)}: {_oom(r)}", (x0, y), fontsize=7, color="tab:red",
                        xytext=(6, -10), textcoords="offset points")
    ax.set_xlabel("TFLOP/s/GPU (model FLOPs; higher is better)")
    ax.set_ylabel(f"{ylabel} [{unit}] (lower is better)", fontsize=9)
    ax.set_title(title if memory == "peak_allocated_bytes" else
                 f"{title}\n(peak memory not measured on this device: activation bytes shown)", fontsize=10)
    xmax = df["tflops_per_gpu"].max() if df["tflops_per_gpu"].notna().any() else 1.0
    ax.set_xlim(0, xmax * 1.3)  # room for the labels of the fastest points
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def markdown_report(df: pd.DataFrame, title: str, image: str | None) -> str:
    """The Markdown report: environment, one row per setting with ratios to the baseline of the same
    shape, the Pareto-optimal settings, and the plot."""
    memory, _ = memory_axis(df)
    front = set(pareto_front(df, memory))
    baselines = _baselines(df)
    env = df.iloc[0]
    measured_with = ", ".join(dict.fromkeys(str(v) for v in df.get("package_version", pd.Series(dtype=str)).dropna()))
    lines = [f"# {title}", "",
             f"device `{env.get('device_name')}`, torch {env.get('torch_version') or 'n/a'}, "
             f"measured with recompute-bench {measured_with or 'n/a'} (git {str(env.get('git_sha') or 'n/a')[:10]}), "
             f"{len(df)} points; report written by recompute-bench {__version__}", "",
             "| Experiment | recompute setting | status | TFLOP/s/GPU | step time | Peak Mem | Activations "
             "| activations vs baseline | FLOPs run vs baseline | Pareto |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in df.iterrows():
        base = baselines.get(tuple(r[c] for c in SHAPE_COLUMNS))
        status = _oom(r) if r["status"] == "oom" else r["status"]
        lines.append(
            f"| {_label(r)} | `{r['setting']}` | {status} | {fmt_tflops(_num(r.get('tflops_per_gpu')))} | "
            f"{fmt_seconds(_num(r.get('step_time_s')))} | {fmt_bytes(_num(r.get('peak_allocated_bytes')))} | "
            f"{fmt_bytes(_num(r.get('activation_bytes')))} | "
            f"{_ratio(r.get('activation_bytes'), None if base is None else base.get('activation_bytes'))} | "
            f"{_ratio(r.get('measured_flops_per_step'), None if base is None else base.get('measured_flops_per_step'))} | "
            f"{'yes' if i in front else ''} |")
    names = [f"{_label(df.loc[i])} (`{df.loc[i]['setting']}`)" for i in front]
    lines += ["", f"Pareto-optimal (no other setting is both faster and uses less "
                  f"{'peak memory' if memory == 'peak_allocated_bytes' else 'activation memory'}): "
                  f"{', '.join(names) or 'none'}.", ""]
    if memory != "peak_allocated_bytes":
        lines += [f"Peak memory is {NOT_MEASURED} (not measured) on this device; the plot uses the bytes saved "
                  "for backward instead, measured the same way on every device.", ""]
    lines += ["FLOPs run vs baseline: FLOPs counted over one step (recompute included) over the baseline's; "
              "activations vs baseline: bytes saved for backward over the baseline's.", ""]
    if image:
        lines += [f"![Pareto plot]({image})", ""]
    return "\n".join(lines)


def write_report(df: pd.DataFrame, out_dir: Path, title: str, records: list[dict] | None = None) -> tuple[Path, Path]:
    """Write `report.md` and `pareto.png` into `out_dir`; returns both paths. `records` (the rows'
    records) add each rank's measured memory beside its estimate where the records carry one."""
    from recompute_bench.render.ranks import rank_lines

    if df.empty:
        raise ConfigError("the results hold no record to report on; run `recompute-bench sweep` or `import` first")
    out_dir = Path(out_dir)
    png = plot_pareto(df, out_dir / "pareto.png", title)
    md = out_dir / "report.md"
    md.write_text(markdown_report(df, title, png.name) + "\n".join(["", *rank_lines(records or [])]))
    return md, png
