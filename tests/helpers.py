"""Helpers shared by the tests: small configs, a direct measurement of saved bytes and FLOPs, the
bytes a rank holds read from its live objects, hand-made result records and golden files, the CLI
in-process. Test modules import from here, never from each other (`conftest.py` holds only the
fixture that keeps every non-GPU test on the CPU)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner

from recompute_bench.cli.app import app, normalize_argv
from recompute_bench.gate.golden import golden_row, write_golden
from recompute_bench.launch.torchrun import Launch, check_launch, run_ranks
from recompute_bench.measure.layout import DTYPES, SingleRank
from recompute_bench.measure.point import run_point
from recompute_bench.measure.probe import SavedTensorProbe
from recompute_bench.measure.record import SCHEMA
from recompute_bench.measure.step import synthetic_batches
from recompute_bench.models import spec_for
from recompute_bench.models.dense.layers import build_model
from recompute_bench.recompute.apply import apply_recompute
from recompute_bench.results.rows import record_row
from recompute_bench.workload import resolve

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


def rank_script(script: str, out: Path, *args: str, nproc: int = 2, timeout: float = 300) -> list[dict]:
    """Run tests/<script> on `nproc` gloo ranks in one torchrun launch (each rank writes
    out/rank<r>.json) and return what each rank wrote; the launch's output tail on failure."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here)])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(here / script), str(out), *args],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def invoke(*args: str):
    """Run the CLI in-process the way `main()` does (argv normalised first)."""
    return CliRunner().invoke(app, normalize_argv(list(args)))


def measure(cfg, **kwargs) -> dict:
    """`run_point` on the CPU, whatever this machine has."""
    return run_point(cfg, device=CPU, **kwargs)


# Multi-rank runs: no dropout (each rank draws its own masks), fp32 (no 16-bit rounding of the
# all-reduce), seq 32, one measured step.
RANK_SETS = ["model.hidden_dropout=0", "model.attention_dropout=0", "training.precision=fp32",
        "training.seq_length=32", "training.warmup_steps=0", "training.measured_steps=1"]
# The losses of the first step (same weights, same tokens) and of the second (after one update
# from the all-reduced gradients) agree to fp32 rounding: only the order in which the micro-batch
# losses and gradients are summed differs, a few ulps of a value near 6.
LOSS_RTOL = 1e-6

# Shrunken layers of the presets: a few layers, small hidden size and sequence, one micro-batch per step.
SHRUNK = {
    "tiny": {"training.global_batch_size": 2},
    "llama3-8b": {"model.num_layers": 3, "model.hidden_size": 64, "model.num_attention_heads": 8,
                  "model.num_query_groups": 2, "model.ffn_hidden_size": 160, "model.vocab_size": 256,
                  "training.seq_length": 32, "training.micro_batch_size": 2, "training.global_batch_size": 2},
    "gpt3-175b": {"model.num_layers": 3, "model.hidden_size": 64, "model.num_attention_heads": 4,
                  "model.ffn_hidden_size": 256, "model.vocab_size": 512, "model.max_position_embeddings": 64,
                  "training.seq_length": 32, "training.micro_batch_size": 2, "training.global_batch_size": 2},
}

def shrunk(workload, **overrides):
    return config(workload, **{k.replace(".", "__"): v for k, v in {**SHRUNK[workload], **overrides}.items()})


def probe_step(cfg, count_flops=False, backward=False):
    """One probe step as `run` takes it (first micro-batch of the step's token tensor): (activation
    bytes, bytes per layer, FLOPs of forward + backward, bytes saved during backward, i.e. by full
    recompute's re-run forward)."""
    model = apply_recompute(build_model(cfg.model, cfg.training.seed, "cpu", DTYPES[cfg.training.precision]),
                            cfg.recompute).train()
    tokens = synthetic_batches(cfg, torch.device("cpu"))[0]
    probe = SavedTensorProbe(model)
    again: dict[int, torch.UntypedStorage] = {}  # held, so every storage saved in backward is counted

    def keep(t):
        if t.untyped_storage()._cdata not in probe.excluded:
            again.setdefault(t.untyped_storage()._cdata, t.untyped_storage())
        return t

    torch.manual_seed(0)
    with FlopCounterMode(display=False) if count_flops else contextlib.nullcontext() as counter:
        with probe.watch():
            loss = model(tokens[:, :-1], tokens[:, 1:])
        total, layers = probe.bytes()
        if backward or count_flops:
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                loss.backward()
    recomputed = sum(s.nbytes() for s in again.values())
    return total, layers / cfg.model.num_layers, counter.get_total_flops() if count_flops else None, recomputed


# ----- hand-made result records and golden files (no measurement) ---------------------------

CPU_ENV = ("cpu", "2.13.0+cpu")
H100_ENV = ("NVIDIA H100 80GB HBM3", "2.13.0+cu128")
BASE_METRICS = {"step_time_s": 0.5, "tflops_per_gpu": 100.0, "peak_allocated_bytes": 50 * 2**30,
                "peak_reserved_bytes": 60 * 2**30, "activation_bytes": 10**9, "measured_flops_per_step": 4 * 10**15,
                "hardware_flops_per_step": 4 * 10**15, "model_flops_per_step": 3 * 10**15,
                "num_parameters": 10**9, "loss": 6.0}


