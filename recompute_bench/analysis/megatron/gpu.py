"""Where Megatron runs, beyond the Config: the GPU kind (its compute capability picks Transformer
Engine's attention kernel and workspace and torch's default cuBLAS workspace) and torch's
CUBLAS_WORKSPACE_CONFIG."""

from __future__ import annotations

from dataclasses import dataclass

from recompute_bench.config.gpus import COMPUTE_CAPABILITY
from recompute_bench.config.schema import BadInput

MiB = 2**20

# Compute capability (major x 10 + minor) of the GPU kinds Megatron runs on, from the one GPU table
# (`config.gpus`); it picks Transformer Engine's attention kernel and workspace and torch's default
# cuBLAS workspace.
DEFAULT_GPU = "h100"


@dataclass(frozen=True)
class MegatronRun:
    """Where Megatron runs, beyond the Config: the GPU kind and torch's CUBLAS_WORKSPACE_CONFIG."""

    gpu: str = DEFAULT_GPU
    """A key of COMPUTE_CAPABILITY (h100, a100, gb200, ...)."""
    cublas_workspace_config: str | None = None
    """The CUBLAS_WORKSPACE_CONFIG environment variable of the run (":4096:8"); None: torch's default."""

    @property
    def compute_capability(self) -> int:
        if self.gpu not in COMPUTE_CAPABILITY:
            raise BadInput(f"unknown GPU kind {self.gpu!r} for framework megatron; pass --gpu with one of "
                              f"{', '.join(COMPUTE_CAPABILITY)}")
        return COMPUTE_CAPABILITY[self.gpu]
