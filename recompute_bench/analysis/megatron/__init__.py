"""Framework megatron: what Megatron-LM (and Megatron Bridge, which runs its models) allocates on one
rank, term by term, each named after the Megatron, Transformer Engine or torch code that allocates it.

The harness's own estimate (`memory.py`) counts the layers this package builds, exactly. Megatron's
layers keep other tensors (Transformer Engine's fused LayerNorm-linear keeps both the norm's input
and output, its fused bias-SwiGLU no SiLU output, its attention kernels their own copies), its
distributed data parallel and optimizers hold other bytes per parameter, and a rank holds buffers
outside the parameters (cuBLAS workspaces, the local attention's score buffer). Nothing here is fitted:
`tests/test_megatron_check.py` checks the sum against the memory Megatron-LM's functional tests
measured on DGX A100, H100 and GB200 (`tests/data/megatron/cases.json`). Pure Python.

Sources (Megatron-LM d98e8a6, TransformerEngine d0067d0, torch 2.13):
- megatron/core/distributed/param_and_grad_buffer.py, distributed_data_parallel.py (grad and param buffers)
- megatron/core/optimizer/optimizer.py, distrib_optimizer.py (master weights, Adam state, main-grad copies)
- megatron/core/pipeline_parallel/schedules.py (micro-batches in flight per stage)
- megatron/core/tensor_parallel/cross_entropy.py, megatron/core/fusions/fused_cross_entropy.py (the loss)
- megatron/core/transformer/dot_product_attention.py, attention.py, mlp.py, megatron/core/fusions/* (layers)
- megatron/core/transformer/multi_latent_attention.py, mla_qk_norm_config.py (multi-latent attention)
- megatron/core/transformer/transformer_block.py, pipeline_parallel_layer_layout.py (the pipeline split)
- megatron/core/transformer/moe/*.py (MoE layers: router, token dispatchers, experts, shared experts)
- transformer_engine/pytorch/module/layernorm_linear.py, linear.py, attention/dot_product_attention/*.py
  (context_parallel.py: the CP attention functions)
- megatron/core/utils.py get_batch_on_this_cp_rank (the sequence split)
- transformer_engine/pytorch/cpp_extensions/gemm.py (TE's cuBLAS workspace)
- aten/src/ATen/cuda/CublasHandlePool.cpp (torch's cuBLAS workspaces)

One module per concern: `gpu` (the GPU kind), `buffers` (workspaces and buffers outside the
parameters), `optimizer` (bytes per parameter), `parameters` (parameters per layer and per stage,
over Megatron's pipeline split), `attention` (the attention paths), `mla` (multi-latent attention),
`layer` (one layer), `moe` (a mixture-of-experts layer's MLP part: router, dispatcher, experts,
shared experts, expert sharding), `outside` (embedding, output layer, loss, inputs, deferred
output-layer gradients), `context_parallel` (the sequence split over cp ranks and Transformer
Engine's CP attention), `fp8` (what Transformer Engine's FP8 recipes change), `cuda_graphs` (graph
buffers and the eager / capture / replay phases), `offload` (what activation offloading takes off
the device), `stage` (a chunk and a stage's peak through the schedule, and the first iteration's, before Adam's
moments exist), `terms` (a stage's peak as the terms Megatron allocates, with the arguments that
move each), `report` (what `estimate`
prints and records carry).
"""

from recompute_bench.analysis.megatron.gpu import COMPUTE_CAPABILITY, DEFAULT_GPU, MegatronRun
from recompute_bench.analysis.megatron.stage import ChunkBytes, StagePeak, chunk_bytes, stage_peak, stage_peaks
from recompute_bench.analysis.megatron.report import estimate_report, record_estimate, setting_estimate

__all__ = ["COMPUTE_CAPABILITY", "DEFAULT_GPU", "MegatronRun", "ChunkBytes", "StagePeak", "chunk_bytes", "stage_peak",
           "stage_peaks", "estimate_report", "record_estimate", "setting_estimate"]