def record(modules=None, full=None, *, status="ok", device=H100_ENV, name=None, sets=(), failure_rank=0, **metrics):
    """A result record of tiny: selective `modules`, full `(method, N)`, or no recompute."""
    overrides = {}
    if modules:
        overrides = {"recompute__granularity": "selective", "recompute__modules": list(modules)}
    elif full:
        overrides = {"recompute__granularity": "full", "recompute__method": full[0], "recompute__num_layers": full[1]}
    cfg = config("tiny", sets=sets, **overrides)
    values = {**BASE_METRICS, **metrics}
    if device[0] == "cpu":
        values.update(peak_allocated_bytes=None, peak_reserved_bytes=None)
    failure = None
    if status != "ok":
        failure = {"rank": failure_rank, "step": 0, "phase": "backward", "message": f"{status} for the test"}
        for key in ("tflops_per_gpu", "step_time_s", "activation_bytes", "measured_flops_per_step", "loss"):
            values[key] = None
    return {"schema": SCHEMA, **cfg.record_fields(),
            "env": {"device": "cuda" if device[0] != "cpu" else "cpu", "device_name": device[0],
                    "torch_version": device[1], "package_version": "0.1.0", "git_sha": "abc", "hostname": "h",
                    "time": "2025-01-01T00:00:00+00:00"},
            "status": status, "failure": failure,
            "ranks": [{"rank": 0, "status": status, "failure": failure, "nvml_total_bytes": 80 * 2**30
                       if device[0] != "cpu" else None}],
            "metrics": values, "point": {"name": name, "index": 0, "run_id": "r1"} if name else None}


def write_results(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_golden_of(path: Path, records: list[dict], tolerance: dict[int, str] | None = None) -> Path:
    """A golden CSV holding these records (tolerance: row index -> tolerance column)."""
    rows = [golden_row(record_row(r), (tolerance or {}).get(i, "")) for i, r in enumerate(records)]
    write_golden(path, rows)
    return path


def meta_step_flops(cfg, kernel=None):
    """FlopCounterMode over one forward and backward of cfg's model on the meta device: every op
    runs its real dispatch and flop formula, no data. `kernel` ("flash", "efficient" or "cudnn")
    makes the model's sdpa call that CUDA kernel; otherwise sdpa runs its math fallback, as it does
    on meta tensors."""
    model = apply_recompute(build_model(cfg.model, 0, "meta", DTYPES[cfg.training.precision]), cfg.recompute).train()
    tokens = torch.zeros(cfg.training.micro_batch_size, cfg.training.seq_length + 1, dtype=torch.long, device="meta")
    aten = torch.ops.aten

    def fused(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert attn_mask is None and scale is None
        if kernel == "flash":
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal)[0]
        if kernel == "efficient":
            return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, is_causal)[0]
        return aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, dropout_p, is_causal)[0]

    with pytest.MonkeyPatch.context() as patch:
        if kernel:
            patch.setattr(torch.nn.functional, "scaled_dot_product_attention", fused)
        with FlopCounterMode(display=False) as counter:
            model(tokens[:, :-1], tokens[:, 1:]).backward()
    return counter.get_total_flops()


def launch_ranks(tmp_path: Path, data_parallel: str = "ddp", sets=(), watchdog_s: float = 60.0,
                 timeout_s: float = 180.0, nproc_per_node: int = 2) -> dict:
    """One point of the tiny model (`RANK_SETS`, then `sets`) measured over `nproc_per_node` ranks: its record."""
    launch = Launch(nproc_per_node=nproc_per_node, data_parallel=data_parallel, watchdog_s=watchdog_s)
    cfg = check_launch(config(sets=[*RANK_SETS, *sets]), launch, "cpu")
    return run_ranks(cfg, launch, name="t", pieces=tmp_path / "pieces", log_path=tmp_path / "t.log", timeout_s=timeout_s)


def processes_naming(path: Path) -> list[int]:
    """Processes whose command line names `path` (a run's workers, a point's torchrun agent and ranks)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(path) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


# A dense model's five kinds of setting as --set lines: none, each selective module, full recompute.
SETTINGS = {"none": [], "core_attn": ["recompute.granularity=selective", 'recompute.modules=["core_attn"]'],
            "layernorm": ["recompute.granularity=selective", 'recompute.modules=["layernorm"]'],
            "mlp": ["recompute.granularity=selective", 'recompute.modules=["mlp"]'],
            "full": ["recompute.granularity=full", "recompute.method=uniform", "recompute.num_layers=1"]}


def saved_step(cfg, device: str = "cpu"):
    """(loss, measured saved bytes, gradients by name, model) of one seeded micro-batch of 32 tokens of
    the model `run` builds for cfg (a vocabulary of at least 256)."""
    model = SingleRank().build(cfg, torch.device(device)).train()
    tokens = torch.randint(0, 256, (1, 33), generator=torch.Generator().manual_seed(0)).to(device)
    probe = SavedTensorProbe(model)
    with probe.watch():
        loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.item(), probe.bytes()[0], {n: p.grad for n, p in model.named_parameters()}, model
