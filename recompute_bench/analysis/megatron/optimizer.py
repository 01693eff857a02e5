"""Parameters, gradients and optimizer state: Megatron's bytes per parameter on a rank.

Sources: megatron/core/distributed/param_and_grad_buffer.py, distributed_data_parallel.py,
megatron/core/optimizer/optimizer.py, distrib_optimizer.py."""

from __future__ import annotations

from recompute_bench.analysis.megatron.context_parallel import optimizer_shards
from recompute_bench.models import ELEMENT_BYTES, FP32_BYTES
from recompute_bench.spec.config import Config

def bytes_per_parameter(cfg: Config) -> dict[str, float]:
    """Megatron's bytes per parameter on a rank, item by item.

    - weights: params_dtype (arguments.py: bf16, fp16 or fp32). With the distributed optimizer they
      live in DDP's param buffer (param_and_grad_buffer.py `_ParamAndGradBuffer.__init__`,
      `param_data`) and the originals are freed.
    - main gradients: DDP's grad buffer (`grad_data`), fp32 for bf16 and fp32 runs (validate_args
      sets accumulate_allreduce_grads_in_fp32 for bf16), fp16 for fp16 runs.
    - master weights and Adam moments: fp32, sharded over dp by the distributed optimizer
      (distrib_optimizer.py; over dp x cp under context parallel, `context_parallel.optimizer_shards`),
      whole otherwise (optimizer.py Float16OptimizerWithFloat16Params); fp32
      runs step the weights themselves (FP32Optimizer).
    - fp32 gradient copies: `_copy_model_grads_to_main_grads` sets `main_param.grad =
      main_grad.float()`, a new fp32 tensor when the grad buffer is fp16, held until the next
      step's zero_grad (sharded with the distributed optimizer).
    DDP's padding (64-element parameter starts, bucket ends to lcm(dp, 128) with the distributed
    optimizer) adds under 0.01% here and is left out."""
    precision, par = cfg.training.precision, cfg.parallel
    shards = optimizer_shards(cfg) if par.use_distributed_optimizer else 1
    weights = ELEMENT_BYTES[precision]
    grads = 2 if precision == "fp16" else FP32_BYTES
    if precision == "fp32":
        return {"weights": 4, "main gradients": 4, "master weights": 0, "Adam moments": 8 / shards,
                "fp32 gradient copies": 0}
    return {"weights": weights, "main gradients": grads, "master weights": 4 / shards, "Adam moments": 8 / shards,
            "fp32 gradient copies": (4 / shards) if precision == "fp16" else 0}
