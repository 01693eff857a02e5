"""The measurement's memory, synchronisation, TF32 and offload facts where only a GPU shows them.
Skipped without CUDA."""

import pytest
import torch

from helpers import config
from recompute_bench.measure.layout import DTYPES
from recompute_bench.measure.optimizer import make_optimizer
from recompute_bench.measure.point import run_point
from recompute_bench.measure.probe import SavedTensorProbe
from recompute_bench.measure.step import Stepper, synthetic_batches
from recompute_bench.models.dense.layers import build_model
from recompute_bench.recompute.apply import apply_recompute
from recompute_bench.config.schema import RecomputeConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")
FAST = ["training.warmup_steps=1", "training.measured_steps=2"]
NO_DROPOUT = ["model.hidden_dropout=0", "model.attention_dropout=0"]


def _stepper(precision="bf16", recompute=None, **overrides):
    cfg = config(training__precision=precision, **overrides)
    model = build_model(cfg.model, 1, CUDA, DTYPES[precision]).train()
    if recompute is not None:
        model = apply_recompute(model, recompute)
    return cfg, model, Stepper(cfg, model, make_optimizer(model, precision), synthetic_batches(cfg, CUDA))


def test_after_the_probe_step_the_device_holds_what_any_step_leaves():
    _, _, stepper = _stepper(training__seq_length=128)
    stepper.step(SavedTensorProbe(stepper.model))  # also creates Adam's state
    torch.cuda.synchronize()
    after_probe = torch.cuda.memory_allocated()
    stepper.step()
    torch.cuda.synchronize()
    assert after_probe == torch.cuda.memory_allocated()


def test_a_step_never_synchronises_with_the_host():
    _, _, stepper = _stepper()
    stepper.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        loss = stepper.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert loss.is_cuda and loss.dim() == 0


def test_the_optimizer_step_allocates_nothing_the_size_of_the_parameters():
    # The estimate counts no step temporaries: fused Adam updates the flat buffers in place.
    cfg, model, stepper = _stepper(training__seq_length=64)
    stepper.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    stepper.optimizer.step()  # main gradients are zero here: the kernel runs all the same
    torch.cuda.synchronize()
    temporaries = torch.cuda.max_memory_allocated() - before
    # The caching allocator rounds blocks to 512 bytes: allow that, not a parameter-sized buffer.
    assert temporaries <= 64 * 1024


def test_fp32_runs_on_tf32_and_the_record_says_so():
    before = torch.get_float32_matmul_precision()
    record = run_point(config(sets=FAST, training__precision="fp32"), device=CUDA)
    assert record["status"] == "ok" and record["env"]["tf32"] is True
    assert torch.get_float32_matmul_precision() == before


def test_the_parent_names_the_gpu_torch_names():
    from recompute_bench.launch.devices import visible_gpu_name
    assert visible_gpu_name() == torch.cuda.get_device_name(0)


def _offload_step(offload: int):
    cfg = config(sets=NO_DROPOUT, training__precision="bf16", training__seq_length=128, model__num_layers=4,
                 model__attention_backend="math")
    model = apply_recompute(build_model(cfg.model, 1, CUDA, torch.bfloat16),
                            RecomputeConfig(activation_offload_layers=offload)).train()
    tokens = synthetic_batches(cfg, CUDA)[0]
    probe = SavedTensorProbe(model)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with probe.watch():
        loss = model(tokens[:, :-1], tokens[:, 1:])
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # lets the allocator retire blocks whose side-stream copies are done
    held = torch.cuda.memory_allocated() - start
    loss.backward()
    torch.cuda.synchronize()
    return model, loss, probe.bytes(), held


def test_offload_frees_the_device_of_exactly_the_activations_and_changes_nothing():
    base, loss0, (total0, layers0), held0 = _offload_step(0)
    model, loss2, (total2, layers2), held2 = _offload_step(2)
    per_layer = layers0 // 4
    offloader = model.activation_offloader
    assert [offloader.packed_bytes(i) for i in (0, 1)] == [per_layer, per_layer]
    assert layers2 == layers0 - 2 * per_layer  # the probe sees only what stays on the device
    assert held0 - held2 >= 2 * per_layer * 0.9  # allocator rounding aside, the device let go of them
    torch.testing.assert_close(loss2, loss0, rtol=0, atol=0)  # the forward runs the same kernels
    # CUDA's embedding backward accumulates with atomics, so two runs may differ in the last bf16 bit.
    for a, b in zip(base.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad)


def test_offload_run_point_records_device_bytes_and_time():
    record = run_point(config(sets=FAST, recompute__activation_offload_layers=2), device=CUDA)
    none = run_point(config(sets=FAST), device=CUDA)
    assert record["status"] == "ok" and record["metrics"]["step_time_s"] > 0
    assert record["metrics"]["activation_bytes"] < none["metrics"]["activation_bytes"]
    assert record["metrics"]["peak_allocated_bytes"] <= none["metrics"]["peak_allocated_bytes"]
