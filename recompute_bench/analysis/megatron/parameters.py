"""Parameters on one Megatron rank: one layer's on a tensor-parallel rank, and a pipeline stage's
over its model chunks as Megatron splits the model (evenly, unevenly, by layout:
`config.pipeline_split.model_chunks`).

Sources: megatron/core/transformer/attention.py `SelfAttention.__init__` (linear_qkv's width with the
output gate, its bias with add_qkv_bias, q_layernorm / k_layernorm over one head),
megatron/core/transformer/multi_latent_attention.py (`analysis.megatron.mla`),
megatron/core/models/gpt/gpt_model.py (embedding, final norm, output layer; on pipelined runs the
last stage's copy of a tied embedding)."""

from __future__ import annotations

from recompute_bench.analysis.megatron.mla import mla_attention_parameters
from recompute_bench.analysis.megatron.moe import moe_layer_parameters
from recompute_bench.analysis.megatron.mtp import chunk_layer_indices, is_mtp_layer, mtp_extra_parameters
from recompute_bench.models.dense.spec import DENSE, norm_parameters
from recompute_bench.config.schema import Config
from recompute_bench.config.pipeline_split import ModelChunk, model_chunks


def layer_parameters(cfg: Config) -> float:
    """One Megatron transformer layer's parameters on one tensor-parallel rank.

    The dense layer is this harness's (`DenseSpec.layer_parameters`: the same linears, norms and
    biases) with Megatron's own arguments: the attention output gate widens linear_qkv by a x d
    columns, add_qkv_bias puts a bias on linear_qkv alone, qk_layernorm adds a norm over one head
    for the queries and one for the keys (TENorm(hidden_size_per_attention_head), replicated over
    the tensor-parallel group). Multi-latent attention replaces the attention block (`mla`)."""
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    h, d, a, g = m.hidden_size, m.head_dim, m.num_attention_heads, m.groups
    if m.multi_latent_attention:
        sharded, replicated = mla_attention_parameters(cfg)
        fc1 = 2 * m.ffn_hidden_size if m.activation == "swiglu" else m.ffn_hidden_size
        bias = 1 if m.add_bias_linear else 0
        # the MLP beside it: linear_fc1 with its fused pre-MLP norm, linear_fc2 (row-parallel bias)
        sharded += h * fc1 + bias * fc1 + m.ffn_hidden_size * h
        replicated += norm_parameters(cfg, h) + bias * h
        return sharded / t + replicated
    dense = DENSE.layer_parameters(cfg)  # a dense layer's, also in a MoE model (its MLP is swapped below)
    sharded, replicated = dense["sharded"] * t, dense["replicated"]
    qkv_width = (a + 2 * g) * d + (a * d if m.attention_output_gate else 0)
    if m.attention_output_gate:  # the gate's columns, with their bias where linear_qkv has one
        sharded += h * a * d + (a * d if m.add_bias_linear else 0)
    if m.add_qkv_bias and not m.add_bias_linear:  # `bias=add_bias_linear or add_qkv_bias`
        sharded += qkv_width
    if m.qk_layernorm:
        replicated += 2 * norm_parameters(cfg, d)
    return sharded / t + replicated


def layer_parameter_groups(cfg: Config, layer: int) -> dict[str, float]:
    """Layer `layer`'s parameters on one rank by the group their gradients are reduced and sharded
    over: "dense" (attention, norms, a dense MLP, the router and shared experts: the data-parallel
    group) and "expert" (the routed experts: the expert-data-parallel group;
    distributed_data_parallel.py keeps them in their own `expert_parallel_buffers`). A MoE layer
    (moe_layer_freq) is a dense layer whose MLP is replaced by `moe.moe_layer_parameters`."""
    dense = layer_parameters(cfg)
    if is_mtp_layer(cfg, layer):  # its norms and eh_proj beside a transformer layer
        dense += mtp_extra_parameters(cfg)
    if not cfg.model.is_moe_layer(layer):
        return {"dense": dense, "expert": 0.0}
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    fc1 = 2 * m.ffn_hidden_size if m.activation == "swiglu" else m.ffn_hidden_size
    bias = 1 if m.add_bias_linear else 0
    # the dense MLP's weights and fc1 bias over tp, fc2's bias whole, and the fused norm in fc1
    dense_mlp = (m.hidden_size * fc1 + bias * fc1 + m.ffn_hidden_size * m.hidden_size) / t + bias * m.hidden_size \
        + norm_parameters(cfg, m.hidden_size)
    moe = moe_layer_parameters(cfg)
    return {"dense": dense - dense_mlp + moe["dense"], "expert": moe["expert"]}


def chunk_parameter_groups(cfg: Config, chunk: ModelChunk, holds_embedding: bool) -> dict[str, float]:
    """A model chunk's parameters on one rank, by group (`layer_parameter_groups`): its layers, and
    the embedding (the padded vocabulary's rows over tp, learned absolute positions whole), or the
    final norm and the output layer (tied to the embedding: a copy of it unless this rank
    `holds_embedding` too)."""
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    vocab = cfg.vocab_rows * m.hidden_size / t
    groups = {"dense": 0.0, "expert": 0.0}
    for i in chunk_layer_indices(cfg, chunk.first_layer, chunk.layers, chunk.mtp):
        for group, count in layer_parameter_groups(cfg, i).items():
            groups[group] += count
    n = 0.0
    # a chunk with multi-token prediction builds an embedding of its own (gpt_model.py: `pre_process
    # or mtp_process`), a copy of the first stage's kept in sync by the embedding group
    if chunk.embedding or chunk.mtp:
        n += vocab + (m.max_position_embeddings * m.hidden_size if m.position_embedding_type == "learned_absolute" else 0)
    if chunk.loss:
        n += norm_parameters(cfg, m.hidden_size)
        if not m.share_embeddings_and_output_weights or not holds_embedding:
            n += vocab
    groups["dense"] += n
    return groups


def stage_parameter_groups(cfg: Config, stage: int) -> dict[str, float]:
    """Parameters on one rank of pipeline stage `stage`, by group: its model chunks'."""
    chunks = model_chunks(cfg, stage)
    holds_embedding = any(c.embedding for c in chunks)
    groups = {"dense": 0.0, "expert": 0.0}
    for c in chunks:
        for group, count in chunk_parameter_groups(cfg, c, holds_embedding).items():
            groups[group] += count
    return groups


def stage_parameters(cfg: Config, stage: int) -> float:
    """Parameters on one rank of pipeline stage `stage`: its model chunks'."""
    return sum(stage_parameter_groups(cfg, stage).values())
