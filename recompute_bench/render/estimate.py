"""Rich tables for `estimate` and `plan`. Bytes come in; GiB appear only here."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table

from recompute_bench.render.tables import fmt_bytes, fmt_flops

PAPER_FORMULAS = {
    # (recompute, tensor parallel > 1, sequence parallel) -> Table 2's formula
    ("none", False, False): "sbh(34 + 5as/h)",
    ("none", True, False): "sbh(10 + 24/t + 5as/(ht))",
    ("none", True, True): "(sbh/t)(34 + 5as/h)",
    ("selective", False, False): "34sbh",
    ("selective", True, False): "sbh(10 + 24/t)",
    ("selective", True, True): "34sbh/t",
    ("full", False, False): "2sbh",
    ("full", True, False): "2sbh",
    ("full", True, True): "2sbh",
}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def layout_line(report: dict[str, Any]) -> str:
    """One line naming the shape and layout an estimate is for."""
    c = report["config"]
    m, t, p = c["model"], c["training"], c["parallel"]
    vpp, ep, cp = p["virtual_pipeline_model_parallel_size"], p.get("expert_model_parallel_size", 1), p.get("context_parallel_size", 1)
    layout = (f"t={p['tensor_model_parallel_size']} p={p['pipeline_model_parallel_size']}"
              + (f" vpp={vpp}" if vpp else "") + (f" cp={cp} ({p.get('cp_comm_type', 'p2p')})" if cp > 1 else "")
              + f" dp={p['data_parallel_size']}" + (f" ep={ep}" if ep > 1 else "")
              + (" sp" if p["sequence_parallel"] else "") + (" dist-opt" if p["use_distributed_optimizer"] else ""))
    return (f"{report['workload']}: L={m['num_layers']} h={m['hidden_size']} a={m['num_attention_heads']} "
            f"g={m['num_query_groups'] or m['num_attention_heads']} | {layout} | b={t['micro_batch_size']} "
            f"s={t['seq_length']} {t['precision']} | {m['attention_backend']} attention runs "
            f"{report.get('attention_kernel', '')} on {report.get('gpu') or report['device']}"
            + (f" | Megatron, {m['transformer_impl']}" if report.get("framework") == "megatron" else ""))


def settings_table(rows: list[dict[str, Any]], title: str, current: str | None = None) -> Table:
    """One row per recompute setting: memory and compute."""
    table = Table(title=escape(title), header_style="bold")
    table.add_column("setting", no_wrap=True)
    for col in ("act/layer", "stage acts", "bwd peak", "peak alloc", "+allowance", "HW FLOPs/step", "overhead",
                "rel. TFLOP/s"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        label = escape(r["label"]) + (" *" if r["label"] == current else "")
        table.add_row(label, fmt_bytes(r["activation_bytes_per_layer"]), fmt_bytes(r["stage_activation_bytes"]),
                      fmt_bytes(r["stage_activation_peak_bytes"]), _gib(r["peak_allocated_bytes"]),
                      _gib(r["device_bytes_needed"]), fmt_flops(r["hardware_flops_per_step"]),
                      f"{100 * r['recompute_overhead']:.1f}%", f"{r['relative_tflops_per_gpu']:.3f}")
    return table


CLASS_HEADERS = {"gemm": "GEMM", "attention": "attn", "memory": "memory", "recompute": "recomp", "tp_comm": "TP comm",
                 "cp_exchange": "CP", "expert_all_to_all": "a2a", "pipeline_p2p": "p2p", "pipeline_bubble": "bubble",
                 "data_parallel_exposed": "DP", "optimizer": "optim", "host_overhead": "host"}
"""Short headers for `StepTime.by_class`'s classes (ms columns of `time_table`)."""


def time_table(rows: list[dict[str, Any]], title: str, current: str | None = None) -> Table | None:
    """One row per recompute setting: the predicted step, TFLOP/s and tokens/s per GPU, MFU, and where
    the step goes by class (ms; "-" a class the model does not price; a class no setting spends
    time in is left out). None where no row has a predicted step."""
    priced = [r for r in rows if r.get("step_seconds") is not None]
    if not priced:
        return None
    classes = [c for c in priced[0]["step_parts"] if any(r["step_parts"][c] for r in priced)]
    table = Table(title=escape(title), header_style="bold")
    table.add_column("setting", no_wrap=True)
    for col in ("step s", "TFLOP/s", "tokens/s", "MFU", *(CLASS_HEADERS.get(c, c) for c in classes)):
        table.add_column(col, justify="right", no_wrap=True)
    for r in priced:
        label = escape(r["label"]) + (" *" if r["label"] == current else "")
        parts = ["-" if r["step_parts"][c] is None else f"{1e3 * r['step_parts'][c]:.0f}" for c in classes]
        table.add_row(label, f"{r['step_seconds']:.3f}", f"{r['tflops_per_gpu']:.0f}", f"{r['tokens_per_s_per_gpu']:.0f}",
                      f"{100 * r['mfu']:.1f}%", *parts)
    return table


