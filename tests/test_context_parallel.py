"""Context parallel, the parts that need no ranks: the sequence split, the attention blocks and their
causal mask offsets, the merge of partial softmaxes, the block kernels against torch's attention on
one process, the estimate's per-rank terms and FLOPs, and bad input (one line, exit 2).
Ranks: tests/test_context_parallel_ranks.py (slow)."""

from __future__ import annotations

import dataclasses
import itertools
import types

import pytest
import torch
import torch.nn.functional as F
from helpers import config, invoke

from recompute_bench.analysis import flops
from recompute_bench.analysis.harness.layer import layer_saved_bytes
from recompute_bench.analysis.harness.rank import optimizer_bytes_per_parameter
from recompute_bench.analysis.harness.stage import activation_bytes, embedding_saved_bytes
from recompute_bench.models.context_parallel import (Block, attention_blocks, causal_key_chunks, fused_blocks, rank_attention_pairs, rank_chunks, rank_positions, rank_ranges)
from recompute_bench.models.cp_attention import BlockKernel, _keep_mask, causal_block_mask, merge
from recompute_bench.models.cp_check import KernelCheckFailed, check_kernel, checked_splits, split_blocks
from recompute_bench.workload import resolved


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_the_split_covers_the_sequence_once_and_balances_causal_work(cp):
    s = 8 * cp
    held = [rank_positions(s, r, cp) for r in range(cp)]
    assert sorted(p for mine in held for p in mine) == list(range(s))
    assert {len(mine) for mine in held} == {s // cp}
    assert len({causal_key_chunks(r, cp) for r in range(cp)}) == 1
    if cp == 2:
        assert rank_chunks(0, 2) == (0, 3) and rank_chunks(1, 2) == (1, 2)
        assert rank_ranges(16, 1, 2) == [(4, 8), (8, 12)]


def causal_mask_rows(block: Block, n: int) -> list[int]:
    """How many leading keys each query row of `block` keeps under the mask the block kernel applies
    (`models.cp_attention.causal_block_mask`; a "full" block keeps every key)."""
    rows, cols = n * len(block.q_chunks), n * len(block.k_chunks)
    hidden = causal_block_mask(block, n, torch.device("cpu"))
    if hidden is None:
        return [cols] * rows
    kept = (~hidden).sum(1)
    assert torch.equal(hidden, torch.arange(cols).unsqueeze(0) >= kept.unsqueeze(1))  # the kept keys lead each row
    return kept.tolist()


def _kept_pairs(cp: int, comm: str, n: int, fused: bool) -> list[tuple[int, int]]:
    """(query position, key position) of every pair a rank's blocks keep, over all ranks."""
    pairs = []
    for r in range(cp):
        blocks = attention_blocks(r, cp, comm)
        for block in fused_blocks(blocks) if fused else blocks:
            keys = [c * n + i for c in block.k_chunks for i in range(n)]
            queries = [c * n + i for c in block.q_chunks for i in range(n)]
            for q, kept in zip(queries, causal_mask_rows(block, n)):
                pairs += [(q, k) for k in keys[:kept]]
                assert all(k > q for k in keys[kept:])  # what the mask hides lies after the query
    return pairs


@pytest.mark.parametrize("cp, comm, fused", list(itertools.product([2, 3, 4], ["p2p", "all_gather"], [False, True])))
def test_the_blocks_of_all_ranks_keep_each_causal_pair_exactly_once(cp, comm, fused):
    n = 3
    s = 2 * cp * n
    assert sorted(_kept_pairs(cp, comm, n, fused)) == [(q, k) for q in range(s) for k in range(q + 1)]


def test_mask_offsets_and_block_kinds():
    # all_gather, cp 2, rank 0 holds chunks 0 and 3: chunk 3 attends to chunks 0..3, the causal mask
    # offset by 3 chunks; a fused kernel runs that as chunks 0..2 whole and chunk 3 causal.
    blocks = attention_blocks(0, 2, "all_gather")
    assert blocks == [Block((0,), (0,)), Block((3,), (0, 1, 2, 3))]
    assert [b.kind for b in blocks] == ["diagonal", "offset"]
    assert causal_mask_rows(blocks[1], 2) == [7, 8]  # query 6 keeps keys 0..6, query 7 keys 0..7
    assert fused_blocks(blocks)[1:] == [Block((3,), (0, 1, 2)), Block((3,), (3,))]
    # p2p, cp 2: step 0 the rank's own chunks (causal), step 1 the other rank's: rank 1 (chunks 1, 2)
    # sees rank 0's first chunk whole; rank 0 (0, 3) sees rank 1's two chunks from its chunk 3 only.
    assert attention_blocks(1, 2, "p2p") == [Block((1, 2), (1, 2)), Block((1, 2), (0,), 1)]
    assert attention_blocks(0, 2, "p2p") == [Block((0, 3), (0, 3)), Block((3,), (1, 2), 1)]
    assert causal_mask_rows(Block((1, 2), (1, 2)), 2) == [1, 2, 3, 4]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_p2p_gives_every_rank_and_step_the_same_work(cp):
    n = 4
    for r in range(cp):
        blocks = attention_blocks(r, cp, "p2p")
        kept = [sum(causal_mask_rows(b, n)) for b in blocks]
        assert kept[1:] == [2 * n * n] * (cp - 1) and kept[0] == 2 * n * n + n  # the diagonal keeps its own row too
    # Pairs an explicit kernel evaluates over all ranks: the whole rectangles (p2p's diagonal 2n x 2n).
    assert rank_attention_pairs(2 * cp * n, cp, "p2p", False) == cp * (4 * n * n + (cp - 1) * 2 * n * n)
    assert rank_attention_pairs(2 * cp * n, cp, "all_gather", False) == cp * (2 * cp + 1) * n * n


def test_merging_partial_softmaxes_gives_the_softmax_over_their_union():
    torch.manual_seed(0)
    scores, values = torch.randn(3, 5, 12, dtype=torch.float64), torch.randn(3, 12, 4, dtype=torch.float64)
    whole = torch.softmax(scores, -1) @ values
    out = torch.zeros(3, 5, 4, dtype=torch.float32)
    lse = torch.full((3, 5), float("-inf"))
    for keys in (slice(0, 5), slice(5, 7), slice(7, 12)):
        part = scores[..., keys]
        merge(out, lse, torch.softmax(part, -1) @ values[:, keys], part.logsumexp(-1).float())
    assert torch.allclose(out.double(), whole, atol=1e-6)
    assert torch.allclose(lse.double(), scores.logsumexp(-1), atol=1e-6)


@pytest.mark.parametrize("kernel, comm, cp", list(itertools.product(["flash", "sdpa_math"], ["p2p", "all_gather"], [2, 3])))
def test_the_blocks_of_every_rank_give_torchs_causal_attention_and_its_gradients(kernel, comm, cp):
    torch.manual_seed(0)
    b, heads, groups, s, d = 2, 4, 2, 12 * cp, 8  # grouped-query attention: 2 query heads per key/value head
    q = torch.randn(b, heads, s, d, requires_grad=True)
    k, v = (torch.randn(b, groups, s, d, requires_grad=True) for _ in range(2))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grad = torch.randn_like(whole)
    whole.backward(grad)
    out, dq, dk, dv = split_blocks(kernel, comm, cp, q.detach(), k.detach(), v.detach(), grad)
    # fp32 sums in another order (the softmax in blocks, dK and dV summed over blocks)
    for got, want in ((out, whole), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (got - want).abs().max()


def test_the_written_out_kernel_draws_the_same_dropout_masks_in_backward():
    torch.manual_seed(0)
    p, n = 0.25, 6
    q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float32, requires_grad=True) for _ in range(3))
    block = Block((1,), (0,))  # whole: every key before every query
    kernel = BlockKernel("sdpa_math", 0.5, p, n)
    out, lse = kernel.forward(q, k, v, block, 3, 100)
    keep = _keep_mask((1, 2, n, n), p, 103, q.device)  # block 3 of seed 100
    explicit = (torch.softmax(q @ k.transpose(-2, -1) * 0.5, -1) * keep / (1 - p)) @ v
    assert torch.allclose(out, explicit, atol=1e-6)
    grad = torch.randn_like(explicit)
    explicit.backward(grad)
    dq, dk, dv = kernel.backward(grad, q.detach(), k.detach(), v.detach(), out, lse, block, 3, 100)
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


