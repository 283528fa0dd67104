"""An optional compiled decode step (``EngineConfig.compile``): ``torch.compile`` of the static decode.

Eager PyTorch runs a decode step as a few hundred small ops, each a Python call and a kernel
launch. ``torch.compile`` (TorchDynamo traces the step, Inductor generates code: C++/OpenMP on a
CPU, Triton on a GPU) fuses the elementwise ops around the matmuls (norms, RoPE, SiLU·up,
residual adds) into fewer kernels and takes Python off the per-op path. The matmuls themselves
stay library calls, so the bytes a step reads do not change: what can shrink is the time outside
the matmuls.

What is compiled: the runner's static decode (``ModelRunner`` with ``static_decode``), one graph
per bucket of (rows, K/V length), the shapes CUDA graphs use too; on CUDA the compiled step is
then captured as a CUDA graph. Prefill steps stay eager (their shapes vary with every prompt).
The first step of each bucket pays the compilation; that time is logged and kept in the step's
``StepRecord.compile_ms`` and in ``ModelRunner.compile_s``. Eager stays the default and the
reference: the tests pin compiled tokens against eager ones.
"""
from __future__ import annotations

import functools
import os
import shutil
from typing import Callable

import torch


@functools.lru_cache(maxsize=None)
def _cxx_compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def compile_unavailable(device: torch.device | str) -> str | None:
    """Why ``torch.compile`` cannot run the decode step on ``device`` here, or None when it can.
    Inductor needs TorchDynamo support for this Python, a C++ compiler on a CPU, Triton on a GPU."""
    dev = torch.device(device)
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    try:
        from torch._dynamo.eval_frame import is_dynamo_supported
        if not is_dynamo_supported():
            return "TorchDynamo does not support this Python version or platform"
    except Exception as e:                    # a broken or partial install
        return f"TorchDynamo is unavailable ({type(e).__name__}: {e})"
    if dev.type == "cpu" and _cxx_compiler() is None:
        return "Inductor compiles C++ on a CPU, and no C++ compiler (g++, c++, clang++ or $CXX) is on the PATH"
    if dev.type == "cuda":
        try:
            import triton  # noqa: F401
        except Exception:
            return "Inductor generates Triton kernels on a GPU, and triton is not importable"
    if dev.type == "mps":
        return "the compiled decode is tested on CPU and CUDA only"
    return None


def compile_step(fn: Callable, max_buckets: int) -> Callable:
    """``torch.compile(fn)`` with static shapes: one graph per decode bucket. TorchDynamo keeps at
    most ``recompile_limit`` graphs per function (8 by default) and then silently runs eager;
    the runner has up to ``max_buckets`` buckets, so the limit is raised to cover them."""
    import torch._dynamo
    cfg = torch._dynamo.config
    if hasattr(cfg, "recompile_limit"):
        cfg.recompile_limit = max(cfg.recompile_limit, max_buckets)
    else:                                     # older torch: the same setting's old name
        cfg.cache_size_limit = max(cfg.cache_size_limit, max_buckets)
    return torch.compile(fn, dynamic=False)
