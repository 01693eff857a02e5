"""What `plan --framework megatron` prints: the settings that fit with every stage's peak and the
predicted throughput, the flags to paste, the allowance's parts, the time's parts on request, what
would fit, and `--auto`'s per-stage and per-layer comparison."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table

FIT_WORDS = {"fits": "[green]yes[/]", "tight": "[yellow]tight[/]", "over": "[red]no[/]"}


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def layout_line(result: dict[str, Any]) -> str:
    """One line: the run's layout, the GPU and where its rates come from."""
    par, tr = result["config"]["parallel"], result["config"]["training"]
    vp = par["virtual_pipeline_model_parallel_size"]
    rates = result["rates"]
    cp, ep = par["context_parallel_size"], par["expert_model_parallel_size"]
    cp_words = f", cp {cp} ({par['cp_comm_type']})" if cp > 1 else ""
    return (f"{result['workload']} on {result['gpus']} x {rates['product']}: tp {par['tensor_model_parallel_size']}"
            f"{' +sp' if par['sequence_parallel'] else ''}, pp {par['pipeline_model_parallel_size']}"
            f"{f' vp {vp}' if vp else ''}{cp_words}"
            f"{f', ep {ep}' if ep > 1 else ''}, dp {par['data_parallel_size']}, {tr['precision']}"
            f"{' (' + tr['fp8_recipe'] + ')' if tr['precision'] == 'fp8' else ''}, micro-batch "
            f"{tr['micro_batch_size']} x {result['num_microbatches']}, seq {tr['seq_length']}; rates: {rates['source']}")


def settings_table(result: dict[str, Any], rows: list[dict[str, Any]], title: str) -> Table:
    """Settings with each pipeline stage's allocated peak, the most loaded stage's need with the
    allowance, whether it fits, the predicted step, its model TFLOP/s, tokens/s per GPU and MFU, and
    the throughput against no recompute."""
    table = Table(title=title, header_style="bold")
    p = len(rows[0]["stages"]) if rows else 1
    stage_col = "peak allocated (GiB)" if p == 1 else "peak allocated per stage (GiB)"
    for col in ("#", "setting", stage_col, "with allowance", "fits", "step (s)", "TFLOP/s/GPU", "tokens/s/GPU", "MFU",
                "rel. TFLOP/s"):
        table.add_column(col, justify="left" if col in ("setting", stage_col) else "right")
    for i, r in enumerate(rows, 1):
        peaks = " ".join(_gib(s["peak_allocated_bytes"]) for s in r["stages"])
        mark = " *" if r["label"] == result.get("current") else ""
        table.add_row(str(i), escape(r["label"]) + mark, peaks, _gib(r["device_bytes_needed"]), FIT_WORDS[r["fit"]],
                      f"{r['step_seconds']:.3f}", f"{r['tflops_per_gpu']:.0f}", f"{r['tokens_per_s_per_gpu']:.0f}",
                      f"{100 * r['mfu']:.1f}%", f"{r['relative_throughput']:.3f}")
    return table


CLASS_WORDS = {"gemm": "GEMMs", "attention": "attention", "memory": "memory-bound", "recompute": "recompute",
               "tp_comm": "TP/SP comm exposed", "cp_exchange": "CP exchange", "expert_all_to_all": "expert all-to-all",
               "offload": "offload copies", "pipeline_p2p": "pipeline sends", "pipeline_bubble": "pipeline bubble",
               "data_parallel_exposed": "DP reduce/gather exposed", "optimizer": "optimizer", "host_overhead": "host overhead"}


def classes_line(by_class: dict[str, float | None], step: float) -> str:
    """Where the step goes by class, the largest first; the classes the model does not price named last."""
    priced = sorted(((k, v) for k, v in by_class.items() if v), key=lambda kv: -kv[1])
    words = ", ".join(f"{CLASS_WORDS[k]} {1e3 * v:.0f} ms ({100 * v / step:.0f}%)" for k, v in priced)
    unpriced = [CLASS_WORDS[k] for k, v in by_class.items() if v is None]
    return f"by class: {words}" + (f"; not priced: {', '.join(unpriced)}" if unpriced else "")