# ----- the estimate -----------------------------------------------------------------------------

def test_a_context_parallel_ranks_layer_keeps_what_one_rank_keeps_of_s_over_cp_tokens_plus_the_lse():
    one = config("tiny", training__seq_length=64, model__attention_dropout=0.0)
    two = config("tiny", training__seq_length=128, model__attention_dropout=0.0, parallel__context_parallel_size=2)
    # One rank's sdpa on a CPU without dropout runs flash, which keeps q, k, v, the output and the
    # log-sum-exp: so does the split's attention, for s / cp tokens each.
    assert layer_saved_bytes(two, (), "cpu") == layer_saved_bytes(one, (), "cpu")
    for modules in (["core_attn"], ["mlp", "layernorm"]):
        assert layer_saved_bytes(two, modules, "cpu") == layer_saved_bytes(one, modules, "cpu")
    # With attention dropout one rank runs sdpa's math fallback (s x s tensors); the split keeps the same
    # five storages with its written-out kernel (masks are drawn again in backward).
    dropped = config("tiny", parallel__context_parallel_size=2)
    saved = layer_saved_bytes(dropped, (), "cpu")
    assert saved["core_attention.logsumexp"] == 4 * 2 * 4 * 64 and not any("softmax" in name for name in saved)
    # Outside the layers: the embedding keeps this rank's copy of the token ids, not a view of the step's.
    assert embedding_saved_bytes(two)["embedding.token_ids"] == 8 * 2 * 64
    assert activation_bytes(two, "cpu")["activation_bytes"] - activation_bytes(one, "cpu")["activation_bytes"] == (
        8 * 2 * 64 - 8 * 2 * 2 * 65)  # the copy in place of the step's whole token tensor (2 micro-batches of s + 1)


