"""A recompute setting in words: its label, as tables, records and golden keys show it, and its
modules in Megatron's order."""

from __future__ import annotations

from typing import Any

from recompute_bench.config.choices import RECOMPUTE_MODULES


def recompute_label(granularity: str, modules=(), method: str | None = None, num_layers: int | None = None,
                    activation_offload_layers: int = 0, layer_policy=(), offload_modules=(),
                    distribute_saved_activations: bool = False, **_: Any) -> str:
    """A recompute setting in a few words: "none", "selective[core_attn,mlp]", "full uniform 1",
    "full block 4 +distribute" (its checkpoints' inputs split over tensor parallel),
    "policy 2 full, 3 selective[mlp]" (a per-layer policy, counted by choice in layer order),
    "offload 4" (layer offloading), "selective[mlp] offload[core_attn,attn_proj]" (fine-grained).
    Takes a record's `recompute` object as keywords (the fields that do not change the words too)."""
    if layer_policy:
        runs: list[list] = []
        for entry in layer_policy:
            choice = entry.split(":")[0]
            if runs and runs[-1][1] == choice:
                runs[-1][0] += 1
            else:
                runs.append([1, choice])
        return "policy " + ", ".join(f"{n} {choice}" for n, choice in runs)
    offload = " offload[" + ",".join(offload_modules) + "]" if offload_modules else ""
    if granularity == "selective":
        return "selective[" + ",".join(modules) + "]" + offload
    if granularity == "full":
        return f"full {method} {num_layers}" + (" +distribute" if distribute_saved_activations else "") + offload
    if activation_offload_layers:
        return f"offload {activation_offload_layers}"
    return offload.strip() or "none"


def canonical_modules(modules: list[str]) -> list[str]:
    """De-duplicate and order module names the way Megatron lists them (unknown names last)."""
    seen = dict.fromkeys(m.strip() for m in modules if m.strip())
    order = {m: i for i, m in enumerate(RECOMPUTE_MODULES)}
    return sorted(seen, key=lambda m: (order.get(m, len(order)), m))
