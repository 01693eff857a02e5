"""The mixture-of-experts GPT's spec (`layers.py`), counted without building it (no torch).

A MoE layer is a dense layer whose MLP is the MoE block: router, top-k, expert-sorted copies of the
tokens, grouped fc1 -> weighted activation -> grouped fc2, un-permutation, optional shared experts.
Layers that are not MoE layers (`moe_layer_freq`) are dense. The spec's per-layer answers are the
mean over the model's layers (a sum over layers is L times it, exactly), since the analysis
multiplies one layer's terms by a layer count.

Routing assumption: dropless routing keeps exactly k copies of every token, so what the experts
keep (T·k rows) does not depend on how the router spreads them: on one rank the estimate holds for
any routing, uniform or skewed. Under expert parallel (ep ranks, num_moe_experts / ep experts on
each) a rank's experts keep the rows every rank of its group sent them: T·k under uniform routing,
which the estimate assumes; summed over the group it is exact for any routing, and one rank's
bytes differ by (rows received - T·k) x the bytes kept per routed row. The record carries the probe
step's tokens per expert (max/mean), per rank as well.

With a capacity factor (token dropping) the experts run sum over experts of min(routed_e, capacity)
rows; the estimate takes min(T·k, E x capacity), exact when every expert receives at least its
capacity (uniform routing and a factor of at most 1); the record carries `tokens_dropped`.
"""

from __future__ import annotations

from typing import Any, Iterable

from recompute_bench.models import ELEMENT_BYTES, INDEX_BYTES, SavedBytes, Work
from recompute_bench.models.dense.spec import DenseSpec, linear
from recompute_bench.models.moe.capacity import routed_rows
from recompute_bench.config.schema import Config, ModelConfig

INT32_BYTES = 4  # the grouped matmul's cumulative expert offsets
MOE_PARTS = ("router", "experts", "shared_experts")


