"""How a point is laid out over ranks: `SingleRank`, one rank holding the whole model and batch, and
the methods every layout has (`measure.data_parallel.DataParallel` for DDP and FSDP2 with tensor,
context and expert parallel, `measure.pipeline.PipelineParallel` for pipeline stages).

A layout builds the model this rank trains, its optimizer, its micro-batches, the stepper and probe of
its steps, and says how a per-rank figure becomes the point's (a mean, a sum, the slowest rank).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from recompute_bench.measure.compile import compile_layers
from recompute_bench.measure.float8 import float8_layers
from recompute_bench.measure.optimizer import make_optimizer
from recompute_bench.measure.probe import SavedTensorProbe
from recompute_bench.measure.step import Stepper, synthetic_batches
from recompute_bench.models.dense.layers import GPT, materialize
from recompute_bench.recompute.apply import apply_recompute
from recompute_bench.config.schema import Config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.bfloat16}
"""The torch dtype of each training precision's weights (fp8: bf16 weights, FP8 matrix multiplies)."""


class SingleRank:
    """How a point is laid out over ranks: here one rank holding the whole model and batch.
    `measure.data_parallel` and `measure.pipeline` have the multi-rank layouts, with the same methods."""

    world_size = 1
    rank = 0
    tensor_group = None
    """The tensor-parallel process group (None: no tensor parallelism)."""
    splits = False
    """Whether this rank holds only part of the model's weights (tensor parallel, FSDP)."""

    def build(self, cfg: Config, device: torch.device, dtype: torch.dtype | None = None) -> GPT:
        """The model this rank trains, split over the tensor-parallel group (`split`), recompute
        installed, then sharded (`shard`); weights in `dtype` (default the training precision); with
        `--compile` each layer compiled (`measure.compile`).

        A layout that `splits` the weights does it as torchtitan does: the model is built on the
        meta device, split, given its recompute and sharded there, and only then materialised, so a
        rank allocates and initialises its own shards (the whole model never exists on one rank),
        with the values one rank's build holds (`models.dense.layers.materialize`). On CUDA the cache
        the initialisation leaves (one whole parameter at a time) is handed back, so that the reserved
        peak measures the training, not the build."""
        dtype = dtype or DTYPES[cfg.training.precision]
        spec = cfg.spec
        if self.splits:
            model = float8_layers(spec.build(cfg, "meta", dtype), cfg.training)  # fp8: torchao's linears
            model = apply_recompute(self.split(model), cfg.recompute, self.tensor_group)
            model = materialize(self.shard(model, cfg), device, cfg.training.seed)
        else:
            model = apply_recompute(float8_layers(spec.build(cfg, device, dtype), cfg.training), cfg.recompute,
                                    self.tensor_group)
        if cfg.training.compile:
            compile_layers(model)  # after recompute: its policy runs inside and around the compiled layers
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return model

    def split(self, model: GPT) -> GPT:
        """This rank's part of the whole model: all of it."""
        return model

    def shard(self, model: GPT, cfg: Config) -> GPT:
        """The model with its weights sharded over the data-parallel ranks: not at all here."""
        return model

    def optimizer(self, model: torch.nn.Module, precision: str):
        """The optimizer of `model`'s parameters on this rank."""
        return make_optimizer(model, precision)

    def no_sync(self, model: torch.nn.Module, optimizer) -> AbstractContextManager:
        """Around a micro-batch whose gradients are accumulated without being reduced: one rank
        reduces nothing."""
        return nullcontext()

    def batches(self, cfg: Config, device: torch.device) -> torch.Tensor:
        """This rank's micro-batches of the step."""
        return synthetic_batches(cfg, device)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """A per-rank value averaged over the ranks that hold different data."""
        return value

    def num_parameters(self, model: torch.nn.Module) -> int:
        """The whole model's parameter count (DTensors count their global size)."""
        return sum(p.numel() for p in model.parameters())

    def stepper(self, cfg: Config, model: torch.nn.Module, optimizer, batches: torch.Tensor) -> Stepper:
        """What runs this layout's training steps."""
        return Stepper(cfg, model, optimizer, batches, lambda: self.no_sync(model, optimizer))

    def probe(self, model: torch.nn.Module) -> SavedTensorProbe:
        """What measures the probe step's saved tensors: the first micro-batch's forward."""
        return SavedTensorProbe(model)

    def world_flops(self, local_flops: int) -> int:
        """The step's FLOPs over every rank from this rank's: each rank runs the same share."""
        return local_flops * self.world_size

    def place(self) -> dict[str, Any]:
        """Where this rank sits beyond its number, for its record entry (a pipeline's stage): nothing here."""
        return {}

    def barrier(self) -> None:
        """Wait until every rank gets here: one rank, nothing to wait for."""

    def slowest(self, times: list[float]) -> tuple[list[float], float | None]:
        """(each measured step's time on the slowest rank, the median spread between the slowest and
        the fastest rank): one rank is its own slowest, and has no spread."""
        return times, None
