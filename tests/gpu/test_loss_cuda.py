"""On CUDA the cross-entropy holds what the estimate says: 16-bit logits beside one fp32 buffer (6
bytes per logit at its peak), not torch's log-softmax path (2 + 4 + 4 + 4). Skipped without CUDA."""

import pytest
import torch
import torch.nn.functional as F

from recompute_bench.backends.pytorch import cross_entropy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _peak_over_logits(loss_fn, tokens=4096, vocab=32768):
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


def test_the_loss_peaks_at_six_bytes_per_logit():
    lean = _peak_over_logits(cross_entropy)
    torch_path = _peak_over_logits(lambda logits, y: F.cross_entropy(logits.float(), y))
    # the logits' 2 bytes and the fp32 softmax's 4, plus the weight gradient (under 0.01 bytes a logit)
    assert 6.0 <= lean < 6.2
    assert torch_path > lean + 3.9
