"""Parameters, gradients and optimizer state: Megatron's bytes per parameter on a rank.

Sources: megatron/core/distributed/param_and_grad_buffer.py, distributed_data_parallel.py,
megatron/core/optimizer/optimizer.py, distrib_optimizer.py; FP8 weights: fp8.py."""

from __future__ import annotations

from typing import Iterable

from recompute_bench.analysis.megatron.fp8 import layer_runs_fp8, weight_bytes
from recompute_bench.analysis.megatron.layer import layer_linear_weights
from recompute_bench.analysis.megatron.run import MegatronRun
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
      (distrib_optimizer.py), whole otherwise (optimizer.py Float16OptimizerWithFloat16Params); fp32
      runs step the weights themselves (FP32Optimizer).
    - fp32 gradient copies: `_copy_model_grads_to_main_grads` sets `main_param.grad =
      main_grad.float()`, a new fp32 tensor when the grad buffer is fp16, held until the next
      step's zero_grad (sharded with the distributed optimizer).
    DDP's padding (64-element parameter starts, bucket ends to lcm(dp, 128) with the distributed
    optimizer) adds under 0.01% here and is left out."""
    precision, par = cfg.training.precision, cfg.parallel
    shards = par.data_parallel_size if par.use_distributed_optimizer else 1
    weights = ELEMENT_BYTES[precision]
    grads = 2 if precision == "fp16" else FP32_BYTES
    if precision == "fp32":
        return {"weights": 4, "main gradients": 4, "master weights": 0, "Adam moments": 8 / shards,
                "fp32 gradient copies": 0}
    return {"weights": weights, "main gradients": grads, "master weights": 4 / shards, "Adam moments": 8 / shards,
            "fp32 gradient copies": (4 / shards) if precision == "fp16" else 0}


def fp8_weight_bytes(cfg: Config, run: MegatronRun, layers: Iterable[int]) -> dict[str, float]:
    """What FP8 changes in the weights of the layers `layers` (global indices) a rank holds, by
    item, beyond `bytes_per_parameter`: each FP8 layer's Transformer Engine linear weights
    (`layer.layer_linear_weights`) through `fp8.weight_bytes` (FP8 weight copies; or FP8 primary
    weights, one byte in DDP's uint8 param buffer, with their transposes). Norms, biases,
    embeddings and the output layer stay 16-bit, as do the bf16 layers of first_last_layers_bf16
    (built outside fp8_model_init)."""
    out: dict[str, float] = {}
    shapes = layer_linear_weights(cfg).values()
    for layer in layers:
        if not layer_runs_fp8(cfg, layer):
            continue
        for rows, cols in shapes:
            for item, nbytes in weight_bytes(cfg, run, rows, cols).items():
                out[item] = out.get(item, 0.0) + nbytes
    return out
