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

This harness does not build the layers from these modules yet: `transformer_engine` cannot be
installed on the machines it was written on, and a backend that never ran is not offered. `te_problem`
refuses the flag in one line either way, naming why; the plan below is what the builder will follow,
and `tests/gpu/test_transformer_engine_cuda.py` checks its module names against an installed TE.
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


def te_problem() -> str:
    """Why `--transformer-impl transformer_engine` cannot run in this harness here (one line)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return ("--transformer-impl transformer_engine builds the layers from Transformer Engine's modules and "
                f"transformer_engine is not importable; {TE_INSTALL}, drop --transformer-impl, or estimate "
                "Megatron's TE layers with --framework megatron")
    return ("--transformer-impl transformer_engine: this harness does not build Transformer Engine's layers yet "
            "(docs/speed.md); estimate them with --framework megatron, or drop --transformer-impl")
