"""The dense GPT's spec: one pre-norm layer of `layers.py`, counted without building it (no torch).

    x = x + dropout(linear_proj(core_attention(rope(linear_qkv(input_layernorm(x))))))
    x = x + dropout(linear_fc2(act(linear_fc1(pre_mlp_layernorm(x)))))

FLOPs are GEMMs only, 2 per multiply-add, as the kernels run them: a linear's backward is two GEMMs
of its forward's size (data and weight gradient); core attention's depends on the kernel (see
`attention_kernel`): the math paths compute the full s x s square, a fused kernel the tiles the
causal mask does not hide wholly (`models.attention`), about half of it. `FlopCounterMode` counts
the same except that its formulas for the fused kernels ignore the mask (the full square).
Megatron's model FLOPs (`layer_model_flops`) are a different count: 3 passes x the forward GEMMs,
exactly the causal half of attention.

Saved bytes are the storages the layer keeps for backward, named one by one and checked against the
saved-tensor probe in the tests. Under tensor parallelism t they split the paper's way: what lies
inside the column/row-parallel region (q, k, v, the attention scores, the MLP's wide activations)
divides by t; what lies outside (norm inputs and outputs, dropout masks, norm statistics) divides by
t only with sequence parallelism.
"""

from __future__ import annotations

from typing import Any, Iterable

from recompute_bench.models import (ELEMENT_BYTES, FP32_BYTES, MASK_BYTES, SavedBytes, Work, device_kind)
from recompute_bench.models.attention import ATTENTION_KERNELS, FUSED_KERNELS, attention_tiles, causal_pairs
from recompute_bench.models.context_parallel import (CP_KERNELS, rank_attention_pairs, rank_seq_length, torch_ring_applies)
from recompute_bench.config.choices import HARNESS_COMM_TYPES
from recompute_bench.config.cp_comm import comm_levels
from recompute_bench.config.schema import Config


def linear(forward: float) -> Work:
    """A linear layer's work: its backward is two GEMMs of its forward's size (data and weight gradient)."""
    return Work(forward, 2 * forward)


def norm_parameters(cfg: Config, width: int) -> int:
    """A norm over `width` features: LayerNorm's weight and bias, RMSNorm's weight."""
    return (2 if cfg.model.normalization == "LayerNorm" else 1) * width


