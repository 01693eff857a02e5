"""Context parallel under framework megatron, term by term: the sequence split, Transformer Engine's
CP attention per cp_comm_type and kernel, the optimizer over dp x cp. Each expectation is counted
from the code that allocates the tensor (named in analysis/megatron/context_parallel.py); the
goldens that pin terms are in test_megatron_check.py."""

import json

import pytest

from helpers import invoke
from recompute_bench.analysis import megatron as mg
from recompute_bench.analysis.megatron import context_parallel as cp, layer, optimizer, outside
from recompute_bench.analysis.megatron.stage import chunk_bytes
from recompute_bench.config.pipeline_split import model_chunks
from recompute_bench.ingest.megatron_args import config_from_megatron

MiB = 2**20
# gpt3_mcore_te_tp2_pp2_cp2 (Megatron-LM's functional test): 12 layers of h 512, 8 heads of 64,
# s 1024, b 4, Transformer Engine, no dropout, bf16, tp 2 with sequence parallel, cp 2.
CASE = {"--num-layers": 12, "--hidden-size": 512, "--num-attention-heads": 8, "--seq-length": 1024,
        "--max-position-embeddings": 1024, "--micro-batch-size": 4, "--global-batch-size": 32,
        "--tensor-model-parallel-size": 2, "--pipeline-model-parallel-size": 2, "--context-parallel-size": 2,
        "--sequence-parallel": True, "--hidden-dropout": 0.0, "--attention-dropout": 0.0, "--bf16": True,
        "--attention-backend": "flash"}
A100, H100 = mg.MegatronRun("a100"), mg.MegatronRun("h100")


def _cfg(**changes):
    args = {**CASE}
    for key, value in changes.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            args.pop(flag, None)
        else:
            args[flag] = value
    return config_from_megatron(args, world_size=16)


