"""The kernels a CUDA run records and what the estimate counts for them; the sharded build and
offload under tensor parallelism on one GPU. Skipped without CUDA.

    PYTHONPATH=. python -m pytest tests/gpu/test_kernels_cuda.py -q
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import config
from recompute_bench.analysis import flops
from recompute_bench.backends import pytorch as backend
from recompute_bench.measure.point import run_point
from recompute_bench.models import DeviceKernels
from recompute_bench.models.attention import FUSED_KERNELS, attention_tiles, causal_pairs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")
FAST = ["training.warmup_steps=1", "training.measured_steps=2"]
# Llama's layer (GQA, RoPE, SwiGLU), 2 layers, head dim 128, s = 1024: longer than every tile.
LLAMA = ["model.num_layers=2", "model.hidden_size=1024", "model.num_attention_heads=8", "model.num_query_groups=2",
         "model.ffn_hidden_size=2048", "model.vocab_size=1024", "training.seq_length=1024",
         "training.global_batch_size=1", *FAST]


def _hidden_tile_flops(cfg, kernel):
    """FlopCounterMode's count minus what the kernel runs: the hidden tiles' pairs, per forward 2
    matmuls, per backward 5, over every query head."""
    m, t = cfg.model, cfg.training
    forward, backward = attention_tiles(kernel, "cuda", m.head_dim, t.seq_length, m.attention_dropout > 0)
    square, per_pair = t.seq_length ** 2, 2 * t.global_batch_size * m.num_attention_heads * m.head_dim
    return m.num_layers * per_pair * (2 * (square - causal_pairs(t.seq_length, *forward))
                                      + 5 * (square - causal_pairs(t.seq_length, *backward)))


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_cuda_records_the_attention_kernel_and_its_flop_counts_agree_with_the_tile_table(precision):
    # bf16: flash (or cuDNN where torch prefers it); fp32 with GQA: the math fallback. FlopCounterMode
    # counts a fused kernel's full square (torch's GQA formulas, or ours on an older torch); the
    # hardware FLOPs skip the hidden tiles; the estimate's bytes are the kernel's. A consistency check
    # only: the hidden tiles come from the same tile table (`attention_tiles`) the hardware FLOPs
    # use, so it shows the two counts agree with each other and with the kernel recorded, not that
    # the kernel launched those tiles.
    cfg = config("llama3-8b", sets=[*LLAMA, f"training.precision={precision}"])
    record = run_point(cfg, device=CUDA)
    assert record["status"] == "ok", record["failure"]
    kernel, m = record["env"]["attention_kernel"], record["metrics"]
    assert kernel == "sdpa_math" if precision == "fp32" else kernel in ("flash", "cudnn")
    hidden = _hidden_tile_flops(cfg, kernel) if kernel in FUSED_KERNELS else 0
    assert m["measured_flops_per_step"] == m["hardware_flops_per_step"] + hidden
    assert m["hardware_flops_per_step"] == flops.hardware_flops_per_step(cfg, DeviceKernels("cuda", kernel))
    # q, k, v, the output and the log-sum-exp; not counted: the kernels' few-byte RNG state tensors
    assert m["estimated_activation_bytes"] == pytest.approx(m["activation_bytes"], rel=1e-3)


def test_grouped_experts_take_the_fast_kernel_in_bf16_on_sm90_and_the_padded_path_otherwise():
    major = torch.cuda.get_device_capability()[0]
    for precision in ("bf16", "fp32"):
        record = run_point(config("tiny-moe", sets=[*FAST, f"training.precision={precision}"]), device=CUDA)
        assert record["status"] == "ok", record["failure"]
        fast = precision == "bf16" and major in (9, 10)
        assert record["env"]["grouped_gemm_path"] == ("grouped_mm" if fast else "padded_bmm")
    if major in (9, 10):  # the fast kernel reads no count on the host: no device sync in a step
        torch.manual_seed(0)
        layer = backend.grouped_linear(8, 64, 128, True).to(CUDA, torch.bfloat16)
        torch.nn.init.normal_(layer.weight, std=0.02)  # built empty, as the GPT's init_weights fills it
        x = torch.randn(96, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
        offsets = torch.tensor([8, 24, 24, 40, 56, 72, 80, 96], device=CUDA, dtype=torch.int32)  # expert 2: no rows
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = layer(x, offsets)
            y.sum().backward()  # an expanded, zero-stride gradient: the layer hands on a contiguous one
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert layer.path == "grouped_mm" and y.float().isfinite().all()
        grad = layer.weight.grad.float()
        assert grad.isfinite().all() and x.grad.float().isfinite().all()
        assert torch.equal(grad[2], torch.zeros_like(grad[2]))  # the empty expert's gradient, written or guarded
        reference = backend.grouped_linear(8, 64, 128, False).to(CUDA, torch.bfloat16)
        reference.weight = torch.nn.Parameter(layer.weight.detach().clone())
        reference(x.detach(), offsets).sum().backward()
        torch.testing.assert_close(grad, reference.weight.grad.float(), rtol=2e-2, atol=2e-2)


SHARDED = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from helpers import config
    from recompute_bench.measure.data_parallel import DataParallel
    from recompute_bench.backends.pytorch import local
    from recompute_bench.measure.probe import SavedTensorProbe

    # rank 0 of a tp 2 group whose peer is torch's fake process group: the build needs no collective,
    # the forward's collectives return at once (values wrong, shapes and memory right)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    cuda = torch.device("cuda", 0)
    torch.cuda.set_device(cuda)
    cfg = config("llama3-8b", sets=["model.num_layers=4", "parallel.tensor_model_parallel_size=2",
                                    "recompute.activation_offload_layers=1", "training.seq_length=1024"])
    layout = DataParallel("ddp", cfg, "cuda")
    torch.cuda.reset_peak_memory_stats(cuda)
    model = layout.build(cfg, cuda)
    weights = sum(local(p).nbytes for p in model.parameters())
    built = {"weights": weights, "peak": torch.cuda.max_memory_allocated(cuda),
             "cached": torch.cuda.memory_reserved(cuda) - torch.cuda.memory_allocated(cuda),
             "largest": max(p.numel() * 4 for p in model.parameters())}
    tokens = torch.randint(0, 1000, (1, cfg.training.seq_length + 1), device=cuda)
    probe = SavedTensorProbe(model)
    with probe.watch():
        loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    torch.cuda.synchronize()
    print(json.dumps({**built, "packed": model.activation_offloader.packed_bytes(0)}))
""")


def test_tensor_parallel_builds_only_its_shards_and_offloads_its_local_activations():
    # One GPU playing rank 0 of tp 2: the build's peak is this rank's bf16 shards plus one whole fp32
    # parameter (the old build allocated the whole fp32 model first), the cache the build leaves is
    # handed back, and offload under tensor parallelism (once a SIGSEGV) copies this rank's activations.
    here = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", SHARDED], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here)])})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["peak"] <= got["weights"] + 2 * got["largest"]
    assert got["cached"] < got["largest"]
    assert got["packed"] > 0
