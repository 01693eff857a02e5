"""The timed window: a step timed between device synchronisations on the measured device's own
stream, started once every rank has reached a barrier."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch


def cuda_event(device: torch.device) -> "torch.cuda.Event":
    """A timing event recorded now on `device`'s current stream. `Event.record()` without a stream
    records on the current device's stream, GPU 0's unless it was set: on `cuda:1` the event would
    time nothing of the work (torch/cuda/streams.py, `Event.record`)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def timed(device: torch.device, fn: Callable[[], Any], barrier: Callable[[], None] = lambda: None) -> float:
    """Seconds `fn` takes on `device`, started when every rank has reached `barrier` (so one rank's
    late start, a slow piece write between steps, is not timed as another rank's wait)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        barrier()
        start = cuda_event(device)
        fn()
        end = cuda_event(device)
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
