"""Megatron's arguments as they are written -> names and Python values (framework megatron).

A `model_config.yaml`'s MODEL_ARGS, a command line (`read_argv`) and the argument dump at the start
of a Megatron log all come here first: `normalize` gives each argument the name Megatron's `args`
holds (`--num-layers` -> num_layers, its argparse destination where that differs) and reads its
text as a Python value (`None`, `True`, `12`, `['core_attn']`, `AttnBackend.flash`). What the
arguments mean is `ingest/megatron_args.py`'s. Pure Python.
"""

from __future__ import annotations

import ast
from typing import Any, Iterable, Mapping

from recompute_bench.config.schema import BadInput

# Long flags whose argparse destination has another name (TransformerConfig's `fp8` is set by
# --fp8-format: transformer_config.py, its field's argparse_meta arg_names).
ALIASES = {"microbatch_group_size_per_virtual_pipeline_stage": "microbatch_group_size_per_vp_stage",
           "no_rope_fusion": "no_apply_rope_fusion",  # argparse: --no-rope-fusion's dest is apply_rope_fusion
           # arguments.py: --no-overlap-p2p-communication's dest is overlap_p2p_comm
           "no_overlap_p2p_communication": "no_overlap_p2p_comm",
           "fp8_format": "fp8"}
FLAG_NAMES = {dest: long for long, dest in ALIASES.items()} | {"overlap_p2p_comm": "no_overlap_p2p_communication"}
"""A normalized name -> the long flag's own name, where ALIASES renames it (fp8 -> fp8_format), or the
only flag that sets it (overlap_p2p_comm: --no-overlap-p2p-communication, argparse's store_false)."""


def read_argv(argv: Iterable[str]) -> dict[str, Any]:
    """A Megatron command line -> {name: value}: a flag without a value is True, a flag followed by
    several words is a list (`--recompute-modules core_attn mlp`), `--flag=value` is one value."""
    out: dict[str, Any] = {}
    name: str | None = None
    for token in argv:
        if token.startswith("--"):
            name, eq, value = token[2:].partition("=")
            out[name] = _value(value) if eq else True
            if eq:
                name = None
        elif name is not None:
            value = _value(token)
            held = out[name]
            out[name] = value if held is True else (held + [value] if isinstance(held, list) else [held, value])
        else:
            raise BadInput(f"Megatron argument value {token!r} follows no --flag; write --name value")
    return out


def normalize(args: Mapping[str, Any]) -> dict[str, Any]:
    """Names as Megatron's `args` holds them (`--num-layers` -> num_layers) and values as Python
    values: a log's text `None`, `True`, `12`, `0.1`, `['core_attn']`, `AttnBackend.flash` is read.
    A negative flag given as a flag (`--no-masked-softmax-fusion`) becomes its destination set to
    False (`masked_softmax_fusion`), as argparse stores it."""
    out = {}
    for key, value in args.items():
        name = str(key).lstrip("-").replace("-", "_")
        value = _value(value) if isinstance(value, str) else value
        if isinstance(value, list):  # a YAML list of words, ["mlp core_attn"] as Megatron's runner splits it
            value = [_value(w) if isinstance(w, str) else w for item in value
                     for w in (item.split() if isinstance(item, str) else [item])]
        name = ALIASES.get(name, name)
        if name.startswith("no_") and value is True:
            out.setdefault(name[3:], False)
        out[name] = value
    return out


def _value(text: str) -> Any:
    text = text.strip()
    if text in ("None", "null", ""):
        return None if text != "" else ""
    if text in ("True", "true"):
        return True
    if text in ("False", "false"):
        return False
    if text.startswith("AttnBackend."):  # the dump prints the enum
        return text.split(".", 1)[1]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return bracket_list(text)


def bracket_list(text: str) -> Any:
    """A list as recipes write one in a `model_config.yaml`: "[mlp core_attn]". Megatron-LM's test
    runner strips the brackets and passes the words as separate arguments
    (tests/functional_tests/shell_test_utils/_run_training.sh, "value is wrapped in [ ]"), so an
    nargs='+' argument gets a list of them. Other text is returned as it is."""
    if len(text) > 2 and text[0] == "[" and text[-1] == "]" and "[" not in text[1:-1]:
        words = text[1:-1].replace(",", " ").split()
        if words:
            return [_value(w) for w in words]
    return text


def module_list(value: Any) -> list[str]:
    """A Megatron list argument as recipes write it: a list, "a,b", or the yaml's "[a b]" (a
    command line's `--flag a b` spelled inside one string)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v).strip() for v in value if str(v).strip()]
    return [word for word in str(value).strip().strip("[]").replace(",", " ").replace("'", " ").split() if word]
