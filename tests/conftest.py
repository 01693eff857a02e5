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


def fsdp_param_groups(model) -> list:
    """FSDP2's parameter groups of `model` (one per `fully_shard` call), none for other layouts."""
    return [group for module in model.modules() if hasattr(module, "_get_fsdp_state")
            for group in module._get_fsdp_state()._fsdp_param_groups]


def all_gathered(group) -> list[torch.Tensor]:
    """An FSDP2 group's all-gathered weights: each parameter's unsharded tensors and, between the
    all-gather and the copy into them, the flat all-gather output (freed ones have empty storages)."""
    pending = group._all_gather_result
    return [*(t for p in group.fsdp_params for t in getattr(p, "all_gather_outputs", [])),
            *([pending.all_gather_output] if pending is not None else [])]


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors`, 0-dim ones left out (Adam's step counters)."""
    storages = {}
    for t in tensors:
        if t.dim() > 0:
            storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(storages.values())


def held_tensors(model, optimizer) -> list[torch.Tensor]:
    """Every tensor a rank holds for its parameters, read from the live objects: the weights (a
    DTensor by its local tensor: a tensor-parallel or FSDP shard), their gradients and main
    gradients, everything the optimizer reaches through attributes, dicts, lists and tuples (not
    descending into modules), and what FSDP2 keeps per parameter: unsharded gradients and
    all-gathered weights (a freed one has an empty storage)."""
    roots = [list(model.parameters()), optimizer]
    for group in fsdp_param_groups(model):
        roots.append(all_gathered(group))
        roots += [(p.unsharded_accumulated_grad, getattr(p, "_unsharded_param", None)) for p in group.fsdp_params]
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(obj) -> None:
        if id(obj) in seen or isinstance(obj, torch.nn.Module):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(getattr(obj, "_local_tensor", obj))
            # its gradient and tensors hung on it (a parameter's main_grad), not a DTensor's spec
            children = [obj.grad, *(v for v in vars(obj).values() if isinstance(v, torch.Tensor))]
        elif isinstance(obj, dict):
            children = [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set)):
            children = list(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            children = list(vars(obj).values())
        else:
            return
        for child in children:
            walk(child)

    walk(roots)
    return found


def held_bytes(model, optimizer) -> int:
    """Bytes of the distinct storages of `held_tensors`, Adam's 0-dim step counters left out."""
    return storage_bytes(held_tensors(model, optimizer))


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
