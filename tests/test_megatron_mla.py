"""Framework megatron's multi-latent attention (analysis/megatron/mla.py) against the tensors
Megatron's MLASelfAttention saves, and against the goldens it reaches.

No Megatron or Transformer Engine here: the twin below is one tensor-parallel rank of
multi_latent_attention.py `MLASelfAttention.forward` written in torch, step for step, with a small
autograd function for each Transformer Engine module that saves what that module saves (TE
linear.py `_Linear.forward`: the contiguous local input; ops/basic/layer_norm.py: the input and fp32
statistics; torch's CUDA dropout: a bool mask). Saved-tensor hooks count what the twin keeps,
storage by storage, parameters excluded, and the estimate's bytes must equal that count."""

import json
import math
from pathlib import Path

import pytest
import torch

from recompute_bench.analysis import megatron as mg
from recompute_bench.analysis.megatron import layer, mla
from recompute_bench.analysis.megatron.parameters import layer_parameters
from recompute_bench.ingest.megatron_args import config_from_megatron
from recompute_bench.models import SavedBytes

E = torch.bfloat16
BASE = {"--num-layers": 2, "--hidden-size": 64, "--num-attention-heads": 4, "--multi-latent-attention": True,
        "--q-lora-rank": 24, "--kv-lora-rank": 16, "--qk-head-dim": 8, "--qk-pos-emb-head-dim": 4, "--v-head-dim": 8,
        "--seq-length": 32, "--max-position-embeddings": 32, "--micro-batch-size": 2, "--global-batch-size": 4,
        "--tensor-model-parallel-size": 2, "--sequence-parallel": True, "--bf16": True, "--attention-backend": "unfused",
        "--attention-softmax-in-fp32": True, "--transformer-impl": "transformer_engine"}
RUN = mg.MegatronRun("h100")


class Linear(torch.autograd.Function):
    """A TE linear on one rank: `prepare_forward` makes the input contiguous, a column-parallel
    linear under sequence parallelism all-gathers it along the sequence (here: `gather` copies),
    and only the local, contiguous input is saved (`saved_inputmat = inputmat`)."""

    @staticmethod
    def forward(ctx, x, weight, gather):
        x = x.contiguous()
        total = torch.cat([x] * gather) if gather > 1 else x
        ctx.save_for_backward(x, weight)
        return total @ weight.t()

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the twin counts the forward only
        raise NotImplementedError


class Norm(torch.autograd.Function):
    """TE's LayerNorm op: saves `input_.contiguous()` and fp32 means and rstdevs per row."""

    @staticmethod
    def forward(ctx, x, weight):
        x = x.contiguous()
        rows = x.numel() // x.shape[-1]
        mean = torch.zeros(rows, dtype=torch.float32)
        rstd = torch.ones(rows, dtype=torch.float32)
        ctx.save_for_backward(x, weight, mean, rstd)
        return torch.nn.functional.layer_norm(x, x.shape[-1:]) * weight

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover
        raise NotImplementedError


class Dropout(torch.autograd.Function):
    """torch's CUDA dropout (native_dropout): saves a bool mask."""

    @staticmethod
    def forward(ctx, x, p):
        mask = torch.rand(x.shape) >= p
        ctx.save_for_backward(mask)
        return x * mask / (1 - p)

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover
        raise NotImplementedError


class CheckpointWithoutOutput(torch.autograd.Function):
    """tensor_parallel.random.CheckpointWithoutOutput: runs `fn` without grad, saves its inputs."""

    @staticmethod
    def forward(ctx, fn, *args):
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, *grads):  # pragma: no cover
        raise NotImplementedError


def _rope(t, freqs):
    """rope_utils.py `_apply_rotary_pos_emb_bshd` with mla_rotary_interleaved."""
    t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
    cos_, sin_ = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return t * cos_ + torch.cat((-x2, x1), dim=-1) * sin_


