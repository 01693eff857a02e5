"""The mixture-of-experts GPT: the dense GPT of `dense/layers.py` whose MLP is, on every
`moe_layer_freq`-th layer, a MoE block (Megatron's MoELayer, named `mlp` as Megatron names it):

    shared = shared_experts(x)                                   (optional dense MLP every token runs)
    probs, experts = top_k(router(x))                            (softmax over the top-k logits, or sigmoid)
    permuted = x[tokens sorted by expert]                        (dropless: every routed copy is kept;
                                                                  with a capacity factor, at most capacity per expert)
    permuted = dispatch(permuted)                                (expert parallel: all-to-all, `dispatch.py`)
    routed = fc2(activation(fc1(permuted)) * probs)              (grouped matmuls over the experts)
    y = shared + sum over each token's k copies of combine(routed)

The routing probabilities multiply the activation's output inside `activation_func`, as Megatron's
grouped MLP does, so `moe_act` recompute (which re-runs that function only) covers them too.
No recompute logic lives here: `recompute.apply` installs it, names unchanged.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from recompute_bench.models.dense.layers import GPT, MLP, AttentionFactory, build_model as build_dense
from recompute_bench.models.moe.dispatch import AllToAllDispatch, LocalDispatch
from recompute_bench.models.moe.capacity import expert_capacity
from recompute_bench.config.schema import ModelConfig


class _AuxLossGradient(torch.autograd.Function):
    """Megatron's MoEAuxLossAutoScaler: the probabilities pass unchanged, and their backward also
    starts the auxiliary loss's own backward (gradient 1), so the loss shapes the router's gradient
    without being added to the language-model loss."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux_loss.shape
        ctx.aux_dtype = aux_loss.dtype
        return probs.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


class Router(nn.Module):
    """Scores every expert for every token and keeps the top k: (probabilities [T, k], experts [T, k]).

    sigmoid (DeepSeek-V3): independent scores; the experts are chosen on the scores plus the expert
    bias, within the best `moe_router_group_topk` of `moe_router_num_groups` groups (a group scored
    by the sum of its best k / group_topk experts), and their own scores, normalised over the k,
    are the probabilities. The choice is made without a graph: only the gather of the chosen scores
    carries gradient, as in Megatron, where the masked top-k's values are those scores.
    `moe_router_topk_scaling_factor` scales the probabilities of either score function."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.topk, self.score_function = cfg.moe_router_topk, cfg.moe_router_score_function
        self.groups, self.group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
        self.scale = cfg.moe_router_topk_scaling_factor
        self.aux_loss_coeff = cfg.moe_aux_loss_coeff
        self.weight = nn.Parameter(torch.empty(cfg.num_moe_experts, cfg.hidden_size))
        # Megatron's expert bias is a buffer, not a parameter: no gradient, no optimizer state.
        self.register_buffer("expert_bias", torch.empty(cfg.num_moe_experts) if cfg.moe_router_enable_expert_bias else None)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The expert bias starts at zero (called by `GPT.init_weights`)."""
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The k experts of every token (no graph)."""
        if self.expert_bias is not None:
            scores = scores + self.expert_bias
        if self.groups:
            grouped = scores.unflatten(-1, (self.groups, -1))
            best = grouped.topk(self.topk // self.group_topk, dim=-1).values.sum(-1).topk(self.group_topk, dim=-1).indices
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(-1, best, True)
            scores = scores.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=-1), float("-inf"))
        return scores.topk(self.topk, dim=-1).indices

    def _aux_loss(self, all_scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Switch/GShard load balancing (Megatron's switch_load_balancing_loss_func): coeff x E / (k T^2)
        x sum over experts of (tokens routed to it) x (its score summed over tokens), the scores taken
        over all E experts (softmax, or sigmoid normalised over all)."""
        all_scores = all_scores.reshape(-1, all_scores.shape[-1])
        tokens, num_experts = all_scores.shape
        with torch.no_grad():
            routed = torch.zeros(num_experts, dtype=all_scores.dtype, device=all_scores.device).index_add_(
                0, experts.reshape(-1), torch.ones(experts.numel(), dtype=all_scores.dtype, device=all_scores.device))
        weight = num_experts * self.aux_loss_coeff / (self.topk * tokens * tokens)
        return (all_scores.sum(0) * routed).sum() * weight

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        if self.score_function == "sigmoid":
            all_scores = torch.sigmoid(logits)
            with torch.no_grad():
                experts = self._choose(all_scores)
            scores = all_scores.gather(-1, experts)
            probs = scores / scores.sum(-1, keepdim=True)
            if self.aux_loss_coeff:
                all_scores = all_scores / all_scores.sum(-1, keepdim=True)
        else:
            top, experts = torch.topk(logits, self.topk, dim=-1)  # Megatron's default: softmax after top-k
            probs = torch.softmax(top, dim=-1)
            if self.aux_loss_coeff:
                all_scores = torch.softmax(logits, dim=-1)
        if self.aux_loss_coeff:
            probs = _AuxLossGradient.apply(probs, self._aux_loss(all_scores, experts))
        return (probs if self.scale is None else probs * self.scale), experts


