"""On CUDA the cross-entropy holds what the estimate says: the 16-bit logits, into which it writes
their gradient, beside one chunk's fp32 working copy (`models.loss_chunk_rows`), not torch's
log-softmax path (2 + 4 + 4 + 4 bytes per logit). Skipped without CUDA."""

import pytest
import torch
import torch.nn.functional as F

from recompute_bench.backends.pytorch import cross_entropy
from recompute_bench.models import loss_chunk_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOKENS, VOCAB = 4096, 32768


def _peak_over_logits(loss_fn, tokens=TOKENS, vocab=VOCAB):
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(vocab, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    x = torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss_fn(x @ weight.t(), labels).backward()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / (tokens * vocab)


def test_the_loss_peaks_at_the_logits_and_one_fp32_chunk():
    chunk = 4 * loss_chunk_rows(TOKENS, VOCAB) / TOKENS  # bytes per logit: 1024 of 4096 tokens, 1.0
    lean = _peak_over_logits(cross_entropy)
    torch_path = _peak_over_logits(lambda logits, y: F.cross_entropy(logits.float(), y))
    # the logits' 2 bytes and the fp32 chunk's in the forward, plus per-token values (under 0.01 a logit);
    # the backward holds less (the logits, now their gradient, and the weight's gradient: 2.03)
    assert 2.0 + chunk <= lean < 2.0 + chunk + 0.05
    assert torch_path > lean + 8


def test_the_chunked_loss_equals_torchs_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = (3 * torch.randn(2, 512, 4096, device="cuda", generator=g)).bfloat16()
    labels = torch.randint(0, 4096, (2, 512), device="cuda", generator=g)
    mine_in = logits.clone().requires_grad_()
    mine = cross_entropy(mine_in * 1, labels, rows=100)
    (grad_mine,) = torch.autograd.grad(mine, mine_in)
    ref_in = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in.float().view(-1, 4096), labels.view(-1))
    (grad_ref,) = torch.autograd.grad(ref, ref_in)
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_mine.float(), grad_ref.float(), rtol=1e-2, atol=1e-6)
