"""Multi-latent attention's spec (`layers.py`), counted without building it (no torch).

`MLAAttention` answers for the attention block only, in place of `DenseSpec`'s MHA/GQA one, so one
class composes it with either layer: `MLASpec` (dense MLP) and `MLAMoESpec` (MoE layers, DeepSeek-V3).

With n heads, qk = qk_head_dim, r = qk_pos_emb_head_dim, v = v_head_dim, per token:

    q_down  h -> q_lora_rank, q_layernorm, q_up  q_lora_rank -> n·(qk + r)     (or q_proj  h -> n·(qk + r))
    kv_down h -> kv_lora_rank + r, kv_layernorm over kv_lora_rank, kv_up  kv_lora_rank -> n·(qk + v)
    core attention: q and k of n·(qk + r), v of n·v;  linear_proj  n·v -> h

What it keeps for backward: the latents (q_down's output and q_layernorm's, kv_down's whole output,
since kv_layernorm reads a view of it, and kv_layernorm's), the norms' statistics, and what core
attention keeps of q, k, v. `mla_up_proj` frees q, k, v after core attention (the up-projections
keep only the latents, already kept) and re-runs the "qkv_up_proj" GEMMs in backward.
"""

from __future__ import annotations

from typing import Any, Iterable

from recompute_bench.models import ELEMENT_BYTES, SavedBytes, Work
from recompute_bench.models.dense.spec import DenseSpec, linear, norm_parameters
from recompute_bench.models.moe.spec import MoESpec, _MoELayer
from recompute_bench.config.schema import Config, ModelConfig