def test_model_flops_follow_megatrons_formula_and_hardware_flops_each_variants_blocks():
    base = config("tiny", model__attention_dropout=0.0)
    cp2 = {comm: dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, context_parallel_size=2, cp_comm_type=comm))
           for comm in ("p2p", "all_gather")}
    # Megatron's model FLOPs count causal attention once over the whole sequence: the same under cp.
    assert flops.model_flops_per_step(cp2["p2p"]) == flops.model_flops_per_step(base)
    # Hardware FLOPs: with dropout (the written-out kernel) every block's whole rectangle, for QK^T and
    # PV forward and the backward's three QK-sized and two PV-sized matmuls.
    drop = {comm: resolved(dataclasses.replace(c, model=dataclasses.replace(c.model, attention_dropout=0.1))) for comm, c in cp2.items()}
    b, a, d, n = 4, 4, 16, 32  # the global batch's 4 sequences of 128 = 4 chunks of n
    width = a * d
    for comm, pairs in (("p2p", 2 * (4 * n * n + 2 * n * n)), ("all_gather", 2 * 5 * n * n)):
        attention = b * pairs * (2 * width * 2) + b * pairs * (3 * 2 * width + 2 * 2 * width)
        without = flops.hardware_flops_per_step(resolved(dataclasses.replace(drop[comm], model=dataclasses.replace(drop[comm].model, num_layers=0))), "cpu")
        assert flops.hardware_flops_per_step(drop[comm], "cpu") - without == pytest.approx(
            4 * (attention + _layer_gemm_flops(base, b)))
    # core_attn recompute re-runs each rank's forward blocks once more.
    sel = dataclasses.replace(drop["p2p"], recompute=dataclasses.replace(base.recompute, granularity="selective", modules=["core_attn"]))
    extra = flops.hardware_flops_per_step(sel, "cpu") - flops.hardware_flops_per_step(drop["p2p"], "cpu")
    assert extra == 4 * b * 2 * (4 * n * n + 2 * n * n) * 2 * width * 2


