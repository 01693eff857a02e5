"""The dense GPT, readable top to bottom. No recompute logic lives here: `recompute.apply` installs
a per-layer policy on the modules of a built model without renaming any of them, so the same
model, with the same parameter names, serves every setting.

Layout is batch-first, [b, s, h]. A layer is pre-norm:
    x = x + dropout(linear_proj(core_attention(rope(linear_qkv(input_layernorm(x))))))
    x = x + dropout(mlp(pre_mlp_layernorm(x)))
Modules come from a backend (`backends/`): the pure-PyTorch one by default; Transformer Engine's
builds the whole layer (`backends/te_layers.py`) under the same module names.

The model is built on the meta device and materialised on the target device (`materialize`:
`to_empty`, then `init_weights`), as torchtitan does: no host copy of a large layer, and the seeded
initialisation runs where the weights live. A layout that splits the model over ranks (tensor
parallel, FSDP2) splits it while it is still on the meta device and materialises only this rank's
shards, each initialised with its part of what one rank's build holds.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from recompute_bench.backends import get_backend
from recompute_bench.backends.pytorch import local
from recompute_bench.config.schema import ModelConfig


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x1, x2) of the two head halves; x is [b, s, heads, d], cos/sin [s, d/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """RoPE tables as buffers (not parameters, not activations); `forward(s)` gives (cos, sin) of
    shape [s, d/2]. Filled by `reset_buffers()`, which `GPT.init_weights` calls after a meta build.
    Under context parallel (`split`) it gives the rows of this rank's positions, kept as buffers of
    their own, so that no rank saves a gathered copy of the tables for backward."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        half = cfg.rotary_dim // 2
        self.register_buffer("cos", torch.empty(cfg.max_position_embeddings, half), persistent=False)
        self.register_buffer("sin", torch.empty(cfg.max_position_embeddings, half), persistent=False)
        self.ranges: list[tuple[int, int]] = []

    def split(self, ranges: list[tuple[int, int]]) -> None:
        """From now on give the rows of positions `ranges` (this context-parallel rank's), in order."""
        if self.ranges:
            return  # a pipeline rank's chunks share one table
        self.ranges = list(ranges)
        rows = sum(stop - start for start, stop in ranges)
        for name in ("cos", "sin"):
            table = getattr(self, name)
            self.register_buffer(f"local_{name}", torch.empty(rows, table.shape[1], dtype=table.dtype,
                                                              device=table.device), persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        d = self.cfg.rotary_dim
        inv_freq = 1.0 / (self.cfg.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = torch.outer(torch.arange(self.cfg.max_position_embeddings, dtype=torch.float64), inv_freq)
        # Through fp32 whatever the buffer's dtype: the same values as an fp32 table cast afterwards.
        self.cos.copy_(angles.cos().float())
        self.sin.copy_(angles.sin().float())
        if self.ranges:
            for name in ("cos", "sin"):
                table = getattr(self, name)
                getattr(self, f"local_{name}").copy_(torch.cat([table[a:b] for a, b in self.ranges]))

    def forward(self, seq_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ranges:
            return self.local_cos, self.local_sin
        return self.cos[:seq_length], self.sin[:seq_length]


class SelfAttention(nn.Module):
    """QKV projection -> RoPE -> core attention -> output projection.

    The fused QKV projection is laid out per query group, as Megatron lays it out: the output
    columns of group g are its heads' queries, then its key, then its value. A column split over
    tensor-parallel ranks then hands each rank whole groups, and the forward reads how many groups
    this rank holds from the width it gets."""

    def __init__(self, cfg: ModelConfig, backend: ModuleType):
        super().__init__()
        self.heads, self.groups, self.d = cfg.num_attention_heads, cfg.groups, cfg.head_dim
        self.linear_qkv = backend.linear(cfg.hidden_size, (self.heads + 2 * self.groups) * self.d, cfg.add_bias_linear)
        self.core_attention = backend.core_attention(cfg.attention_backend, self.heads, self.groups, self.d,
                                                     cfg.attention_dropout)
        self.linear_proj = backend.linear(self.heads * self.d, cfg.hidden_size, cfg.add_bias_linear)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
        qkv = self.linear_qkv(x)
        b, s = qkv.shape[:2]  # the whole sequence, also where x is a sequence-parallel shard
        per_group = self.heads // self.groups
        q, k, v = qkv.view(b, s, -1, (per_group + 2) * self.d).split([per_group * self.d, self.d, self.d], dim=-1)
        q = q.reshape(b, s, -1, self.d)  # a view with one head per group, else a copy (as in Megatron)
        if rope:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return self.linear_proj(self.core_attention(q, k, v))


class MLP(nn.Module):
    """h -> f -> GeLU -> h, or h -> 2f -> SwiGLU (silu(gate) * up) -> h."""

    def __init__(self, cfg: ModelConfig, backend: ModuleType, ffn_hidden_size: Optional[int] = None):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        f = ffn_hidden_size or cfg.ffn_hidden_size  # a shared expert's own width
        self.linear_fc1 = backend.linear(cfg.hidden_size, 2 * f if self.swiglu else f, cfg.add_bias_linear)
        self.linear_fc2 = backend.linear(f, cfg.hidden_size, cfg.add_bias_linear)

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

    def __init__(self, cfg: ModelConfig, backend: ModuleType, mlp: Optional[nn.Module] = None,
                 attention: Optional["AttentionFactory"] = None):
        super().__init__()
        self.input_layernorm = backend.norm(cfg.normalization, cfg.hidden_size, cfg.layernorm_epsilon)
        self.self_attention = (attention or SelfAttention)(cfg, backend)  # another architecture's (MLA) in its place
        self.pre_mlp_layernorm = backend.norm(cfg.normalization, cfg.hidden_size, cfg.layernorm_epsilon)
        self.mlp = MLP(cfg, backend) if mlp is None else mlp  # another architecture's block (MoE) in its place
        self.hidden_dropout = backend.dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, *rope: torch.Tensor) -> torch.Tensor:
        x = x + self.hidden_dropout(self.self_attention(self.input_layernorm(x), rope))
        x = x + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(x)))
        return x


