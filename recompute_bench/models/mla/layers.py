"""Multi-latent attention (DeepSeek-V2/V3, Megatron's MLASelfAttention), the attention block of a
GPT whose q and kv pass through low-rank latents:

    q_compressed = q_layernorm(linear_q_down_proj(x))          (or x itself when q_lora_rank is unset)
    kv_compressed, k_pos_emb = linear_kv_down_proj(x)          (the latent and one shared rotary key)
    kv_compressed = kv_layernorm(kv_compressed)
    q, k, v = qkv_up_proj_and_rope(q_compressed, kv_compressed, k_pos_emb)
    y = linear_proj(core_attention(q, k, v))

`qkv_up_proj_and_rope` is the q up-projection (or the plain q projection), the kv up-projection,
RoPE on the decoupled rotary dimensions (the key's rotary part is shared by every head) and the
concatenation into q and k of head dim qk_head_dim + qk_pos_emb_head_dim, and v of v_head_dim:
what `mla_up_proj` recomputes. No recompute logic lives here: `recompute.apply` installs it.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from recompute_bench.models.dense.layers import GPT, apply_rope
from recompute_bench.config.schema import ModelConfig


class MLASelfAttention(nn.Module):
    """Multi-latent attention (see the module docstring); parameters named as Megatron names them."""

    def __init__(self, cfg: ModelConfig, backend: ModuleType):
        super().__init__()
        h, bias = cfg.hidden_size, cfg.add_bias_linear
        self.heads, self.kv_lora_rank = cfg.num_attention_heads, cfg.kv_lora_rank
        self.qk_head_dim, self.rope_dim, self.v_head_dim = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        q_width = self.heads * (self.qk_head_dim + self.rope_dim)
        self.q_lora_rank = cfg.q_lora_rank
        if self.q_lora_rank:
            self.linear_q_down_proj = backend.linear(h, self.q_lora_rank, bias)
            self.q_layernorm = backend.norm(cfg.normalization, self.q_lora_rank, cfg.layernorm_epsilon)
            self.linear_q_up_proj = backend.linear(self.q_lora_rank, q_width, bias)
        else:
            self.linear_q_proj = backend.linear(h, q_width, bias)
        self.linear_kv_down_proj = backend.linear(h, self.kv_lora_rank + self.rope_dim, bias)
        self.kv_layernorm = backend.norm(cfg.normalization, self.kv_lora_rank, cfg.layernorm_epsilon)
        self.linear_kv_up_proj = backend.linear(self.kv_lora_rank, self.heads * (self.qk_head_dim + self.v_head_dim), bias)
        self.core_attention = backend.core_attention(cfg.attention_backend, self.heads, self.heads,
                                                     self.qk_head_dim + self.rope_dim, cfg.attention_dropout)
        self.linear_proj = backend.linear(self.heads * self.v_head_dim, h, bias)

    def qkv_up_proj_and_rope(self, q_compressed: torch.Tensor, kv_compressed: torch.Tensor, k_pos_emb: torch.Tensor,
                             cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [b, s, n, qk + rope], k [b, s, n, qk + rope], v [b, s, n, v_head_dim], each a fresh tensor."""
        b, s = q_compressed.shape[:2]
        n, dqk = self.heads, self.qk_head_dim
        q = (self.linear_q_up_proj if self.q_lora_rank else self.linear_q_proj)(q_compressed)
        q_no_pe, q_pos_emb = q.view(b, s, n, -1).split([dqk, self.rope_dim], dim=-1)
        k_no_pe, v = self.linear_kv_up_proj(kv_compressed).view(b, s, n, -1).split([dqk, self.v_head_dim], dim=-1)
        k_pos_emb = apply_rope(k_pos_emb.view(b, s, 1, self.rope_dim), cos, sin).expand(b, s, n, self.rope_dim)
        q = torch.cat((q_no_pe, apply_rope(q_pos_emb, cos, sin)), dim=-1)
        return q, torch.cat((k_no_pe, k_pos_emb), dim=-1), v.contiguous()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
        q_compressed = self.q_layernorm(self.linear_q_down_proj(x)) if self.q_lora_rank else x
        kv_compressed, k_pos_emb = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q, k, v = self.qkv_up_proj_and_rope(q_compressed, self.kv_layernorm(kv_compressed), k_pos_emb, *rope)
        return self.linear_proj(self.core_attention(q, k, v))


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                backend: str = "torch") -> GPT:
    """The GPT with multi-latent attention in every layer, and MoE blocks where the config has
    experts (DeepSeek-V3), built, materialised and initialised as the dense GPT is."""
    from recompute_bench.models.moe.layers import build_model as build_moe
    from recompute_bench.models.dense.layers import build_model as build_dense

    if cfg.num_moe_experts:
        return build_moe(cfg, seed, device, dtype, backend, attention=MLASelfAttention)
    return build_dense(cfg, seed, device, dtype, backend, attention=MLASelfAttention)
