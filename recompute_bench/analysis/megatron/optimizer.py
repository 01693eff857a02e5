"""Parameters, gradients and optimizer state: Megatron's bytes per parameter on a rank.

Sources: megatron/core/distributed/param_and_grad_buffer.py, distributed_data_parallel.py,
megatron/core/optimizer/optimizer.py, distrib_optimizer.py; FP8 weights: fp8.py."""

from __future__ import annotations

from typing import Iterable

from recompute_bench.analysis.megatron.context_parallel import optimizer_shards
from recompute_bench.analysis.megatron.fp8 import layer_runs_fp8, weight_bytes
from recompute_bench.analysis.megatron.layer import layer_linear_weights
from recompute_bench.analysis.megatron.gpu import MegatronRun
from recompute_bench.models import ELEMENT_BYTES, FP32_BYTES
from recompute_bench.config.schema import Config

def bytes_per_parameter(cfg: Config, expert: bool = False) -> dict[str, float]:
    """Megatron's bytes per parameter on a rank, item by item.

    - weights: params_dtype (arguments.py: bf16, fp16 or fp32). With the distributed optimizer they
      live in DDP's param buffer (param_and_grad_buffer.py `_ParamAndGradBuffer.__init__`,
      `param_data`) and the originals are freed.
    - main gradients: DDP's grad buffer (`grad_data`), fp32 for bf16 and fp32 runs (validate_args
      sets accumulate_allreduce_grads_in_fp32 for bf16), fp16 for fp16 runs, bf16 with
      --grad-reduce-in-bf16 or --main-grads-dtype bf16 (`main_gradient_bytes`).
    - master weights and Adam moments: fp32, sharded over dp by the distributed optimizer
      (distrib_optimizer.py; over dp x cp under context parallel, `context_parallel.optimizer_shards`),
      whole otherwise (optimizer.py Float16OptimizerWithFloat16Params); fp32
      runs step the weights themselves (FP32Optimizer).
    - fp32 gradient copies: `_copy_model_grads_to_main_grads` sets `main_param.grad =
      main_grad.float()`, a new fp32 tensor when the grad buffer is 16-bit, held until the next
      step's zero_grad (sharded with the distributed optimizer).
    - the precision-aware optimizer (--use-precision-aware-optimizer) keeps master weights and
      moments in their own dtypes and reads the gradients in place.
    DDP's padding (64-element parameter starts, bucket ends to lcm(dp, 128) with the distributed
    optimizer) adds under 0.01% here and is left out. The routed experts' parameters (`expert`) are
    sharded over the expert-data-parallel group instead (optimizer/__init__.py builds their optimizer
    over `expt_dp`)."""
    precision, tr = cfg.training.precision, cfg.training
    shards = distributed_optimizer_shards(cfg, expert)
    weights = ELEMENT_BYTES[precision]
    if precision == "fp32":
        return {"weights": 4, "main gradients": 4, "master weights": 0, "Adam moments": 8 / shards,
                "fp32 gradient copies": 0}
    grads = main_gradient_bytes(cfg)
    # Adam's exp_avg and exp_avg_sq: fp32 (Megatron's optimizer), or TE's FusedAdam's dtypes
    moments = OPTIMIZER_DTYPE_BYTES[tr.exp_avg_dtype] + OPTIMIZER_DTYPE_BYTES[tr.exp_avg_sq_dtype] \
        if tr.use_precision_aware_optimizer else 8
    if tr.use_precision_aware_optimizer and precision_aware_holds_master(cfg):
        # optimizer/__init__.py: TE's FusedAdam with master_weights, master_weight_dtype main_params_dtype,
        # exp_avg_dtype / exp_avg_sq_dtype and store_param_remainders (OptimizerConfig default True),
        # use_decoupled_grad: it reads the gradient from DDP's buffer, no fp32 copy.
        # fused_adam.py `_initialize_state`: with fp32 master weights of bf16 parameters only the
        # trailing 16 bits are kept (int16); an fp8 moment is a uint8 Float8Tensor (scales aside).
        master = 2 if tr.main_params_dtype == "fp32" and precision != "fp16" else OPTIMIZER_DTYPE_BYTES[tr.main_params_dtype]
        return {"weights": weights, "main gradients": grads, "master weights": master / shards,
                "Adam moments": moments / shards, "fp32 gradient copies": 0}
    # precision-aware without TE's master weights: Megatron keeps fp32 master weights, FusedAdam the moments
    return {"weights": weights, "main gradients": grads, "master weights": 4 / shards, "Adam moments": moments / shards,
            "fp32 gradient copies": (4 / shards) if grads == 2 else 0}