def twin_attention(cfg, up_proj_recompute=False):
    """One tensor-parallel rank of MLASelfAttention.forward (learned absolute positions: unfused
    RoPE; TE's unfused core attention), its input norm included. Returns the saved bytes."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    t, sp = par.tensor_model_parallel_size, par.sequence_parallel
    s, b, h, n = tr.seq_length, tr.micro_batch_size, m.hidden_size, m.num_attention_heads // t
    qk, r, v = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    weights = {  # shapes as MLASelfAttention.__init__ builds them on a rank
        "norm": torch.ones(h, dtype=E, requires_grad=True),
        "q_down": torch.randn(m.q_lora_rank, h, dtype=E, requires_grad=True),  # TELinear "duplicated"
        "q_up": torch.randn(n * (qk + r), m.q_lora_rank, dtype=E, requires_grad=True),  # column-parallel
        "kv_down": torch.randn(m.kv_lora_rank + r, h, dtype=E, requires_grad=True),
        "kv_up": torch.randn(n * (qk + v), m.kv_lora_rank, dtype=E, requires_grad=True),
        "proj": torch.randn(h, n * v, dtype=E, requires_grad=True),  # row-parallel
    }
    x = torch.randn(s // t if sp else s, b, h, dtype=E, requires_grad=True)
    freqs = torch.randn(s, 1, 1, r)
    storages, params = {}, {w.untyped_storage()._cdata for w in weights.values()} | {x.untyped_storage()._cdata}

    def pack(tensor):
        storages.setdefault(tensor.untyped_storage()._cdata, tensor.untyped_storage())
        return tensor

    def up_proj_and_rope(q_compressed, kv_compressed, k_pos_emb):
        gather = t if sp else 1  # column-parallel: all-gathers the sequence under sequence parallelism
        q = Linear.apply(q_compressed, weights["q_up"], gather).view(s, b, n, qk + r)
        kv = Linear.apply(kv_compressed, weights["kv_up"], gather).view(s, b, n, qk + v)
        q_no_pe, q_pos_emb = torch.split(q, [qk, r], dim=-1)
        k_no_pe, value = torch.split(kv, [qk, v], dim=-1)
        q_pos_emb = _rope(q_pos_emb, freqs)
        k_pos_emb = _rope(k_pos_emb.unsqueeze(-2), freqs)
        query = torch.cat([q_no_pe, q_pos_emb], dim=-1)
        key = torch.cat([k_no_pe, k_pos_emb.expand(-1, -1, n, -1)], dim=-1)
        return query.contiguous(), key.contiguous(), value.contiguous()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        # the layer's input_layernorm (a TENorm of its own in MLA's spec); the layer input is the
        # norm's saved input, counted as such (x is excluded from `params` only as a leaf)
        hidden = Norm.apply(x * 1, weights["norm"])
        q_compressed = Linear.apply(hidden, weights["q_down"], 1)
        kv_combined = Linear.apply(hidden, weights["kv_down"], 1)
        kv_compressed, k_pos_emb = torch.split(kv_combined, [m.kv_lora_rank, r], dim=-1)
        if sp and t > 1:
            k_pos_emb = torch.cat([k_pos_emb] * t)  # gather_from_sequence_parallel_region
        if up_proj_recompute:
            query, key, value = CheckpointWithoutOutput.apply(up_proj_and_rope, q_compressed, kv_compressed, k_pos_emb)
            query, key, value = (z.detach().requires_grad_() for z in (query, key, value))
        else:
            query, key, value = up_proj_and_rope(q_compressed, kv_compressed, k_pos_emb)
        # TE UnfusedDotProductAttention: [s, b*n, d] views, baddbmm, softmax, dropout, bmm
        q2, k2 = query.reshape(s, b * n, -1), key.reshape(s, b * n, -1)
        scores = torch.baddbmm(torch.empty(b * n, s, s, dtype=E), q2.transpose(0, 1), k2.transpose(0, 1).transpose(1, 2),
                               beta=0.0, alpha=1 / math.sqrt(qk + r))
        probs = Dropout.apply(torch.softmax(scores.view(b, n, s, s), dim=-1), m.attention_dropout)
        context = torch.bmm(probs.view(b * n, s, s), value.reshape(s, b * n, -1).transpose(0, 1))
        context = context.view(b, n, s, v).permute(2, 0, 1, 3).contiguous().view(s, b, n * v)
        if up_proj_recompute:  # discard_output_and_register_recompute
            for z in (query, key, value):
                z.untyped_storage().resize_(0)
        Linear.apply(context, weights["proj"], 1)
    total = sum(st.nbytes() for key, st in storages.items() if key not in params)
    return total, sum(w.numel() for w in weights.values())


def _estimate(cfg, modules=()):
    """The input norm's three entries (layer.py) and mla_attention_saved, on one rank."""
    saved = SavedBytes()
    tr, m = cfg.training, cfg.model
    tokens = tr.seq_length * tr.micro_batch_size
    saved.add("input_layernorm.input", 2 * tokens * m.hidden_size, "sp")
    saved.add("input_layernorm.norm_stats", 2 * 4 * tokens, "sp")
    saved.add("input_layernorm.output", 2 * tokens * m.hidden_size, "sp")
    mla.mla_attention_saved(saved, cfg, RUN, set(modules))
    saved.add("core_attention.output", 0, "tp")  # already there: linear_proj's input
    return sum(saved.per_rank(cfg.parallel.tensor_model_parallel_size, cfg.parallel.sequence_parallel).values())


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True), (2, False)])
def test_mla_saved_bytes_equal_what_the_code_saves(tp, sp):
    args = {**BASE, "--tensor-model-parallel-size": tp, "--sequence-parallel": sp}
    cfg = config_from_megatron(args, world_size=tp)
    assert cfg.model.multi_latent_attention and cfg.parallel.sequence_parallel == (sp and tp > 1)
    assert not mla.mla_rope_fused(cfg)  # learned_absolute: validate_args turns rope fusion off
    measured, _ = twin_attention(cfg)
    assert _estimate(cfg) == measured


