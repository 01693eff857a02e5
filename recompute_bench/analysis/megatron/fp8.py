"""FP8: what Transformer Engine's linears keep under each of Megatron's FP8 recipes.

`precision fp8` is Megatron's `--bf16 --fp8-format F --fp8-recipe R`: weights, activations and
gradients stay 16-bit; inside `fp8_autocast` every Transformer Engine linear (LayerNormLinear for
QKV and fc1, Linear for the projections) quantizes its GEMM operands. What that changes on a rank:

- a linear's saved input (`linear_input_bytes`): one byte per element instead of two, plus its
  scale-inverses, in the layout the backward's weight-gradient GEMM reads;
- the weights (`weight_bytes`): without `fp8_param_gather` every linear keeps a cached FP8 copy of
  its weight (and its transpose where the GEMM needs one) beside the bf16 weight; with it the weight
  itself is FP8 and lives in DDP's uint8 param buffer;
- per module scaling state (`scaling_state_bytes`): delayed scaling's amax history and scales;
- nothing else: attention (`fp8_dot_product_attention` off), the norms' inputs and statistics, the
  fused bias-activation's input (Megatron's own SwiGLU/GeLU between fc1 and fc2: its MLP never runs
  TE's LayerNormMLP), dropout masks, the output layer and the loss stay as in bf16. Checked against
  TE f031cf87 too (the version Bridge pinned for the seeds' run): the same usages are saved.

Megatron keeps the first `num_layers_at_start_in_bf16` and last `num_layers_at_end_in_bf16` layers
in bf16 under `first_last_layers_bf16` (`layer_runs_fp8`, `layer_config`).

Sources (TransformerEngine d0067d0, Megatron-LM d98e8a6):
- transformer_engine/pytorch/module/linear.py `_linear_forward_impl` (input usages, saved input,
  `save_original_input`), layernorm_linear.py `_LayerNormLinear.forward` (ln_out's usages),
  base.py `quantize_weight`, `TransformerEngineBaseModule` (`_fp8_workspaces`, fp8_meta)
- transformer_engine/pytorch/tensor/float8_tensor.py, mxfp8_tensor.py, float8_blockwise_tensor.py
  (data, transpose / columnwise data and scale-inverse shapes), utils.py
  `is_non_tn_fp8_gemm_supported`, `post_all_gather_processing`, `replace_raw_data`
- transformer_engine/pytorch/quantization.py (which GPUs run which recipe; DelayedScalingRecipeState)
- megatron/core/fp8_utils.py `get_fp8_recipe`, `is_first_last_bf16_layer`;
  megatron/core/transformer/attention.py (`set_save_original_input(linear_proj)`);
  megatron/core/distributed/param_and_grad_buffer.py (uint8 param buffer, the MXFP8 shared buffer).
Every module of this package that counts a linear's saved input (the dense layer's norm-linears
and linears, MoE's grouped experts, MLA's projections) asks `linear_input_bytes`. Pure Python.
"""

from __future__ import annotations

import dataclasses
import math

from recompute_bench.analysis.megatron.gpu import MegatronRun
from recompute_bench.models import ELEMENT_BYTES, FP32_BYTES
from recompute_bench.config.schema import BadInput, Config

FP8_BYTES = 1
"""One E4M3 / E5M2 value (TE stores FP8 data as uint8)."""
ALLOCATION_BYTES = 512
"""The caching allocator's smallest block (c10/cuda/CUDACachingAllocator.cpp kMinBlockSize): a
one-element scale takes this much of `memory_allocated`."""
BLOCK = 128
"""Float8BlockQuantizer.block_len: 1 x 128 blocks for activations, 128 x 128 for weights."""
MX_BLOCK = 32
"""MXFP8_BLOCK_SCALING_SIZE: one E8M0 scale per 32 values."""

# TE recipe class per Megatron --fp8-recipe (fp8_utils.get_fp8_recipe) and the compute capabilities
# that run it (quantization.py `_compute_fp8_support` 8.9+, `_compute_fp8_block_scaling_support`
# 9.0+ with CUDA 12.9, `_compute_mxfp8_support` 10.x and 11.x only).
RECIPES = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling",
           "blockwise": "Float8BlockScaling", "mxfp8": "MXFP8BlockScaling"}
SUPPORTED_CAPABILITY = {"delayed": (89, 999), "tensorwise": (89, 999), "blockwise": (90, 999), "mxfp8": (100, 120)}


def runs_fp8(cfg: Config) -> bool:
    """Whether the run uses FP8 linears at all."""
    return cfg.training.precision == "fp8"


