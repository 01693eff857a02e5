"""What tests/test_sharded_build.py runs on each of 2 ranks under torchrun (CPU, gloo), in one launch:
activation offload under tensor parallelism and FSDP, measured with `run_point` and on one micro-batch,
and each layout's weights against one rank's build. Writes OUT/rank<N>.json."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from helpers import config
from recompute_bench.measure.data_parallel import DataParallel
from recompute_bench.measure.distributed import init_process_group
from recompute_bench.backends.pytorch import local
from recompute_bench.measure.layout import SingleRank
from recompute_bench.measure.point import run_point
from recompute_bench.measure.probe import SavedTensorProbe
from recompute_bench.models import spec_for

CPU = torch.device("cpu")
# fp32, no dropout (tensor-parallel ranks draw their own masks), 2 layers, seq 32.
BASE = ["model.hidden_dropout=0", "model.attention_dropout=0", "training.precision=fp32", "training.seq_length=32",
        "training.warmup_steps=0", "training.measured_steps=1", "model.num_layers=2"]
TP2 = ["parallel.tensor_model_parallel_size=2"]
OFFLOAD = ["recompute.activation_offload_layers=1"]
LLAMA = ["model.normalization=RMSNorm", "model.activation=swiglu", "model.position_embedding_type=rope",
         "model.num_query_groups=2", "model.add_bias_linear=false", "model.share_embeddings_and_output_weights=false"]


def _tokens(cfg) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, cfg.model.vocab_size, (cfg.training.micro_batch_size, cfg.training.seq_length + 1), generator=g)


def _offloaded_micro_batch(sets: list[str], kind: str) -> dict:
    """One micro-batch under `kind` with layer 0 offloaded: the bytes the offloader copied, the
    saved-tensor probe's per-layer bytes without offload, and the loss and local gradients of both."""
    out = {}
    for name, extra in (("kept", []), ("offloaded", OFFLOAD)):
        cfg = config(sets=[*BASE, *sets, *extra])
        layout = DataParallel(kind, cfg, "cpu")
        model = layout.build(cfg, CPU)
        model.train()
        tokens = _tokens(cfg)
        probe = SavedTensorProbe(model)
        with probe.watch():
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads = [local(p.grad).clone() for p in model.parameters()]
        out[name] = {"loss": loss.item(), "grads": grads, "layer_bytes": probe.bytes()[1] / cfg.model.num_layers,
                     "packed": model.activation_offloader.packed_bytes(0) if extra else None}
    kept, off = out["kept"], out["offloaded"]
    return {"packed": off["packed"], "layer_bytes": kept["layer_bytes"], "loss_equal": kept["loss"] == off["loss"],
            "grads_equal": all(torch.equal(a, b) for a, b in zip(kept["grads"], off["grads"]))}


def _weights_equal_one_ranks(sets: list[str], kind: str) -> dict:
    """Every parameter of `kind`'s build, gathered into the single-rank layout, against one rank's
    whole build from the same seed; and this rank's parameter bytes."""
    cfg = config(sets=[*BASE, *sets])
    layout = DataParallel(kind, cfg, "cpu")
    model = layout.build(cfg, CPU)
    alone = dict(SingleRank().build(cfg, CPU).named_parameters())
    equal, worst = True, None
    for name, p in model.named_parameters():
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        if layout.tensor:
            whole = layout.tensor.whole(name, whole, cfg)
        if not torch.equal(whole, alone[name.removeprefix("module.")]):
            equal, worst = False, name
    return {"equal": equal, "worst": worst, "local_bytes": sum(local(p).nbytes for p in model.parameters()),
            "whole_bytes": sum(p.nbytes for p in alone.values())}


def _build_peak(sets: list[str]) -> dict:
    """How far this process's peak resident memory rises while the layout builds a model of about
    600 MB of fp32 weights split over tp 2 (the first build of the process: the peak is a high-water
    mark), with the model's whole and this rank's parameter bytes."""
    cfg = config(sets=[*BASE, *sets, "model.hidden_size=1024", "model.num_attention_heads=16",
                       "model.ffn_hidden_size=4096", "model.num_layers=12"])
    whole = sum(p.nbytes for p in spec_for(cfg.model).build(cfg, "meta", torch.float32).parameters())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = DataParallel("ddp", cfg, "cpu").build(cfg, CPU)
    rise = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"rise": rise, "whole": whole, "local": sum(local(p).nbytes for p in model.parameters()),
            "largest": max(p.nbytes for p in spec_for(cfg.model).build(cfg, "meta", torch.float32).parameters())}


def main(out: Path) -> None:
    init_process_group(CPU, 120.0)
    results = {"build peak tp": _build_peak(TP2)}  # first: the peak resident memory is a high-water mark
    # Offload under tensor parallelism through run_point (a DTensor's saved wrappers held no data to copy).
    cfg = config(sets=[*BASE, *TP2, *OFFLOAD])
    record = run_point(cfg, device=CPU, layout=DataParallel("ddp", cfg, "cpu"))
    alone = run_point(config(sets=[*BASE, *TP2]), device=CPU, layout=DataParallel("ddp", cfg, "cpu"))
    results["tp offload run"] = {"status": record["ranks"][0]["status"], "failure": record["ranks"][0]["failure"],
                                 "losses": record["ranks"][0]["losses"], "kept_losses": alone["ranks"][0]["losses"]}
    results["tp offload"] = _offloaded_micro_batch(TP2, "ddp")
    # RoPE, no position embedding added: layer 0's norm saves the embedding's all-reduced output as it
    # comes, an AsyncCollectiveTensor (another wrapper that holds no data itself).
    results["tp offload llama"] = _offloaded_micro_batch([*TP2, *LLAMA], "ddp")
    results["fsdp offload"] = _offloaded_micro_batch([], "fsdp")
    results["weights tp"] = _weights_equal_one_ranks([*TP2, *LLAMA], "ddp")
    results["weights tp sp"] = _weights_equal_one_ranks([*TP2, *LLAMA, "parallel.sequence_parallel=true"], "ddp")
    results["weights fsdp"] = _weights_equal_one_ranks(LLAMA, "fsdp")
    results["weights fsdp tied"] = _weights_equal_one_ranks([], "fsdp")
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