OPTIMIZER_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
"""Bytes of one element of the precision-aware optimizer's dtypes."""


def main_gradient_bytes(cfg: Config) -> int:
    """DDP's grad buffer element (param_and_grad_buffer.py: fp32 with grad_reduce_in_fp32, else the
    parameters' dtype). arguments.py sets accumulate_allreduce_grads_in_fp32 (DDP's
    grad_reduce_in_fp32) for bf16 unless --grad-reduce-in-bf16 or a 16-bit --main-grads-dtype;
    fp16 runs reduce in fp16."""
    tr = cfg.training
    if tr.precision == "fp16" or tr.grad_reduce_in_bf16 or tr.main_grads_dtype != "fp32":
        return 2
    return FP32_BYTES


def precision_aware_holds_master(cfg: Config) -> bool:
    """Whether TE's FusedAdam holds the master weights (OptimizerConfig
    `use_precision_aware_optimizer_no_fp8_or_ds_fp8`): unless FP8 weights with a recipe other than
    delayed scaling and fp32 master weights, where Megatron keeps fp32 main params itself."""
    tr = cfg.training
    return tr.main_params_dtype != "fp32" or tr.precision != "fp8" or tr.fp8_recipe == "delayed"


def distributed_optimizer_shards(cfg: Config, expert: bool = False) -> int:
    """Ranks the optimizer state is sharded over: 1 without the distributed optimizer; with it, the
    data-parallel group, or with several instances (--num-distributed-optimizer-instances) the group
    within one instance, dp x cp / instances: optimizer/__init__.py `get_megatron_optimizer` builds the
    DistributedOptimizer on `intra_dp_cp_group` (parallel_state.py: dp x cp / instances ranks;
    `context_parallel.optimizer_shards` is dp x cp), and distributed_data_parallel.py
    reduce-scatters the gradients within it and all-reduces them across the instances. The routed
    experts' state is sharded over the expert-data-parallel group (tp x cp x dp / (etp x ep))."""
    par = cfg.parallel
    if not par.use_distributed_optimizer:
        return 1
    group = par.expert_data_parallel_size if expert else optimizer_shards(cfg)
    return max(1, group // par.num_distributed_optimizer_instances)


def fp8_weight_bytes(cfg: Config, run: MegatronRun, layers: Iterable[int]) -> dict[str, float]:
    """What FP8 changes in the weights of the layers `layers` (global indices) a rank holds, by
    item, beyond `bytes_per_parameter`: each FP8 layer's Transformer Engine linear weights
    (`layer.layer_linear_weights`: attention or MLA, a dense MLP or a MoE
    layer's shared and routed experts) through `fp8.weight_bytes` (FP8 weight copies; or FP8 primary
    weights, one byte in DDP's uint8 param buffer, with their transposes). Norms, biases,
    embeddings and the output layer stay 16-bit, as do the bf16 layers of first_last_layers_bf16
    (built outside fp8_model_init)."""
    out: dict[str, float] = {}
    for layer in layers:
        if not layer_runs_fp8(cfg, layer):
            continue
        for rows, cols in layer_linear_weights(cfg, layer).values():
            for item, nbytes in weight_bytes(cfg, run, rows, cols).items():
                out[item] = out.get(item, 0.0) + nbytes
    return out
