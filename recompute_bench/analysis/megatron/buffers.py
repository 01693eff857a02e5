"""Buffers a Megatron rank holds for the whole run besides parameters and optimizer state: cuBLAS
workspaces (torch's and Transformer Engine's), the local attention's score buffer and causal mask.

Sources: transformer_engine/pytorch/cpp_extensions/gemm.py (the single, grouped and userbuffers GEMMs'
workspaces), aten/src/ATen/cuda/CublasHandlePool.cpp,
torch/csrc/autograd/engine.cpp, transformer_engine/pytorch/module/base.py (`get_dummy_wgrad`),
megatron/core/transformer/dot_product_attention.py,
megatron/core/fusions/fused_softmax.py."""

from __future__ import annotations

from typing import Iterable

from recompute_bench.analysis.cuda_workspaces import TORCH_CUBLAS_HANDLES, cublas_workspace_bytes
from recompute_bench.analysis.megatron.attention import softmax_fused
from recompute_bench.analysis.megatron.fp8 import layer_runs_fp8, scaling_state_bytes
from recompute_bench.analysis.megatron.layer import layer_linear_weights
from recompute_bench.analysis.megatron.moe import allgather_buffer_bytes
from recompute_bench.analysis.megatron.gpu import MiB, MegatronRun
from recompute_bench.models import ELEMENT_BYTES, MASK_BYTES
from recompute_bench.config.schema import Config

def te_cublas_workspace_bytes(run: MegatronRun) -> float:
    """Transformer Engine's cuBLAS workspace, one per device (cpp_extensions/gemm.py
    `get_cublas_workspace`, lru-cached): `get_cublas_workspace_size_bytes` is 32 MiB plus 1 KiB on
    sm90 and newer, 4 MiB before."""
    return 32 * MiB + 1024 if run.compute_capability >= 90 else 4 * MiB


def torch_cublas_workspace_bytes(run: MegatronRun) -> float:
    """One of torch's cuBLAS workspaces on the run's GPU under its CUBLAS_WORKSPACE_CONFIG
    (`analysis.cuda_workspaces`, CublasHandlePool.cpp `getChosenWorkspaceSize`)."""
    return cublas_workspace_bytes(run.compute_capability, run.cublas_workspace_config)


TE_USERBUFFERS_STREAMS = 3
"""Transformer Engine's GEMMs that overlap a tensor-parallel collective through userbuffers take a
workspace of their own, one cuBLAS workspace per userbuffers stream (cpp_extensions/gemm.py
`_NUM_MAX_UB_STREAMS = 3`)."""


def te_userbuffers_workspace_bytes(cfg: Config, run: MegatronRun) -> float:
    """With --tp-comm-overlap, the workspace of TE's userbuffers GEMMs: `general_gemm` asks
    `get_cublas_workspace(device, ub is not None, False)`, which is lru-cached per (device, ub,
    grouped_gemm), so the GEMMs with a userbuffers communicator get one more torch tensor of
    `_NUM_MAX_UB_STREAMS` x `get_cublas_workspace_size_bytes()` beside the ordinary GEMMs' one, held
    all run. The userbuffers themselves are TE's own device allocations (userbuffers-host.cpp
    `register_user_buffer_collective`), outside torch's allocator."""
    if not cfg.parallel.tp_comm_overlap:
        return 0.0
    return TE_USERBUFFERS_STREAMS * te_cublas_workspace_bytes(run)


TE_GROUPED_GEMM_STREAMS = 4
"""Transformer Engine's grouped GEMM takes one workspace per compute stream
(cpp_extensions/gemm.py `get_cublas_workspace(..., grouped_gemm=True)`, `tex.get_num_cublas_streams()`:
common/util/multi_stream.cpp `num_compute_streams = 4`), beside the single GEMMs' one."""


def local_attention_buffer_bytes(cfg: Config) -> float:
    """Megatron's own attention (transformer_impl local): dot_product_attention.py
    `DotProductAttention.forward` takes `matmul_input_buffer` [b x a/t, s, s] in 16 bits from the
    global memory buffer (parallel_state.GlobalMemoryBuffer), which keeps it for the whole run."""
    if cfg.model.transformer_impl != "local":
        return 0.0
    tr, m = cfg.training, cfg.model
    return ELEMENT_BYTES[tr.precision] * tr.micro_batch_size * m.num_attention_heads / \
        cfg.parallel.tensor_model_parallel_size * tr.seq_length ** 2


