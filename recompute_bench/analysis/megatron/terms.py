"""A stage's peak as the terms that make it up, each named after what allocates it in Megatron (the
buffer, the optimizer's state, the module and tensor a layer saves for backward) and the arguments
that move it: what `estimate --framework megatron` prints beside each stage's peak, so a user sees
which knob moves which bytes. The terms add up to `stage_peak` exactly (tests/test_run_source.py).

Sources: as `stage` and its parts (param_and_grad_buffer.py, distrib_optimizer.py, optimizer.py,
transformer_engine/pytorch/optimizers/fused_adam.py, transformer_layer.py, attention.py, mlp.py,
tensor_parallel/random.py, tensor_parallel/cross_entropy.py, pretrain_gpt.py get_batch)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from recompute_bench.analysis.megatron.outside import embedding_saved_bytes, loss_saved_bytes, output_saved_bytes
from recompute_bench.analysis.megatron.stage import ACTIVATION_ITEMS, CHECKPOINT_INPUT, StagePeak
from recompute_bench.config.pipeline_split import model_chunks
from recompute_bench.config.schema import Config

SHARDS = "--tensor/pipeline-model-parallel-size"
ACTIVATIONS = "--micro-batch-size, --seq-length"
"""Every activation term scales with both; the knobs named per term are the others."""


def _static(cfg: Config, item: str) -> tuple[str, str]:
    """Megatron's name of a static item (parameters, optimizer state, buffers) and its knobs."""
    par, precision = cfg.parallel, cfg.training.precision
    distributed = par.use_distributed_optimizer
    names = {
        "weights": ("DDP param buffer (param_and_grad_buffer.py _ParamAndGradBuffer.param_data)" if distributed
                    else "the modules' parameters (params_dtype)", f"{SHARDS}, --bf16/--fp16"),
        "main gradients": ("DDP grad buffer (_ParamAndGradBuffer.grad_data)",
                           f"{SHARDS}, --accumulate-allreduce-grads-in-fp32"),
        "master weights": (("DistributedOptimizer.shard_fp32_from_float16_groups" if distributed
                            else "Float16OptimizerWithFloat16Params.fp32_from_float16_groups"),
                           f"{SHARDS}, --use-distributed-optimizer (over data parallel)"),
        "Adam moments": ("Adam state exp_avg, exp_avg_sq (FusedAdam, from its first step)",
                         f"{SHARDS}, --use-distributed-optimizer (over data parallel)"),
        "fp32 gradient copies": ("main_param.grad = main_grad.float() (optimizer.py _copy_model_grads_to_main_grads)",
                                 "--fp16, --use-distributed-optimizer"),
        "torch cuBLAS workspaces": ("torch cuBLAS workspace x 2 handles (CublasHandlePool.cpp)", "CUBLAS_WORKSPACE_CONFIG"),
        "Transformer Engine cuBLAS workspace": ("TE get_cublas_workspace (cpp_extensions/gemm.py)", "the GPU"),
        "Transformer Engine userbuffers GEMM workspace": ("TE get_cublas_workspace(ub=True) x 3 streams "
                                                          "(cpp_extensions/gemm.py)", "--tp-comm-overlap, the GPU"),
        "Transformer Engine placeholder weight gradients": ("TE get_dummy_wgrad per weight shape (module/base.py "
                                                            "_dummy_wgrads)", "--no-gradient-accumulation-fusion, "
                                                            f"{SHARDS}, --hidden-size, --ffn-hidden-size"),
        "attention score buffer (local)": ("GlobalMemoryBuffer matmul_input_buffer (dot_product_attention.py)",
                                           f"--transformer-impl, {ACTIVATIONS}"),
        "causal mask (local softmax)": ("get_default_causal_mask (fused_softmax.py)",
                                        "--seq-length, --no-masked-softmax-fusion"),
    }
    if precision == "fp32" and item == "weights":
        return "the modules' parameters (fp32; FP32Optimizer steps them)", SHARDS
    return names.get(item, (item, ""))


def _activation_knobs(name: str) -> str:
    """The arguments that move one saved tensor, besides the micro-batch and sequence length."""
    if name == CHECKPOINT_INPUT:
        return "--recompute-num-layers, --recompute-method, --sequence-parallel"
    if name.startswith(("core_attention.", "rotary.", "query.")):
        return "--recompute-modules core_attn, --attention-backend, --tensor-model-parallel-size"
    if name.startswith(("linear_fc1.output", "linear_fc2.")):
        return "--recompute-modules mlp, --ffn-hidden-size, --tensor-model-parallel-size"
    if name.endswith("dropout_mask"):
        return "--hidden-dropout, --sequence-parallel"
    if "layernorm" in name or name.endswith(("norm_stats", "ln_out")):
        return "--recompute-modules layernorm (local norms), --sequence-parallel"
    return "--sequence-parallel, --tensor-model-parallel-size"


