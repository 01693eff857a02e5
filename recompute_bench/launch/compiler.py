"""Whether `--compile` can run here, asked without importing torch (the sweep parent checks its plan
before any worker starts, `cli.run.check_runnable`).

torch.compile's default backend, inductor, writes kernels it must build: C++ (OpenMP) on a CPU, which
needs a C++ compiler on the PATH (torch/_inductor/cpp_builder.py `get_cpp_compiler`: `$CXX`, else
`config.cpp.cxx`'s search, g++ first), Triton on CUDA (torch/utils/_triton.py `has_triton`). Dynamo
itself refuses Python 3.15 and later (torch/_dynamo/eval_frame.py `check_if_dynamo_supported`, torch 2.13).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

CPP_COMPILERS = ("g++", "c++", "clang++")


def compile_problem(device_type: str) -> str | None:
    """Why torch.compile cannot build its kernels for `device_type` here (one line), or None."""
    if sys.version_info >= (3, 15):
        return f"torch.compile does not run on Python {sys.version_info.major}.{sys.version_info.minor}"
    if sys.platform == "win32":
        return "torch.compile's CPU and Triton kernels are not built on Windows by this harness"
    if device_type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "torch.compile builds Triton kernels on CUDA and triton is not installed (pip install triton)"
        return None
    cxx = os.environ.get("CXX")
    if cxx and shutil.which(cxx) is None:
        return f"torch.compile builds C++ kernels on a CPU and $CXX ({cxx}) is not on the PATH"
    if not cxx and not any(shutil.which(c) for c in CPP_COMPILERS):
        return "torch.compile builds C++ kernels on a CPU and no C++ compiler (g++, clang++) is on the PATH"
    return None
