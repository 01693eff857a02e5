"""One training step over the step's micro-batches (`Stepper`), and those micro-batches (`synthetic_batches`).

A layout's stepper runs its steps (`measure.pipeline_step.PipelineStepper` through torch's pipeline
schedule); it remembers the step and phase it is in, so a failure can say where, and injects the
point's fault there (`measure.faults`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import torch

from recompute_bench.measure.faults import Fault
from recompute_bench.measure.probe import SavedTensorProbe
from recompute_bench.config.schema import Config


def synthetic_batches(cfg: Config, device: torch.device) -> torch.Tensor:
    """Seeded random tokens, [num_microbatches, micro_batch_size, seq_length + 1]."""
    g = torch.Generator().manual_seed(cfg.training.seed)
    shape = (cfg.num_microbatches, cfg.training.micro_batch_size, cfg.training.seq_length + 1)
    return torch.randint(0, cfg.model.vocab_size, shape, generator=g).to(device)


class Stepper:
    """Runs training steps and remembers where it is, so a failure can say so."""

    def __init__(self, cfg: Config, model: torch.nn.Module, optimizer, batches: torch.Tensor,
                 no_sync: Callable[[], Any] | None = None):
        self.cfg, self.model, self.optimizer, self.batches = cfg, model, optimizer, batches
        self.no_sync = no_sync
        """Around each micro-batch but the last (`layout.no_sync`): its gradients accumulate on the
        rank, and only the last one's backward reduces them over the data-parallel ranks."""
        self.step_index = 0
        self.phase = "setup"
        self.fault = Fault.from_env()

    def check_fault(self, phase: str) -> None:
        """Inject the point's fault if it names this phase of this step (nothing when there is none)."""
        if self.fault is not None:
            self.fault.at(phase, self.step_index)

    def fields(self, step_times_s: list[float]) -> dict[str, Any]:
        """Figures of the measured steps beyond their times (a pipeline's: `measure.pipeline`); none here."""
        return {}

    def step(self, probe: SavedTensorProbe | None = None) -> torch.Tensor:
        """One optimizer step over every micro-batch; returns the mean loss as a 0-dim fp32 tensor
        on the device. Nothing in the step reads a value back to the host (that would wait for the
        device once per micro-batch inside the timed step): read the loss after the step."""
        n = len(self.batches)
        total = torch.zeros((), dtype=torch.float32, device=self.batches.device)
        for i, tokens in enumerate(self.batches):
            with self.no_sync() if self.no_sync and i < n - 1 else nullcontext():
                self.phase = "forward"
                self.check_fault("forward")
                if probe is not None and i == 0:
                    with probe.watch():
                        loss = self.model(tokens[:, :-1], tokens[:, 1:])
                else:
                    loss = self.model(tokens[:, :-1], tokens[:, 1:])
                self.phase = "backward"
                self.check_fault("backward")
                (loss / n).backward()
            total += loss.detach()
        self.phase = "optimizer"
        self.check_fault("optimizer")
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        self.step_index += 1
        return total / n
