"""What `plan --framework megatron --search-layouts` prints: the search in one line, the best
layouts with their setting, predicted TFLOP/s per GPU, step and peak, and each one's flags."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table


def search_line(result: dict[str, Any]) -> str:
    """One line: the model, the GPUs, the budget and what the search priced."""
    s = result["searched"]
    fixed = f"; fixed: {', '.join(result['fixed'])}" if result["fixed"] else ""
    return (f"{result['workload']} on {result['gpus']} x {result['rates']['product']}, "
            f"{result['budget_bytes'] / 2**30:g} GiB: {s['layouts']} layouts, {s['refused']} refused by Megatron's "
            f"rules, {s['over_static_memory']} over the budget before any activation, {s['priced']} priced, "
            f"{s['searched_settings']} searched for a setting ({s['pruned']} could not beat the best){fixed}; "
            f"rates: {result['rates']['source']}")


def layouts_table(result: dict[str, Any]) -> Table:
    """The best layouts, fastest first."""
    table = Table(title="best layouts that fit, by predicted TFLOP/s per GPU", header_style="bold")
    for col in ("#", "layout", "setting", "TFLOP/s/GPU", "step (s)", "peak (GiB)", "with allowance", "stage"):
        table.add_column(col, justify="left" if col in ("layout", "setting") else "right")
    for i, r in enumerate(result["layouts"], 1):
        table.add_row(str(i), escape(r["layout_label"]), escape(r["setting"]), f"{r['tflops_per_gpu']:.0f}",
                      f"{r['step_seconds']:.3f}", f"{r['peak_allocated_bytes'] / 2**30:.1f}",
                      f"{r['device_bytes_needed'] / 2**30:.1f}", str(r["peak_stage"]))
    return table