def _layer_gemm_flops(cfg, b: int) -> int:
    """The linears of one tiny layer over b sequences, forward and backward (3 x 2 per multiply-add)."""
    h, f, s = cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.training.seq_length
    return 3 * 2 * b * s * (h * 3 * h + h * h + 2 * h * f)


def test_fsdp_shards_the_optimizer_over_data_and_context_parallel_ranks():
    cfg = config("tiny", parallel__context_parallel_size=2, parallel__data_parallel_size=2,
                 parallel__use_distributed_optimizer=True, training__global_batch_size=4)
    held = {h.name: h.per_parameter for h in optimizer_bytes_per_parameter(cfg)}
    assert held["weights (fp32 shards)"] == 4 / 4 and held["Adam moments (fp32 shards)"] == 8 / 4


def test_estimate_with_context_parallel_prints_every_setting(tmp_path):
    result = invoke("estimate", "-w", "llama3-8b", "--seq-length", "65536", "--set", "model.max_position_embeddings=131072",
                    "--cp", "4", "--json")
    assert result.exit_code == 0, result.output
    import json
    report = json.loads(result.stdout)
    assert report["config"]["parallel"]["context_parallel_size"] == 4
    assert report["setting"]["layer_saved_bytes"]["core_attention.logsumexp"] == 4 * 32 * 65536 // 4


@pytest.mark.parametrize("args, words", [
    (["--cp", "3"], "context parallel 3 splits seq_length 128 into 2 x cp = 6 chunks, which do not divide it; pass "
                    "--seq-length as a multiple of 6 or a smaller --context-parallel-size"),
    (["--cp", "2", "--set", "parallel.cp_comm_type=a2a"], "this harness splits attention over context-parallel ranks with "
                                                          "p2p (a ring of K and V) or all_gather, not a2a"),
    (["--cp", "2", "--attention-backend", "math"], "attention backend math cannot split over context-parallel ranks"),
    (["--cp", "2", "-w", "tiny-moe"], "mixture-of-experts and multi-latent attention under it are not measured yet"),
    (["-w", "llama3-8b", "--seq-length", "16384"], "seq_length 16384 is longer than the 8192 positions of the RoPE "
                                                   "tables (max_position_embeddings); pass --set model.max_position_embeddings=16384"),
])
def test_bad_context_parallel_input_is_one_line_exit_2(tmp_path, args, words):
    for command in ("run", "estimate"):
        extra = ["--device", "cpu", "--results", str(tmp_path / "r.jsonl")] if command == "run" else []
        result = invoke(command, *extra, *args)
        assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "r.jsonl").exists()


def test_a_launch_that_cp_does_not_divide_is_one_line_exit_2(tmp_path):
    result = invoke("run", "--device", "cpu", "--results", str(tmp_path / "r.jsonl"), "--cp", "2", "--nproc-per-node", "3")
    assert result.exit_code == 2, result.output
    assert ("tensor_model_parallel_size 1 x pipeline_model_parallel_size 1 x context_parallel_size 2 does not divide the 3 "
            "rank(s) launched") in " ".join(result.output.split())


def test_plan_over_gpus_answers_the_long_sequence_question_as_the_docs_show_it():
    """docs/context-parallel.md's table is what its command prints now."""
    import re
    import shlex
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "context-parallel.md").read_text()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", doc, re.M | re.S)
    i = next(i for i, b in enumerate(blocks) if b.startswith("recompute-bench plan") and "--gpus" in b)
    result = invoke(*shlex.split(blocks[i].strip())[1:], "--json")
    assert result.exit_code == 0, result.output
    printed = " ".join(result.output.split())
    shown = [row for row in blocks[i + 1].splitlines() if row.startswith(("│", "recommended", "in Megatron"))]
    assert len(shown) == 6  # four layouts, the recommendation, its flags
    for row in shown:
        assert " ".join(row.split()) in printed, row
    import json
    plan = json.loads(result.stdout)
    rows = {r["context_parallel_size"]: r for r in plan["layouts"]}
    assert sorted(rows) == [1, 2, 4, 8] and not rows[1]["fits"] and rows[4]["fits"]
    assert all(r["data_parallel_size"] * cp == 8 for cp, r in rows.items())
    best = min((r for r in rows.values() if r["fits"]), key=lambda r: r["recompute_overhead"])
    assert plan["recommended"]["context_parallel_size"] == best["context_parallel_size"]
    assert all(r["device_bytes_needed"] <= 80 * 2**30 for r in rows.values() if r["fits"])


