"""The GPT, readable top to bottom. No recompute logic lives here: `recompute.py` wraps the modules
of a built model, so the same model serves every setting.

Layout is batch-first, [b, s, h]. A layer is pre-norm:
    x = x + dropout(linear_proj(core_attention(rope(linear_qkv(input_layernorm(x))))))
    x = x + dropout(mlp(pre_mlp_layernorm(x)))
The `math` attention path is the one the paper's memory formula describes: QK^T, mask, softmax,
dropout, times V, each saving what autograd needs. `sdpa` calls torch's fused kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from recompute_bench.spec.config import ModelConfig


class _RMSNormFunction(torch.autograd.Function):
    """y = x * rsqrt(mean(x^2) + eps) * w as one autograd node (statistics in fp32), saving x and rstd."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        acc = torch.promote_types(x.dtype, torch.float32)
        rstd = torch.rsqrt(x.to(acc).pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return (x.to(acc) * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        x_hat = x.to(rstd.dtype) * rstd
        g = grad.to(rstd.dtype) * weight.to(rstd.dtype)
        grad_x = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
        grad_w = (grad.to(rstd.dtype) * x_hat).reshape(-1, x.shape[-1]).sum(0)
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


class RMSNorm(nn.Module):
    """RMSNorm as fused kernels (Apex, Transformer Engine) run it: one node in the graph. torch's own
    `rms_norm` decomposes into several ops on CPU, so the layer input's gradient would be a sum of
    three contributions whose order changes when the norm is recomputed, breaking bitwise equality."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


def norm(cfg: ModelConfig) -> nn.Module:
    """LayerNorm (with bias) or RMSNorm, as the preset says."""
    if cfg.normalization == "RMSNorm":
        return RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)


class Dropout(nn.Module):
    """Dropout that saves a 1-byte mask on every device, as the paper counts it. (`F.dropout` on a
    CPU saves a mask of the activation's own dtype; `native_dropout` saves a bool mask everywhere.)"""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.native_dropout(x, self.p, True)[0] if self.training else x


def dropout(p: float) -> nn.Module:
    # No module at all when p == 0, so no mask is ever saved for it.
    return Dropout(p) if p > 0 else nn.Identity()


class RotaryEmbedding(nn.Module):
    """RoPE tables; `forward(s)` gives (cos, sin) of shape [s, d/2]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.kv_channels
        inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, seq_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq_length], self.sin[:seq_length]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x1, x2) of the two head halves; x is [b, s, heads, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d) + causal mask) -> dropout -> times V. Inputs [b, s, heads, d]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.backend = cfg.attention_backend
        self.heads, self.groups = cfg.num_attention_heads, cfg.groups
        self.scale = 1.0 / math.sqrt(cfg.kv_channels)
        self.attention_dropout = cfg.attention_dropout
        self.dropout = dropout(cfg.attention_dropout)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s = q.shape[:2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, s, d]
        if self.backend == "sdpa":
            p = self.attention_dropout if self.training else 0.0
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                 enable_gqa=self.groups != self.heads)
        else:
            if self.groups != self.heads:
                k = k.repeat_interleave(self.heads // self.groups, dim=1)
                v = v.repeat_interleave(self.heads // self.groups, dim=1)
            # An additive -inf mask, built for this length: the add saves nothing for backward.
            mask = torch.full((s, s), float("-inf"), device=q.device, dtype=q.dtype).triu(1)
            scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale + mask
            probs = self.dropout(torch.softmax(scores, dim=-1))
            out = torch.matmul(probs, v)
        return out.transpose(1, 2).reshape(b, s, -1)


class SelfAttention(nn.Module):
    """QKV projection -> RoPE -> core attention -> output projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.groups, self.d = cfg.num_attention_heads, cfg.groups, cfg.kv_channels
        self.linear_qkv = nn.Linear(cfg.hidden_size, (self.heads + 2 * self.groups) * self.d, bias=cfg.add_bias_linear)
        self.core_attention = CoreAttention(cfg)
        self.linear_proj = nn.Linear(self.heads * self.d, cfg.hidden_size, bias=cfg.add_bias_linear)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.linear_qkv(x).split([self.heads * self.d, self.groups * self.d, self.groups * self.d], dim=-1)
        q, k, v = q.view(b, s, self.heads, self.d), k.view(b, s, self.groups, self.d), v.view(b, s, self.groups, self.d)
        if rope:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return self.linear_proj(self.core_attention(q, k, v))


class MLP(nn.Module):
    """h -> f -> GeLU -> h, or h -> 2f -> SwiGLU (silu(gate) * up) -> h."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        width = 2 * cfg.ffn_hidden_size if self.swiglu else cfg.ffn_hidden_size
        self.linear_fc1 = nn.Linear(cfg.hidden_size, width, bias=cfg.add_bias_linear)
        self.linear_fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=cfg.add_bias_linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear_fc1(x)
        if self.swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        else:
            x = F.gelu(x)
        return self.linear_fc2(x)


class TransformerLayer(nn.Module):
    """One pre-norm layer: the two residual equations."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = norm(cfg)
        self.self_attention = SelfAttention(cfg)
        self.pre_mlp_layernorm = norm(cfg)
        self.mlp = MLP(cfg)
        self.hidden_dropout = dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, *rope: torch.Tensor) -> torch.Tensor:
        x = x + self.hidden_dropout(self.self_attention(self.input_layernorm(x), rope))
        x = x + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(x)))
        return x


class GPT(nn.Module):
    """Embedding -> L layers -> final norm -> output layer -> cross-entropy."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = (nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
                                    if cfg.position_embedding_type == "learned_absolute" else None)
        self.rotary = RotaryEmbedding(cfg) if cfg.position_embedding_type == "rope" else None
        self.embedding_dropout = dropout(cfg.hidden_dropout)
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_layers))
        self.final_layernorm = norm(cfg)
        self.output_layer = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.share_embeddings_and_output_weights:
            self.output_layer.weight = self.word_embeddings.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Seeded, deterministic initialisation: normal(0, std) weights, zero biases, unit norms."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
            else:
                nn.init.normal_(p, mean=0.0, std=self.cfg.init_method_std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of next-token prediction; tokens and labels are [b, s]."""
        s = tokens.shape[1]
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings.weight[:s]
        x = self.embedding_dropout(x)
        rope = self.rotary(s) if self.rotary is not None else ()
        for layer in self.layers:
            x = layer(x, *rope)
        logits = self.output_layer(self.final_layernorm(x))
        # Cross-entropy in fp32, as Megatron does: the fp32 log-softmax is what the loss saves.
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> GPT:
    """Two builds with the same seed are identical, whatever was built before."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(cfg)
    return model.to(device=device, dtype=dtype)
