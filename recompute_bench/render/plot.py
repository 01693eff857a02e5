"""The report of a sweep: a Markdown page and the Pareto plot a user looks at to choose a setting.

The plot puts speed on the x axis and memory on the y axis, one point per setting: the best settings
sit bottom right, and the Pareto front (no other setting is both faster and smaller) is drawn as a
line. Speed is TFLOP/s/GPU where the wall clock means something (a GPU); on a CPU, where the same
point's time swings many-fold with the machine's load, it is the relative speed the FLOPs run
predict: the fewest FLOPs any setting of the same shape ran over this setting's (1 for no
recompute, about 0.75 for full recompute), and the axis says so. Memory is the peak allocated by the
allocator where it was measured (CUDA); where it was not (CPU), the bytes saved for backward stand
in, and the axis says so. The device's memory (NVML) is drawn when known, and points that ran out of
memory are marked with a red X at the left edge (they have no speed). Labels are placed so that none
covers another (`place_labels`).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from recompute_bench import __version__
from recompute_bench.config.schema import BadInput
from recompute_bench.render.tables import NOT_MEASURED, fmt_bytes, fmt_seconds
from recompute_bench.results.rows import SHAPE_COLUMNS
from recompute_bench.render.comparison import fmt_tflops


def _num(x) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def memory_axis(df: pd.DataFrame) -> tuple[str, str]:
    """(column, axis label): peak allocated where measured, else activation bytes."""
    if "peak_allocated_bytes" in df and df["peak_allocated_bytes"].notna().any():
        return "peak_allocated_bytes", "peak allocated memory per GPU"
    return "activation_bytes", "activation bytes saved for backward"


def speed_axis(df: pd.DataFrame) -> tuple[pd.Series, str]:
    """(speed per row, axis label): TFLOP/s/GPU where a GPU measured the points; on a CPU the
    relative speed from FLOPs run (the fewest measured FLOPs among the points of the same shape
    over the row's), since CPU wall-clock time is noise. NaN where there is none (an OOM)."""
    on_cpu = "device" in df and df["device"].notna().any() and (df["device"].dropna() == "cpu").all()
    if not on_cpu or "measured_flops_per_step" not in df or df["measured_flops_per_step"].isna().all():
        return df["tflops_per_gpu"].astype(float), "TFLOP/s/GPU (model FLOPs; higher is better)"
    flops = df["measured_flops_per_step"].astype(float)
    shape = df[list(SHAPE_COLUMNS)].astype(str).agg("|".join, axis=1)
    fewest = flops.groupby(shape).transform("min")
    return (fewest / flops).where(df["status"] == "ok"), ("relative speed from FLOPs run: fewest FLOPs of the same "
                                                          "shape / this setting's (CPU time is noise; higher is better)")


def pareto_front(df: pd.DataFrame, memory: str, speed: pd.Series | None = None) -> list[int]:
    """Index labels of the ok points no other ok point beats on both speed (higher; default
    TFLOP/s/GPU) and memory (lower)."""
    speed = df["tflops_per_gpu"] if speed is None else speed
    ok = df[(df["status"] == "ok") & speed.notna() & df[memory].notna()]
    x, y = speed[ok.index], ok[memory]
    front = []
    for i in ok.index:
        dominated = ((x >= x[i]) & (y <= y[i]) & ((x > x[i]) | (y < y[i]))).any()
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


# Where a label may go around its point (offsets in points), nearest first; a far one gets a leader line.
_OFFSETS = [(dx * r, dy * r) for r in (1, 2, 3, 4) for dx, dy in ((5, 3), (5, -11), (-5, 3), (-5, -11), (0, 9), (0, -17))]


def place_labels(ax, points: list[tuple[float, float, str, str]], fontsize: float = 7) -> list:
    """Annotate each (x, y, text, color) in data coordinates, trying `_OFFSETS` in turn and taking
    the first where the label overlaps no label placed before it and no marker and stays inside the
    axes (else the one overlapping least); a label away from its point gets a leader line. Call it
    once the axes' limits and layout are final. Returns the annotations."""
    renderer = ax.figure.canvas.get_renderer()
    markers = [ax.transData.transform((x, y)) for x, y, _, _ in points]
    inside = ax.get_window_extent(renderer)
    placed, out = [], []

    def overlap(a, b) -> float:
        w, h = min(a.x1, b.x1) - max(a.x0, b.x0), min(a.y1, b.y1) - max(a.y0, b.y0)
        return w * h if w > 0 and h > 0 else 0.0

    def cost(box) -> float:
        area = box.width * box.height
        outside = not (inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1)
        return (sum(overlap(box, b) for b in placed) + area * sum(box.contains(*m) for m in markers)
                + (area if outside else 0.0))

    def annotate(x, y, text, color, offset, line=False):
        return ax.annotate(text, (x, y), xytext=offset, textcoords="offset points", fontsize=fontsize, color=color,
                           ha="left" if offset[0] >= 0 else "right",
                           arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.5", "shrinkB": 3} if line else None)

    for x, y, text, color in sorted(points, key=lambda p: (p[0], p[1])):
        tried = []
        for offset in _OFFSETS:
            probe = annotate(x, y, text, color, offset)
            box = probe.get_window_extent(renderer).expanded(1.05, 1.1)
            probe.remove()
            tried.append((cost(box), len(tried), offset, box))
            if tried[-1][0] == 0:
                break
        _, index, offset, box = min(tried)
        out.append(annotate(x, y, text, color, offset, line=index >= 6))  # beyond the first ring
        placed.append(box)
    return out


def plot_pareto(df: pd.DataFrame, path: Path, title: str) -> Path:
    """Write the Pareto plot (PNG) of the results and return its path."""
    import matplotlib.pyplot as plt

    fig = draw_pareto(df, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def draw_pareto(df: pd.DataFrame, title: str):
    """The Pareto plot of the results as a matplotlib Figure (Agg): points, front, labels, axes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory, ylabel = memory_axis(df)
    speed, xlabel = speed_axis(df)
    values = [v for v in df[memory].dropna()] + [v for v in df.get("memory_limit_bytes", pd.Series(dtype=float)).dropna()]
    scale, unit = next(((s, u) for s, u in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))
                        if values and max(values) >= s), (1, "B"))
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    ok = df[(df["status"] == "ok") & speed.notna() & df[memory].notna()]
    ax.scatter(speed[ok.index], ok[memory] / scale, s=36, color="tab:blue", zorder=3, label="setting")
    policies = ok[ok["setting"].str.startswith("policy ")]  # per-layer policies (plan --auto, --policy)
    if len(policies):
        ax.scatter(speed[policies.index], policies[memory] / scale, marker="*", s=160, color="tab:orange",
                   zorder=4, label="per-layer policy")
    front = pareto_front(df, memory, speed)
    if front:
        order = speed[front].sort_values().index
        ax.step(speed[order], df.loc[order, memory] / scale, where="post", color="tab:green", lw=1.2,
                zorder=2, label="Pareto front (faster and smaller)")
    limits = df["memory_limit_bytes"].dropna() if "memory_limit_bytes" in df else pd.Series(dtype=float)
    if len(limits):
        ax.axhline(limits.min() / scale, color="tab:red", ls="--", lw=1, label="device memory (NVML)")
    oom = df[df["status"] == "oom"]
    labels = [(speed[i], r[memory] / scale, f"{_label(r)}: {r['setting']}", "black") for i, r in ok.iterrows()]
    if len(oom):
        top = limits.min() if len(limits) else (ok[memory].max() if len(ok) else 1.0)
        ys = [(_num(r[memory]) or top) / scale for _, r in oom.iterrows()]
        ax.scatter([0.0] * len(oom), ys, marker="X", s=80, color="tab:red", zorder=4, label="out of memory")
        labels += [(0.0, y, f"{_label(r)}: {_oom(r)}", "tab:red") for (_, r), y in zip(oom.iterrows(), ys)]
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(f"{ylabel} [{unit}] (lower is better)", fontsize=9)
    ax.set_title(title if memory == "peak_allocated_bytes" else
                 f"{title}\n(peak memory not measured on this device: activation bytes shown)", fontsize=10)
    xmax = speed.max() if speed.notna().any() else 1.0
    ax.set_xlim(0, xmax * 1.35)  # room for the labels of the fastest points
    ymax = max([y for _, y, _, _ in labels] or [1.0])
    ax.set_ylim(0, ymax * 1.15)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    place_labels(ax, labels)
    return fig


def markdown_report(df: pd.DataFrame, title: str, image: str | None) -> str:
    """The Markdown report: environment, one row per setting with ratios to the baseline of the same
    shape, the Pareto-optimal settings, and the plot."""
    memory, _ = memory_axis(df)
    speed, xlabel = speed_axis(df)
    front = set(pareto_front(df, memory, speed))
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
    if not xlabel.startswith("TFLOP/s"):
        lines += ["", f"Speed on this device: {xlabel}."]
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
        raise BadInput("the results hold no record to report on; run `recompute-bench sweep` or `import` first")
    out_dir = Path(out_dir)
    png = plot_pareto(df, out_dir / "pareto.png", title)
    md = out_dir / "report.md"
    md.write_text(markdown_report(df, title, png.name) + "\n".join(["", *rank_lines(records or [])]))
    return md, png