def test_plan_over_gpus_refuses_a_gpu_count_tp_does_not_divide():
    result = invoke("plan", "-w", "tiny", "--tp", "2", "--gpus", "3", "--memory-gb", "80")
    assert result.exit_code == 2 and "--gpus 3 is not a multiple of tensor x pipeline parallel (2)" in result.stderr


def test_plan_auto_profiles_one_device_and_refuses_cp():
    result = invoke("plan", "--auto", "-w", "tiny", "--memory-gb", "1", "--device", "cpu", "--profile", "--cp", "2")
    assert result.exit_code == 2 and "with --cp > 1 plan with analytical costs (drop --profile)" in result.stderr


def _whole(q, k, v, grad):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    whole.backward(grad)
    return whole.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_the_flash_blocks_hold_when_the_kernel_reads_the_log_sum_exp_by_pointer(monkeypatch, comm):
    # CUDA's flash backward reads the log-sum-exp through its data pointer as a contiguous [b, heads, s]
    # array (flash_api.cpp mha_bwd); the CPU kernel honours strides, which hid a block's strided rows of
    # the merged log-sum-exp from every CPU test. Read it here as CUDA does.
    cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    def by_pointer(dout, q, k, v, out, lse, *args, **kwargs):
        dense = torch.empty(lse.shape).stride()
        return cpu_backward(dout, q, k, v, out, lse.as_strided(lse.shape, dense, lse.storage_offset()), *args, **kwargs)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", by_pointer)
    torch.manual_seed(0)
    b, heads, groups, s, d = 2, 4, 2, 24, 8
    q, k, v = torch.randn(b, heads, s, d), torch.randn(b, groups, s, d), torch.randn(b, groups, s, d)
    grad = torch.randn(b, heads, s, d)
    for got, want in zip(split_blocks("flash", comm, 2, q, k, v, grad), _whole(q, k, v, grad)):
        assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("kernel, comm", list(itertools.product(["flash", "sdpa_math"], ["p2p", "all_gather"])))
def test_the_device_check_passes_a_right_kernel_and_names_what_it_checked(kernel, comm):
    result = check_kernel(kernel, comm, 2, 4, 2, 16, torch.float32, "cpu")
    assert result["passed"] and max(result[t] for t in ("out", "dq", "dk", "dv")) < 1e-5
    split = types.SimpleNamespace(path=comm, ran=(kernel, 4, 2, 16, torch.float32, "cpu"), comm_type=comm,
                                  peers=types.SimpleNamespace(size=2))
    module = torch.nn.Module()
    module.context_parallel = split
    text = checked_splits(module)["context_parallel_check"]
    assert text.startswith(f"{comm} {kernel} cp2 float32 on cpu") and "tolerance 1e-04" in text
    assert checked_splits(torch.nn.Linear(2, 2)) == {}


def test_a_kernel_whose_gradients_are_wrong_on_the_device_fails_the_point(monkeypatch):
    right = BlockKernel._flash_backward  # the reference is the written-out formulas
    monkeypatch.setattr(BlockKernel, "_flash_backward", lambda self, *a: tuple(g * 1.01 for g in right(self, *a)))
    check_kernel.cache_clear()
    try:
        result = check_kernel("flash", "p2p", 2, 4, 2, 16, torch.float32, "cpu")
        assert not result["passed"] and result["out"] < 1e-5 and result["dq"] > 5e-3
        module = torch.nn.Module()
        module.context_parallel = types.SimpleNamespace(path="p2p", ran=("flash", 4, 2, 16, torch.float32, "cpu"),
                                                        comm_type="p2p", peers=types.SimpleNamespace(size=2))
        with pytest.raises(KernelCheckFailed, match=r"p2p, flash kernel\) is wrong on cpu: relative errors out"):
            checked_splits(module)
    finally:
        check_kernel.cache_clear()
