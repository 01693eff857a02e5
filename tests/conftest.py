"""Shared helpers: small configs and a direct measurement of saved bytes and FLOPs.

Every test not marked `gpu` runs on the CPU, on any machine (`on_the_cpu`): its 1e-6 and bitwise
comparisons hold in fp32 on a CPU, not under CUDA's TF32, atomics or NCCL. Helpers that measure in
this process pass `CPU`; the processes a test starts (workers, torchrun ranks) see no GPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner

from recompute_bench.cli.app import app, normalize_argv
from recompute_bench.measure.point import SavedTensorProbe, run_point
from recompute_bench.models import spec_for
from recompute_bench.recompute.apply import apply_recompute
from recompute_bench.spec.presets import resolve

CPU = torch.device("cpu")
FAST = ["training.warmup_steps=0", "training.measured_steps=1"]
# A Llama-style layer small enough for a CPU test: RMSNorm, SwiGLU, GQA, RoPE, no biases.
SMALL_LLAMA = {"model.num_layers": 3, "model.hidden_size": 64, "model.num_attention_heads": 8,
               "model.num_query_groups": 2, "model.ffn_hidden_size": 160, "model.vocab_size": 256,
               "training.seq_length": 32, "training.micro_batch_size": 2, "training.global_batch_size": 2}


def config(workload: str = "tiny", sets=(), **overrides):
    """A validated Config; keyword overrides use "section__key" names."""
    cfg, _ = resolve(workload, overrides={k.replace("__", "."): v for k, v in overrides.items()}, sets=list(sets), gpu="cpu")
    return cfg


def probe(cfg, dtype=torch.float32):
    """(activation bytes, bytes inside the layers, forward FLOPs, forward+backward FLOPs) of one micro-batch."""
    model = apply_recompute(spec_for(cfg.model).build(cfg, "cpu", dtype), cfg.recompute).train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.training.micro_batch_size, cfg.training.seq_length + 1), generator=g)
    p = SavedTensorProbe(model)
    torch.manual_seed(0)
    with FlopCounterMode(display=False) as fwd_counter:
        with p.watch():
            loss = model(tokens[:, :-1], tokens[:, 1:])
    total, layers = p.bytes()
    with FlopCounterMode(display=False) as bwd_counter:
        loss.backward()
    fwd = fwd_counter.get_total_flops()
    return total, layers, fwd, fwd + bwd_counter.get_total_flops()


def invoke(*args: str):
    """Run the CLI in-process the way `main()` does (argv normalised first)."""
    return CliRunner().invoke(app, normalize_argv(list(args)))


@pytest.fixture(autouse=True)
def on_the_cpu(request, monkeypatch):
    """Hide every GPU from a test not marked gpu: CUDA_VISIBLE_DEVICES="" reaches the processes it
    starts (a worker's or torchrun rank's torch then sees no CUDA device and takes gloo) and the
    NVML lookups of this process (`launch.devices`), which the CLI's default device follows. CUDA
    may already be initialised in this process by a GPU test, so in-process helpers pass `CPU`."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def measure(cfg, **kwargs) -> dict:
    """`run_point` on the CPU, whatever this machine has."""
    return run_point(cfg, device=CPU, **kwargs)