class MLAAttention:
    """The attention block of an MLA layer; mixed in before `DenseSpec` or `MoESpec`."""

    def _attention_head_dims(self, cfg: Config) -> tuple[int, int]:
        """q and k's head dimension (qk_head_dim + qk_pos_emb_head_dim) and v's (v_head_dim): where
        they differ, no flash kernel takes them (`attention_kernel`)."""
        m = cfg.model
        return m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim

    def _attention_flops(self, cfg: Config, b: int, device: str) -> dict[str, Work]:
        """"qkv_down_proj" (q_down and kv_down), "qkv_up_proj" (q_up or q_proj, and kv_up: what
        `mla_up_proj` re-runs), "core_attn", "out_proj", for b sequences."""
        m = cfg.model
        h, n, tokens = m.hidden_size, m.num_attention_heads, b * cfg.training.seq_length
        q_width, kv_width = n * (m.qk_head_dim + m.qk_pos_emb_head_dim), n * (m.qk_head_dim + m.v_head_dim)
        q_in = m.q_lora_rank or h
        down = h * (m.q_lora_rank or 0) + h * (m.kv_lora_rank + m.qk_pos_emb_head_dim)
        return {"qkv_down_proj": linear(2 * tokens * down),
                "qkv_up_proj": linear(2 * tokens * (q_in * q_width + m.kv_lora_rank * kv_width)),
                "core_attn": self._core_attn_flops(cfg, b, device, q_width, n * m.v_head_dim),  # type: ignore[attr-defined]
                "out_proj": linear(2 * tokens * n * m.v_head_dim * h)}

    def _attention_model_flops(self, cfg: Config, b: int) -> float:
        """Megatron's MLA term (`num_floating_point_operations`): 3 x 2 x (q term + kv term + the
        rotary key's projection + output projection) per token, a latent's norm counted as one
        column, and the causal half of QK^T (qk + r per head) and of times V (v per head)."""
        m, s = cfg.model, cfg.training.seq_length
        h, n, r = m.hidden_size, m.num_attention_heads, m.qk_pos_emb_head_dim
        qk, v = m.qk_head_dim, m.v_head_dim
        q = h * n * (qk + r) if m.q_lora_rank is None else m.q_lora_rank * (h + n * (qk + r) + 1)
        per_token = 3 * 2 * (q + m.kv_lora_rank * (h + n * (qk + v) + 1) + h * r + n * v * h)
        core = 3 * n * (qk + r + v)  # 3 x 2 x (n(qk + r) + n v) / 2
        return b * s * per_token + b * s * s * core

    def _attention_saved(self, saved: SavedBytes, cfg: Config, mods: set[str], device: str) -> None:
        """The latents, the latent norms' statistics, and q, k, v as core attention keeps them (freed
        under `mla_up_proj`: their storages count nothing, wherever core attention saved them as they are)."""
        m, tr = cfg.model, cfg.training
        e, tokens = ELEMENT_BYTES[tr.precision], tr.seq_length * tr.micro_batch_size
        n, r = m.num_attention_heads, m.qk_pos_emb_head_dim
        stats = self.norm_stats_bytes(cfg, device, tokens)  # type: ignore[attr-defined]
        if m.q_lora_rank:
            saved.add("linear_q_down_proj.output", e * tokens * m.q_lora_rank, "tp")  # q_layernorm's input
            saved.add("q_layernorm.stats", stats, "tp")
            saved.add("q_layernorm.output", e * tokens * m.q_lora_rank, "tp")  # q_up's input
        saved.add("linear_kv_down_proj.output", e * tokens * (m.kv_lora_rank + r), "tp")  # kv_layernorm reads a view
        saved.add("kv_layernorm.stats", stats, "tp")
        saved.add("kv_layernorm.output", e * tokens * m.kv_lora_rank, "tp")  # kv_up's input
        qk_width, v_width = n * (m.qk_head_dim + r), n * m.v_head_dim
        kept = 0 if "mla_up_proj" in mods else 1
        sources = {"q": ("up_proj.q", kept * e * tokens * qk_width), "k": ("up_proj.k", kept * e * tokens * qk_width),
                   "v": ("up_proj.v", kept * e * tokens * v_width)}
        self._core_attention(saved, cfg, mods, device, sources, qk_width, v_width, False)  # type: ignore[attr-defined]

    def _attention_parameters(self, cfg: Config) -> dict[str, int]:
        """q_down, q_layernorm and q_up (or q_proj), kv_down, kv_layernorm, kv_up and linear_proj,
        with a bias on every linear where the model has them."""
        m = cfg.model
        h, n, r, bias = m.hidden_size, m.num_attention_heads, m.qk_pos_emb_head_dim, 1 if m.add_bias_linear else 0
        q_width, kv_width = n * (m.qk_head_dim + r), n * (m.qk_head_dim + m.v_head_dim)
        norm = norm_parameters
        if m.q_lora_rank:
            q = (h + bias) * m.q_lora_rank + norm(cfg, m.q_lora_rank) + (m.q_lora_rank + bias) * q_width
        else:
            q = (h + bias) * q_width
        kv = (h + bias) * (m.kv_lora_rank + r) + norm(cfg, m.kv_lora_rank) + (m.kv_lora_rank + bias) * kv_width
        return {"sharded": q + kv + n * m.v_head_dim * h, "replicated": bias * h}

    def selective_recompute_flops(self, cfg: Config, modules: Iterable[str], samples: int | None = None,
                                  device: str = "cuda") -> float:
        """The layer's own targets, plus `mla_up_proj`: the up-projections' GEMMs (RoPE is no GEMM)."""
        mods = set(modules)
        rest = super().selective_recompute_flops(cfg, mods - {"mla_up_proj"}, samples, device)  # type: ignore[misc]
        if "mla_up_proj" not in mods:
            return rest
        return rest + self.layer_flops(cfg, samples, device)["qkv_up_proj"].forward  # type: ignore[attr-defined]


class MLASpec(MLAAttention, DenseSpec):
    """A GPT with multi-latent attention and dense MLPs (DeepSeek-V2-Lite's attention on a dense model)."""

    name = "mla"
    recompute_targets = (*DenseSpec.recompute_targets, "mla_up_proj")

    def build(self, cfg: Config, device: Any = "cpu", dtype: Any = None) -> Any:
        """The torch model (`layers.py`); torch is imported here only."""
        from recompute_bench.models.mla.layers import build_model

        if dtype is None:
            return build_model(cfg.model, cfg.training.seed, device)
        return build_model(cfg.model, cfg.training.seed, device, dtype)


class _MLAMoELayer(MLAAttention, _MoELayer):
    """One MoE layer with multi-latent attention."""


class MLAMoESpec(MLAAttention, MoESpec):
    """DeepSeek-V3: multi-latent attention in every layer, MoE layers by `moe_layer_freq`."""

    name = "mla-moe"
    layer_spec = _MLAMoELayer

    def __init__(self, model: ModelConfig):
        super().__init__(model)
        self.recompute_targets = (*self.recompute_targets, "mla_up_proj")

    build = MLASpec.build