def check_supported(cfg: Config, run: MegatronRun) -> None:
    """BadInput when the GPU kind cannot run the recipe (TE raises at the first fp8_autocast)."""
    if not runs_fp8(cfg):
        return
    recipe = cfg.training.fp8_recipe
    low, high = SUPPORTED_CAPABILITY[recipe]
    cc = run.compute_capability
    if not low <= cc < high:
        kinds = "b200, gb200, b300 or gb300" if recipe == "mxfp8" else "h100 or newer" if low == 90 else "l4, l40s, h100 or newer"
        raise BadInput(f"Transformer Engine's {RECIPES[recipe]} (--fp8-recipe {recipe}) does not run on {run.gpu} "
                       f"(compute capability {cc // 10}.{cc % 10}); pass --gpu {kinds.split(',')[0].split(' ')[0]} "
                       f"or another of {kinds}, or another fp8_recipe")


def non_tn_gemm(run: MegatronRun) -> bool:
    """utils.py `is_non_tn_fp8_gemm_supported`: Blackwell (10.x, 11.x, 13.x+) multiplies FP8 in any
    layout, so a per-tensor FP8 tensor keeps one copy for both usages; Hopper and Ada need a
    separate transpose for the column-wise usage."""
    cc = run.compute_capability
    return 100 <= cc < 120 or cc >= 130


def _scale_bytes(nbytes: float) -> float:
    return math.ceil(nbytes / ALLOCATION_BYTES) * ALLOCATION_BYTES if nbytes else 0.0


def _round_up(value: float, multiple: int) -> float:
    return math.ceil(value / multiple) * multiple


def quantized_bytes(recipe: str, rows: float, cols: int, *, rowwise: bool, columnwise: bool,
                    weight: bool = False, run: MegatronRun | None = None) -> float:
    """Bytes of one TE quantized tensor of logical shape [rows, cols] holding the usages asked for.

    - delayed, tensorwise (Float8Tensor): `_data` (row-wise) and `_transpose` (column-wise); on
      Blackwell one `_data` serves both (csrc/quantizer.cpp Float8Quantizer::create_tensor); one
      fp32 scale-inverse. A saved activation keeps one usage, 1 byte per value either way.
    - blockwise (Float8BlockwiseQTensor): each usage its own data; fp32 scale-inverses per 1 x 128
      block (activations, `get_scale_shape` block_scaling_dim 1) or 128 x 128 block (weights, 2).
    - mxfp8 (MXFP8Tensor): each usage its own data; one uint8 E8M0 scale per 32 values along the
      usage's direction, the scale tensor padded to multiples of [128, 4] (row-wise) or [4, 128]."""
    data = rows * cols * FP8_BYTES
    if recipe in ("delayed", "tensorwise"):
        one_copy = run is not None and non_tn_gemm(run)
        copies = 1 if one_copy else int(rowwise) + int(columnwise)
        return copies * data + _scale_bytes(FP32_BYTES)
    total = 0.0
    if recipe == "blockwise":
        if weight:  # 128 x 128 blocks: (ceil(r/128), ceil4(ceil(c/128))) and its transpose
            blocks_r, blocks_c = math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)
            row_scales, col_scales = blocks_r * _round_up(blocks_c, 4), blocks_c * _round_up(blocks_r, 4)
        else:  # 1 x 128 blocks: row-wise (ceil(c/128), ceil4(r)), column-wise (ceil(r/128), ceil4(c))
            row_scales = math.ceil(cols / BLOCK) * _round_up(rows, 4)
            col_scales = math.ceil(rows / BLOCK) * _round_up(cols, 4)
        scale_size = FP32_BYTES
    elif recipe == "mxfp8":
        row_scales = _round_up(rows, 128) * _round_up(cols // MX_BLOCK, 4)
        col_scales = _round_up(rows // MX_BLOCK, 4) * _round_up(cols, 128)
        scale_size = 1
    else:
        raise ValueError(f"unknown FP8 recipe {recipe!r}")
    if rowwise:
        total += data + _scale_bytes(scale_size * row_scales)
    if columnwise:
        total += data + _scale_bytes(scale_size * col_scales)
    return total


def linear_input_bytes(cfg: Config, elements: float, features: int | None = None, *, gathered: bool = False) -> float:
    """Bytes a linear keeps of an input of `elements` values (last dimension `features`) for its
    weight gradient. Without FP8: the 16-bit (or fp32) input. Under FP8 the quantized input, in
    the usage the backward reads (linear.py `_linear_forward_impl`, layernorm_linear.py): a
    column-parallel linear that all-gathers its input under sequence parallel (`gathered`) keeps
    per-tensor FP8 row-wise (Float8Quantizer / Float8CurrentScalingQuantizer
    `supports_only_rowwise_all_gather`: backward gathers the rows and transposes them), every other
    case keeps only the column-wise usage (row-wise data is discarded after the forward GEMM).
    Without `features` the scales are counted as if the shape divided into whole blocks."""
    if not runs_fp8(cfg):
        return ELEMENT_BYTES[cfg.training.precision] * elements
    recipe = cfg.training.fp8_recipe
    cols = features or (BLOCK * MX_BLOCK)
    rows = elements / cols
    per_tensor = recipe in ("delayed", "tensorwise")
    rowwise = gathered and per_tensor
    return quantized_bytes(recipe, rows, cols, rowwise=rowwise, columnwise=not rowwise)


def proj_saves_original_input(cfg: Config) -> bool:
    """attention.py: with FP8 other than delayed scaling Megatron calls `set_save_original_input` on
    linear_proj, which then keeps the attention output it was given (already kept by the attention
    kernel) instead of an FP8 copy; delayed scaling's quantizer cannot be re-run in backward
    (linear.py refuses `save_original_input` with Float8Quantizer)."""
    return runs_fp8(cfg) and cfg.training.fp8_recipe != "delayed"


def layer_runs_fp8(cfg: Config, layer: int) -> bool:
    """fp8_utils.py `is_first_last_bf16_layer`: layer `layer` (global, from 0) runs FP8 unless
    first_last_layers_bf16 keeps it among the first num_layers_at_start_in_bf16 or the last
    num_layers_at_end_in_bf16 layers."""
    if not runs_fp8(cfg):
        return False
    tr = cfg.training
    # a multi-token-prediction layer (index num_layers + k) runs under the global FP8 context
    # (multi_token_prediction.py `_proj_and_transformer_layer`; is_first_last_bf16_layer(-1) is False)
    if not tr.first_last_layers_bf16 or layer >= cfg.model.num_layers:
        return True
    return tr.num_layers_at_start_in_bf16 <= layer < cfg.model.num_layers - tr.num_layers_at_end_in_bf16


def layer_config(cfg: Config, layer: int) -> Config:
    """The config layer `layer` runs under: cfg, or for a layer Megatron keeps in bf16 the same run
    in plain bf16 (get_fp8_context returns nullcontext for it, get_fp8_context(is_init=True) builds
    its weights without fp8_model_init: a bf16 layer in every term)."""
    if not runs_fp8(cfg) or layer_runs_fp8(cfg, layer):
        return cfg
    return dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, precision="bf16"))