class DenseSpec:
    """The dense GPT (GPT-3 and Llama layers: LayerNorm or RMSNorm, GeLU or SwiGLU, MHA or GQA,
    learned or rotary positions)."""

    name = "dense"
    recompute_targets = ("core_attn", "mlp", "layernorm")
    """Selective recompute targets this layer has, in Megatron's order."""

    # ----- kernels ------------------------------------------------------------------------------

    def attention_kernel(self, cfg: Config, device: str = "cuda") -> str:
        """What the core attention runs on `device`, which decides what it saves and what its
        backward computes: the kernel the run measured where `device` names one
        (`models.DeviceKernels`, what `run` records as `env.attention_kernel`), else the prediction
        below of torch's choice (`torch._fused_sdp_choice`):

        - "math": the model's explicit QK^T, softmax, dropout, times V (`--attention-backend math`);
        - "flash", "efficient", "cudnn" (`models.attention.FUSED_KERNELS`): torch's fused kernels.
          They save q, k, v, the output and an fp32 log-sum-exp per query (the memory-efficient
          kernel's padded to a multiple of 32 queries), no s² tensor, so their backward recomputes
          QK^T before the four gradient matmuls: five matmuls where the others run four
          (torch/utils/flop_counter.py `sdpa_backward_flop_count`); and they skip the tiles the
          causal mask hides (`models.attention`). Predicted on CUDA: flash for 16-bit q, k, v of one
          head dimension up to 256 (first in torch's default order; where torch puts cuDNN first,
          on sm90/sm100 with cuDNN newer than 9.15, the run records cudnn, which saves the same);
          efficient for fp32 or two head dimensions (MLA), which it takes; on a CPU "flash" is torch's
          CPU flash kernel (`cpu_flash_attention`: no dropout, one head dimension), which has no
          FlopCounterMode formula, so `FlopCounterMode` on a CPU counts none of its FLOPs;
        - "sdpa_math": torch's own math fallback inside `scaled_dot_product_attention`, which upcasts
          16-bit inputs to fp32 and keeps the s² tensors in fp32: on a CPU with attention dropout or
          two head dimensions; on CUDA fp32 with grouped query attention (flash needs 16-bit,
          memory-efficient has no GQA).
        """
        m = cfg.model
        if cfg.parallel.context_parallel_size > 1:
            return self._cp_attention_kernel(cfg, device)
        if m.attention_backend == "math":
            return "math"
        measured = getattr(device, "attention_kernel", None)
        if measured in ATTENTION_KERNELS:  # not one the analysis models ("overrideable"): predict
            return measured
        qk_dim, v_dim = self._attention_head_dims(cfg)
        if device_kind(device) == "cpu":
            return "sdpa_math" if m.attention_dropout > 0 or qk_dim != v_dim else "flash"
        if cfg.training.precision != "fp32" and qk_dim == v_dim <= 256:
            return "flash"
        return "sdpa_math" if m.groups != m.num_attention_heads else "efficient"

    def _cp_attention_kernel(self, cfg: Config, device: str) -> str:
        """Under context parallel, what each block of a rank's attention runs (`models.cp_attention`):
        the one measured, else torch's fused flash kernel where it takes the block (no attention dropout;
        on CUDA 16-bit and a head dimension up to 256), else the same formulas written out in fp32
        ("sdpa_math", the stand-in for sdpa's math fallback)."""
        measured = getattr(device, "attention_kernel", None)
        if measured in CP_KERNELS:
            return measured
        if cfg.model.attention_dropout > 0:
            return "sdpa_math"
        if device_kind(device) == "cuda" and (cfg.training.precision == "fp32" or cfg.model.head_dim > 256):
            return "sdpa_math"
        return "flash"

    def cp_attention_path(self, cfg: Config, device: str = "cuda") -> str:
        """Which attention runs a context-parallel rank's blocks: "torch_ring" (torch's own context
        parallel, `context_parallel.torch_ring_applies`) or this harness's cp_comm_type."""
        m, p = cfg.model, cfg.parallel
        kernel = self._cp_attention_kernel(cfg, device)
        return "torch_ring" if torch_ring_applies(device, kernel, p.cp_comm_type, m.num_attention_heads, m.groups) else p.cp_comm_type

    def _attention_head_dims(self, cfg: Config) -> tuple[int, int]:
        """(q and k's, v's) head dimension of core attention."""
        return cfg.model.head_dim, cfg.model.head_dim

    # ----- FLOPs ----------------------------------------------------------------------------------

    def layer_flops(self, cfg: Config, samples: int | None = None, device: str = "cuda") -> dict[str, Work]:
        """FLOPs of one layer for `samples` sequences (default: one micro-batch), part by part:
        "qkv_proj", "core_attn", "out_proj", "mlp"."""
        m = cfg.model
        b = cfg.training.micro_batch_size if samples is None else samples
        tokens = b * cfg.training.seq_length
        fc_widths = 3 if m.activation == "swiglu" else 2  # fc1 is h -> 2f under SwiGLU, fc2 f -> h
        return self._attention_flops(cfg, b, device) | {"mlp": linear(2 * tokens * m.hidden_size * m.ffn_hidden_size * fc_widths)}

    def _attention_flops(self, cfg: Config, b: int, device: str) -> dict[str, Work]:
        """The attention block's parts for b sequences: "qkv_proj", "core_attn", "out_proj"."""
        m = cfg.model
        h, tokens = m.hidden_size, b * cfg.training.seq_length
        q, kv = m.head_dim * m.num_attention_heads, m.head_dim * m.groups
        return {"qkv_proj": linear(2 * tokens * h * (q + 2 * kv)),
                "core_attn": self._core_attn_flops(cfg, b, device, q, q),
                "out_proj": linear(2 * tokens * q * h)}

    def _core_attn_flops(self, cfg: Config, b: int, device: str, qk_width: int, v_width: int) -> Work:
        """Core attention over b sequences whose q and k have `qk_width` and v `v_width` elements per
        token over all heads: QK^T and times V forward; the backward's gradients of both, plus QK^T
        once more for a kernel that kept no scores (torch's `sdpa_backward_flop_count`). The math
        paths run every (query, key) pair of the square; a fused kernel the pairs of the tiles the
        causal mask does not hide wholly, with its forward's and its backward's tiles."""
        s = cfg.training.seq_length
        kernel = self.attention_kernel(cfg, device)
        forward_pairs = backward_pairs = s * s
        if cfg.parallel.context_parallel_size > 1:
            return self._cp_core_attn_flops(cfg, b, device, qk_width, v_width)
        if kernel in FUSED_KERNELS:
            head_dim = max(qk_width, v_width) // cfg.model.num_attention_heads
            tiles = attention_tiles(kernel, device_kind(device), head_dim, s, cfg.model.attention_dropout > 0)
            forward_pairs, backward_pairs = (causal_pairs(s, *tile) for tile in tiles)
        qk, pv = 2 * b * qk_width, 2 * b * v_width  # per pair: one row of [b, a, s, d] x [b, a, d, s] each
        return Work(forward_pairs * (qk + pv),
                    backward_pairs * ((3 if kernel in FUSED_KERNELS else 2) * qk + 2 * pv))

    def _cp_core_attn_flops(self, cfg: Config, b: int, device: str, qk_width: int, v_width: int) -> Work:
        """Core attention of b sequences over every context-parallel rank: the (query, key) pairs of
        each rank's blocks (`context_parallel.attention_blocks`; torch's ring runs the p2p ones), whole
        under the written-out kernel (its masks applied after the matmuls), the tiles a causal mask
        does not hide wholly on a diagonal block under flash. Both kernels' backward recompute the
        scores (three QK-sized and two PV-sized matmuls per pair)."""
        s, cp = cfg.training.seq_length, cfg.parallel.context_parallel_size
        kernel = self.attention_kernel(cfg, device)
        path = self.cp_attention_path(cfg, device)
        comm = "p2p" if path == "torch_ring" else path
        head_dim = max(qk_width, v_width) // cfg.model.num_attention_heads
        fused = kernel == "flash"

        def tiled(which: int):
            return lambda side: causal_pairs(side, *attention_tiles(kernel, device_kind(device), head_dim, side, False)[which])

        ring = cp
        if comm not in HARNESS_COMM_TYPES:
            # Megatron's all-to-all kinds (Transformer Engine's AttnFuncWithCPAndQKVOA2A; a2a+p2p runs
            # the p2p ring over the second level of hierarchical_context_parallel_sizes): after the
            # all-to-all a rank runs 1 / a2a of the heads over the sequence its ring holds, so over
            # all ranks each head sees the pairs of a ring of `ring` ranks (one rank: the whole square).
            # A per-layer list of kinds is counted by its first (estimates of Megatron do not gate FLOPs).
            kind, _, ring = comm_levels(comm.split()[0], cp, cfg.parallel.hierarchical_context_parallel_sizes)
            comm = "p2p" if kind != "all_gather" else kind
        forward = rank_attention_pairs(s, ring, comm, fused, tiled(0))
        backward = rank_attention_pairs(s, ring, comm, fused, tiled(1))
        qk, pv = 2 * b * qk_width, 2 * b * v_width
        return Work(forward * (qk + pv), backward * (3 * qk + 2 * pv))

    def selective_recompute_flops(self, cfg: Config, modules: Iterable[str], samples: int | None = None,
                                  device: str = "cuda") -> float:
        """Forward FLOPs one layer runs again in backward when `modules` are recomputed selectively
        (`layernorm` re-runs a norm only: no GEMM)."""
        parts = self.layer_flops(cfg, samples, device)
        return sum(parts[x].forward for x in set(modules) & {"core_attn", "mlp"})

    def layer_model_flops(self, cfg: Config, samples: int | None = None) -> float:
        """One layer's term of Megatron's model FLOPs (`num_floating_point_operations`) for `samples`
        sequences: 3 passes (forward, data and weight gradient) x 2 per multiply-add over the QKV
        (GQA: smaller k and v), output-projection and MLP (SwiGLU: a third matrix) GEMMs, plus QK^T
        and times V over the causal half of the square. Recompute is never counted."""
        m, s = cfg.model, cfg.training.seq_length
        b = cfg.training.micro_batch_size if samples is None else samples
        ffn_matrices = 3 if m.activation == "swiglu" else 2
        return b * s * 3 * 2 * ffn_matrices * m.hidden_size * m.ffn_hidden_size + self._attention_model_flops(cfg, b)

    def _attention_model_flops(self, cfg: Config, b: int) -> float:
        """The attention term of Megatron's model FLOPs for b sequences."""
        m, s = cfg.model, cfg.training.seq_length
        h = m.hidden_size
        q, kv = m.head_dim * m.num_attention_heads, m.head_dim * m.groups
        core = 3 * 2 * (2 * q) // 2  # per query-key pair: QK^T and times V, the causal half
        return b * s * 3 * 2 * (h * (q + 2 * kv) + q * h) + b * s * s * core

    def output_layer_flops(self, cfg: Config, samples: int | None = None) -> Work:
        """The output layer over Megatron's padded vocabulary (a linear: backward twice forward)."""
        b = cfg.training.micro_batch_size if samples is None else samples
        forward = 2 * b * cfg.training.seq_length * cfg.model.hidden_size * cfg.vocab_rows
        return Work(forward, 2 * forward)

    def logits_model_flops(self, cfg: Config, samples: int | None = None) -> float:
        """The logits term of Megatron's model FLOPs: 3 x 2 x h x padded vocabulary per token."""
        b = cfg.training.micro_batch_size if samples is None else samples
        return 3 * 2 * b * cfg.training.seq_length * cfg.model.hidden_size * cfg.vocab_rows

    # ----- bytes ----------------------------------------------------------------------------------

    def norm_stats_bytes(self, cfg: Config, device: str, tokens: int) -> float:
        """Statistics one norm saves for `tokens` positions: RMSNorm's fp32 rstd; LayerNorm's mean
        and rstd, which torch keeps in fp32 on CUDA and in the parameters' dtype on a CPU."""
        if cfg.model.normalization == "RMSNorm":
            return FP32_BYTES * tokens
        per = FP32_BYTES if device_kind(device) == "cuda" else ELEMENT_BYTES[cfg.training.precision]
        return 2 * per * tokens

    def layer_saved_bytes(self, cfg: Config, modules: Iterable[str] = (), device: str = "cuda") -> dict[str, float]:
        """Bytes one layer keeps for backward for one micro-batch on one tensor-parallel rank,
        storage by storage, when the layer is not inside a full-recompute checkpoint and `modules`
        are recomputed selectively."""
        m, tr, par = cfg.model, cfg.training, cfg.parallel
        e = ELEMENT_BYTES[tr.precision]
        tokens, h = rank_seq_length(cfg) * tr.micro_batch_size, m.hidden_size  # this context-parallel rank's
        mods = set(modules)
        saved = SavedBytes()

        # Attention block: input_layernorm -> linear_qkv -> (RoPE) -> core attention -> linear_proj -> dropout.
        saved.add("layer_input", e * tokens * h, "sp")  # the norm (or its recompute function) keeps its input
        if "layernorm" not in mods:  # layernorm recompute frees the output and keeps no statistics
            saved.add("input_layernorm.stats", self.norm_stats_bytes(cfg, device, tokens), "sp")
            saved.add("input_layernorm.output", e * tokens * h, "sp")  # the attention's input
        self._attention_saved(saved, cfg, mods, device)
        if m.hidden_dropout > 0:
            saved.add("attention.dropout_mask", MASK_BYTES * tokens * h, "sp")

        # MLP block: pre_mlp_layernorm -> fc1 -> GeLU or SwiGLU -> fc2 -> dropout.
        saved.add("pre_mlp_layernorm.input", e * tokens * h, "sp")
        if "layernorm" not in mods:
            saved.add("pre_mlp_layernorm.stats", self.norm_stats_bytes(cfg, device, tokens), "sp")
            saved.add("pre_mlp_layernorm.output", e * tokens * h, "sp")  # fc1's input, or the mlp checkpoint's
        self._mlp_saved(saved, cfg, mods, device)
        if m.hidden_dropout > 0:
            saved.add("mlp.dropout_mask", MASK_BYTES * tokens * h, "sp")
        return saved.per_rank(par.tensor_model_parallel_size, par.sequence_parallel)

    def _mlp_saved(self, saved: SavedBytes, cfg: Config, mods: set[str], device: str) -> None:
        """What the MLP keeps after its input (pre_mlp_layernorm's output): fc1's output, SwiGLU's
        silu(gate), fc2's input; nothing when `mlp` is recomputed. Another architecture's block
        (MoE) answers this for its own layers."""
        if "mlp" in mods:
            return
        tokens = rank_seq_length(cfg) * cfg.training.micro_batch_size
        self._dense_mlp_saved(saved, cfg, "", tokens, cfg.model.ffn_hidden_size)

    @staticmethod
    def _dense_mlp_saved(saved: SavedBytes, cfg: Config, prefix: str, tokens: int, f: int) -> None:
        """A dense MLP of width `f` over `tokens` rows: fc1's output, silu(gate), fc2's input."""
        e = ELEMENT_BYTES[cfg.training.precision]
        swiglu = cfg.model.activation == "swiglu"
        saved.add(f"{prefix}linear_fc1.output", e * tokens * f * (2 if swiglu else 1), "tp")  # activation's input
        if swiglu:
            saved.add(f"{prefix}mlp.silu_output", e * tokens * f, "tp")  # silu(gate), kept by the product
        saved.add(f"{prefix}linear_fc2.input", e * tokens * f, "tp")

    def _attention_saved(self, saved: SavedBytes, cfg: Config, mods: set[str], device: str) -> None:
        """What the attention block keeps after its input (input_layernorm's output): RoPE's q and k
        (or the fused QKV output) and what core attention keeps."""
        m, tr = cfg.model, cfg.training
        e, tokens = ELEMENT_BYTES[tr.precision], rank_seq_length(cfg) * tr.micro_batch_size
        q_width, kv_width = m.num_attention_heads * m.head_dim, m.groups * m.head_dim
        qkv = ("linear_qkv.output", e * tokens * (q_width + 2 * kv_width))
        rope = m.position_embedding_type == "rope"
        # q, k, v are views of the fused QKV output (laid out per query group); RoPE makes new q and k,
        # but v stays a view, so the whole QKV output stays alive whenever v is saved as it is. With
        # several heads per group q's heads are not adjacent in that layout: q is a copy.
        q_copy = rope or m.groups != m.num_attention_heads
        sources = {"q": ("rope.q" if rope else "linear_qkv.q", e * tokens * q_width) if q_copy else qkv,
                   "k": ("rope.k", e * tokens * kv_width) if rope else qkv,
                   "v": qkv}
        self._core_attention(saved, cfg, mods, device, sources, q_width, q_width, m.groups != m.num_attention_heads)

    def _core_attention(self, saved: SavedBytes, cfg: Config, mods: set[str], device: str,
                        sources: dict[str, tuple[str, float]], qk_width: int, v_width: int, gqa: bool) -> None:
        """What core attention keeps (see `attention_kernel`), or its checkpoint when `core_attn` is
        recomputed: q, k and v as they come (`sources`: storage name and bytes), `qk_width` and
        `v_width` elements per token over all query heads."""
        m, tr = cfg.model, cfg.training
        e = ELEMENT_BYTES[tr.precision]
        s, b, a = rank_seq_length(cfg), tr.micro_batch_size, m.num_attention_heads
        tokens = s * b
        if "core_attn" in mods:
            for name, nbytes in sources.values():  # the checkpoint saves q, k and v
                saved.add(name, nbytes, "tp")
            saved.add("core_attention.output", e * tokens * v_width, "tp")  # linear_proj's input
            return
        if cfg.parallel.context_parallel_size > 1:
            # The attention over the split (`models.cp_attention`), whatever its kernel, keeps this rank's
            # q, k, v, its output (laid out as linear_proj's input: one storage) and an fp32
            # log-sum-exp per query. torch's ring (CUDA) merges into a [b, heads, s, d] tensor its node
            # keeps beside the [b, s, h] copy linear_proj keeps (read from torch's `_SDPAMerger`; not
            # measured here).
            for name, nbytes in sources.values():
                saved.add(name, nbytes, "tp")
            saved.add("core_attention.output", e * tokens * v_width, "tp")
            saved.add("core_attention.logsumexp", FP32_BYTES * b * a * s, "tp")
            if self.cp_attention_path(cfg, device) == "torch_ring":
                saved.add("core_attention.ring_output", e * tokens * v_width, "tp")
            return
        scores = a * s * s * b  # elements of one [b, a, s, s] tensor
        kernel = self.attention_kernel(cfg, device)
        if kernel in FUSED_KERNELS:
            for name, nbytes in sources.values():
                saved.add(name, nbytes, "tp")
            saved.add("core_attention.output", e * tokens * v_width, "tp")  # also linear_proj's input (a view)
            # The memory-efficient kernel pads its log-sum-exp to a multiple of 32 queries (kAlignLSE,
            # `_efficient_attention_forward` in ATen/native/transformers/cuda/attention.cu).
            rows = -(-s // 32) * 32 if kernel == "efficient" and device_kind(device) == "cuda" else s
            saved.add("core_attention.logsumexp", FP32_BYTES * b * a * rows, "tp")
            return
        # matmul folds [b, heads, s, d] into [b*heads, s, d]: a view for b = 1, a copy of the transposed
        # view for b > 1, so a saved operand is either its source storage or a fresh copy.
        copy = b > 1
        widths = {"q": qk_width, "k": qk_width, "v": v_width}
        if kernel == "math":
            saved.add(*(("core_attention.q", e * tokens * qk_width) if copy else sources["q"]), "tp")
            for x in ("k", "v"):  # GQA repeats k and v to every head first: a fresh tensor either way
                saved.add(*((f"core_attention.{x}", e * tokens * widths[x]) if gqa or copy else sources[x]), "tp")
            saved.add("core_attention.softmax", e * scores, "tp")
            if m.attention_dropout > 0:
                saved.add("core_attention.dropout_mask", MASK_BYTES * scores, "tp")
                saved.add("core_attention.dropout_output", e * scores, "tp")
        else:  # sdpa's math fallback: q and k scaled in fp32, v upcast (or repeated) unless already fp32 MHA
            acc = FP32_BYTES
            saved.add("core_attention.q", acc * tokens * qk_width, "tp")
            saved.add("core_attention.k", acc * tokens * qk_width, "tp")
            fresh_v = gqa or e < acc or copy
            saved.add(*(("core_attention.v", acc * tokens * v_width) if fresh_v else sources["v"]), "tp")
            saved.add("core_attention.softmax", acc * scores, "tp")
            if m.attention_dropout > 0:
                # torch's own dropout there: a bool mask on CUDA, the scaled fp32 noise on a CPU
                mask = MASK_BYTES if device_kind(device) == "cuda" else acc
                saved.add("core_attention.dropout_mask", mask * scores, "tp")
                saved.add("core_attention.dropout_output", acc * scores, "tp")
        saved.add("core_attention.output", e * tokens * v_width, "tp")  # the [b, s, h] copy linear_proj keeps

    # ----- parameters -----------------------------------------------------------------------------

    def layer_parameters(self, cfg: Config) -> dict[str, float]:
        """Parameters of one layer on one tensor-parallel rank: "sharded" (QKV, projections, MLP
        weights and column-parallel biases) and "replicated" (norms, row-parallel biases)."""
        m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
        h, f = m.hidden_size, m.ffn_hidden_size
        fc1 = 2 * f if m.activation == "swiglu" else f
        bias = 1 if m.add_bias_linear else 0
        attention = self._attention_parameters(cfg)
        sharded = attention["sharded"] + h * fc1 + bias * fc1 + f * h
        replicated = 2 * norm_parameters(cfg, h) + bias * h + attention["replicated"]
        return {"sharded": sharded / t, "replicated": replicated}

    def _attention_parameters(self, cfg: Config) -> dict[str, int]:
        """The attention block's parameters on one rank before the tensor-parallel split: "sharded"
        (QKV and output projection, column-parallel biases), "replicated" (the output bias)."""
        m = cfg.model
        h = m.hidden_size
        qkv = (m.num_attention_heads + 2 * m.groups) * m.head_dim
        q, bias = m.num_attention_heads * m.head_dim, 1 if m.add_bias_linear else 0
        return {"sharded": h * qkv + bias * qkv + q * h, "replicated": bias * h}

    # ----- building -------------------------------------------------------------------------------

    def build(self, cfg: Config, device: Any = "cpu", dtype: Any = None) -> Any:
        """The torch model (`layers.py`), seeded with cfg.training.seed; torch is imported here only."""
        from recompute_bench.models.dense.layers import build_model

        if dtype is None:
            return build_model(cfg.model, cfg.training.seed, device)
        return build_model(cfg.model, cfg.training.seed, device, dtype)


DENSE = DenseSpec()
