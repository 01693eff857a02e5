"""The harness's cross-entropy, chunked over tokens: the same loss and gradients as torch's and as
Megatron's whole-logits `_VocabParallelCrossEntropy` (bit for bit in fp32), whatever the chunking,
and the bytes it holds (the gradient, in the logits' own storage, and one fp32 chunk), as the
estimate counts them."""

import weakref

import pytest
import torch
import torch.nn.functional as F
from helpers import config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import recompute_bench.models as models
from recompute_bench.analysis.harness.stage import loss_saved_bytes, loss_workspace_bytes
from recompute_bench.backends.pytorch import cross_entropy


def _logits(dtype, b=2, s=16, v=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(b, s, v, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (b, s), generator=g)
    return logits, labels


def _megatron(logits, labels):
    """Megatron's steps over the whole logits at once (one fp32 softmax kept for backward), the
    harness's previous loss: the reference the chunked one must equal."""

    class WholeLogits(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, target):
            work = x.detach().float().clone()
            work -= work.max(dim=-1).values.unsqueeze(-1)
            picked = work.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            torch.exp(work, out=work)
            total = work.sum(dim=-1)
            work.div_(total.unsqueeze(-1))
            ctx.save_for_backward(work, target)
            return torch.log(total) - picked

        @staticmethod
        def backward(ctx, grad):
            softmax, target = ctx.saved_tensors
            softmax.scatter_add_(-1, target.unsqueeze(-1), torch.full_like(softmax[:, :1], -1.0))
            return softmax.mul_(grad.unsqueeze(-1)), None

    return WholeLogits.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).mean()


def _loss_and_grad(fn, logits, labels, **kw):
    x = logits.detach().clone().requires_grad_()
    loss = fn(x * 1, labels, **kw)  # a non-leaf, as the output layer's logits are (they are overwritten)
    (grad,) = torch.autograd.grad(loss, x)
    return loss, grad


@pytest.mark.parametrize("rows", [None, 1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_same_loss_and_gradient_as_torchs_cross_entropy(dtype, rows):
    logits, labels = _logits(dtype)
    mine, grad_mine = _loss_and_grad(cross_entropy, logits, labels, rows=rows)
    ref, grad_ref = _loss_and_grad(lambda x, y: F.cross_entropy(x.float().view(-1, x.shape[-1]), y.reshape(-1)),
                                   logits, labels)
    tol = {torch.float32: 1e-6, torch.float64: 1e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(mine.float(), ref.float(), rtol=tol, atol=tol)
    assert grad_mine.dtype == dtype
    torch.testing.assert_close(grad_mine.float(), grad_ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_fp32_equals_megatrons_whole_logits_loss_bit_for_bit_whatever_the_chunks(rows):
    logits, labels = _logits(torch.float32)
    mine, grad_mine = _loss_and_grad(cross_entropy, logits, labels, rows=rows)
    ref, grad_ref = _loss_and_grad(_megatron, logits, labels)
    assert torch.equal(mine, ref) and torch.equal(grad_mine, grad_ref)


def test_bf16_equals_megatrons_to_one_rounding_of_the_gradient():
    # The gradient is rounded to bf16 in forward, then scaled by the token's gradient (1/tokens) in
    # backward: bit for bit Megatron's (one rounding of the fp32 product) where 1/tokens is a power of
    # two, within one more bf16 rounding elsewhere. The loss itself is fp32 and equal.
    for s, exact in ((16, True), (15, False)):
        logits, labels = _logits(torch.bfloat16, s=s)
        mine, grad_mine = _loss_and_grad(cross_entropy, logits, labels, rows=7)
        ref, grad_ref = _loss_and_grad(_megatron, logits, labels)
        assert torch.equal(mine, ref)
        if exact:
            assert torch.equal(grad_mine, grad_ref)
        else:
            assert not torch.equal(grad_mine, grad_ref)
            torch.testing.assert_close(grad_mine.float(), grad_ref.float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_it_keeps_only_the_gradient_in_the_logits_own_storage(dtype):
    logits, labels = _logits(dtype)
    out = logits * 1  # a non-leaf, as the output layer's logits are
    kept, grads = [], []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        loss = cross_entropy(out, labels)
    out.register_hook(lambda g: grads.append(g))
    loss.backward()
    assert [(t.dtype, t.numel()) for t in kept] == [(dtype, 2 * 16 * 96)]
    assert kept[0].untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert grads[0].untyped_storage().data_ptr() == out.untyped_storage().data_ptr()


class _LogitSizedPeak(TorchDispatchMode):
    """The most bytes of storages at least one row of logits large that ops create and that are
    alive at once (the logits themselves excluded): the loss's working set beside the logits. The
    per-token tensors (max, sum, target: about 30 bytes a token) are below it."""

    def __init__(self, row_elements: int, logits: torch.Tensor):
        super().__init__()
        self.row, self.live, self.peak = row_elements, {}, 0
        self.logits = logits.untyped_storage()._cdata

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() >= self.row:
                key = t.untyped_storage()._cdata
                if key == self.logits:
                    continue
                refs = self.live.setdefault(key, [t.untyped_storage().nbytes(), []])[1]
                refs.append(weakref.ref(t))
        self.live = {k: v for k, v in self.live.items() if any(r() is not None for r in v[1])}
        self.peak = max(self.peak, sum(v[0] for v in self.live.values()))
        return out


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_what_it_holds_is_what_the_estimate_counts(monkeypatch, precision):
    cfg = config(training__precision=precision)  # tiny: s 128, b 2, vocabulary 512
    tokens, vocab = 128 * 2, cfg.vocab_rows
    monkeypatch.setattr(models, "LOSS_CHUNK_LOGITS", 40 * vocab)  # 40 tokens a chunk: 7 chunks
    assert models.loss_chunk_rows(tokens, vocab) == 40
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    logits, labels = _logits(dtype, b=2, s=128, v=vocab)
    out = logits * 1
    kept = []
    with _LogitSizedPeak(vocab, out) as mode:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            loss = cross_entropy(out, labels)
        (grad,) = torch.autograd.grad(loss, out)  # the loss's backward alone
    assert grad.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    saved = loss_saved_bytes(cfg, "cpu")
    assert sum(t.untyped_storage().nbytes() for t in kept) == saved["loss.logits_gradient"] == out.nbytes
    assert mode.peak == loss_workspace_bytes(cfg) == (4 * 40 * vocab if precision == "bf16" else 0)


def test_the_default_chunk_is_128_mib_of_fp32():
    assert models.loss_chunk_rows(8192, 128256) == 261  # llama3-8b's vocabulary: 32 chunks of seq 8192
    assert models.loss_chunk_rows(256, 512) == 256 and models.loss_chunk_rows(4, 2**26) == 1
    cfg = config("llama3-8b")
    assert loss_workspace_bytes(cfg) == 4 * 261 * 128256
    assert loss_saved_bytes(cfg)["loss.logits_gradient"] == 2 * 8192 * 128256