def _transient(cfg: Config, peak: StagePeak) -> tuple[str, str, str]:
    """What the pass at the peak holds beyond what it stores: (term, Megatron's name, knobs), by the pass."""
    last_chunk = (cfg.parallel.virtual_pipeline_model_parallel_size or 1) - 1
    loses = peak.stage == cfg.parallel.pipeline_model_parallel_size - 1 and peak.peak_chunk == last_chunk
    if peak.peak_kind == "F":
        if loses:
            return ("working set of the loss's forward", "vocab-parallel cross-entropy's logits and their fp32 copy "
                    "(cross_entropy.py), the micro-batch's inputs (get_batch)",
                    "--tensor-model-parallel-size, --cross-entropy-loss-fusion, the vocabulary")
        return "the micro-batch's inputs", "tokens, labels, masks (pretrain_gpt.py get_batch)", "--micro-batch-size, --seq-length"
    if loses:
        return ("working set of the loss's chunk's backward", "the loss's gradient (cross_entropy.py) or a layer's backward: "
                "linear_fc2's data gradient and the activation's gradient, a full-recompute checkpoint's rebuilt layers",
                "--tensor-model-parallel-size, --recompute-granularity full, --ffn-hidden-size")
    return ("working set of a backward", "a layer's backward: linear_fc2's data gradient and the activation's gradient, "
            "a full-recompute checkpoint's rebuilt layers", "--recompute-granularity full, --ffn-hidden-size")


def stage_terms(cfg: Config, peak: StagePeak) -> list[dict[str, Any]]:
    """The terms of one stage's steady-state peak: {"term", "megatron", "bytes", "knobs"} each, the
    saved tensors of the layers with how many layers hold them (`layers`). Their bytes add up to
    `peak.peak_allocated_bytes`."""
    out: list[dict[str, Any]] = []
    for item, nbytes in peak.items.items():
        if item in ACTIVATION_ITEMS[:3]:  # the deferred weight gradients stay a term of their own
            continue
        megatron, knobs = _static(cfg, item)
        out.append({"term": item, "megatron": megatron, "bytes": nbytes, "knobs": knobs})
    if not peak.held_chunks and not peak.peak_kind:
        return out  # the optimizer step: no activations
    par = cfg.parallel
    vp = par.virtual_pipeline_model_parallel_size or 1
    # each held model chunk's own saved tensors (a stage's chunks differ in their layers' kinds)
    built = model_chunks(cfg, peak.stage)
    saved: dict[str, dict[str, float]] = {}
    for c, held in Counter(peak.held_chunks).items():
        layers = built[c].layers + built[c].mtp
        for name, nbytes in peak.chunks[c].terms.items():
            term = saved.setdefault(name, {"bytes": 0.0, "layers": 0, "units": 0})
            term["bytes"] += held * nbytes
            term["layers"] += held * layers
            term["units"] += held * (layers if name != CHECKPOINT_INPUT else 1)
    for name, term in saved.items():
        megatron = ("saved for backward by a full-recompute checkpoint (CheckpointFunction)" if name == CHECKPOINT_INPUT
                    else "saved for backward by each TransformerLayer")
        out.append({"term": name, "megatron": megatron, "bytes": term["bytes"], "knobs": _activation_knobs(name),
                    "layers": term["layers"], "units": term["units"]})
    first, last = peak.stage == 0, peak.stage == par.pipeline_model_parallel_size - 1
    embeds = sum(1 for c in peak.held_chunks if first and c == 0)
    loses = sum(1 for c in peak.held_chunks if last and c == vp - 1)
    if embeds and embedding_saved_bytes(cfg):
        out.append({"term": "embedding dropout mask", "megatron": "LanguageModelEmbedding.forward dropout",
                    "bytes": embeds * embedding_saved_bytes(cfg), "knobs": "--hidden-dropout"})
    if loses:
        out.append({"term": "final norm and output layer input", "megatron": "final_layernorm, output_layer "
                    "(ColumnParallelLinear)", "bytes": loses * output_saved_bytes(cfg),
                    "knobs": "--sequence-parallel"})
        out.append({"term": "cross-entropy's saved softmax", "megatron": "_VocabParallelCrossEntropy exp_logits (fp32)",
                    "bytes": loses * loss_saved_bytes(cfg), "knobs": "--tensor-model-parallel-size, "
                    "the vocabulary"})
    term, megatron, knobs = _transient(cfg, peak)
    out.append({"term": term, "megatron": megatron, "bytes": peak.items["transient of the pass at the peak"],
                "knobs": knobs})
    return out
