"""Recompute as a per-layer policy: what each transformer layer does with its activations.

Megatron's settings are ways to write a list of per-layer policies:

- none: every layer keeps everything;
- selective [modules]: every layer recomputes the same modules;
- full uniform N: layers are checkpointed in chunks of N consecutive layers (the last may be shorter);
- full block N: the first N layers are checkpointed one each; the others keep everything;
- activation offload N: the first N layers keep their saved activations in host memory.

A policy list may also mix choices layer by layer, which no single Megatron setting can. Pure
Python (no torch), so the analysis and the planner use the same policies the model runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from recompute_bench.config.schema import ModelConfig, RecomputeConfig

MOE_MODULES = ("moe", "moe_act", "shared_experts")
"""Selective targets that exist on mixture-of-experts layers only (`mlp` exists on dense layers only)."""


@dataclass(frozen=True)
class LayerPolicy:
    """What one layer recomputes or offloads."""

    modules: frozenset[str] = frozenset()
    """Selective: the sub-modules of this layer that are recomputed."""
    chunk: int | None = None
    """Full: the checkpoint this layer belongs to; consecutive layers with the same chunk are
    checkpointed together (only the chunk's input is saved). None: not checkpointed whole."""
    offload: bool = False
    """Keep this layer's saved activations in host memory."""

    @property
    def label(self) -> str:
        """The choice in a few words: "none", "selective[core_attn,mlp]", "full", "offload"."""
        if self.chunk is not None:
            return "full"
        if self.modules:
            return "selective[" + ",".join(sorted(self.modules)) + "]"
        return "offload" if self.offload else "none"

    @property
    def entry(self) -> str:
        """The policy as `RecomputeConfig.layer_policy` and a policy file write it: "none",
        "selective[core_attn,mlp]", "full:CHUNK", with "+offload" where offloaded ("offload" alone)."""
        if self.chunk is None and not self.modules:
            return self.label
        base = f"full:{self.chunk}" if self.chunk is not None else self.label
        return base + ("+offload" if self.offload else "")


def parse_entry(entry: str) -> LayerPolicy:
    """The inverse of `LayerPolicy.entry`; ValueError naming what is wrong. Module names are not
    checked against a model here (`policy_file.check` does that)."""
    text = entry.strip()
    base, plus, suffix = text.partition("+")
    if plus and suffix != "offload":
        raise ValueError(f"{entry!r}: only +offload may follow a choice")
    offload = bool(plus)
    if base in ("none", "offload"):
        return LayerPolicy(offload=offload or base == "offload")
    if base.startswith("full:") and base[5:].isdigit():
        return LayerPolicy(chunk=int(base[5:]), offload=offload)
    if base.startswith("selective[") and base.endswith("]"):
        modules = frozenset(m.strip() for m in base[len("selective["):-1].split(",") if m.strip())
        if not modules:
            raise ValueError(f"{entry!r}: selective[] names no module; write none instead")
        return LayerPolicy(modules=modules, offload=offload)
    raise ValueError(f"{entry!r} is not none, offload, selective[MODULES] or full:CHUNK")


def layer_policies(r: RecomputeConfig, num_layers: int, first: int = 0) -> list[LayerPolicy]:
    """The per-layer policies a (validated) Megatron setting means for `num_layers` layers (Megatron
    applies a setting within each model chunk, whichever layers it holds); a per-layer policy
    (`r.layer_policy`) as written, its entries for layers `first` to `first + num_layers - 1` (a
    stage's or a model chunk's)."""
    if r.layer_policy:
        return [parse_entry(e) for e in r.layer_policy[first:first + num_layers]]
    offload = [i < r.activation_offload_layers for i in range(num_layers)]
    if r.granularity == "full":
        n = r.num_layers
        if r.method == "uniform":
            return [LayerPolicy(chunk=i // n, offload=offload[i]) for i in range(num_layers)]
        return [LayerPolicy(chunk=i if i < n else None, offload=offload[i]) for i in range(num_layers)]
    modules = frozenset(r.modules) if r.granularity == "selective" else frozenset()
    return [LayerPolicy(modules=modules, offload=offload[i]) for i in range(num_layers)]


def layer_kind(model: ModelConfig, index: int) -> str:
    """"moe" or "dense": what layer `index` (from 0, over the whole model) is. Layers of one kind
    keep the same bytes and cost the same; a policy may choose differently for each kind."""
    return "moe" if model.is_moe_layer(index) else "dense"


def kind_targets(targets: tuple[str, ...], kind: str) -> tuple[str, ...]:
    """The selective targets of the model (`targets`) that a layer of `kind` has: MoE modules on
    MoE layers only, `mlp` on dense layers only."""
    absent = ("mlp",) if kind == "moe" else MOE_MODULES
    return tuple(t for t in targets if t not in absent)


def chunks(policies: list[LayerPolicy]) -> list[tuple[int, int]]:
    """[start, stop) layer ranges run as one unit: each full-recompute chunk, and each other layer alone."""
    out: list[tuple[int, int]] = []
    i = 0
    while i < len(policies):
        j = i + 1
        chunk = policies[i].chunk
        if chunk is not None:
            while j < len(policies) and policies[j].chunk == chunk:
                j += 1
        out.append((i, j))
        i = j
    return out


def recomputed_layers(policies: list[LayerPolicy]) -> int:
    """How many layers full recompute re-runs in backward."""
    return sum(p.chunk is not None for p in policies)


def _shape(model: ModelConfig, policies: list[LayerPolicy], first: int, targets: tuple[str, ...]) -> tuple:
    """What the layers `first`, `first + 1`, ... do under `policies`, as comparable values: each
    layer's selective modules its kind has, whether it is offloaded, and the full-recompute chunks
    as layer ranges (chunk numbers themselves say nothing)."""
    layers = tuple((frozenset(p.modules) & frozenset(kind_targets(targets, layer_kind(model, first + i))), p.offload)
                   for i, p in enumerate(policies))
    return layers, tuple(r for r in chunks(policies) if policies[r[0]].chunk is not None)


def megatron_setting(model: ModelConfig, policies: list[LayerPolicy], targets: tuple[str, ...],
                     first: int = 0) -> RecomputeConfig | None:
    """The Megatron setting (one of `layer_policies`' meanings) that runs exactly `policies` on the
    model chunk of layers `first`, `first + 1`, ..., or None where none does (a mix of choices).
    Megatron applies a selective module only where the layer has it, so a MoE model's selective
    setting lists the union of its layers' modules. Candidates: none, offload N, selective over
    the modules used, full uniform N and full block N for every N of the chunk."""
    n = len(policies)
    used = sorted(set().union(*(p.modules for p in policies)))
    candidates = [RecomputeConfig()] + [RecomputeConfig(activation_offload_layers=k) for k in range(1, n + 1)]
    if used:
        candidates.append(RecomputeConfig("selective", [t for t in targets if t in used]))
    candidates += [RecomputeConfig("full", [], method, k) for method in ("uniform", "block") for k in range(1, n + 1)]
    want = _shape(model, policies, first, targets)
    return next((r for r in candidates if _shape(model, layer_policies(r, n), first, targets) == want), None)


def megatron_flags(r: RecomputeConfig) -> list[str]:
    """Megatron-LM's command-line arguments (`megatron/training/arguments.py`) for the setting `r`:
    `--recompute-granularity`, `--recompute-modules`, `--recompute-method`, `--recompute-num-layers`,
    `--distribute-saved-activations`; `--cpu-offloading --cpu-offloading-num-layers N` for layer
    offload (`--cpu-offloading` switches it on: newer Megatron-LM also turns it on from N > 0, older
    releases only from the flag); `--fine-grained-activation-offloading --offload-modules a b` for
    fine-grained offload; none for no recompute."""
    out: list[str] = []
    if r.granularity == "selective":
        out += ["--recompute-granularity", "selective", "--recompute-modules", *r.modules]
    elif r.granularity == "full":
        out += ["--recompute-granularity", "full", "--recompute-method", str(r.method),
                "--recompute-num-layers", str(r.num_layers)]
        if r.distribute_saved_activations:
            out.append("--distribute-saved-activations")
    if r.activation_offload_layers:
        out += ["--cpu-offloading", "--cpu-offloading-num-layers", str(r.activation_offload_layers)]
    if r.fine_grained_activation_offloading:
        out += ["--fine-grained-activation-offloading", "--offload-modules", *r.offload_modules]
    return out
