"""Values as Megatron and Megatron Bridge print them: Python's `str()` or `repr()` of an argument
(`None`, `True`, `4`, `0.1`, `['core_attn']`, `'selective'`), and names that are no literal
(`torch.bfloat16`, `AttnBackend.auto`, `<AttnBackend.flash: 1>`) kept as text."""

from __future__ import annotations

import ast
import re
from typing import Any

_ENUM_REPR = re.compile(r"^<(?P<name>[\w.]+): .*>$")


def printed_value(text: str) -> Any:
    """A printed argument value as Python data: a literal where it is one, else the text (an enum's
    repr `<AttnBackend.flash: 1>` as its name `AttnBackend.flash`)."""
    text = text.strip()
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        m = _ENUM_REPR.match(text)
        return m.group("name") if m else text