def paper_table(report: dict[str, Any]) -> Table:
    """Table 2 of the paper for this shape beside the built layer."""
    par = report["config"]["parallel"]
    tp, sp = par["tensor_model_parallel_size"] > 1, par["sequence_parallel"]
    table = Table(title="per layer: Korthikanti et al. Table 2 vs the layer built here", header_style="bold")
    for col in ("recompute", "paper formula", "paper", "built", "built - paper", "paper HFU FLOPs/step"):
        table.add_column(col, justify="left" if col in ("recompute", "paper formula") else "right")
    for row in report["paper"]["rows"]:
        table.add_row(escape(row["recompute"] + (" [core_attn]" if row["recompute"] == "selective" else "")),
                      PAPER_FORMULAS[(row["recompute"], tp, sp and tp)], fmt_bytes(row["paper_bytes"]),
                      fmt_bytes(row["built_bytes"]), fmt_bytes(row["built_bytes"] - row["paper_bytes"]),
                      fmt_flops(row["paper_flops"]["hardware_flops_per_step"]))
    return table


def paper_notes(report: dict[str, Any]) -> list[str]:
    """Why built and paper differ, the other optimizer layout, and the paper's FLOPs inconsistency."""
    paper = report["paper"]
    notes = []
    if paper["differences"]:
        notes.append("this layer is not the paper's: " + "; ".join(paper["differences"]))
    else:
        notes.append(f"the paper's layer: built - paper = the two norms' statistics "
                     f"({fmt_bytes(paper['norm_stats_bytes'])}), which the paper leaves out as small")
    if report["config"]["parallel"]["sequence_parallel"]:
        notes.append("full recompute with sequence parallelism keeps the sequence-sharded layer input, 2sbh/t; "
                     "Table 2's 2sbh is the paper's baseline without it")
    routing = report.get("routing")
    if routing:
        rows, peaks = routing["routed_rows"], routing["peak_allocated_bytes"]
        notes.append(f"MoE routing: the estimate assumes balanced routing, {rows['balanced']:,.0f} rows per MoE layer's "
                     f"experts on a rank per micro-batch; Megatron's {routing['dispatcher']} dispatcher lets a rank "
                     f"receive up to {rows['bound']:,.0f} (every token of its dispatch group), which would peak at "
                     f"{_gib(peaks['bound'])} against {_gib(peaks['balanced'])}")
    other = report.get("other_optimizer")
    if other:
        notes.append(f"{'with FSDP (a distributed optimizer)' if other['use_distributed_optimizer'] else 'with DDP'} over "
                     f"dp={report['config']['parallel']['data_parallel_size']}, this setting's peak allocated would be "
                     f"{_gib(other['peak_allocated_bytes'])}")
    sel = next(r for r in paper["rows"] if r["recompute"] == "selective")["paper_flops"]
    notes.append(f"paper FLOPs for selective recompute: Eq. 8 (its Table 5 HFU) {fmt_flops(sel['hardware_flops_per_step'])}"
                 f", its text's +4Bs^2h per layer {fmt_flops(sel['hardware_flops_per_step_from_text'])}; model FLOPs"
                 f" (Eq. 7) {fmt_flops(sel['model_flops_per_step'])}")
    return notes


def breakdown_table(report: dict[str, Any]) -> Table:
    """The whole-rank peak of the command's own setting, item by item."""
    s = report["setting"]
    title = f"whole-rank peak: {s['label']} on pipeline stage {s['peak_stage']} ({s['peak_phase']})"
    table = Table(title=escape(title), header_style="bold")
    table.add_column("item")
    table.add_column("bytes", justify="right")
    for name, value in s["breakdown"].items():
        table.add_row(escape(name), fmt_bytes(value))
    a = report["allowance"]
    table.add_row("[bold]peak allocated[/]", f"[bold]{_gib(s['peak_allocated_bytes'])}[/]")
    for phase, value in (s.get("phase_peaks") or {}).items():  # CUDA graphs: the peak is the most of these
        table.add_row(escape(f"  peak of the {phase}"), _gib(value))
    if "first_iteration_peak_allocated_bytes" in s:  # framework megatron: Adam's moments come at the first step
        table.add_row("first iteration's peak (no Adam moments yet)", _gib(s["first_iteration_peak_allocated_bytes"]))
        after = s.get("peak_after_iteration", {}).get("2")
        if after is not None and after != s["peak_allocated_bytes"]:  # CUDA graphs captured after iteration 2
            table.add_row("a memory line after iteration 2 (max allocated so far)", _gib(after))
    table.add_row(f"allowance: {100 * a['fraction']:.0f}% allocator + {fmt_bytes(a['bytes'])} context/workspaces",
                  fmt_bytes(s["device_bytes_needed"] - s["peak_allocated_bytes"]))
    table.add_row("[bold]device memory needed[/]", f"[bold]{_gib(s['device_bytes_needed'])}[/]")
    return table


