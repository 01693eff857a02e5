"""`--transformer-impl transformer_engine` in this harness: which Transformer Engine modules Megatron
builds a dense GPT layer from, and how each recompute setting lands on them. Pure Python (no import
of transformer_engine), read from Megatron-LM (d98e8a6):

- `megatron/core/models/gpt/gpt_layer_specs.py` `get_gpt_layer_with_transformer_engine_submodules`:
  the input norm is fused into `linear_qkv` (`TELayerNormColumnParallelLinear`, TE's
  `LayerNormLinear`; `input_layernorm` is `IdentityOp`), the core attention is
  `TEDotProductAttention` (TE's `DotProductAttention`), `linear_proj` and `linear_fc2` are
  `TERowParallelLinear` (TE's `Linear`), and the pre-MLP norm is fused into `linear_fc1`
  (`pre_mlp_layernorm` is `IdentityOp` in a dense layer).
- `megatron/core/transformer/transformer_layer.py`: `layernorm` recompute applies to a norm only
  where it is not `IdentityOp`, so in TE's dense layer it recomputes nothing; `mlp` recompute
  checkpoints the whole MLP (`_run_mlp`, v0.16's `_forward_mlp`: `te_checkpoint` under FP8, else
  `tensor_parallel.checkpoint`).
- `megatron/core/transformer/attention.py` `Attention._checkpointed_attention_forward`: `core_attn`
  checkpoints the core attention alone (q, k, v in, its output kept), always with
  `tensor_parallel.checkpoint`.
- `megatron/core/recompute.py` `checkpointed_forward` (the full-recompute loop that was
  `TransformerBlock._checkpointed_forward`): one checkpoint per chunk of layers, `te_checkpoint` under
  FP8 (`megatron/core/extensions/transformer_engine.py` `te_checkpoint`:
  `transformer_engine.pytorch.distributed.checkpoint`), else `tensor_parallel.checkpoint`.

The harness builds its dense layers from these modules (`te_layers.py`) where `transformer_engine.pytorch`
imports and a CUDA device is present; `te_problem` refuses the flag in one line elsewhere, and for the
layouts the TE layers are not built for yet. Only the stand-in of tests/te_standin.py has run them so far;
`tests/gpu/test_transformer_engine_cuda.py` runs them on an installed TE.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

TE_INSTALL = "pip install --no-build-isolation 'transformer_engine[pytorch]' (needs CUDA)"

# The harness's module name -> (Megatron's TE class, TE's own module in transformer_engine.pytorch).
TE_MODULES = {
    "linear_qkv": ("TELayerNormColumnParallelLinear", "LayerNormLinear"),
    "core_attention": ("TEDotProductAttention", "DotProductAttention"),
    "linear_proj": ("TERowParallelLinear", "Linear"),
    "linear_fc1": ("TELayerNormColumnParallelLinear", "LayerNormLinear"),
    "linear_fc2": ("TERowParallelLinear", "Linear"),
}
FUSED_NORMS = {"input_layernorm": "linear_qkv", "pre_mlp_layernorm": "linear_fc1"}
"""Each dense-layer norm and the TE module it is fused into (the norm itself is `IdentityOp`)."""


@dataclass(frozen=True)
class TERecompute:
    """How one recompute setting lands on TE's dense layer: what is checkpointed (module names of the
    harness), which checkpoint function runs it, and the modules asked for that recompute nothing."""

    checkpointed: tuple[str, ...]
    checkpoint: str
    no_effect: tuple[str, ...] = ()


def te_recompute(granularity: str, modules: tuple[str, ...] | list[str], precision: str) -> TERecompute:
    """The recompute Megatron applies to a TE dense layer for `granularity` and selective `modules`
    under `precision` (see the module docstring for the source of each rule)."""
    fp8 = precision == "fp8"
    checkpoint = "transformer_engine.pytorch.distributed.checkpoint" if fp8 else "tensor_parallel.checkpoint"
    if granularity == "full":
        return TERecompute(("layers",), checkpoint)
    if granularity != "selective":
        return TERecompute((), "none")
    wanted = tuple(modules)
    checkpointed = tuple(name for name in ("core_attn", "mlp") if name in wanted)
    no_effect = ("layernorm",) if "layernorm" in wanted else ()  # both norms are fused: IdentityOp
    # core_attn always runs Megatron's own checkpoint (attention.py), mlp TE's under FP8 (transformer_layer.py);
    # `checkpoint` names the MLP's where both are asked for
    how = checkpoint if "mlp" in checkpointed else "tensor_parallel.checkpoint"
    return TERecompute(checkpointed, how if checkpointed else "none", no_effect)


def cuda_present() -> bool:
    """Whether torch sees a CUDA device (TE's modules run only there)."""
    import torch

    return torch.cuda.is_available()


def te_problem(cfg=None) -> str | None:
    """Why `--transformer-impl transformer_engine` cannot run in this harness here (one line), or None:
    TE not importable, no CUDA device, or (with `cfg`) a model or layout its layers are not built for."""
    if importlib.util.find_spec("transformer_engine") is None:
        return ("--transformer-impl transformer_engine builds the layers from Transformer Engine's modules and "
                f"transformer_engine is not importable; {TE_INSTALL}, drop --transformer-impl, or estimate "
                "Megatron's TE layers with --framework megatron")
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as e:  # installed but broken: a CUDA or torch mismatch, said in its own words
        first = (str(e).splitlines() or [""])[0]
        return (f"--transformer-impl transformer_engine: transformer_engine.pytorch does not import "
                f"({type(e).__name__}: {first}); reinstall it ({TE_INSTALL}) or drop --transformer-impl")
    if not cuda_present():
        return ("--transformer-impl transformer_engine: Transformer Engine's modules run on CUDA and torch sees no "
                "CUDA device here; run on a GPU, drop --transformer-impl, or estimate with --framework megatron")
    return None if cfg is None else _unbuilt(cfg)


def _unbuilt(cfg) -> str | None:
    """The models and layouts `te_layers.py` does not build TE layers for (one line), or None."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    unbuilt = [(m.num_moe_experts, "mixture-of-experts layers"), (m.multi_latent_attention, "multi-latent attention"),
               (p.tensor_model_parallel_size > 1, "--tensor-model-parallel-size above 1"),
               (p.pipeline_model_parallel_size > 1, "--pipeline-model-parallel-size above 1"),
               (p.context_parallel_size > 1, "--context-parallel-size above 1"),
               (t.precision == "fp8", "--precision fp8 (TE's fp8_autocast is not wired)"),
               (t.compile, "--compile")]
    what = [name for hit, name in unbuilt if hit]
    if not what:
        return None
    return (f"--transformer-impl transformer_engine builds dense single-rank layers (data parallel allowed), not "
            f"{', '.join(what)}; drop those, or estimate Megatron's TE layers with --framework megatron")