def test_a_cp_rank_holds_its_share_of_every_per_token_tensor():
    c = _cfg()
    assert cp.rank_tokens(c) == 512 * 4  # s / cp x b
    # get_batch_on_this_cp_rank slices the mask's queries, not its keys: [b, 1, s/cp, s]
    assert cp.attention_mask_bytes(c) == 4 * 512 * 1024
    assert outside.batch_bytes(c) == (3 * 8 + 4) * 2048 + 4 * 512 * 1024
    # the loss over the split sequence: s/cp x b logits of the padded vocabulary (50257 -> 50432) over tp
    assert outside.logits(c) == 2048 * 50432 / 2 and outside.loss_peak_bytes(c) == 6 * outside.logits(c)
    # a full-recompute checkpoint keeps [s/cp, b, h] in bf16, split over tp by sequence parallel
    full = _cfg(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert chunk_bytes(full, A100, 6).stored == 6 * 2 * 2048 * 512 / 2
    # 16 GPUs / (tp 2 x pp 2 x cp 2) = dp 2
    assert c.parallel.data_parallel_size == 2


def test_flash_p2p_keeps_what_flash_keeps_without_cp_at_s_over_cp():
    # AttnFuncWithCPAndKVP2P keeps q (flash's [b, s, ...] copy), the last K/V buffer received, its
    # merged output and softmax_lse; flash without CP keeps its q, k, v copies, its output and lse:
    # the same bytes at s/cp tokens, under other names.
    with_cp, without = layer.layer_saved_bytes(_cfg(), A100), layer.layer_saved_bytes(_cfg(context_parallel_size=1,
                                                                                           seq_length=512), A100)
    assert sum(with_cp.values()) == sum(without.values())
    assert with_cp["core_attention.kv_received"] == 2 * 2048 * 2 * 4 * 64  # K and V of the 4 heads a tp rank holds
    assert "core_attention.qkv_bshd" in without and "core_attention.qkv_bshd" not in with_cp


def test_fused_cp_attention_lets_the_qkv_output_go():
    # Without CP, FusedAttnFunc keeps q, k, v as given, views of linear_qkv's output; under CP,
    # FusedAttention hands TE `contiguous()` copies and only q's copy and the K/V buffer are kept.
    fused = layer.layer_saved_bytes(_cfg(attention_backend="fused"), H100)
    dense = layer.layer_saved_bytes(_cfg(attention_backend="fused", context_parallel_size=1, seq_length=512), H100)
    assert "linear_qkv.output" in dense and "linear_qkv.output" not in fused
    q = 2 * 2048 * 512 / 2
    assert fused["core_attention.query_contiguous"] == q and fused["core_attention.output"] == q
    # q's copy and K/V (3 q with full heads) in place of the QKV output (3 q): the same bytes here
    assert sum(fused.values()) == sum(dense.values())
    # grouped queries: Megatron's query.reshape is already a contiguous copy, which TE keeps as it is
    gqa = layer.layer_saved_bytes(_cfg(attention_backend="fused", group_query_attention=True, num_query_groups=2), H100)
    assert gqa["query.reshape"] == q and "core_attention.query_contiguous" not in gqa
    # RoPE: its q is contiguous, so that is what TE keeps
    rope = layer.layer_saved_bytes(_cfg(attention_backend="fused", position_embedding_type="rope"), H100)
    assert "rotary.query" in rope and "rotary.key" not in rope


@pytest.mark.parametrize("kind,path,queries", [
    # flash hands TE [b, s, ...] copies and copies the output back: 5 q-sized tensors whatever the kind
    ("p2p", "flash", 5), ("all_gather", "flash", 5), ("a2a", "flash", 5), ("a2a+p2p", "flash", 5),
    # fused: p2p keeps q's copy, K/V (2 q here), the output it returns; all_gather q, k, v and output
    ("p2p", "fused", 4), ("all_gather", "fused", 4),
    # the all-to-all's q, k, v (or q and K/V), its output, and the output after the all-to-all back
    ("a2a", "fused", 5), ("a2a+p2p", "fused", 5),
])
def test_each_comm_type_keeps_its_own_set(kind, path, queries):
    c = _cfg(context_parallel_size=4, cp_comm_type=kind, tensor_model_parallel_size=1, sequence_parallel=None,
             attention_backend=path, hierarchical_context_parallel_sizes="2 2" if kind == "a2a+p2p" else None)
    kept = layer.layer_saved_bytes(c, H100)
    q, lse = 2 * 1024 * 512, 4 * 1024 * 8  # 1024 tokens on a CP rank, 8 heads of 64 (MHA: K/V is 2 q)
    attention = {k: v for k, v in kept.items() if k.startswith("core_attention") or k.startswith("rotary")}
    assert sum(attention.values()) == queries * q + lse
    assert "linear_qkv.output" not in kept


def test_hierarchical_levels_of_one_rank_fall_back_as_transformer_engine_does():
    # attn_forward_func_with_cp: a2a+p2p with one a2a rank runs p2p, with one p2p rank a2a
    ring = _cfg(cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes="[1 2]")
    heads = _cfg(cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes="[2 1]")
    assert cp.layer_attention(ring, 0) == cp.CpAttention("p2p", 1, 2)
    assert cp.layer_attention(heads, 0) == cp.CpAttention("a2a", 2, 1)
    assert layer.layer_saved_bytes(ring, A100) == layer.layer_saved_bytes(_cfg(), A100)


def test_one_comm_type_per_layer_gives_each_layer_its_own():
    # --cp-comm-type p2p p2p a2a ... (one per layer): layer_number - 1 picks it (transformer_layer.py)
    types = ["p2p"] * 6 + ["a2a"] * 6
    c = _cfg(cp_comm_type=types)
    assert c.parallel.cp_comm_type == " ".join(types)
    p2p, a2a = _cfg(), _cfg(cp_comm_type="a2a")
    # stage 0 holds layers 0-5 (p2p), stage 1 layers 6-11 (a2a)
    assert (model_chunks(c, 0)[0].first_layer, model_chunks(c, 1)[0].first_layer) == (0, 6)
    assert chunk_bytes(c, A100, 6, 0).stored == chunk_bytes(p2p, A100, 6).stored
    assert chunk_bytes(c, A100, 6, 6).stored == chunk_bytes(a2a, A100, 6).stored
    assert mg.stage_peak(c, 1, A100).peak_allocated_bytes == mg.stage_peak(a2a, 1, A100).peak_allocated_bytes


def test_the_ring_holds_every_step_until_its_forward_ends():
    # cp 4 on the ring's last rank: 4 K/V buffers (one kept), 4 full per-step outputs and 4
    # softmax_lse beside the kept ones; flash's k and v copies, linear_qkv's output held by the caller.
    c = _cfg(context_parallel_size=4, tensor_model_parallel_size=1, sequence_parallel=None)
    work = cp.attention_forward_bytes(c, "flash", cp.layer_attention(c, 0))
    q, kv, lse = 2 * 1024 * 512, 2 * 1024 * 512 * 2, 4 * 1024 * 8
    assert work == {"linear_qkv.output": 3 * q, "core_attention.key_bshd": q, "core_attention.value_bshd": q,
                    "core_attention.kv_ring_buffers": 3 * kv, "core_attention.outputs_per_step": 4 * q,
                    "core_attention.softmax_lse_per_step": 4 * lse}
    # backward: dq_buffer, two [2, K/V] ring buffers, the diagonal step's dq, dk, dv
    back = cp.attention_backward_bytes(c, "flash", cp.layer_attention(c, 0))
    assert sum(back.values()) == q + 4 * kv + q + kv
    assert layer.layer_forward_bytes(c, A100) == sum(work.values())
    assert layer.layer_forward_bytes(_cfg(context_parallel_size=1), A100) == 0


def test_the_distributed_optimizer_shards_over_dp_times_cp():
    c = _cfg(use_distributed_optimizer=True)
    per = optimizer.bytes_per_parameter(c)
    assert cp.optimizer_shards(c) == 2 * 2
    assert per["master weights"] == 4 / 4 and per["Adam moments"] == 8 / 4
    # without it every rank holds the whole state, whatever cp
    assert optimizer.bytes_per_parameter(_cfg())["master weights"] == 4


def test_estimate_shows_context_parallels_terms():
    result = invoke("estimate", "-w", "llama3-8b", "--framework", "megatron", "--cp", "4", "--tp", "2",
                    "--seq-length", "65536", "--gpu", "h100", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    part = report["context_parallel"]
    assert (part["context_parallel_size"], part["rank_tokens"]) == (4, 16384)
    (attention,) = part["attention"]
    assert (attention["cp_comm_type"], attention["kv_ranks"], attention["layers"]) == ("p2p", 4, 32)
    # fused on H100 with RoPE: q (RoPE's), K/V received, lse, output on one of 2 tp ranks
    assert attention["kept_bytes"]["core_attention.kv_received"] == 2 * 16384 * 2 * 8 * 128 / 2
    assert "context parallel 4 (p2p)" in report["paper"]["differences"][0]
