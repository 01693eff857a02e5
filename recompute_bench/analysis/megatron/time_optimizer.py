"""The step after the micro-batches, as Megatron runs it: each pass over memory its optimizer makes,
one `Op` per pass, with the bytes it reads and writes on one rank and the kernel that runs it.

Per parameter of the rank's shard S (the distributed optimizer's share; every parameter without it)
and of all N the rank holds, in Megatron's order (MegatronOptimizer `step`: prepare_grads, clip,
step_with_ready_grads; DDP's `zero_grad_buffer` at the start of the next iteration):

    zero_grad_buffer         write N grad-buffer elements (fp32, or 16-bit with a 16-bit buffer)
    grads to fp32            16-bit buffer only: read 2 + write 4 per S (`.float()` makes a copy)
    unscale (fp16)           read + write 4 per S, and the inf/NaN check
    grad norm                read 4 per S (multi-tensor L2 norm)
    clip                     read + write 4 per S (multi-tensor scale by min(1, clip / norm))
    Adam                     read grad, master, both moments; write master, both moments: 28 per S
    main params to model     read 4 + write 2 per S (a 16-bit weight); FP8 weights: an amax pass
                             (read 4) and the cast (read 4 + write 1, 2 for MXFP8's two copies)

TE's FusedAdam with master weights (the precision-aware optimizer) reads the gradient in place in
the buffer's dtype and writes the 16-bit weight in the Adam kernel itself: no grad copy, no copy-out.
fp32 runs step the weights themselves (grads fp32, nothing to copy).

Where the bytes go each pass runs at its kernel's rate (`Op.kernel`): the per-tensor copies, casts
and fills at the copy bandwidth, the multi-tensor-apply kernels (L2 norm, scale, unscale, fp16's
copy-out) at `config.gpus.MULTI_TENSOR_SHARE["multi_tensor"]` of it and fused Adam at
`MULTI_TENSOR_SHARE["adam"]`, both measured on our H200. Pure Python.

Sources (Megatron-LM d98e8a6, TransformerEngine d0067d0):
- megatron/core/distributed/distributed_data_parallel.py `zero_grad_buffer`, param_and_grad_buffer.py
  `_ParamAndGradBuffer.reset` (grad_data.zero_() over the whole, unsharded buffer) and
  `group_params_for_buffers` (grad_dtype fp32 with grad_reduce_in_fp32, else the parameter's dtype)
- megatron/core/optimizer/distrib_optimizer.py `_copy_model_grads_to_main_grads` (a shard view of the
  grad buffer, `.float()`: the same tensor when fp32, a copy when 16-bit; decoupled_grad: the view),
  `_copy_main_params_to_model_params` (per-parameter `copy_` into DDP's param buffer; fp8_param_gather:
  `fp8_utils.quantize_param_shard`; precision-aware: returns, the optimizer wrote them)
- megatron/core/optimizer/optimizer.py Float16OptimizerWithFloat16Params `_copy_model_grads_to_main_grads`
  (`main_grad.float()`), `_copy_main_params_to_model_params` (`_multi_tensor_copy_this_to_that`:
  multi_tensor_scale by 1.0 for fp16; bf16 has no overflow buffer, so a per-tensor `copy_` loop),
  MixedPrecisionOptimizer `_unscale_main_grads_and_check_for_nan`
  (torch._amp_foreach_non_finite_check_and_unscale_; fp16 always has a grad scaler, bf16 none
  unless --loss-scale), `step` (clip_grad_norm when clip_grad > 0; OptimizerConfig clip_grad 1.0)
- megatron/core/optimizer/clip_grads.py `get_grad_norm_fp32` (multi_tensor_l2norm over the fp32
  main grads), `clip_grad_by_total_norm_fp32`: with TE the norm stays a tensor, so clip_coeff is
  clamped to 1 on the GPU and multi_tensor_scale_tensor runs every step (with apex only when the
  norm exceeds clip_grad); we price TE's, every step
- megatron/core/optimizer/__init__.py (TE's FusedAdam, else apex's; precision-aware: master_weights,
  use_decoupled_grad, store_param_remainders, OptimizerConfig default True)
- transformer_engine/pytorch/optimizers/fused_adam.py `step` (multi_tensor_adam over [g, p, m, v],
  fp32 params; with master weights [g, p16, m, v, master] writes p16 too, or the 16-bit remainder
  with store_param_remainders)
- transformer_engine/pytorch/tensor/utils.py `quantize_master_weights`: delayed scaling casts with
  the amax in the cast kernel; current (tensorwise) `tex.compute_amax`, blockwise and MXFP8 partial
  amaxes first, a pass over the fp32 shard, then the cast

Left out: count_zeros (only with --log-num-zeros-in-grad), the data-parallel gradient pre-scaling
and the FP8 weights' transposes after the parameter all-gather (they belong to the data-parallel
exchange), the rescaling passes of 16-bit or FP8 moments of the precision-aware optimizer, and
the 16-bit norms, embeddings and first/last bf16 layers of an FP8-weight run (all of a rank's
parameters are cast to FP8 here).
"""