def weight_bytes(cfg: Config, run: MegatronRun, rows: int, cols: int) -> dict[str, float]:
    """Bytes an FP8 layer's TE linear weight [rows, cols] (one tensor-parallel rank) adds beyond
    what `optimizer.bytes_per_parameter` counts for a bf16 weight, by item:

    - "FP8 weight copies": without fp8_param_gather, the weight quantized into the module's
      `_fp8_workspaces["weight"]` (base.py `quantize_weight`, cache=True since Megatron passes
      is_first_microbatch) with row-wise and column-wise usage, kept all run;
    - with fp8_param_gather (fp8_model_init, FP8 primary weights): "weights" -1 byte per value (the
      row-wise data in DDP's uint8 param buffer instead of bf16), and "FP8 weight transposes": the
      column-wise data `post_all_gather_processing` builds (a Float8Tensor's transpose on Hopper,
      none on Blackwell; a blockwise tensor's column-wise data and scales). MXFP8 weights cannot be
      mapped into the param buffer (`replace_raw_data` raises): Megatron runs them with
      --reuse-grad-buf-for-mxfp8-param-ag, whose param buffer is a view of the grad buffer, so
      the weight costs no "weights" bytes and keeps its own row-wise and column-wise data."""
    recipe = cfg.training.fp8_recipe
    n = rows * cols
    bf16 = ELEMENT_BYTES["bf16"] * n
    if not cfg.training.fp8_param_gather:
        return {"FP8 weight copies": quantized_bytes(recipe, rows, cols, rowwise=True, columnwise=True, weight=True, run=run)}
    if recipe == "mxfp8":
        return {"weights": -bf16, "FP8 weights (own storage)":
                quantized_bytes(recipe, rows, cols, rowwise=True, columnwise=True, weight=True, run=run)}
    both = quantized_bytes(recipe, rows, cols, rowwise=True, columnwise=True, weight=True, run=run)
    rowwise = quantized_bytes(recipe, rows, cols, rowwise=True, columnwise=False, weight=True, run=run)
    out = {"weights": rowwise - bf16}
    if both > rowwise:
        out["FP8 weight transposes"] = both - rowwise
    return out


def scaling_state_bytes(cfg: Config) -> float:
    """Scaling state of one FP8 TE module with one GEMM, allocated once (each tensor a block of
    the caching allocator): delayed scaling's DelayedScalingRecipeState per direction, `scale`
    [n] and `amax_history` [fp8_amax_history_len, n] in fp32, n = 3 forward quantizers (input,
    weight, output) and 2 backward (base.py `num_fp8_tensors`). Current scaling keeps none (its
    quantizer holds no buffers: float8_tensor.py Float8CurrentScalingQuantizer, "scale and amax
    tensors are not needed"), nor do block and MX scaling (their scales live in each tensor)."""
    recipe = cfg.training.fp8_recipe
    if recipe == "delayed":
        history = cfg.training.fp8_amax_history_len
        return sum(_scale_bytes(FP32_BYTES * n) + _scale_bytes(FP32_BYTES * history * n) for n in (3, 2))
    return 0.0
