"""Megatron's gradient-accumulation fusion (`backends.main_grad_linear`): the linears' weight
gradients accumulated into the fp32 main gradients inside their matmul. On a CPU it runs only when
asked (`fused_devices=("cpu",)`; by default the CPU keeps autograd's gradient and the hook's add):
the main gradients equal the unfused path's to rounding, under recompute too, no gradient of a fused
weight is ever made, and each parameter is ready once per backward, as the buckets need."""

import pytest
import torch
from helpers import config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from recompute_bench.backends.main_grad_linear import MainGradLinear, fusable_weights
from recompute_bench.config.schema import RecomputeConfig
from recompute_bench.measure.layout import DTYPES
from recompute_bench.measure.optimizer import MainGrads, make_optimizer
from recompute_bench.measure.step import synthetic_batches
from recompute_bench.models.dense.layers import build_model
from recompute_bench.recompute.apply import apply_recompute

CPU = torch.device("cpu")
NO_DROPOUT = ["model.hidden_dropout=0", "model.attention_dropout=0"]


class _Made(TorchDispatchMode):
    """Every new tensor an op makes during the backward whose shape is one of `shapes` in `dtype`
    (views and in-place results of the weights and the main-gradient buffer are not new)."""

    def __init__(self, shapes, dtype, owned):
        super().__init__()
        self.shapes, self.dtype, self.made = set(shapes), dtype, []
        self.owned = {t.untyped_storage()._cdata for t in owned}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and tuple(t.shape) in self.shapes and t.dtype == self.dtype
                    and t.untyped_storage()._cdata not in self.owned):
                self.made.append(str(func))
        return out


def _micro_batches(precision, fused, recompute=None, **sets):
    cfg = config(training__precision=precision, sets=NO_DROPOUT, training__seq_length=32,
                 training__micro_batch_size=1, training__global_batch_size=2, **sets)
    model = build_model(cfg.model, 1, CPU, DTYPES[precision])
    if recompute is not None:
        model = apply_recompute(model, recompute)
    model.train()
    optimizer = make_optimizer(model, precision, fused_devices=("cpu",) if fused else ())
    ready = []
    optimizer.grads.ready = lambda p: ready.append(id(p))
    fused_ids = fusable_weights(model, ("cpu",))
    # the word embedding's gradient is made (by the embedding's backward), tied to the output layer or not
    others = {tuple(p.shape) for p in model.parameters() if id(p) not in fused_ids} | {tuple(model.word_embeddings.weight.shape)}
    shapes = {tuple(p.shape) for p in model.parameters() if id(p) in fused_ids} - others
    made = _Made(shapes, DTYPES[precision], [*model.parameters(), optimizer.grads.data])
    for tokens in synthetic_batches(cfg, CPU):
        loss = model(tokens[:, :-1], tokens[:, 1:]) / 2
        with made:
            loss.backward()
    grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    return model, grads, ready, made.made, fused_ids


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_main_gradients_equal_the_unfused_ones_to_rounding(precision):
    model, fused, ready_f, made_f, ids = _micro_batches(precision, True)
    other, plain, ready_p, made_p, _ = _micro_batches(precision, False)
    linears = [m for m in model.modules() if isinstance(m, MainGradLinear)]
    assert len(ids) == len(linears) > 4  # every linear's weight: QKV, projection, fc1, fc2, output layer
    tol = {"fp32": 1e-5, "bf16": 2e-2}[precision]  # bf16: the unfused gradient is rounded to bf16 first
    for n in plain:
        torch.testing.assert_close(fused[n], plain[n], rtol=tol, atol=tol * max(plain[n].abs().max().item(), 1e-3))
    # each parameter ready once per backward (2 micro-batches), fused or not, as the buckets need
    assert sorted(ready_f) == sorted([id(p) for p in model.parameters()] * 2)
    assert sorted(ready_p) == sorted([id(p) for p in other.parameters()] * 2)
    # the unfused path makes each linear weight's gradient (mm) and adds it; the fused path makes none
    assert len(made_p) >= 2 * len(ids) and made_f == []


def test_under_recompute_the_fused_gradients_follow_the_recomputed_forward():
    full = RecomputeConfig(granularity="full", method="uniform", num_layers=1)
    _, fused, _, made, _ = _micro_batches("fp32", True, full)
    _, plain, _, _, _ = _micro_batches("fp32", False, full)
    _, none, _, _, _ = _micro_batches("fp32", False)
    assert made == []
    for n in plain:
        torch.testing.assert_close(fused[n], plain[n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fused[n], none[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tied", [True, False])
def test_an_output_layer_tied_or_not_gets_its_gradient(tied):
    # tied: the output layer's matmul accumulates into the shared main gradient, the hook adds the embedding's
    model, fused, ready, made, ids = _micro_batches("fp32", True, model__share_embeddings_and_output_weights=tied)
    _, plain, _, _, _ = _micro_batches("fp32", False, model__share_embeddings_and_output_weights=tied)
    assert (model.output_layer.weight is model.word_embeddings.weight) == tied and id(model.output_layer.weight) in ids
    for n in plain:
        torch.testing.assert_close(fused[n], plain[n], rtol=1e-5, atol=1e-6)
    assert sorted(ready) == sorted([id(p) for p in model.parameters()] * 2) and made == []


def test_the_cpu_keeps_the_unfused_path_by_default():
    cfg = config()
    model = build_model(cfg.model, 1, CPU, torch.float32)
    assert fusable_weights(model) == set() and len(fusable_weights(model, ("cpu",))) > 0
    grads = MainGrads(list(model.parameters()))  # no fused set: every weight through autograd and the hook
    assert not any(p.fuse_wgrad for p in grads.params)
