"""How Megatron splits the model over pipeline stages and their model chunks: evenly, unevenly
(`decoder_first_pipeline_num_layers` / `decoder_last_pipeline_num_layers`), with the embedding and
the loss counted as layers (`account_for_embedding_in_pipeline_split` /
`account_for_loss_in_pipeline_split`), or by an explicit `pipeline_model_parallel_layout`.

Sources: megatron/core/transformer/transformer_block.py `get_num_layers_to_build`,
megatron/core/transformer/pipeline_parallel_layer_layout.py `PipelineParallelLayerLayout`
(`parse_str_to_list`, the 1D -> 2D conversion, `validate_layer_layout`), and
megatron/training/arguments.py `validate_args` (the virtual-pipeline size a layout implies).
Pure Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from recompute_bench.config.schema import BadInput, Config

LAYOUT_SYMBOLS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}
"""The layer characters of a layout string (`parse_str_to_list`'s char2layer_type)."""


@dataclass(frozen=True)
class ModelChunk:
    """What one model chunk of a pipeline rank builds."""

    layers: int
    """Transformer (decoder) layers."""
    embedding: bool = False
    """The word (and position) embedding: the model's first virtual stage."""
    loss: bool = False
    """The final norm, the output layer and the loss: the model's last virtual stage."""
    first_layer: int = 0
    """Its first transformer layer, 0-based over the whole model (`get_transformer_layer_offset`):
    the layers of every virtual stage before it."""
    mtp: int = 0
    """Multi-token-prediction layers it builds after its decoder layers (the layout's m; without a
    layout all of them, on the last stage's last chunk: multi_token_prediction.py
    `get_mtp_num_layers_to_build`). They count as layers num_layers + k (ModelConfig.decoder_layer_of)."""


def parse_layout(text: str) -> list[str]:
    """A layout string -> one string of layer characters per virtual stage, in order:
    `parse_str_to_list` drops commas, unrolls "(...)*n" then "x*n", and splits at "|"."""
    layout = str(text).replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        layout = re.sub(pattern, lambda match: match.group(1) * int(match.group(2)), layout)
    stages = layout.split("|")
    unknown = sorted({c for stage in stages for c in stage} - set(LAYOUT_SYMBOLS))
    if unknown:
        raise BadInput(f"pipeline_model_parallel_layout {text!r} has unknown layer characters {''.join(unknown)}; "
                       f"write E (embedding), t (layer), m (multi-token prediction), L (loss) and | between stages")
    return stages


def layout_virtual_stages(text: str, pipeline_model_parallel_size: int) -> int:
    """Model chunks per pipeline rank a layout implies (validate_args: its stages / pp)."""
    stages = len(parse_layout(text))
    if stages % pipeline_model_parallel_size:
        raise BadInput(f"pipeline_model_parallel_layout {text!r} has {stages} stages, which pipeline_model_parallel_size "
                       f"{pipeline_model_parallel_size} does not divide; give a multiple of it")
    return stages // pipeline_model_parallel_size


def uneven(cfg: Config) -> bool:
    """Whether the split is other than num_layers / pp layers on every rank."""
    p = cfg.parallel
    return (p.pipeline_model_parallel_layout is not None or p.decoder_first_pipeline_num_layers is not None
            or p.decoder_last_pipeline_num_layers is not None or p.account_for_embedding_in_pipeline_split
            or p.account_for_loss_in_pipeline_split)


def model_chunks(cfg: Config, stage: int) -> list[ModelChunk]:
    """The model chunks pipeline rank `stage` builds, in order (chunk c is virtual stage c x p + stage),
    each with its first layer over the whole model."""
    p, vp = cfg.parallel.pipeline_model_parallel_size, cfg.parallel.virtual_pipeline_model_parallel_size or 1
    every = [_rank_chunks(cfg, r) for r in range(p)]
    offsets, first = {}, 0
    for c in range(vp):  # virtual stage c x p + r comes after every virtual stage of lower index
        for r in range(p):
            offsets[(r, c)] = first
            first += every[r][c].layers
    return [ModelChunk(chunk.layers, chunk.embedding, chunk.loss, offsets[(stage, c)], chunk.mtp)
            for c, chunk in enumerate(every[stage])]


def _rank_chunks(cfg: Config, stage: int) -> list[ModelChunk]:
    """`model_chunks` without the offsets."""
    par = cfg.parallel
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    if par.pipeline_model_parallel_layout is not None:
        stages = parse_layout(par.pipeline_model_parallel_layout)
        mine = [stages[c * p + stage] for c in range(len(stages) // p)]
        return [ModelChunk(s.count("t"), "E" in s, "L" in s, mtp=s.count("m")) for s in mine]
    per_rank = _layers_per_rank(cfg, stage)
    out = []
    for c in range(vp):
        layers = per_rank // vp
        embedding, loss = stage == 0 and c == 0, stage == p - 1 and c == vp - 1
        # get_num_layers_to_build: the embedding (loss) takes one layer's place in its chunk
        layers -= int(embedding and par.account_for_embedding_in_pipeline_split)
        layers -= int(loss and par.account_for_loss_in_pipeline_split)
        out.append(ModelChunk(layers, embedding, loss, mtp=cfg.model.mtp_num_layers if loss else 0))
    return out


def _layers_per_rank(cfg: Config, stage: int) -> int:
    """get_num_layers_to_build before the virtual split: the uneven first / last stages, the rest
    shared evenly; or (num_layers + the embedding and loss when they count) / pp."""
    par, m = cfg.parallel, cfg.model
    p = par.pipeline_model_parallel_size
    first, last = par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        if stage == 0 and first is not None:
            return first
        if stage == p - 1 and last is not None:
            return last
        rest, left = m.num_layers - (first or 0) - (last or 0), p - (first is not None) - (last is not None)
        return rest // left if left else 0
    total = m.num_layers + int(par.account_for_embedding_in_pipeline_split) + int(par.account_for_loss_in_pipeline_split)
    return total // p


def validate_split(cfg: Config) -> None:
    """Megatron's rules for the split (get_num_layers_to_build's asserts, validate_args,
    `validate_layer_layout`), one clear line each."""
    par, m = cfg.parallel, cfg.model
    p, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    first, last = par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers
    accounted = par.account_for_embedding_in_pipeline_split or par.account_for_loss_in_pipeline_split
    if par.pipeline_model_parallel_layout is not None:
        if first is not None or last is not None or accounted:
            raise BadInput("pipeline_model_parallel_layout places every layer itself; drop the uneven-split settings "
                           "(decoder_first/last_pipeline_num_layers, account_for_*_in_pipeline_split)")
        layout = par.pipeline_model_parallel_layout
        if layout_virtual_stages(layout, p) != vp:
            raise BadInput(f"pipeline_model_parallel_layout {layout!r} gives {layout_virtual_stages(layout, p)} model chunks "
                           f"per pipeline rank, not virtual_pipeline_model_parallel_size {vp}; set it to match the layout")
        flat = "".join(parse_layout(layout))
        if not flat.startswith("E") or not flat.endswith("L") or flat.count("E") != 1 or flat.count("L") != 1:
            raise BadInput(f"pipeline_model_parallel_layout {layout!r} must start with the embedding E and end with the "
                           "loss L, each once")
        if flat.count("m") != m.mtp_num_layers:
            raise BadInput(f"pipeline_model_parallel_layout {layout!r} places {flat.count('m')} multi-token-prediction "
                           f"layers (m), not mtp_num_layers {m.mtp_num_layers}; write one m per layer")
        if m.mtp_num_layers and not any(stage.count("m") == m.mtp_num_layers and stage.endswith("L")
                                        for stage in parse_layout(layout)):
            raise BadInput(f"pipeline_model_parallel_layout {layout!r} places the multi-token-prediction layers (m) "
                           "apart from the loss L; they are modelled in the loss's virtual stage: write them as "
                           "...mL")
        if flat.count("t") != m.num_layers:
            raise BadInput(f"pipeline_model_parallel_layout {layout!r} places {flat.count('t')} layers, not num_layers "
                           f"{m.num_layers}; write one t per layer")
        return
    if first is not None or last is not None:
        if accounted:
            raise BadInput("Megatron does not combine an uneven first/last stage with account_for_*_in_pipeline_split; "
                           "drop one of them")
        for name, value in (("decoder_first_pipeline_num_layers", first), ("decoder_last_pipeline_num_layers", last)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise BadInput(f"{name} must be 0 or more, got {value!r}; pass --set parallel.{name}=N")
        rest, left = m.num_layers - (first or 0) - (last or 0), p - (first is not None) - (last is not None)
        if rest < 0 or (left and rest % left) or (not left and rest):
            raise BadInput(f"with {first} layers first and {last} last, the other {rest} of num_layers {m.num_layers} do "
                           f"not split evenly over the {left} other pipeline stages; change the uneven stage sizes")
    else:
        total = m.num_layers + int(par.account_for_embedding_in_pipeline_split) + int(par.account_for_loss_in_pipeline_split)
        if total % p:
            what = f"num_layers {m.num_layers}" + (f" plus the embedding and loss counted as layers ({total})" if accounted else "")
            raise BadInput(f"{what} is not divisible by pipeline_model_parallel_size {p}; change --num-layers or "
                           f"--pipeline-model-parallel-size")
    for stage in range(p):
        if _layers_per_rank(cfg, stage) % vp:
            raise BadInput(f"virtual_pipeline_model_parallel_size {vp} must divide the {_layers_per_rank(cfg, stage)} "
                           f"layers of pipeline stage {stage}; pass {vp} dividing every stage's layers")
        if any(chunk.layers < 0 for chunk in model_chunks(cfg, stage)):
            raise BadInput(f"pipeline stage {stage}'s model chunks have too few layers to hold the embedding or loss "
                           "counted as a layer; drop account_for_*_in_pipeline_split or add layers")
