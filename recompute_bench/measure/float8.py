"""`--precision fp8`: the transformer layers' linears in FP8 through torchao's float8 training
(pytorch/ao `torchao/float8`), as torchtitan applies it (`convert_to_float8_training` over the model,
the output layer left in 16 bits).

torchao swaps each `nn.Linear` for a `Float8Linear` (`float8_linear_utils.py`
`convert_to_float8_training`, `swap_linear_layers`), keeping the module's name and its bf16 weight, so
`recompute.apply` finds the same modules and every recompute setting applies unchanged. The
recipe is Megatron's field, `fp8_recipe`: tensorwise (one dynamic scale per tensor, E4M3 forward and
E5M2 gradients) or rowwise (one scale per row, E4M3 throughout; `config.py`
`Float8LinearConfig.from_recipe_name`). torchao dropped delayed scaling; blockwise and mxfp8 are
Transformer Engine's recipes, not torchao's float8 linear.

What a `Float8Linear` keeps for backward (`float8_linear.py`, `matmul_with_hp_or_float8_args.forward`):
its high-precision input and weight (`ctx.save_for_backward(input_hp, weight_hp_t)`), cast to FP8
again in backward, never the FP8 copies. The weight is the parameter (a view of it), so a layer
keeps exactly the bytes of a bf16 layer, and the estimate (`models.ELEMENT_BYTES["fp8"]`, 2) follows
that; Megatron with Transformer Engine keeps the FP8 copy of the input instead
(`analysis.megatron.fp8`). Recompute composes with it: a checkpointed MLP re-runs its Float8Linears'
casts in backward; `layernorm` recompute frees the norm's output once `linear_qkv` / `linear_fc1` has
saved it, which is the same tensor (`input_hp`).

`float8_problem` says beforehand (in the launching process, without importing torch's CUDA
context) why a device cannot run it: torchao not importable, or a GPU below compute capability 8.9
(`torch._scaled_mm` needs FP8 tensor cores). On a CPU torch's `_scaled_mm` runs the FP8 GEMMs
(torch 2.13 checked), so CPU tests run the real path.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by the build, not by the launcher's check (`float8_problem`)
    from torch import nn

MIN_CAPABILITY = (8, 9)
"""The first compute capability with FP8 tensor cores (Ada, sm_89); Hopper is 9.0."""
INSTALL = "pip install 'recompute-bench[fp8]' (torchao)"


def float8_problem(device_type: str, capability: tuple[int, int] | None = None) -> str | None:
    """Why `--precision fp8` cannot run on `device_type` here (one line), or None. `capability` is
    the CUDA device's (major, minor) where known."""
    if importlib.util.find_spec("torchao") is None:
        return f"--precision fp8 runs the linears through torchao's float8 training and torchao is not importable; {INSTALL}"
    if device_type == "cuda" and capability is not None and tuple(capability) < MIN_CAPABILITY:
        return (f"--precision fp8 needs FP8 tensor cores (compute capability 8.9 or later) and this GPU has "
                f"{capability[0]}.{capability[1]}; pass --precision bf16 or run on an Ada, Hopper or Blackwell GPU")
    return None


def to_float8(model: nn.Module, recipe: str) -> nn.Module:
    """Swap every `nn.Linear` of `model.layers` for torchao's `Float8Linear` with `recipe`, in place
    (the embedding and the output layer stay in 16 bits, as torchtitan leaves the output layer);
    returns the model. Works on the meta device: the swap keeps the weight tensors themselves."""
    import logging

    # torchao's import tries its CUDA/CUTLASS extensions and logs each one it cannot load; float8
    # training needs none of them (its GEMM is torch._scaled_mm), so those lines are noise here.
    quiet = logging.getLogger("torchao")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    finally:
        quiet.setLevel(level)

    config = Float8LinearConfig.from_recipe_name(recipe)
    for layer in model.layers:
        convert_to_float8_training(layer, config=config)
    return model


def float8_layers(model: nn.Module, training) -> nn.Module:
    """`model` with its layers' linears in FP8 (`to_float8`) when `training.precision` is fp8, else
    as it is. On a CUDA device below compute capability 8.9 it raises (`float8_problem` refuses that
    at launch where NVML knows the GPU)."""
    if training.precision != "fp8":
        return model
    device = next(model.parameters()).device
    if device.type == "cuda":
        import torch

        problem = float8_problem("cuda", torch.cuda.get_device_capability(device))
        if problem:
            raise RuntimeError(problem)
    return to_float8(model, training.fp8_recipe)


def float8_linears(model: nn.Module) -> int:
    """How many of `model`'s modules are torchao `Float8Linear`s (0 where torchao is not imported)."""
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def float8_env(model: nn.Module, recipe: str) -> dict[str, str]:
    """The record's `env` entry of a model whose linears run in FP8: `float8`, e.g. "torchao 0.18.0
    tensorwise, 8 linears"; nothing for a model without any."""
    count = float8_linears(model)
    if not count:
        return {}
    from importlib.metadata import version

    return {"float8": f"torchao {version('torchao')} {recipe}, {count} linears"}
