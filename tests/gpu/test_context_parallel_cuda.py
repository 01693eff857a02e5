"""Context parallel on CUDA: the per-block flash kernel on one GPU against torch's attention, and a
point over two GPUs (NCCL) with this harness's attention (grouped-query heads) and with torch's own
context_parallel ring (one key/value head per query head). Skipped without the GPUs."""

import json

import pytest
import torch
import torch.nn.functional as F

from helpers import SMALL_LLAMA, invoke

from recompute_bench.models.cp_check import check_kernel, split_blocks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_the_cuda_flash_kernel_per_block_gives_torchs_attention(comm):
    torch.manual_seed(0)
    b, heads, groups, s, d = 2, 8, 2, 256, 64
    q = torch.randn(b, s, heads, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_(True)
    k, v = (torch.randn(b, s, groups, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_(True)
            for _ in range(2))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grad = torch.randn_like(whole)
    whole.backward(grad)
    out, dq, dk, dv = split_blocks("flash", comm, 2, q.detach(), k.detach(), v.detach(), grad)
    for got, want in ((out, whole), (dq, q.grad), (dk, k.grad), (dv, v.grad)):  # bf16 rounding of other sums
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), (got - want).abs().max()


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_the_device_check_passes_the_flash_blocks_on_cuda(comm):
    result = check_kernel("flash", comm, 2, 8, 2, 64, torch.bfloat16, "cuda")
    assert result["passed"], result


def _run(tmp_path, *args: str) -> dict:
    result = invoke("run", "--nproc-per-node", "2", "--cp", "2", "--results", str(tmp_path / "r.jsonl"),
                    "--set", "training.warmup_steps=1", "--set", "training.measured_steps=2", *args)
    assert result.exit_code == 0, result.output
    return json.loads((tmp_path / "r.jsonl").read_text())


@TWO_GPUS
def test_cp2_on_two_gpus_with_grouped_query_heads_runs_this_harnesss_attention(tmp_path):
    record = _run(tmp_path, "-w", "llama3-8b", *[a for k, v in SMALL_LLAMA.items() for a in ("--set", f"{k}={v}")])
    assert record["env"]["context_parallel_attention"] == "p2p" and record["env"]["attention_kernel"] == "flash"
    assert record["env"]["context_parallel_check"].startswith("p2p flash cp2 bfloat16 on cuda")
    assert [r["status"] for r in record["ranks"]] == ["ok", "ok"]
    assert all(r["peak_allocated_bytes"] > 0 for r in record["ranks"])


@TWO_GPUS
def test_cp2_on_two_gpus_with_one_kv_head_per_query_head_runs_torchs_ring(tmp_path):
    record = _run(tmp_path, "-w", "tiny", "--set", "model.attention_dropout=0", "--set", "model.hidden_dropout=0")
    assert record["env"]["context_parallel_attention"] == "torch_ring"
    assert "not checked here" in record["env"]["context_parallel_check"]
    assert [r["status"] for r in record["ranks"]] == ["ok", "ok"]