def stages_table(report: dict[str, Any]) -> Table:
    """Every pipeline stage's peak of the command's own setting, and where it happens (framework
    megatron: the first iteration's peak beside it)."""
    first = "first_iteration_peak_allocated_bytes" in report["stages"][0]
    table = Table(title=f"every pipeline stage: {report['setting']['label']}", header_style="bold")
    for col in ("stage", "peak allocated", "+allowance", *(("1st iteration",) if first else ()), "where", "parameters"):
        table.add_column(col, justify="left" if col == "where" else "right")
    for r in report["stages"]:
        table.add_row(str(r["stage"]), _gib(r["peak_allocated_bytes"]), _gib(r["device_bytes_needed"]),
                      *((_gib(r["first_iteration_peak_allocated_bytes"]),) if first else ()),
                      escape(r["phase"]), f"{r['parameters_on_rank'] / 1e9:.3f} B")
    return table


def terms_table(report: dict[str, Any]) -> Table:
    """Framework megatron: each stage's steady-state peak as the terms that make it up, named after
    what allocates each in Megatron, with the arguments that move it; then the first iteration's peak."""
    stages = report["stages"]
    table = Table(title=f"each stage's peak, term by term: {report['setting']['label']}", header_style="bold",
                  caption="every activation term also scales with --micro-batch-size and --seq-length")
    table.add_column("term", overflow="fold")
    table.add_column("allocated by (Megatron)", overflow="fold")
    for r in stages:
        table.add_column(f"stage {r['stage']}", justify="right", no_wrap=True)
    table.add_column("moved by", overflow="fold")
    rows: dict[str, dict[str, Any]] = {}
    for r in stages:
        for term in r["terms"]:
            row = rows.setdefault(term["term"], {"megatron": term["megatron"], "knobs": term["knobs"], "bytes": {}})
            row["bytes"][r["stage"]] = term["bytes"]
    layers = {r["stage"]: max((t.get("layers", 0) for t in r["terms"]), default=0) for r in stages}
    for name, row in rows.items():
        table.add_row(escape(name), escape(row["megatron"]),
                      *(fmt_bytes(row["bytes"][r["stage"]]) if r["stage"] in row["bytes"] else "-" for r in stages),
                      escape(row["knobs"]))
    table.add_row("[dim]layers whose saved tensors are held[/]", "", *(str(layers[r["stage"]]) for r in stages), "")
    table.add_row("[bold]peak allocated[/]", "the steady state", *(f"[bold]{_gib(r['peak_allocated_bytes'])}[/]"
                                                                   for r in stages), "")
    table.add_row("first iteration's peak", "before the first step creates the Adam moments",
                  *(_gib(r["first_iteration_peak_allocated_bytes"]) for r in stages), "")
    if any(r.get("peak_after_iteration", {}).get("2", r["peak_allocated_bytes"]) != r["peak_allocated_bytes"]
           for r in stages):
        table.add_row("a memory line after iteration 2", "max allocated so far (eager, before the CUDA graphs)",
                      *(_gib(r["peak_after_iteration"]["2"]) for r in stages), "")
    return table


def logged_memory_table(report: dict[str, Any]) -> Table:
    """`estimate --from` a Megatron or Bridge log: each stage's memory lines (max allocated since the
    process started, the most over the stage's ranks that printed one) beside what the estimate says
    that line reports, iteration by iteration."""
    table = Table(title="the log's memory lines beside the estimate (max allocated so far)", header_style="bold")
    for col in ("stage", "after iteration", "ranks", "logged", "estimated", "error", "the estimate is"):
        table.add_column(col, justify="left" if col == "the estimate is" else "right")
    rows: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for line in report["logged_memory"]:
        if line["peak_allocated_bytes"] is not None:
            rows.setdefault((line["stage"], line["after_iteration"]), []).append(line)
    for (stage, after), lines in sorted(rows.items()):
        logged = max(x["peak_allocated_bytes"] for x in lines)
        estimated = lines[0]["estimated_peak_allocated_bytes"]
        table.add_row(str(stage), str(after), str(len(lines)), f"{logged / 1e9:.2f} GB", f"{estimated / 1e9:.2f} GB",
                      f"{100 * (estimated / logged - 1):+.1f}%", escape(lines[0]["estimate_describes"]))
    return table