def flags_lines(flags: dict[str, list[str]], indent: str = "  ") -> list[str]:
    """The setting in each framework's words."""
    lm = " ".join(flags["megatron_lm"]) or "(no recompute arguments: leave out every --recompute-* argument)"
    return [f"{indent}Megatron-LM:           {lm}",
            f"{indent}Megatron Bridge:       {'; '.join(flags['bridge'])}",
            f"{indent}Bridge perf script:    {' '.join(flags['bridge_perf_script'])}",
            f"{indent}NeMo 2.0:              {'; '.join(flags['nemo2'])}"]


def allowance_lines(result: dict[str, Any]) -> list[str]:
    """What the allowance is made of and what expandable segments change."""
    a = result["allowance"]
    return [f"allowance: {100 * a['fraction']:g}% of the allocated peak for the caching allocator (reserved above "
            f"allocated) + {a['bytes'] / 2**30:g} GiB fixed (CUDA context, NCCL buffers, cuDNN/cuBLAS handles); "
            f"'tight' fits only if the allocator stays inside it. The fraction is stated, not derived: "
            f"{a['why_not_derived']}.",
            f"{a['expandable_segments']}."]


def parts_table(result: dict[str, Any], top: int = 20) -> Table:
    """The recommended setting's predicted step, op by op on its pacing stage."""
    t = result["time_parts"]
    table = Table(title=f"predicted step of {escape(result['recommended'])}: {t['step_seconds']:.3f} s (stage {t['pacing_stage']} "
                        f"paces the pipeline: {t['num_microbatches']} micro-batches x {1e3 * t['microbatch_seconds'][t['pacing_stage']]:.1f} ms, "
                        f"bubble {1e3 * t['bubble_seconds']:.0f} ms, optimizer {1e3 * t['optimizer_seconds']:.0f} ms)",
                  header_style="bold")
    for col in ("op", "kind", "pass", "module", "ms per step", "share"):
        table.add_column(col, justify="right" if col in ("ms per step", "share") else "left")
    parts = t["parts"]
    for p in parts[:top]:
        table.add_row(escape(p["op"]), p["kind"], p["pass"], p["module"] or "-", f"{1e3 * p['seconds']:.1f}",
                      f"{100 * p['seconds'] / t['step_seconds']:.1f}%")
    rest = sum(p["seconds"] for p in parts[top:])
    if rest:
        table.add_row(f"{len(parts) - top} more ops", "", "", "", f"{1e3 * rest:.1f}", f"{100 * rest / t['step_seconds']:.1f}%")
    return table


def would_fit_table(result: dict[str, Any]) -> Table:
    """Changes of layout and the fastest setting each would let fit."""
    table = Table(title="what would fit", header_style="bold")
    for col in ("change", "fits", "setting", "with allowance (GiB)", "rel. TFLOP/s", "note"):
        table.add_column(col, justify="right" if col in ("with allowance (GiB)", "rel. TFLOP/s") else "left")
    for r in result["would_fit"]:
        fits = FIT_WORDS[r.get("fit", "over")] if r["setting"] else "[red]no[/]"
        table.add_row(escape(r["change"]), fits, escape(r["setting"] or "-"),
                      "-" if r["device_bytes_needed"] is None else _gib(r["device_bytes_needed"]),
                      "-" if r["relative_throughput"] is None else f"{r['relative_throughput']:.3f}", escape(r["note"] or ""))
    return table


def auto_table(auto: dict[str, Any]) -> Table:
    """The best uniform setting beside per-stage and per-layer choice."""
    table = Table(title="per-stage and per-layer choice against the best uniform setting", header_style="bold")
    for col in ("", "setting", "step (s)", "rel. TFLOP/s", "gain"):
        table.add_column(col, justify="left" if col in ("", "setting") else "right")
    u = auto["uniform"]
    table.add_row("uniform", escape(u["setting"]) if u else "[red]nothing fits[/]",
                  f"{u['step_seconds']:.3f}" if u else "-", f"{u['relative_throughput']:.3f}" if u else "-", "")
    for key, name in (("per_stage", "per stage"), ("per_layer", "per layer")):
        x = auto[key]
        if x["step_seconds"] is None:
            table.add_row(name, f"[red]stage {', '.join(map(str, x['unfit_stages']))} fits nothing[/]", "-", "-", "-")
            continue
        words = "; ".join(f"{s['stage']}: {s['setting']}" for s in x["stages"])
        table.add_row(name, escape(words), f"{x['step_seconds']:.3f}", f"{x['relative_throughput']:.3f}",
                      "-" if x["gain"] is None else f"{100 * x['gain']:+.1f}%")
    return table