class WeightedActivation(nn.Module):
    """GeLU, or SwiGLU (silu(gate) * up), times each row's routing probability: what `moe_act`
    recomputes. No parameters, so installing recompute on it renames nothing."""

    def __init__(self, swiglu: bool):
        super().__init__()
        self.swiglu = swiglu

    def forward(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        else:
            x = F.gelu(x)
        return x * probs.unsqueeze(-1)


class GroupedMLP(nn.Module):
    """All routed experts: grouped fc1 -> weighted activation -> grouped fc2 over expert-sorted rows."""

    def __init__(self, cfg: ModelConfig, backend: ModuleType):
        super().__init__()
        f, e = cfg.moe_ffn, cfg.num_moe_experts
        swiglu = cfg.activation == "swiglu"
        self.linear_fc1 = backend.grouped_linear(e, cfg.hidden_size, 2 * f if swiglu else f, cfg.moe_grouped_gemm)
        self.activation_func = WeightedActivation(swiglu)
        self.linear_fc2 = backend.grouped_linear(e, f, cfg.hidden_size, cfg.moe_grouped_gemm)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation_func(self.linear_fc1(x, offsets), probs), offsets)


class MoELayer(nn.Module):
    """Router, token permutation, experts, un-permutation, and shared experts (see the module docstring).

    `tokens_per_expert` holds the last forward's routed rows per expert of this rank (under expert
    parallel: the rows its experts received from every rank), on the device (read once after the
    probe step, never inside a step)."""

    def __init__(self, cfg: ModelConfig, backend: ModuleType):
        super().__init__()
        self.topk, self.num_experts = cfg.moe_router_topk, cfg.num_moe_experts
        self.router = Router(cfg)
        self.experts = GroupedMLP(cfg, backend)
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared_experts = MLP(cfg, backend, shared) if shared else None
        self.capacity_factor, self.drop_policy = cfg.moe_expert_capacity_factor, cfg.moe_token_drop_policy
        self.tokens_per_expert: torch.Tensor | None = None
        self.tokens_dropped: torch.Tensor | None = None
        self.dispatch: LocalDispatch | AllToAllDispatch = LocalDispatch()
        """Copies to the experts and back: all here, or by all-to-all under expert parallel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Submodules take x as it came ([b, s, h]), not a view of it: under a re-entrant checkpoint
        # a view requires grad without a grad_fn, which torch's module tracker cannot hook.
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        probs, experts = self.router(x)
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # routed copies sorted by expert, tokens in order within one
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device).index_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))  # no host read (bincount would sync)
        routed_counts = counts
        if self.capacity_factor is not None:
            order, counts = self._drop(order, counts, probs.detach().reshape(-1), flat)
        self.tokens_dropped = (routed_counts - counts).sum().detach()
        token = order // self.topk
        rows, row_probs, counts, combine = self.dispatch(x.index_select(0, token), probs.reshape(-1).index_select(0, order),
                                                         counts)
        self.tokens_per_expert = counts.detach()
        routed = combine(self.experts(rows, counts.cumsum(0, dtype=torch.int32), row_probs))
        # Un-permute by a gather back to token order and a sum over each token's k copies: index_add
        # would keep the routed rows for its backward, and on CUDA adds with atomics (not bitwise stable).
        if self.capacity_factor is None:
            inverse = order.argsort()
        else:  # a dropped copy gathers an appended zero row: it adds nothing, the token keeps its residual
            routed = torch.cat([routed, routed.new_zeros(1, routed.shape[-1])])
            inverse = torch.full_like(flat, order.numel()).index_copy_(0, order, torch.arange(order.numel(), device=x.device))
        y = routed.index_select(0, inverse).view(*shape[:-1], self.topk, shape[-1]).sum(-2)
        return y if shared is None else y + shared

    def _drop(self, order: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor,
              flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token dropping (Megatron's capacity factor): each expert keeps at most `expert_capacity`
        copies, its highest-probability ones (`probs`) or its first tokens (`position`); the kept
        copies stay sorted by expert, tokens in order. No graph. The kept count is read on the host
        (a boolean mask's size): one sync per MoE layer, only with a capacity factor."""
        capacity = expert_capacity(flat.numel() // self.topk, self.topk, self.num_experts, self.capacity_factor)
        ranked = order
        if self.drop_policy == "probs":  # by expert, the highest probability first within one
            by_prob = (-probs).argsort(stable=True)
            ranked = by_prob.index_select(0, flat.index_select(0, by_prob).argsort(stable=True))
        starts = counts.cumsum(0) - counts
        rank = torch.arange(flat.numel(), device=flat.device) - starts.index_select(0, flat.index_select(0, ranked))
        keep = torch.zeros_like(flat, dtype=torch.bool).index_fill_(0, ranked[rank < capacity], True)
        return order[keep.index_select(0, order)], counts.clamp(max=capacity)


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                backend: str = "torch", attention: AttentionFactory | None = None) -> GPT:
    """The dense GPT with a MoE block as the MLP of every MoE layer (`cfg.is_moe_layer`), built,
    materialised and initialised as `dense.layers.build_model` does (router and expert weights are
    matrices: normal(0, std); the experts' fc2 scaled like every residual-feeding projection).
    `attention`: another attention block (MLA), as the dense build takes it."""
    return build_dense(cfg, seed, device, dtype, backend,
                       lambda i, b: MoELayer(cfg, b) if cfg.is_moe_layer(i) else None, attention)