class TransformerLayers(nn.ModuleList):
    """The layers, called as one module (names stay `layers.0`, `layers.1`, ...). Full recompute
    replaces this module's forward with one that checkpoints chunks of layers."""

    def forward(self, x: torch.Tensor, *rope: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x, *rope)
        return x


MlpFactory = Callable[[int, ModuleType], Optional[nn.Module]]
"""The block after pre_mlp_layernorm of layer i (None: the dense MLP), for architectures that swap it."""
AttentionFactory = Callable[[ModelConfig, ModuleType], nn.Module]
"""The attention block of every layer, called as `attention(x, rope)` (default: `SelfAttention`)."""


class GPT(nn.Module):
    """Embedding -> L layers -> final norm -> output layer -> cross-entropy.

    The embedding and output layer have `padded_vocab_size` rows (Megatron's padding), so FLOPs and
    memory match Megatron's for the same run; tokens come from the first `vocab_size` ids.

    Under context parallel the model still takes whole sequences of tokens and labels, and works on
    this rank's positions of them (`context_parallel`, set by the layout: `models.cp_attention.SequenceSplit`)."""

    context_parallel = None
    """This rank's part of every sequence under context parallel (None: the whole sequence)."""

    def __init__(self, cfg: ModelConfig, backend: str = "torch", mlp_for: Optional[MlpFactory] = None,
                 attention: Optional[AttentionFactory] = None):
        super().__init__()
        b = get_backend(backend)
        self.cfg = cfg
        self.backend = backend
        vocab = cfg.padded_vocab_size()
        self.word_embeddings = nn.Embedding(vocab, cfg.hidden_size)
        self.position_embeddings = (nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
                                    if cfg.position_embedding_type == "learned_absolute" else None)
        self.rotary = RotaryEmbedding(cfg) if cfg.position_embedding_type == "rope" else None
        self.embedding_dropout = b.dropout(cfg.hidden_dropout)
        layer = getattr(b, "transformer_layer", TransformerLayer)  # a backend may build the layer itself (TE's)
        self.layers = TransformerLayers(layer(cfg, b, mlp_for(i, b) if mlp_for else None, attention)
                                        for i in range(cfg.num_layers))
        self.final_layernorm = b.norm(cfg.normalization, cfg.hidden_size, cfg.layernorm_epsilon)
        self.output_layer = b.linear(cfg.hidden_size, vocab, False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the word embedding with the output layer where the preset says so (again after
        `to_empty`, which may replace parameters)."""
        if self.cfg.share_embeddings_and_output_weights:
            self.output_layer.weight = self.word_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Seeded initialisation on the weights' device: normal(0, std) matrices, and Megatron's
        scaled init std / sqrt(2L) for the two projections that feed the residual stream
        (linear_proj, linear_fc2); unit norm weights, zero biases.

        Every matrix is drawn whole in fp32 from one generator, parameter by parameter in
        `named_parameters` order, so its values do not depend on the layout: a parameter split over
        ranks (a DTensor: tensor parallel, FSDP2) keeps its own part of the whole draw, a 16-bit one
        its rounding, and a module whose rows a tensor-parallel plan reorders (`init_row_order`,
        SwiGLU's fc1) takes them in that order. Each rank holds one whole parameter at a time
        beside its shards. A pipeline rank holds some layers only: a parameter left on the meta
        device (another stage's) is drawn and dropped, so the generator advances as on one rank, and
        an output layer holding its own copy of the tied embedding (the last stage's) takes the
        embedding's draw; an expert weight holding some of the experts (expert parallel) keeps its
        rows of the whole draw."""
        device = next(local(p).device for p in self.parameters() if not local(p).is_meta)
        g = torch.Generator(device=device).manual_seed(seed)
        std = self.cfg.init_method_std
        residual_std = std / math.sqrt(2 * self.cfg.num_layers)
        row_orders = {f"{prefix}.{name}": module.init_row_order for prefix, module in self.named_modules()
                      if getattr(module, "init_row_order", None) is not None for name in ("weight", "bias")}
        # an expert weight holding some experts of the whole one (expert parallel: moe.dispatch.ExpertRows)
        parts = {f"{prefix}.weight": module.init_rows for prefix, module in self.named_modules()
                 if getattr(module, "init_rows", None) is not None}
        copy = (self.output_layer.weight if self.cfg.share_embeddings_and_output_weights
                and self.output_layer.weight is not self.word_embeddings.weight else None)
        for name, p in self.named_parameters():
            if copy is not None and p is copy:
                continue  # drawn with the embedding below
            targets = [t for t in [p, *([copy] if copy is not None and name == "word_embeddings.weight" else [])]
                       if not local(t).is_meta]
            if p.dim() == 1 and name not in row_orders:
                for t in targets:
                    t.fill_(1.0 if name.endswith("weight") and "norm" in name else 0.0)
                continue
            if p.dim() == 1:
                value = torch.zeros(p.shape, dtype=torch.float32, device=device)  # a reordered bias: zeros
            else:
                scaled = name.endswith(("linear_proj.weight", "linear_fc2.weight"))
                part = parts.get(name)
                if (len(targets) == 1 and targets[0] is p and local(p) is p and p.dtype == torch.float32
                        and name not in row_orders and part is None):
                    p.normal_(0.0, residual_std if scaled else std, generator=g)  # the whole parameter, in place
                    continue
                value = torch.empty(part.whole_shape if part else p.shape, dtype=torch.float32, device=device)
                value.normal_(0.0, residual_std if scaled else std, generator=g)
                if part:
                    value = value[part.rows]
            if name in row_orders:
                value = value[row_orders[name].to(device)]
            for t in targets:
                _assign(t, value)
            del value  # before the next parameter's draw: one whole parameter at a time, not two
        for module in self.modules():  # buffers a module fills itself (RoPE tables, a router's expert bias)
            if hasattr(module, "reset_buffers"):
                module.reset_buffers()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The hidden states entering layer 0: word (and learned position) embeddings, then dropout."""
        split = self.context_parallel
        if split is not None:
            tokens = split.select(tokens)  # a copy of this rank's ids, which the embedding keeps
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            table = self.position_embeddings.weight
            x = x + (split.select(table, 0) if split is not None else table[:tokens.shape[1]])
        return self.embedding_dropout(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The logits of the last layer's hidden states: final norm, then the output layer."""
        return self.output_layer(self.final_layernorm(x))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Megatron's cross-entropy: an fp32 softmax worked in place is what the loss keeps
        (vocabulary-parallel where the logits are split over the tensor-parallel ranks). Under context
        parallel `labels` are the whole sequence's and the mean is over this rank's tokens."""
        if self.context_parallel is not None:
            labels = self.context_parallel.select(labels)
        return get_backend(self.backend).cross_entropy(logits, labels)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of next-token prediction; tokens and labels are [b, s]."""
        rope = self.rotary(tokens.shape[1]) if self.rotary is not None else ()
        return self.loss(self.head(self.layers(self.embed(tokens), *rope)), labels)


def _assign(p: torch.Tensor, whole: torch.Tensor) -> None:
    """Write this rank's part of `whole` (the parameter's global value) into p, cast to p's dtype."""
    if local(p) is p:
        p.copy_(whole)
        return
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank drew the same whole value, so each cuts its own part locally,
    # with no collective (FSDP2 over a tensor-parallel shard included).
    part = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local()
    local(p).copy_(part)


def materialize(model: GPT, device: torch.device | str, seed: int) -> GPT:
    """Allocate a model built on the meta device (and perhaps split over ranks there) on `device`,
    each rank only its own shards, and initialise it from `seed` (`GPT.init_weights`); on "meta"
    the shapes only."""
    model.to_empty(device=device)
    model.tie_weights()
    if torch.device(device).type != "meta":
        model.init_weights(seed)
    return model


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                backend: str = "torch", mlp_for: Optional[MlpFactory] = None,
                attention: Optional[AttentionFactory] = None) -> GPT:
    """Build on the meta device in `dtype`, materialise on `device` and initialise from `seed`
    (`materialize`). Two builds with the same seed on the same device are identical, whatever the
    dtype (the weights are drawn in fp32 and rounded). On "meta" (shapes only, as FLOP counting and
    the sharded layouts use it) nothing is allocated or initialised. `transformer_impl
    transformer_engine` builds the layers from Transformer Engine's modules (`backends/te_layers.py`)."""
    if cfg.transformer_impl == "transformer_engine":
        backend = "transformer_engine"
    with torch.device("meta"):
        model = GPT(cfg, backend, mlp_for, attention).to(dtype=dtype)
    return materialize(model, device, seed)
