"""Rendering for people: number formats and rich tables. Bytes and seconds come in; GiB, ms and
TFLOP/s appear only here. A value that was not measured prints as "n/m", never as zero."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from recompute_bench.measure.record import layout_label, rank_summary
from recompute_bench.config.labels import recompute_label

NOT_MEASURED = "n/m"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return NOT_MEASURED
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_flops(n: float | None) -> str:
    if n is None:
        return NOT_MEASURED
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(n) >= size:
            return f"{n / size:.3f} {unit}"
    return f"{n:.0f} FLOP"


def fmt_seconds(s: float | None) -> str:
    return NOT_MEASURED if s is None else (f"{s * 1e3:.2f} ms" if s < 10 else f"{s:.2f} s")


def fmt_number(x: float | None, digits: int = 2) -> str:
    return NOT_MEASURED if x is None else f"{x:,.{digits}f}"


def fmt_percent(x: float | None) -> str:
    return NOT_MEASURED if x is None else f"{100 * x:.1f}%"


def run_table(record: dict) -> Table:
    """One point: its setting, status and every metric, one row each."""
    m, rank = record["metrics"], record["ranks"][0]
    title = escape(f"{record['workload']} | {recompute_label(**record['recompute'])} | {record['env']['device_name']}")
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    status = record["status"]
    if record.get("failure"):
        f = record["failure"]
        status += f" (rank {f.get('rank', 0)}, step {f['step']}, {f['phase']}: {f['message']})"
    launch = record.get("launch") or {}
    world = launch.get("world_size", 1)
    par = (record.get("config") or {}).get("parallel") or {}
    layout = layout_label(world, launch.get("data_parallel", "ddp"), par.get("tensor_model_parallel_size", 1),
                          par.get("sequence_parallel", False), par.get("pipeline_model_parallel_size", 1),
                          par.get("context_parallel_size", 1))
    rows = [
        ("status", status),
        *([("ranks", f"{world} ({launch['nnodes']} node(s), {layout}): "
                     + (rank_summary(record) or "all finished")),
           ("largest peak allocated / spread over ranks",
            f"{fmt_bytes(m['peak_allocated_bytes'])} / {fmt_bytes(m.get('peak_allocated_spread_bytes'))}")]
          if world > 1 else []),
        ("step time (median)", fmt_seconds(m["step_time_s"])),
        ("TFLOP/s/GPU (model)", fmt_number(m["tflops_per_gpu"], 3)),
        ("tokens/s/GPU", fmt_number(m["tokens_per_s_per_gpu"], 0)),
        ("MFU", fmt_percent(m["mfu"])),
        ("HFU", fmt_percent(m["hfu"])),
        ("model FLOPs/step", fmt_flops(m["model_flops_per_step"])),
        ("hardware FLOPs/step", fmt_flops(m["hardware_flops_per_step"])),
        ("measured FLOPs/step", fmt_flops(m["measured_flops_per_step"])),
        ("activation bytes (1 micro-batch)", fmt_bytes(m["activation_bytes"])),
        ("activation bytes per layer", fmt_bytes(m["activation_bytes_per_layer"])),
        ("peak allocated", fmt_bytes(rank["peak_allocated_bytes"])),
        ("peak reserved", fmt_bytes(rank["peak_reserved_bytes"])),
        ("whole-run peak allocated", fmt_bytes(rank["run_peak_allocated_bytes"])),
        ("alloc retries / OOMs", NOT_MEASURED if rank["alloc_retries"] is None else f"{rank['alloc_retries']} / {rank['num_ooms']}"),
        ("NVML device memory used", fmt_bytes(rank["nvml_used_bytes"])),
        ("parameters", fmt_number(m["num_parameters"], 0)),
        ("loss (first step)", fmt_number(m["loss"], 4)),
        # The analytical model (estimate.py) beside each measured twin, with its error.
        ("estimated activation bytes (error)", _vs(m, "estimated_activation_bytes", m["activation_bytes"], fmt_bytes)),
        ("estimated activation bytes per layer (error)",
         _vs(m, "estimated_activation_bytes_per_layer", m["activation_bytes_per_layer"], fmt_bytes)),
        ("estimated hardware FLOPs/step (error vs measured)",
         _vs(m, "estimated_hardware_flops_per_step", m["measured_flops_per_step"], fmt_flops)),
        ("estimated peak allocated (error)", _vs(m, "estimated_peak_allocated_bytes", rank["peak_allocated_bytes"], fmt_bytes)),
    ]
    rows += pipeline_rows(record.get("pipeline"))
    for name, value in rows:
        table.add_row(name, escape(value))
    return table


def pipeline_rows(pipeline: dict | None) -> list[tuple[str, str]]:
    """The pipeline's rows of a point's table: the schedule and its bubble, the stage that bounds
    memory, and each stage's held micro-batches, saved bytes at its peak and allocated peak, measured
    beside estimated."""
    if not pipeline:
        return []
    rows = [("pipeline schedule / micro-batches", f"{pipeline['schedule']} / {pipeline['num_microbatches']}"),
            ("bubble (measured / theoretical)",
             f"{fmt_percent(pipeline['bubble_fraction'])} / {fmt_percent(pipeline['estimated_bubble_fraction'])}"),
            ("bounds memory", pipeline["summary"])]
    for st in pipeline["stages"]:
        held = st["microbatches_in_flight"]
        rows.append((f"stage {st['pipeline_stage']} (ranks {','.join(map(str, st['ranks']))}; chunks "
                     f"{','.join(map(str, st['model_chunks']))})",
                     f"holds {NOT_MEASURED if held is None else f'{held:g}'} (est {st['estimated_microbatches_in_flight']:g}) "
                     f"micro-batches; saved at peak {fmt_bytes(st['activation_peak_bytes'])} "
                     f"(est {fmt_bytes(st['estimated_activation_peak_bytes'])}); peak allocated "
                     f"{fmt_bytes(st['peak_allocated_bytes'])} (est {fmt_bytes(st['estimated_peak_allocated_bytes'])}); "
                     f"step share {fmt_percent(st['step_share'])}"))
    return rows


def _vs(metrics: dict, key: str, measured: float | None, fmt) -> str:
    """An estimate and its error against the measured value: "1.00 MiB (+0.00%)"."""
    estimate = metrics.get(key)
    if estimate is None:
        return NOT_MEASURED
    error = f"{100 * (estimate - measured) / measured:+.2f}%" if measured else NOT_MEASURED
    return f"{fmt(estimate)} ({error})"
