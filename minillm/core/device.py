"""Device and dtype helpers: the bottom layer the model, the engine and everything above use.

Which device (cuda → mps → cpu), which dtype by default (bf16 on CUDA, fp32 elsewhere), how many
bytes a dtype takes, how much memory is free for the KV cache, and a synchronise that waits for a
device's queued work (so a timestamp marks work done, not work launched). Nothing here imports the
rest of the project.
"""
from __future__ import annotations

import os

import torch


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """cuda → mps → cpu unless one is given (design.md §6). A device that is asked for but
    absent is an error, not a silent fallback: a learner must know what they measured."""
    if isinstance(device, torch.device):
        device = str(device)
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}: use cpu, cuda, cuda:N, mps or auto") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} was asked for, but this torch build sees no CUDA GPU "
                             f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) found")
    elif dev.type == "mps" and not mps_available():
        raise ValueError(f"device {device!r} was asked for, but MPS is not available here")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unsupported device type {dev.type!r}: use cpu, cuda or mps")
    return dev


def mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def synchronize(device: torch.device | str) -> None:
    """Wait until the device has finished its queued work (so a clock read means 'done')."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
           "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _NAMES:
            raise ValueError(f"unsupported dtype {dtype}: use bf16, fp16 or fp32")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use bf16, fp16 or fp32")
    return _DTYPES[key]


def dtype_name(dtype: str | torch.dtype) -> str:
    return _NAMES[parse_dtype(dtype)]


def dtype_bytes(dtype: str | torch.dtype) -> int:
    return torch.empty((), dtype=parse_dtype(dtype)).element_size()


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on GPUs that have it (the dtype models are served in), fp16 on older GPUs and MPS,
    fp32 on a CPU (CPU kernels for half types are often slower than fp32, which would
    misrepresent the bandwidth story)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dev.type == "mps":
        return torch.float16
    return torch.float32


def free_memory_bytes(device: torch.device | str) -> int:
    """Memory the KV cache may grow into (the caller applies a safety fraction)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    if dev.type == "mps":
        return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    return host_available_bytes()


def host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30  # macOS has no SC_AVPHYS_PAGES; assume a laptop's worth


def host_total_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# ----------------------------------------------------------------------------- the spec table


def cpu_cores() -> int:
    """Cores this process may use (a container's or taskset's limit, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_server_threads(device: str | None) -> int | None:
    """For ``serve`` on a CPU: one core fewer than we may use, for the HTTP side (min 1).

    Why: the engine thread is not the main thread, and OpenMP regions started from another
    thread compete badly with the main thread's idle OpenMP workers. Measured on a 2-core Xeon
    (torch 2.13 CPU, the tiny model): a prefill took 2.0 ms from the main thread, 5.3 ms from a
    second thread with 2 OpenMP threads, 2.2 ms from a second thread with 1. Only the CLI server
    (a process of its own) gets this default; a ServerThread inside a notebook leaves torch alone.
    On an accelerator the intra-op threads barely matter: None (torch's default)."""
    try:
        if pick_device(device).type != "cpu":
            return None
    except ValueError:
        return None            # LLM(...) reports the bad device with its own message
    return max(1, cpu_cores() - 1)


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is the device (or the host) running out of memory: a batch that does not fit is
    reported as such and a sweep goes on."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "out of memory" in str(e).lower()
