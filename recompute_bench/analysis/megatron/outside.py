"""Outside the layers, per micro-batch: the embedding's dropout mask, the final norm and output
layer, the loss, and the micro-batch's inputs. Under context parallel each holds the rank's s/cp
tokens (`context_parallel.rank_tokens`): the loss runs over the split sequence, and its per-token
losses are summed and reduced afterwards.

Sources: megatron/core/models/common/embeddings/language_model_embedding.py,
megatron/core/tensor_parallel/cross_entropy.py, megatron/core/fusions/fused_cross_entropy.py,
pretrain_gpt.py get_batch."""

from __future__ import annotations

from recompute_bench.analysis.megatron.context_parallel import attention_mask_bytes, rank_tokens
from recompute_bench.models import ELEMENT_BYTES, FP32_BYTES, INDEX_BYTES, MASK_BYTES
from recompute_bench.config.schema import Config

def embedding_saved_bytes(cfg: Config) -> float:
    """First stage, per micro-batch: the embedding dropout's mask (LanguageModelEmbedding.forward)."""
    m, par = cfg.model, cfg.parallel
    if m.hidden_dropout <= 0:
        return 0.0
    t = par.tensor_model_parallel_size if par.sequence_parallel else 1
    return MASK_BYTES * rank_tokens(cfg) * m.hidden_size / t


def output_saved_bytes(cfg: Config) -> float:
    """Last stage, per micro-batch: the final norm's input and statistics (TENorm / FusedLayerNorm)
    and its output, which the output layer (ColumnParallelLinear) keeps for its weight gradient."""
    m, tr, par = cfg.model, cfg.training, cfg.parallel
    tokens = rank_tokens(cfg)
    t = par.tensor_model_parallel_size if par.sequence_parallel else 1
    stats = (2 if m.normalization == "LayerNorm" else 1) * FP32_BYTES * tokens
    return (2 * ELEMENT_BYTES[tr.precision] * tokens * m.hidden_size + stats) / t


def logits(cfg: Config) -> float:
    """Logits on one tensor-parallel rank: s/cp x b x padded vocabulary / t."""
    return rank_tokens(cfg) * cfg.vocab_rows / cfg.parallel.tensor_model_parallel_size


def loss_saved_bytes(cfg: Config) -> float:
    """Kept from the loss's forward to its backward: cross_entropy.py `_VocabParallelCrossEntropy`
    saves `exp_logits`, its fp32 working copy of the logits turned into the softmax in place;
    Transformer Engine's cross-entropy (cross_entropy_fusion_impl te) its fp32 gradient buffer."""
    return FP32_BYTES * logits(cfg)


def loss_peak_bytes(cfg: Config) -> float:
    """The most the loss holds at once. cross_entropy.py `_VocabParallelCrossEntropy.forward`: the
    16-bit logits and their fp32 copy (`calculate_logits_max`: `.float()`), everything after in place;
    backward: the gradient is computed in place in the saved fp32 buffer and autograd casts it to the
    logits' 16 bits (engine.cpp validate_outputs) while it is alive: 2 + 4 bytes per logit either way.
    The fused cross-entropy (fused_cross_entropy.py, its steps under jit_fuser = torch.compile) holds
    one more fp32 buffer: the compiled `calculate_predicted_logits` writes exp(logits) anew before
    copying it back into the input it mutates, and `calculate_gradients` likewise: 2 + 4 + 4."""
    e = ELEMENT_BYTES[cfg.training.precision]
    m = cfg.model
    if m.cross_entropy_loss_fusion and m.cross_entropy_fusion_impl == "te":
        # Transformer Engine's parallel_cross_entropy (cross_entropy.py `CrossEntropyFunction`,
        # triton/cross_entropy.py `cross_entropy_forward`): the logits as they are and a new fp32
        # gradient buffer, written in forward and saved; backward scales it in place and autograd
        # casts it to the logits' dtype: e + 4 bytes per logit either way, 4 kept
        return (e + FP32_BYTES) * logits(cfg)
    held = (e + FP32_BYTES) if e < FP32_BYTES else FP32_BYTES
    if m.cross_entropy_loss_fusion:
        held += FP32_BYTES
    return held * logits(cfg)


def batch_bytes(cfg: Config) -> float:
    """One micro-batch's inputs on the GPU on the first and last stages (pretrain_gpt.py get_batch):
    tokens, labels and position ids (int64), the loss mask (fp32) and, with
    create_attention_mask_in_dataloader (Megatron's default), the [b, 1, s, s] bool attention mask;
    under context parallel the rank's slices (`get_batch_on_this_cp_rank`: s/cp tokens, the mask's
    s/cp queries over all s keys)."""
    # --no-create-attention-mask-in-dataloader: gpt_dataset.py `GPTDataset.__getitem__` builds no
    # mask (`elif self.config.create_attention_mask`), and get_batch moves none to the GPU
    mask = attention_mask_bytes(cfg) if cfg.training.create_attention_mask_in_dataloader else 0
    return (3 * INDEX_BYTES + FP32_BYTES) * rank_tokens(cfg) + mask


def deferred_wgrad_bytes(cfg: Config, microbatch: int) -> float:
    """With defer_embedding_wgrad_compute, what the output layer's backward of micro-batch
    `microbatch` leaves held until the pipeline flush: tensor_parallel/layers.py
    `ColumnParallelLinear.forward` appends its input to `embedding_activation_buffer` and
    `LinearWithGradAccumulationAndAsyncCommunication.backward` its 16-bit output gradient (the
    logits' gradient) to `grad_output_buffer`, for the first wgrad_deferral_limit micro-batches (0:
    all); schedules.py `finish_embedding_wgrad_compute` (utils.py `drain_embedding_wgrad_compute`)
    computes their weight gradient and frees them after the last backward."""
    tr, m, par = cfg.training, cfg.model, cfg.parallel
    limit = tr.wgrad_deferral_limit
    if not tr.defer_embedding_wgrad_compute or (limit and microbatch >= limit):
        return 0.0
    t = par.tensor_model_parallel_size if par.sequence_parallel else 1
    e = ELEMENT_BYTES[tr.precision]
    return e * logits(cfg) + e * rank_tokens(cfg) * m.hidden_size / t
