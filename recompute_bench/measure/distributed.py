"""One rank of a multi-rank point: the process group, the layout, this rank's piece of the record.

`launch.rank` (the program torchrun starts on every rank) calls `measure_rank`. It joins the
process group torchrun's rendezvous set up (gloo on CPU, NCCL on CUDA) with a collective time
limit (the watchdog of a rank stuck waiting for a peer that hangs or died), caps the allocator
with `--memory-limit-gb` (`memory.limit_memory`), and measures the point with `measure.point.run_point`
under its layout (`make_layout`): pipeline stages (`measure.pipeline`) or data parallel, DDP or FSDP2
(`measure.data_parallel`). After every step the rank writes its piece of the record (`piece_path`,
through a rename), so a rank killed later still leaves what it had measured; the launcher
(`launch.torchrun`) merges the pieces. `verify_ranks` is `verify` over the same layouts.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import threading

import torch
import torch.distributed as dist

from recompute_bench.measure.data_parallel import DataParallel, gathered_loss_and_grads
from recompute_bench.measure.memory import limit_memory
from recompute_bench.measure.pipeline import PipelineParallel, pipeline_loss_and_grads
from recompute_bench.measure.point import pick_device, run_point
from recompute_bench.config.schema import Config
from recompute_bench.workload import resolved


def init_process_group(device: torch.device, watchdog_s: float) -> None:
    """Join the group torchrun's rendezvous made: NCCL on CUDA, gloo on CPU; a collective that waits
    longer than `watchdog_s` fails instead of hanging (a peer hung, or died mid-collective)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=watchdog_s),
                            device_id=device if device.type == "cuda" else None)


LEAVE_GROUP_S = 30.0
"""How long a rank waits for `destroy_process_group` before it exits without it."""


def leave_group(limit_s: float = LEAVE_GROUP_S) -> bool:
    """`destroy_process_group`, given at most `limit_s` seconds; whether it returned. A rank whose
    peer died or hung may wait on its communicators there (NCCL's abort and destroy can block, and
    torch's own default, TORCH_NCCL_ASYNC_ERROR_HANDLING=3, exists to skip them), so the call runs in
    a thread the rank stops waiting for: a rank always gets to exit with its verdict."""
    if not dist.is_initialized():
        return True
    leaving = threading.Thread(target=dist.destroy_process_group, name="destroy-process-group", daemon=True)
    leaving.start()
    leaving.join(limit_s)
    if leaving.is_alive():
        sys.stderr.write(f"destroy_process_group did not return within {limit_s:g} s; exiting without it\n")
    return not leaving.is_alive()


def rank_device(requested: str | None) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK where CUDA is present (or asked for), else the CPU."""
    kind = requested.split(":")[0] if requested else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind != "cuda":
        return pick_device(kind)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def make_layout(data_parallel: str, cfg: Config, device_type: str) -> DataParallel:
    """The layout of `cfg` over the process group: pipeline stages (`measure.pipeline`) when
    pipeline_model_parallel_size is above 1, else data (and tensor) parallel."""
    if cfg.parallel.pipeline_model_parallel_size > 1:
        return PipelineParallel(data_parallel, cfg, device_type)
    return DataParallel(data_parallel, cfg, device_type)


def measure_rank(cfg: Config, *, data_parallel: str, piece_path, device: str | None = None,
                 peak_tflops: float | None = None, memory_limit_gb: float | None = None,
                 watchdog_s: float = 300.0) -> dict:
    """Measure this rank's share of `cfg`, writing its piece after every step; returns the last piece."""
    from recompute_bench.results.store import write_json_atomic

    dev = rank_device(device)
    limit_memory(dev, memory_limit_gb)
    init_process_group(dev, watchdog_s)
    layout = make_layout(data_parallel, cfg, dev.type)

    def write(metrics: dict, rank_entry: dict, env: dict | None = None) -> dict:
        piece = {"rank": layout.rank, "world_size": layout.world_size, "rank_entry": rank_entry, "metrics": metrics,
                 **({"env": env} if env else {})}
        write_json_atomic(piece_path, piece)
        return piece

    record = run_point(cfg, device=dev, peak_tflops=peak_tflops, layout=layout, progress=write)
    return write(record["metrics"], record["ranks"][0], record["env"])


def verify_ranks(cfg: Config, settings, backends: list[str], device: torch.device, data_parallel: str) -> dict:
    """`verify` over the ranks of the process group: each setting against no recompute under the
    same layout (bitwise on CPU), and that baseline against one rank running every data-parallel
    rank's micro-batch, each seeded alike, gradients averaged (equal to fp32 rounding: only the
    order of the sums differs). Tensor-parallel ranks draw their own dropout masks for their heads
    and sequence shards, so that comparison runs with dropout off under tensor parallelism. Under
    pipeline parallelism every rank runs the step's micro-batches through torch's schedule
    (`measure.pipeline.pipeline_loss_and_grads`); each stage draws its own dropout masks (stage 1's
    layers draw first on their rank, not after stage 0's as on one rank), so that comparison runs
    with dropout off too. Rank 0's result: {"outcomes": [...], "single_rank": [...]}."""
    from recompute_bench.measure.verify import Outcome, max_grad_diff, fp32_with_dropout, loss_and_grads
    from recompute_bench.config.schema import RecomputeConfig

    layout = make_layout(data_parallel, cfg, device.type)
    pipeline = cfg.parallel.pipeline_model_parallel_size > 1
    run = pipeline_loss_and_grads if pipeline else gathered_loss_and_grads
    # one micro-batch per data-parallel rank; the step's micro-batches per replica under a pipeline
    shape = (layout.dp_size, *([cfg.num_microbatches] if pipeline else []), cfg.training.micro_batch_size,
             cfg.training.seq_length + 1)
    outcomes, single = [], []
    for backend in backends:
        run_cfg = fp32_with_dropout(cfg, backend)
        g = torch.Generator().manual_seed(run_cfg.training.seed)
        tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=g).to(device)
        base_loss, base_grads = run(run_cfg, tokens[layout.dp_rank], device, layout)
        alone_cfg, alone_base = run_cfg, (base_loss, base_grads)
        if layout.tensor or layout.context or pipeline:
            alone_cfg = resolved(dataclasses.replace(run_cfg, model=dataclasses.replace(
                run_cfg.model, hidden_dropout=0.0, attention_dropout=0.0)))
            alone_base = run(alone_cfg, tokens[layout.dp_rank], device, layout)
        if layout.rank == 0:
            alone = [loss_and_grads(alone_cfg, RecomputeConfig(), t, device)
                     for t in tokens.reshape(-1, *tokens.shape[-2:])]
            loss = sum(a[0] for a in alone) / len(alone)
            grads = {n: sum(a[1][n] for a in alone) / len(alone) if alone[0][1][n] is not None else None
                     for n in alone[0][1]}
            worst, worst_name = max_grad_diff(grads, alone_base[1])
            single.append(Outcome("none", backend, (loss - alone_base[0]).abs().item(), worst, worst_name).__dict__)
        for setting in settings:
            loss, grads = run(dataclasses.replace(run_cfg, recompute=setting), tokens[layout.dp_rank], device, layout)
            worst, worst_name = max_grad_diff(base_grads, grads)
            outcomes.append(Outcome(setting.label, backend, (loss - base_loss).abs().item(), worst, worst_name).__dict__)
    return {"outcomes": outcomes, "single_rank": single}
