import os

import pytest

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # CPU tests stay on the CPU even on a GPU machine


@pytest.fixture
def tiny_overrides():
    """A faster tiny: fewer steps."""
    return ["training.warmup_steps=0", "training.measured_steps=1"]
