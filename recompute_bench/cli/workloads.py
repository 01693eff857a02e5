"""`recompute-bench workloads`: the presets and their shapes."""

from __future__ import annotations

import json


import typer
from rich.table import Table

from recompute_bench.cli.common import err, json_flag
from recompute_bench.config.presets import load_preset, workload_names
from recompute_bench.workload import resolve

COLUMNS = {"workload": "workload", "num_layers": "L", "hidden_size": "h", "num_attention_heads": "a",
           "num_query_groups": "g", "ffn_hidden_size": "ffn", "vocab_size": "vocab", "seq_length": "s",
           "normalization": "norm", "activation": "act", "position_embedding_type": "pos",
           "num_moe_experts": "experts", "moe_router_topk": "top-k", "attention_type": "attn"}

PresetsJson = json_flag("the presets")


def workloads(json_out: PresetsJson = False) -> None:
    """List the built-in workload presets with their shapes."""
    rows = []
    for name in workload_names():
        cfg, _ = resolve(name, gpu="cpu")
        m, t = cfg.model, cfg.training
        rows.append({"workload": name, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
                     "num_attention_heads": m.num_attention_heads, "num_query_groups": m.groups,
                     "ffn_hidden_size": m.ffn_hidden_size, "vocab_size": m.vocab_size, "seq_length": t.seq_length,
                     "normalization": m.normalization, "activation": m.activation,
                     "position_embedding_type": m.position_embedding_type,
                     "num_moe_experts": m.num_moe_experts, "moe_router_topk": m.moe_router_topk if m.num_moe_experts else None,
                     "attention_type": ("MLA" if m.multi_latent_attention else
                                        "GQA" if m.groups != m.num_attention_heads else "MHA"),
                     "micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
                     "precision": t.precision, "description": load_preset(name).get("description", "")})
    if json_out:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="workload presets")
    text_columns = ("workload", "normalization", "activation", "position_embedding_type", "attention_type")
    for key, title in COLUMNS.items():
        table.add_column(title, justify="left" if key in text_columns else "right")
        if key == "seq_length":
            table.add_column("b/B", justify="right")
    for r in rows:
        cells = []
        for key in COLUMNS:
            cells.append("-" if r[key] is None else str(r[key]))
            if key == "seq_length":
                cells.append(f"{r['micro_batch_size']}/{r['global_batch_size']}")
        table.add_row(*cells)
    err.print(table)