def test_mla_up_proj_frees_query_key_value_and_keeps_the_latents():
    cfg = config_from_megatron({**BASE, "--recompute-granularity": "selective", "--recompute-modules": ["mla_up_proj"]},
                               world_size=2)
    measured, _ = twin_attention(cfg, up_proj_recompute=True)
    assert _estimate(cfg, ["mla_up_proj"]) == measured
    full, _ = twin_attention(cfg)
    # what mla_up_proj saves here: q, k, v (2 heads of 12 + 12 + 8 over 64 tokens, bf16), the kv_up
    # copy and RoPE's cos/sin, less the kv latent's whole [s/t, b, kv_lora + r] output the checkpoint
    # keeps and the gathered k_pos_emb
    e, tokens = 2, 64
    freed = e * tokens * 2 * (12 + 12 + 8) + e * tokens // 2 * 16 + 4 * e * 32 * 4
    held = e * tokens // 2 * (16 + 4) + e * tokens * 4
    assert full - measured == freed - held


def test_mla_parameters_are_the_modules_shapes():
    for tp in (1, 2):
        cfg = config_from_megatron({**BASE, "--tensor-model-parallel-size": tp}, world_size=tp)
        _, numel = twin_attention(cfg)
        sharded, replicated = mla.mla_attention_parameters(cfg)
        # the twin's norm has LayerNorm's weight only; Megatron's LayerNorm has a bias too, and
        # linear_proj a bias (add_bias_linear, Megatron's default)
        assert sharded / tp + replicated == numel + cfg.model.hidden_size + cfg.model.hidden_size
    # the layer: the block and the dense MLP beside it (fc1 with its fused norm, fc2, their biases)
    cfg = config_from_megatron(BASE, world_size=2)
    h, f = 64, 256
    sharded, replicated = mla.mla_attention_parameters(cfg)
    assert layer_parameters(cfg) == (sharded + h * f + f + f * h) / 2 + replicated + 2 * h + h


def test_qk_layernorm_fuses_the_latent_norms_into_the_up_projections():
    plain = config_from_megatron(BASE, world_size=2)
    normed = config_from_megatron({**BASE, "--qk-layernorm": True}, world_size=2)
    extra = layer.layer_bytes(normed, RUN) - layer.layer_bytes(plain, RUN)
    # TELayerNormColumnParallelLinear keeps its norm's output and fp32 statistics (the local shard
    # under sequence parallelism): q latent 24 and kv latent 16 wide, 64 tokens, 2 ranks
    assert extra == (2 * 64 * (24 + 16) + 2 * 2 * 4 * 64) / 2
    sharded, replicated = mla.mla_attention_parameters(normed)
    assert (sharded, replicated - mla.mla_attention_parameters(plain)[1]) == (mla.mla_attention_parameters(plain)[0],
                                                                            2 * (24 + 16))


def test_the_mla_goldens_are_within_one_percent():
    data = json.loads((Path(__file__).parent / "data" / "megatron" / "cases.json").read_text())
    for name in ("gpt3_mcore_te_tp2_pp2_mla", "gpt3_mcore_te_tp2_pp2_mla_1node"):
        case = next(c for c in data["cases"] if c["case"] == name)
        for golden, g in case["goldens"].items():
            cfg = config_from_megatron(case["args"], world_size=g["gpus"])
            peak = mg.stage_peak(cfg, 1, mg.MegatronRun(golden.split("_")[1], case["env"]["CUBLAS_WORKSPACE_CONFIG"]))
            assert abs(peak.peak_allocated_bytes / g["max_allocated_bytes"] - 1) < 0.01
            assert abs(peak.static_bytes / g["allocated_bytes"] - 1) < 0.03
