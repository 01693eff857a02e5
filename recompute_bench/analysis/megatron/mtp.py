"""Multi-token prediction (`--mtp-num-layers D`) as Megatron runs it: what each MTP layer adds to
the model chunk that builds it, one micro-batch on one rank, and its parameters.

Megatron builds the MTP block on the last stage's loss chunk (or in the layout's `m` stage, which
this estimate takes only beside the loss `L`), after the decoder; `GPTModel._postprocess` runs it
before the output layer (multi_token_prediction.py `MultiTokenPredictionBlock.forward`). MTP layer k
(`MultiTokenPredictionLayer.forward`):

    input_ids, position_ids rolled one token left       roll_tensor
    decoder_input = embedding(input_ids)                 the chunk's own LanguageModelEmbedding
                                                          (`pre_process or mtp_process`), [s/t, b, h]
    enorm(decoder_input), hnorm(hidden_states)           TENorm: each keeps its input and statistics
    eh_proj(cat([e, h], -1))                             TEColumnParallelLinear 2h -> h: keeps the
                                                          [s/t, b, 2h] concatenation
    gather over tp, scatter over the sequence            (no saved tensors)
    mtp_model_layer                                      a TransformerLayer of the last decoder
                                                          layer's spec (gpt_builders.py), layer k + 1
    final_layernorm                                      TENorm: keeps its input and statistics

Layer k's hidden states are layer k - 1's output (the decoder's, already normed, for k = 0). The
block returns `torch.cat` of the decoder's and every MTP layer's output, [(1 + D) s/t, b, h], a new
tensor whose chunks the output layer keeps for its weight gradient (`process_mtp_loss`: one
output-layer pass and one cross-entropy per MTP layer, each keeping its fp32 softmax until backward,
then the main loss on chunk 0). The MTP layers run under the global FP8 context
(`_proj_and_transformer_layer`: `get_fp8_context(config)`, never a bf16 first/last layer).

Not counted: the rolled ids, labels and loss masks and the per-token MTP losses ([b, s] each, under
0.1% of a layer). Pure Python.

Sources (Megatron-LM d98e8a6): megatron/core/transformer/multi_token_prediction.py,
megatron/core/models/gpt/gpt_model.py (`_postprocess`, `mtp_process`), gpt_builders.py,
megatron/core/models/common/language_module/language_module.py
(`setup_embeddings_and_output_layer`: the MTP chunk's embedding copy).
"""

from __future__ import annotations

from recompute_bench.analysis.megatron.context_parallel import rank_tokens
from recompute_bench.analysis.megatron.fp8 import linear_input_bytes
from recompute_bench.analysis.megatron.outside import embedding_saved_bytes, loss_saved_bytes
from recompute_bench.models import ELEMENT_BYTES, SavedBytes
from recompute_bench.models.dense.spec import norm_parameters
from recompute_bench.config.schema import Config


def mtp_index(cfg: Config, k: int) -> int:
    """The layer index MTP layer `k` takes in this package's per-layer terms: num_layers + k (its
    kind is the last decoder layer's: ModelConfig.decoder_layer_of)."""
    return cfg.model.num_layers + k


def chunk_layer_indices(cfg: Config, first_layer: int, layers: int, mtp: int = 0) -> list[int]:
    """The layer indices of a model chunk: its `layers` decoder layers from global layer
    `first_layer` on, then its `mtp` multi-token-prediction layers (`mtp_index`)."""
    return [*range(first_layer, first_layer + layers), *(mtp_index(cfg, k) for k in range(mtp))]


def is_mtp_layer(cfg: Config, index: int) -> bool:
    """Whether layer `index` is a multi-token-prediction layer."""
    return index >= cfg.model.num_layers


def mtp_extra_parameters(cfg: Config) -> float:
    """An MTP layer's parameters beside its transformer layer, on one tensor-parallel rank: enorm,
    hnorm and final_layernorm over h (replicated), eh_proj [h / t, 2h] (column-parallel, no bias)."""
    m = cfg.model
    norm = norm_parameters(cfg, m.hidden_size)
    return 3 * norm + 2 * m.hidden_size * m.hidden_size / cfg.parallel.tensor_model_parallel_size


def eh_proj_weight(cfg: Config) -> tuple[int, int]:
    """eh_proj's weight on one rank as [out, in] (a Transformer Engine linear: FP8 quantizes it)."""
    h = cfg.model.hidden_size
    return h // cfg.parallel.tensor_model_parallel_size, 2 * h


def mtp_saved_bytes(cfg: Config, k: int, checkpointed: bool = False) -> dict[str, float]:
    """What MTP layer `k` keeps for backward besides its transformer layer (`layer_saved_bytes` of
    its index), one micro-batch on one rank, storage by storage: the chunk's embedding's dropout mask,
    enorm's input (the embedding's output) and statistics, hnorm's input (for k > 0 the previous MTP
    layer's output; for k = 0 the decoder's, which the output layer's terms hold) and statistics,
    eh_proj's input, final_layernorm's input and statistics, its share of the concatenated hidden
    states the output layer keeps (the decoder's share with k = 0), and its cross-entropy's fp32
    softmax. Under full recompute (`checkpointed`: `_checkpointed_forward` checkpoints the projection,
    the transformer layer and the final norm) the checkpoint keeps its inputs, the embedding's output
    and the hidden states, instead of those layers' tensors."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    e, tokens, h = ELEMENT_BYTES[tr.precision], rank_tokens(cfg), m.hidden_size
    stats = cfg.spec.norm_stats_bytes(cfg, "cuda", tokens)
    saved = SavedBytes()
    if embedding_saved_bytes(cfg):
        saved.add("mtp.embedding.dropout_mask", embedding_saved_bytes(cfg), "none")  # already per rank
    if checkpointed:
        saved.add("mtp.checkpoint.decoder_input", e * tokens * h, "sp")
        if k:
            saved.add("mtp.checkpoint.hidden_states", e * tokens * h, "sp")
    else:
        saved.add("mtp.enorm.input", e * tokens * h, "sp")
        saved.add("mtp.enorm.norm_stats", stats, "sp")
        if k:
            saved.add("mtp.hnorm.input", e * tokens * h, "sp")
        saved.add("mtp.hnorm.norm_stats", stats, "sp")
        # TE's column-parallel linear keeps its local input (FP8 under fp8, gathered in backward)
        saved.add("mtp.eh_proj.input", linear_input_bytes(cfg, tokens * 2 * h, 2 * h, gathered=par.sequence_parallel),
                  "sp")
        saved.add("mtp.final_layernorm.input", e * tokens * h, "sp")
        saved.add("mtp.final_layernorm.norm_stats", stats, "sp")
    # torch.cat of the hidden states: one [s/t, b, h] share per MTP layer and, with the first, the
    # decoder's own share (its final norm's output stays held by hnorm)
    saved.add("mtp.output_layer.input", (2 if k == 0 else 1) * e * tokens * h, "sp")
    out = saved.per_rank(par.tensor_model_parallel_size, par.sequence_parallel)
    out["mtp.cross_entropy.softmax"] = loss_saved_bytes(cfg)
    return out
