"""A pipeline rank's training steps: torch's schedule over its model chunks (`measure.pipeline`
builds them and the schedule), the tied embedding's gradient summed, the optimizer's step, and the
rank's pipeline figures (schedule and compute seconds, the measured bubble) read once the steps are
over. The step-by-step flow is `measure.step.Stepper`'s; what differs is that one step runs every
micro-batch through the schedule, whose stage methods are wrapped here."""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch
from torch import nn

from recompute_bench.config.schema import Config
from recompute_bench.measure.pipeline_probe import ScheduleProbe
from recompute_bench.measure.step import Stepper
from recompute_bench.measure.timing import cuda_event


class PipelineStepper(Stepper):
    """Training steps through torch's pipeline schedule: every micro-batch of the step in one
    `schedule.step`, then the tied embedding's gradient summed over its two ranks, then the optimizer.
    The stage methods the schedule calls are wrapped to keep the phase (for a failure's record), to
    inject faults, to time the compute (for the measured bubble) and to feed the probe.

    Timing never waits for the device inside the step: a `torch.cuda.synchronize` per action would
    wait for NCCL's P2P streams at every forward and backward and stop the host from launching
    ahead (the measured bubble would be a serialised pipeline's), and under the runtime schedules
    (Interleaved1F1B, the zero-bubble ones, DualPipeV) a rank blocked there while its peer waits for
    its send could wait in a cycle. On CUDA each action and the schedule's whole span are bracketed
    by events on the device's current stream (`timing.cuda_event`), read in `fields` once the steps
    are over (each step ends with the device synchronised: `timing.timed`, or the loss read after a
    step); on a CPU the ops run as they are called, so the host's clock times them."""

    def __init__(self, cfg: Config, model: nn.ModuleList, optimizer, batches: torch.Tensor, layout: Any):
        """`model`: this rank's chunks; `layout`: the `measure.pipeline.PipelineParallel` that built them
        and makes this stepper (its schedule, its ends, the tied embedding's sum)."""
        super().__init__(cfg, model, optimizer, batches)
        self.layout = layout
        self.device = batches.device
        self.schedule, stages = layout.schedule(model, cfg, batches.device)
        self.probe: ScheduleProbe | None = None
        self.spans: list[tuple[Any, list[Any]]] = []
        """Per step: (the schedule's span, this rank's actions: forward, backward, weight pass, loss),
        each a (start, end) pair of CUDA events, or seconds on a CPU; the rest of the span it waited."""
        self._actions: list[Any] = []
        for stage in stages:
            self._wrap(stage)
        self.loss_fn = self.schedule._loss_fn
        self.schedule._loss_fn = self._loss

    def _wrap(self, stage) -> None:
        forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

        def forward_one_chunk(i: int, *args: Any, **kwargs: Any):
            self.phase = "forward"
            self.check_fault("forward")
            probe = self.probe.chunk_forward(stage.stage_index, i) if self.probe else nullcontext()
            with self._timed(), probe:
                return forward(i, *args, **kwargs)

        grads = getattr(self.optimizer, "grads", None)  # the main gradients (not under FSDP)
        params = [p for p in stage.submod.parameters() if p.requires_grad]

        def backward_one_chunk(i: int, *args: Any, **kwargs: Any):
            self.phase = "backward"
            self.check_fault("backward")
            with self._timed():
                return backward(i, *args, **kwargs)

        def backward_weight_one_chunk(i: int, *args: Any, **kwargs: Any):
            with self._timed():
                weight(i, *args, **kwargs)
                if grads is not None:
                    # The weight pass assigns `.grad` (stage_backward_weight) instead of accumulating
                    # it, so no post-accumulate hook moved it into the main gradients: move it here.
                    for p in params:
                        if p.grad is not None:
                            grads._accumulate(p)

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    def _loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self._timed():
            loss = self.loss_fn(output, labels)
        if self.probe:
            self.probe.sample()  # the last stage's saved tensors include the loss's
        return loss

    def _mark(self) -> Any:
        """Now: an event on the device's current stream (CUDA), the host's clock (CPU)."""
        return cuda_event(self.device) if self.device.type == "cuda" else time.perf_counter()

    @contextmanager
    def _timed(self) -> Iterator[None]:
        """Around one action of the schedule: its span joins this step's actions (nothing waits)."""
        start = self._mark()
        try:
            yield
        finally:
            self._actions.append((start, self._mark()))

    @staticmethod
    def _seconds(span: tuple[Any, Any]) -> float:
        start, end = span
        if isinstance(start, float):
            return end - start
        end.synchronize()  # recorded by a step that has ended: returns at once
        return start.elapsed_time(end) / 1e3

    def step(self, probe: ScheduleProbe | None = None) -> torch.Tensor:
        """One optimizer step over every micro-batch through the schedule; returns the step's mean loss
        (on the last stage; zero elsewhere) as a 0-dim fp32 tensor on the device."""
        layout = self.layout
        rows = self.batches.reshape(-1, self.batches.shape[-1]) if self.batches.numel() else None  # views of the step's tokens
        args = (rows[:, :-1],) if layout.first else ()
        target = rows[:, 1:] if layout.last else None
        losses: list[torch.Tensor] = []
        self._actions, self.probe = [], probe
        grads = getattr(self.optimizer, "grads", None)
        # Main gradients only accumulate in the schedule; the optimizer's step reduces them over the
        # data-parallel ranks (`finish`): a rank may hold one parameter in two chunks (a tied
        # embedding under a V schedule), so no chunk's last backward is the parameter's last.
        with probe.watch() if probe else nullcontext(), grads.no_sync() if grads else nullcontext():
            begin = self._mark()
            self.schedule.step(*args, target=target, losses=losses if layout.last else None, return_outputs=False)
            self.spans.append(((begin, self._mark()), self._actions))
        self.probe = None
        layout.sum_tied_embedding(self.model)
        self.phase = "optimizer"
        self.check_fault("optimizer")
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        self.step_index += 1
        total = torch.stack([x.detach().float() for x in losses]).sum() if losses else torch.zeros((), device=self.device)
        return total

    def fields(self, step_times_s: list[float]) -> dict[str, Any]:
        """The rank's pipeline figures over the measured steps, read now that they are over: the
        seconds of each step's schedule (`schedule_times_s`, the optimizer's step after it left out),
        the seconds this rank computed in it (`compute_times_s`), and the median share of the
        schedule it waited (`bubble_fraction`, its bubble: Megatron's (p - 1)/(m·vp + p - 1) is a
        share of the forward-backward pass)."""
        measured = self.spans[-len(step_times_s):] if step_times_s else []
        schedule = [self._seconds(span) for span, _ in measured]
        compute = [sum(self._seconds(a) for a in actions) for _, actions in measured]
        share = sorted(c / t for c, t in zip(compute, schedule) if t > 0)
        return {"schedule_times_s": schedule, "compute_times_s": compute,
                "bubble_fraction": 1 - share[len(share) // 2] if share else None}