def plan_table(result: dict[str, Any]) -> Table:
    """The settings that fit, fastest first."""
    table = Table(title=f"settings that fit in {_gib(result['budget_bytes'])}, fastest first", header_style="bold")
    for col in ("#", "setting", "peak allocated", "with allowance", "overhead", "rel. TFLOP/s"):
        table.add_column(col, justify="left" if col == "setting" else "right")
    for i, r in enumerate(result["fits"], 1):
        table.add_row(str(i), escape(r["label"]), _gib(r["peak_allocated_bytes"]), _gib(r["device_bytes_needed"]),
                      f"{100 * r['recompute_overhead']:.1f}%", f"{r['relative_tflops_per_gpu']:.3f}")
    return table


def cp_plan_table(result: dict[str, Any]) -> Table:
    """`plan --gpus`: each context-parallel layout of the GPUs and its fastest fitting setting."""
    table = Table(title=f"{result['gpus']} GPUs of {_gib(result['budget_bytes'])}: context parallel x recompute",
                  header_style="bold")
    for col in ("cp", "dp", "micro-batches", "fits", "setting", "with allowance", "overhead"):
        table.add_column(col, justify="left" if col in ("setting", "fits") else "right")
    for r in result["layouts"]:
        table.add_row(str(r["context_parallel_size"]), str(r["data_parallel_size"]), str(r.get("num_microbatches", "-")),
                      "[green]yes[/]" if r["fits"] else "[red]no[/]",
                      escape(r["setting"] or r["reason"] or "-"),
                      "-" if r["device_bytes_needed"] is None else _gib(r["device_bytes_needed"]),
                      "-" if r["recompute_overhead"] is None else f"{100 * r['recompute_overhead']:.1f}%")
    return table


def would_fit_table(result: dict[str, Any]) -> Table:
    """Layout changes and what they would give."""
    table = Table(title="what would fit", header_style="bold")
    for col in ("change", "fits", "setting", "with allowance", "overhead"):
        table.add_column(col, justify="right" if col in ("with allowance", "overhead") else "left")
    for r in result["would_fit"]:
        table.add_row(escape(r["change"]), "[green]yes[/]" if r["fits"] else "[red]no[/]", escape(r["setting"]),
                      "-" if r["device_bytes_needed"] is None else _gib(r["device_bytes_needed"]),
                      "-" if r["recompute_overhead"] is None else f"{100 * r['recompute_overhead']:.1f}%")
    return table


def auto_table(result: dict[str, Any]) -> Table:
    """`plan --auto`: the per-layer policy beside the best uniform setting at the same budget."""
    table = Table(title=f"per-layer policy and best uniform setting in {_gib(result['budget_bytes'])}", header_style="bold")
    cost = "recompute ms" if result["costs"] == "measured seconds" else "recomputed FLOPs"
    for col in ("", "setting", "peak allocated", "with allowance", "overhead", "rel. TFLOP/s", cost):
        table.add_column(col, justify="left" if col in ("", "setting") else "right")
    for name, r in (("auto", result["predicted"]), ("uniform", result["uniform"])):
        if r is None:
            table.add_row(name, "[red]nothing fits[/]", "-", "-", "-", "-", "-")
            continue
        spent = (f"{1e3 * r['recompute_cost']:.3f}" if result["costs"] == "measured seconds"
                 else fmt_flops(r["recompute_cost"]))
        label = "a policy per stage (below)" if name == "auto" and len(result["stages"] or ()) > 1 else r["label"]
        table.add_row(name, escape(label), _gib(r["peak_allocated_bytes"]), _gib(r["device_bytes_needed"]),
                      f"{100 * r['recompute_overhead']:.1f}%", f"{r['relative_tflops_per_gpu']:.3f}", spent)
    return table


def auto_stages_table(result: dict[str, Any]) -> Table:
    """`plan --auto` with pipeline stages: each stage's policy against its in-flight micro-batches."""
    table = Table(title="per-stage policy", header_style="bold")
    cost = "recompute ms" if result["costs"] == "measured seconds" else "recomputed FLOPs"
    for col in ("stage", "layers", "in flight", "policy", "as Megatron", "peak allocated", "with allowance", cost):
        table.add_column(col, justify="left" if col in ("policy", "as Megatron") else "right")
    for s in result["stages"]:
        spent = (f"{1e3 * s['recompute_cost']:.3f}" if result["costs"] == "measured seconds" else fmt_flops(s["recompute_cost"]))
        table.add_row(str(s["stage"]), f"{s['layers'][0]}-{s['layers'][1]}", f"{s['microbatches_in_flight']:g}",
                      escape(s["label"]), escape(s["megatron_setting"] or "- (a mix)"), _gib(s["peak_allocated_bytes"]),
                      _gib(s["device_bytes_needed"]), spent)
    return table