def _mean(dense: dict[str, Any], moe: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """Per-layer mean of a dense layer's and a MoE layer's answers (numbers or Work), name by name:
    (sum over the layers) / L, so that L times it is the sum up to one rounding."""
    n, total = cfg.model.moe_layers, cfg.model.num_layers
    names = [*dense, *(k for k in moe if k not in dense)]

    def mean(a: float, b: float) -> float:
        return (a * (total - n) + b * n) / total

    out: dict[str, Any] = {}
    for k in names:
        a, b = dense.get(k), moe.get(k)
        if isinstance(a or b, Work):
            a, b = a or Work(0, 0), b or Work(0, 0)
            out[k] = Work(mean(a.forward, b.forward), mean(a.backward, b.backward))
        else:
            out[k] = mean(a or 0, b or 0)
    return {k: v for k, v in out.items() if v != 0}


class _MoELayer(DenseSpec):
    """One MoE layer: the dense layer's attention, the MoE block in the MLP's place."""

    def _mlp_saved(self, saved: SavedBytes, cfg: Config, mods: set[str], device: str) -> None:
        if "moe" in mods:  # the block's checkpoint keeps its input only: pre_mlp_layernorm's output
            return
        m, tr = cfg.model, cfg.training
        e = ELEMENT_BYTES[tr.precision]
        tokens, k, f, h = tr.seq_length * tr.micro_batch_size, m.moe_router_topk, m.moe_ffn, m.hidden_size
        rows, kept = tokens * k, routed_rows(m, tokens)
        if m.moe_shared_expert_intermediate_size and "shared_experts" not in mods:
            self._dense_mlp_saved(saved, cfg, "shared_experts.", tokens, m.moe_shared_expert_intermediate_size)
        # Router: top-k keeps its indices; softmax its output, or sigmoid its scores and the
        # normalisation its two operands (the top-k scores and their sum).
        saved.add("router.topk_indices", INDEX_BYTES * rows, "none")
        if m.moe_router_score_function == "sigmoid":
            saved.add("router.sigmoid_output", e * tokens * m.num_moe_experts, "none")
            saved.add("router.topk_scores", e * rows, "none")
            saved.add("router.score_sum", e * tokens, "none")
        else:
            saved.add("router.probs", e * rows, "none")
        if m.moe_aux_loss_coeff:  # the scores over all experts (softmax's, or the sigmoid's normaliser) and the routed counts
            if m.moe_router_score_function == "sigmoid":
                saved.add("router.aux_score_sum", e * tokens, "none")
            else:
                saved.add("router.aux_softmax", e * tokens * m.num_moe_experts, "none")
            saved.add("router.aux_routed", e * m.num_moe_experts, "none")
        # Permutation: the sort order (gathers the probabilities), each copy's token (gathers the
        # rows) and the inverse order (gathers the experts' output back into token order).
        saved.add("permutation.order", INDEX_BYTES * kept, "none")
        saved.add("permutation.token", INDEX_BYTES * kept, "none")
        saved.add("permutation.inverse", INDEX_BYTES * rows, "none")  # gathers the copies back (dropped: a zero row)
        rows = kept  # what the experts run
        ep = cfg.parallel.expert_model_parallel_size
        if ep > 1:  # the arrivals' sort by local expert, and its inverse (the copies sent keep nothing)
            saved.add("dispatch.order", INDEX_BYTES * rows, "none")
            saved.add("dispatch.inverse", INDEX_BYTES * rows, "none")
        saved.add("experts.linear_fc1.input", e * rows * h, "none")  # the permuted copies (received ones)
        if m.moe_grouped_gemm:
            saved.add("experts.offsets", INT32_BYTES * m.num_moe_experts // ep, "none")
        swiglu = m.activation == "swiglu"
        saved.add("experts.linear_fc1.output", e * rows * f * (2 if swiglu else 1), "none")
        saved.add("experts.permuted_probs", e * rows, "none")
        if "moe_act" not in mods:  # output-discarding: fc2's input freed, the activation's internals never kept
            if swiglu:
                saved.add("experts.silu_output", e * rows * f, "none")
            saved.add("experts.activation_output", e * rows * f, "none")  # before the probabilities
            saved.add("experts.linear_fc2.input", e * rows * f, "none")

    def moe_flops(self, cfg: Config, samples: int | None = None) -> dict[str, Work]:
        """Router, routed experts and shared experts of one MoE layer, as the kernels run them."""
        m = cfg.model
        b = cfg.training.micro_batch_size if samples is None else samples
        tokens, h = b * cfg.training.seq_length, m.hidden_size
        widths = 3 if m.activation == "swiglu" else 2
        parts = {"router": linear(2 * tokens * h * m.num_moe_experts),
                 "experts": linear(2 * routed_rows(m, tokens) * h * m.moe_ffn * widths)}
        if m.moe_shared_expert_intermediate_size:
            parts["shared_experts"] = linear(2 * tokens * h * m.moe_shared_expert_intermediate_size * widths)
        return parts


class MoESpec(DenseSpec):
    """The mixture-of-experts GPT (Mixtral, Qwen3-MoE): MoE layers every `moe_layer_freq` layers."""

    name = "moe"
    layer_spec: type = _MoELayer
    """The spec of one MoE layer (another attention's, for MLA)."""

    def __init__(self, model: ModelConfig):
        dense = model.moe_layers < model.num_layers
        targets = ["core_attn"] + (["mlp"] if dense else []) + ["layernorm", "moe"]
        if model.moe_grouped_gemm:
            targets.append("moe_act")
        if model.moe_shared_expert_intermediate_size:
            targets.append("shared_experts")
        self.recompute_targets = tuple(targets)
        self._layer = self.layer_spec()

    def layer_flops(self, cfg: Config, samples: int | None = None, device: str = "cuda") -> dict[str, Work]:
        """Mean FLOPs of one layer by part: attention's, "mlp" (dense layers), "router", "experts"
        and "shared_experts" (MoE layers)."""
        dense = super().layer_flops(cfg, samples, device)
        moe = {k: v for k, v in dense.items() if k != "mlp"} | self._layer.moe_flops(cfg, samples)
        attention = {k: v for k, v in dense.items() if k != "mlp"}
        return attention | _mean({"mlp": dense["mlp"]}, {k: v for k, v in moe.items() if k in MOE_PARTS}, cfg)

    def selective_recompute_flops(self, cfg: Config, modules: Iterable[str], samples: int | None = None,
                                  device: str = "cuda") -> float:
        """Forward FLOPs re-run in backward: `moe` re-runs the whole block (router, experts, shared
        experts), `shared_experts` the shared MLP once more (a third time inside a `moe` recompute),
        `moe_act` and `layernorm` no GEMM."""
        parts, mods = self.layer_flops(cfg, samples, device), set(modules)
        repeat = {"core_attn": ("core_attn",), "mlp": ("mlp",), "moe": MOE_PARTS, "shared_experts": ("shared_experts",)}
        return sum(parts[p].forward for mod in mods & repeat.keys() for p in repeat[mod] if p in parts)

    def layer_model_flops(self, cfg: Config, samples: int | None = None) -> float:
        """Megatron's term per layer (mean): attention as dense; a MoE layer's MLP term is the top-k
        routed experts plus the shared experts (the router is not counted)."""
        m, s = cfg.model, cfg.training.seq_length
        b = cfg.training.micro_batch_size if samples is None else samples
        matrices = 3 if m.activation == "swiglu" else 2
        dense_mlp = 3 * 2 * b * s * m.hidden_size * m.ffn_hidden_size * matrices
        moe_mlp = 3 * 2 * b * s * m.hidden_size * matrices * (
            m.moe_ffn * m.moe_router_topk + (m.moe_shared_expert_intermediate_size or 0))
        w = m.moe_layers / m.num_layers
        return super().layer_model_flops(cfg, samples) - dense_mlp + (1 - w) * dense_mlp + w * moe_mlp

    def layer_saved_bytes(self, cfg: Config, modules: Iterable[str] = (), device: str = "cuda") -> dict[str, float]:
        """Mean bytes one layer keeps (see the module docstring for the routing assumption)."""
        mods = list(modules)
        return _mean(super().layer_saved_bytes(cfg, mods, device), self._layer.layer_saved_bytes(cfg, mods, device), cfg)

    def layer_parameters(self, cfg: Config) -> dict[str, float]:
        """Mean parameters of one layer on one rank: a MoE layer has the router, its experts' fc1
        and fc2 (no biases; num_moe_experts / ep of them under expert parallel) and the shared MLP
        in place of the dense MLP."""
        m, t, ep = cfg.model, cfg.parallel.tensor_model_parallel_size, cfg.parallel.expert_model_parallel_size
        dense = super().layer_parameters(cfg)
        h, bias = m.hidden_size, 1 if m.add_bias_linear else 0
        fc1 = 2 if m.activation == "swiglu" else 1
        dense_mlp = (h * fc1 * m.ffn_hidden_size + bias * fc1 * m.ffn_hidden_size + m.ffn_hidden_size * h) / t
        shared = m.moe_shared_expert_intermediate_size or 0
        moe_mlp = (m.num_moe_experts // ep * (fc1 + 1) * h * m.moe_ffn + (fc1 + 1) * h * shared
                   + bias * fc1 * shared) / t + h * m.num_moe_experts
        w = m.moe_layers / m.num_layers
        return {"sharded": dense["sharded"] - w * dense_mlp + w * moe_mlp, "replicated": dense["replicated"]}

    def build(self, cfg: Config, device: Any = "cpu", dtype: Any = None) -> Any:
        """The torch model (`layers.py`); torch is imported here only."""
        from recompute_bench.models.moe.layers import build_model

        if dtype is None:
            return build_model(cfg.model, cfg.training.seed, device)
        return build_model(cfg.model, cfg.training.seed, device, dtype)