from __future__ import annotations

from recompute_bench.analysis.megatron.optimizer import (OPTIMIZER_DTYPE_BYTES, distributed_optimizer_shards,
                                                        main_gradient_bytes, precision_aware_holds_master)
from recompute_bench.analysis.megatron.time_ops import FP8_BYTES, Op
from recompute_bench.config.schema import Config
from recompute_bench.models import ELEMENT_BYTES, FP32_BYTES

ADAM = "adam"
MULTI_TENSOR = "multi_tensor"
"""`Op.kernel` of fused Adam and of the other multi-tensor-apply passes (`GpuRates.memory_rate`)."""


def shard_parameters(cfg: Config, parameters: float | dict[str, float]) -> tuple[float, float]:
    """(all the parameters a rank holds, its optimizer's shard of them): the distributed optimizer
    shards the dense parameters over its data-parallel group (`optimizer.distributed_optimizer_shards`)
    and the routed experts' over the expert-data-parallel group; without it the shard is all."""
    groups = parameters if isinstance(parameters, dict) else {"dense": parameters}
    total = sum(groups.values())
    shard = groups.get("dense", 0.0) / distributed_optimizer_shards(cfg) + \
        groups.get("expert", 0.0) / distributed_optimizer_shards(cfg, expert=True)
    return total, shard


def optimizer_ops(cfg: Config, parameters: float | dict[str, float]) -> list[Op]:
    """The passes of the optimizer step on a rank holding `parameters` (a count, or counts by group:
    "dense", and "expert" for the routed experts), in the order Megatron runs them (the module's
    docstring)."""
    tr, distributed = cfg.training, cfg.parallel.use_distributed_optimizer
    total, shard = shard_parameters(cfg, parameters)
    grad = main_gradient_bytes(cfg) if tr.precision != "fp32" else FP32_BYTES
    ops = [Op("optimizer.zero_grad_buffer", "memory", bytes=grad * total)]
    if tr.precision == "fp32":  # FP32Optimizer: Adam on the weights and their fp32 grads
        return ops + _norm_and_clip(shard) + [Op("optimizer.adam", "memory", bytes=7 * FP32_BYTES * shard, kernel=ADAM)]
    te_master = tr.use_precision_aware_optimizer and precision_aware_holds_master(cfg)
    if grad != FP32_BYTES and not te_master:
        ops.append(Op("optimizer.main_grads_to_fp32", "memory", bytes=(grad + FP32_BYTES) * shard))
    if tr.precision == "fp16":
        ops.append(Op("optimizer.unscale_main_grads", "memory", bytes=2 * FP32_BYTES * shard, kernel=MULTI_TENSOR))
    norm_bytes = grad if te_master else FP32_BYTES  # the decoupled grad in the buffer's dtype
    ops += _norm_and_clip(shard, norm_bytes)
    moments = (OPTIMIZER_DTYPE_BYTES[tr.exp_avg_dtype] + OPTIMIZER_DTYPE_BYTES[tr.exp_avg_sq_dtype]
               if tr.use_precision_aware_optimizer else 2 * FP32_BYTES)
    weight = ELEMENT_BYTES[tr.precision]
    if te_master:
        if tr.main_params_dtype == "fp32" and tr.precision != "fp16":  # the 16-bit weight + an int16 remainder
            master = 2 * weight + 2 * 2
        else:
            master = 2 * OPTIMIZER_DTYPE_BYTES[tr.main_params_dtype] + weight
        return ops + [Op("optimizer.adam", "memory", bytes=(grad + 2 * moments + master) * shard, kernel=ADAM)]
    ops.append(Op("optimizer.adam", "memory", bytes=(FP32_BYTES + 2 * moments + 2 * FP32_BYTES) * shard, kernel=ADAM))
    if tr.precision == "fp8" and tr.fp8_param_gather and distributed:
        if tr.fp8_recipe != "delayed":
            ops.append(Op("optimizer.main_params_amax", "memory", bytes=FP32_BYTES * shard))
        written = 2 * FP8_BYTES if tr.fp8_recipe == "mxfp8" else FP8_BYTES
        ops.append(Op("optimizer.main_params_to_model_params", "memory", bytes=(FP32_BYTES + written) * shard))
        return ops
    copy_kernel = MULTI_TENSOR if tr.precision == "fp16" and not distributed else None
    ops.append(Op("optimizer.main_params_to_model_params", "memory", bytes=(FP32_BYTES + weight) * shard,
                  kernel=copy_kernel))
    return ops


def _norm_and_clip(shard: float, grad_bytes: int = FP32_BYTES) -> list[Op]:
    """The gradient norm (a read of the shard's gradients) and the clip (a multi-tensor scale of them)."""
    return [Op("optimizer.grad_norm", "memory", bytes=grad_bytes * shard, kernel=MULTI_TENSOR),
            Op("optimizer.clip_grad", "memory", bytes=2 * grad_bytes * shard, kernel=MULTI_TENSOR)]
