"""Parameters, gradients and optimizer state: Megatron's bytes per parameter on a rank.

Sources: megatron/core/distributed/param_and_grad_buffer.py, distributed_data_parallel.py,
megatron/core/optimizer/optimizer.py, distrib_optimizer.py."""

from __future__ import annotations

from recompute_bench.analysis.megatron.moe import moe_layer_parameters
from recompute_bench.analysis.stage import outside_parameters
from recompute_bench.models import ELEMENT_BYTES, FP32_BYTES
from recompute_bench.models.dense.spec import DENSE
from recompute_bench.spec.config import Config


def stage_parameter_groups(cfg: Config, stage: int) -> dict[str, float]:
    """Parameters on one rank of pipeline stage `stage`, by the group their gradients are reduced
    and sharded over: "dense" (attention, norms, dense MLPs, the router and shared experts, the
    embedding and output layer: the data-parallel group) and "expert" (the routed experts of its MoE
    layers: the expert-data-parallel group; distributed_data_parallel.py keeps them in their own
    `expert_parallel_buffers`, and the distributed optimizer shards them over that group). A MoE
    layer is a dense layer whose MLP is replaced by `moe.moe_layer_parameters`."""
    from recompute_bench.analysis.megatron.stage import chunk_layers

    par = cfg.parallel
    vp = par.virtual_pipeline_model_parallel_size or 1
    dense_layer = sum(DENSE.layer_parameters(cfg).values())
    pattern = cfg.model.moe_layer_pattern
    groups = {"dense": outside_parameters(cfg, stage), "expert": 0.0}
    if any(pattern):
        m, t = cfg.model, par.tensor_model_parallel_size
        fc1 = 2 * m.ffn_hidden_size if m.activation == "swiglu" else m.ffn_hidden_size
        bias = 1 if m.add_bias_linear else 0
        # the dense MLP's weights and fc1 bias over tp, fc2's bias whole, and the fused norm in fc1
        dense_mlp = (m.hidden_size * fc1 + bias * fc1 + m.ffn_hidden_size * m.hidden_size) / t + bias * m.hidden_size \
            + (2 if m.normalization == "LayerNorm" else 1) * m.hidden_size
        moe = moe_layer_parameters(cfg)
    for c in range(vp):
        for i in chunk_layers(cfg, stage, c):
            if pattern[i]:
                groups["dense"] += dense_layer - dense_mlp + moe["dense"]
                groups["expert"] += moe["expert"]
            else:
                groups["dense"] += dense_layer
    return groups


def bytes_per_parameter(cfg: Config, expert: bool = False) -> dict[str, float]:
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
    optimizer) adds under 0.01% here and is left out. The routed experts' parameters (`expert`) are
    sharded over the expert-data-parallel group instead (optimizer/__init__.py builds their optimizer
    over `expt_dp`)."""
    precision, par = cfg.training.precision, cfg.parallel
    group = par.expert_data_parallel_size if expert else par.data_parallel_size
    shards = group if par.use_distributed_optimizer else 1
    weights = ELEMENT_BYTES[precision]
    grads = 2 if precision == "fp16" else FP32_BYTES
    if precision == "fp32":
        return {"weights": 4, "main gradients": 4, "master weights": 0, "Adam moments": 8 / shards,
                "fp32 gradient copies": 0}
    return {"weights": weights, "main gradients": grads, "master weights": 4 / shards, "Adam moments": 8 / shards,
            "fp32 gradient copies": (4 / shards) if precision == "fp16" else 0}
