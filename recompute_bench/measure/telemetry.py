"""What the process runs on: the environment block of a record (the memory figures are `measure.memory`'s).

Importing this module does not import torch: the sweep parent builds the records of points whose
worker left none with `host_environment`, and must not hold a CUDA context (see launch.devices).
Only the functions that take a torch.device import torch, and only workers call them.
"""

from __future__ import annotations

import datetime
import importlib.util
import platform
import re
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def device_name(device: "torch.device") -> str:
    """Marketing name of the GPU, or "cpu"."""
    if device.type != "cuda":
        return "cpu"
    import torch
    return torch.cuda.get_device_name(device)


def uses_tf32(device_type: str, precision: str) -> bool:
    """Whether fp32 matmuls and convolutions run on TF32 tensor cores: fp32 runs on CUDA.

    The fp32 MFU divides by the TF32 tensor-core peak (analysis.flops.PEAK_FLOPS), so TF32 must
    be on for that figure to mean anything; PyTorch leaves it off for matmuls by default. We turn
    it on rather than divide by the plain fp32 peak because on a tensor-core GPU nobody trains
    in IEEE fp32 GEMMs, and the record says so (env.tf32). A CPU has no TF32: its fp32 stays
    exact, which `verify`'s bitwise equality needs.
    """
    return device_type == "cuda" and precision == "fp32"


def torch_build() -> tuple[str | None, str | None]:
    """(torch version, the CUDA version torch was built with or None) read from torch's
    `version.py` without importing torch; (None, None) when torch is not installed."""
    spec = importlib.util.find_spec("torch")  # finds the package; does not run its __init__
    if spec is None or not spec.submodule_search_locations:
        return None, None
    try:
        text = (Path(list(spec.submodule_search_locations)[0]) / "version.py").read_text()
    except OSError:
        return None, None

    def field(name: str) -> str | None:
        match = re.search(rf"^{name}\s*(?::[^=\n]*)?=\s*['\"]([^'\"]*)['\"]", text, re.MULTILINE)
        return match[1] if match else None

    return field("__version__"), field("cuda")


def package_version() -> str:
    try:
        return metadata.version("recompute-bench")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def git_sha() -> str | None:
    """Commit of the checkout the package runs from, if it is one."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def host_environment(device_type: str, device_name: str, tf32: bool | None = None) -> dict:
    """The record's `env` block from what needs no torch: torch's version and CUDA build are read
    from its installed files (`torch_build`). `tf32`: whether fp32 matmuls ran on
    TF32 (None where nothing ran)."""
    torch_version, cuda_version = torch_build()
    return {
        "device": device_type,
        "device_name": device_name,
        "cpu": platform.processor() or platform.machine(),
        "torch_version": torch_version,
        "cuda_version": cuda_version if device_type == "cuda" else None,
        "package_version": package_version(),
        "git_sha": git_sha(),
        "hostname": socket.gethostname(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tf32": tf32,
    }


def environment(device: "torch.device", tf32: bool | None = None) -> dict:
    """The record's `env` block of a process that measures on `device` (imports torch)."""
    import torch

    env = host_environment(device.type, device_name(device), tf32)
    env["torch_version"] = torch.__version__  # the imported torch is the authority where it is loaded
    env["cuda_version"] = torch.version.cuda if device.type == "cuda" else None
    return env
