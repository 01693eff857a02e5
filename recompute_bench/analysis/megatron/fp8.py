"""FP8: what a Transformer Engine linear keeps of its input for backward, by precision and recipe.

Every module of this package that counts a linear's saved input (the dense layer's norm-linears and
linears, MoE's grouped experts, MLA's projections) asks `linear_input_bytes`, so the FP8 recipes
change that one place. Without FP8 a linear keeps its 16-bit (or fp32) input.
"""

from __future__ import annotations

from recompute_bench.models import ELEMENT_BYTES
from recompute_bench.spec.config import Config


def linear_input_bytes(cfg: Config, elements: float) -> float:
    """Bytes a linear keeps of an input of `elements` values for its weight gradient."""
    return ELEMENT_BYTES[cfg.training.precision] * elements