def buffer_bytes(cfg: Config, run: MegatronRun) -> dict[str, float]:
    """The buffers a Megatron rank holds for the whole run besides parameters and optimizer state."""
    m = cfg.model
    out = {"torch cuBLAS workspaces": TORCH_CUBLAS_HANDLES * torch_cublas_workspace_bytes(run)}
    gathered = allgather_buffer_bytes(cfg)
    # A MoE router's gating GEMM is TE's general_gemm wherever TE is importable (moe_utils.py
    # RouterGatingLinearFunction), as in every Megatron container, local layers or not.
    if m.transformer_impl == "transformer_engine" or m.num_moe_experts:
        out["Transformer Engine cuBLAS workspace"] = te_cublas_workspace_bytes(run)
    if cfg.parallel.tp_comm_overlap:
        out["Transformer Engine userbuffers GEMM workspace"] = te_userbuffers_workspace_bytes(cfg, run)
    if m.num_moe_experts and m.moe_grouped_gemm and m.transformer_impl == "transformer_engine":
        out["Transformer Engine grouped-GEMM workspaces"] = TE_GROUPED_GEMM_STREAMS * te_cublas_workspace_bytes(run)
    if m.transformer_impl == "transformer_engine":
        if gathered:
            out["MoE allgather dispatcher's gathered tokens"] = gathered
    else:
        # GlobalMemoryBuffer keeps one tensor per (name, dtype), grown to the largest request: the
        # local attention's scores, the local linears' sequence-parallel gather of their [s, b, h]
        # input (tensor_parallel/layers.py) and the allgather dispatcher's tokens share "mpu"
        tr, m = cfg.training, cfg.model
        sp = ELEMENT_BYTES[tr.precision] * tr.seq_length * tr.micro_batch_size * m.hidden_size \
            if cfg.parallel.sequence_parallel else 0.0
        users = {"attention score buffer (local)": local_attention_buffer_bytes(cfg),
                 "sequence-parallel gather buffer (local)": sp, "MoE allgather dispatcher's gathered tokens": gathered}
        name = max(users, key=users.get)
        out[name] = users[name]
        if not softmax_fused(cfg, run):  # fused_softmax.py get_default_causal_mask is lru-cached
            out["causal mask (local softmax)"] = MASK_BYTES * cfg.training.seq_length ** 2
    return out


def te_dummy_wgrad_bytes(cfg: Config, layers: Iterable[int]) -> float:
    """With gradient_accumulation_fusion (Megatron-LM's default), Transformer Engine's linears write
    their weight gradient straight into DDP's `main_grad` and hand autograd a placeholder instead:
    `get_dummy_wgrad(shape, weight.dtype)` (module/base.py), one tensor per (shape, dtype) kept in
    the module-level `_dummy_wgrads` for the rest of the run (linear.py, layernorm_linear.py,
    grouped_linear.py backward, "Handle custom DDP from mcore"). So a rank holds one weight-sized
    16-bit tensor per distinct TE linear weight shape among its layers (`layer.layer_linear_weights`:
    a MoE layer's routed experts share one shape), from its first backward on. Megatron's own
    linears (the output layer, local layers) return a fresh gradient each backward instead: nothing
    kept."""
    if not cfg.training.gradient_accumulation_fusion or cfg.model.transformer_impl != "transformer_engine":
        return 0.0
    shapes = {shape for layer in layers for shape in layer_linear_weights(cfg, layer).values()}
    return sum(ELEMENT_BYTES[cfg.training.precision] * rows * cols for rows, cols in shapes)


FP8_MODULES_PER_LAYER = 4
"""A dense layer's Transformer Engine modules that quantize: linear_qkv, linear_proj, linear_fc1,
linear_fc2 (each one GEMM)."""


def fp8_scaling_bytes(cfg: Config, layers: Iterable[int]) -> float:
    """The FP8 scaling state (`fp8.scaling_state_bytes`) of the FP8 layers among `layers`."""
    return sum(FP8_MODULES_PER_LAYER * scaling_state_bytes(cfg) for layer in layers if layer_runs_fp8(cfg, layer))
