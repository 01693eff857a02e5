"""recompute-bench: measure, predict and gate activation-recomputation settings of GPT training."""

from importlib import metadata

try:
    __version__ = metadata.version("recompute-bench")
except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH that was never installed
    __version__ = "0+unknown"
