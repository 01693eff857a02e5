"""The harness's cross-entropy, worked as Megatron's `_VocabParallelCrossEntropy`: the same loss
and gradients as torch's, and the lean bytes (an fp32 softmax worked in place) it keeps."""

import pytest
import torch
import torch.nn.functional as F
from helpers import config

from recompute_bench.analysis.harness.stage import loss_saved_bytes
from recompute_bench.backends.pytorch import cross_entropy


def _logits(dtype, b=2, s=16, v=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(b, s, v, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (b, s), generator=g)
    return logits, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_same_loss_and_gradient_as_torchs_cross_entropy(dtype):
    logits, labels = _logits(dtype)
    ref_logits = logits.detach().clone().requires_grad_()
    mine = cross_entropy(logits * 1, labels)  # fp32 logits are overwritten, as the output layer's may be
    (grad_mine,) = torch.autograd.grad(mine, logits)
    ref = F.cross_entropy(ref_logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))
    (grad_ref,) = torch.autograd.grad(ref, ref_logits)
    tol = {torch.float32: 1e-6, torch.float64: 1e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(mine.float(), ref.float(), rtol=tol, atol=tol)
    assert grad_mine.dtype == dtype  # autograd casts the fp32 gradient back to the logits' dtype
    torch.testing.assert_close(grad_mine.float(), grad_ref.float(), rtol=tol, atol=tol)


def test_it_keeps_only_the_softmax_and_the_per_token_target():
    logits, labels = _logits(torch.bfloat16, b=2, s=16, v=96)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        loss = cross_entropy(logits, labels)
    sizes = sorted((str(t.dtype), t.numel()) for t in kept)
    tokens = 2 * 16
    assert sizes == sorted([("torch.float32", tokens * 96), ("torch.bool", tokens), ("torch.int64", tokens)])
    loss.backward()


def test_fp32_logits_are_worked_in_place_and_backward_writes_into_the_saved_buffer():
    logits, labels = _logits(torch.float32)
    out = logits * 1.0  # a non-leaf, as the output layer's logits are
    kept, grads = [], []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        loss = cross_entropy(out, labels)
    out.register_hook(lambda g: grads.append(g))
    loss.backward()
    softmax = next(t for t in kept if t.dtype == torch.float32)
    # no fp32 copy: the softmax is the logits' own storage, and the gradient is that same buffer
    assert softmax.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert grads[0].untyped_storage().data_ptr() == softmax.untyped_storage().data_ptr()


def test_the_estimate_names_what_it_keeps():
    cfg = config()  # tiny: s 128, b 2, vocabulary 512
    loss = loss_saved_bytes(cfg)
    tokens = 128 * 2
    assert loss["loss.softmax"] == 4 * tokens * 512
    assert loss["loss.masked_target"] == 8 * tokens and loss["loss.target_mask"] == tokens
