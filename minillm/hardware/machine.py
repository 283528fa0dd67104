"""What machine is this, and what are its ceilings? (chapter 10.3)

Two kinds of ceiling, always labelled:
- **spec**: the vendor's number (a table keyed by GPU name, or NVML's memory clock × bus width);
- **measured**: what this machine actually does right now — a large read (a sum reduction:
  bytes read), a large device copy (bytes read + written) and a large matmul in the model's
  dtype. The roofline is drawn against the measured ceilings, because "% of a datasheet number"
  mixes our code's efficiency with the hardware's. Decode *reads* its weights and writes almost
  nothing, so its bound uses the read bandwidth; a copy's read + write figure is lower on most
  machines (here 25 against 30 GB/s) and would flatter every "% of the bound". Both are shown.

Everything here works on CUDA, Apple MPS and CPU; nothing needs a GPU to import.
"""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field

import torch

from minillm.core.device import (
    cpu_cores,
    default_dtype,
    dtype_name,
    free_memory_bytes,
    host_available_bytes,
    host_total_bytes,
    parse_dtype,
    pick_device,
    synchronize,
)
from minillm.hardware.pages import huge_page_bytes, huge_page_empty

# ----------------------------------------------------------------------------- spec sheets

@dataclass(frozen=True)
class GPUSpec:
    name: str
    bandwidth: float               # bytes/s, vendor spec
    flops: dict                    # dense (no sparsity) FLOP/s by dtype name; fp32 = non-tensor FP32
    source: str
    memory: float = 0.0            # bytes: the memory it is sold with (N GB taken as N·2^30); 0: unknown


T, G, GiB = 1e12, 1e9, 2**30
# Dense figures: NVIDIA quotes tensor FLOP/s "with sparsity" for Ampere and later; we halve those.
# GeForce cards: the FP16/BF16 tensor figure *with FP32 accumulate* (what PyTorch matmuls use).
GPU_SPECS: list[tuple[tuple[str, ...], GPUSpec]] = [
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): 4.8 TB/s, BF16 1,979 TF sparse, FP32 67 TF
    # H200 NVL (same datasheet): 4.8 TB/s, BF16 1,671 TF sparse, FP32 60 TF
    (("H200", "NVL"),
     GPUSpec("H200 NVL 141GB", 4.8 * T, {"bf16": 835.5 * T, "fp16": 835.5 * T, "fp32": 60 * T},
             "NVIDIA H200 datasheet", 141 * GiB)),
    (("H200",), GPUSpec("H200 SXM 141GB", 4.8 * T, {"bf16": 989.5 * T, "fp16": 989.5 * T, "fp32": 67 * T},
                        "NVIDIA H200 datasheet", 141 * GiB)),
    # NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): SXM 3.35 TB/s, BF16 1,979 TF sparse, FP32 67
    # TF; PCIe 2 TB/s, 1,513 TF sparse, FP32 51 TF; NVL 3.9 TB/s, 1,671 TF sparse, FP32 60 TF
    (("H100", "NVL"),
     GPUSpec("H100 NVL 94GB", 3.9 * T, {"bf16": 835.5 * T, "fp16": 835.5 * T, "fp32": 60 * T},
             "NVIDIA H100 datasheet", 94 * GiB)),
    (("H100", "PCIE"),
     GPUSpec("H100 PCIe 80GB", 2.0 * T, {"bf16": 756.5 * T, "fp16": 756.5 * T, "fp32": 51 * T},
             "NVIDIA H100 datasheet", 80 * GiB)),
    (("H100",), GPUSpec("H100 SXM 80GB", 3.35 * T, {"bf16": 989.5 * T, "fp16": 989.5 * T, "fp32": 67 * T},
                        "NVIDIA H100 datasheet", 80 * GiB)),
    # NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): 80GB SXM 2,039 GB/s, 80GB PCIe 1,935 GB/s,
    # 40GB 1,555 GB/s; BF16/FP16 tensor 312 TF dense; FP32 19.5 TF
    (("A100", "40GB"), GPUSpec("A100 40GB", 1555 * G, {"bf16": 312 * T, "fp16": 312 * T, "fp32": 19.5 * T},
                               "NVIDIA A100 datasheet", 40 * GiB)),
    (("A100", "PCIE"),
     GPUSpec("A100 PCIe 80GB", 1935 * G, {"bf16": 312 * T, "fp16": 312 * T, "fp32": 19.5 * T},
             "NVIDIA A100 datasheet", 80 * GiB)),
    (("A100",), GPUSpec("A100 SXM 80GB", 2039 * G, {"bf16": 312 * T, "fp16": 312 * T, "fp32": 19.5 * T},
                        "NVIDIA A100 datasheet", 80 * GiB)),
    # NVIDIA L40S datasheet: 864 GB/s, BF16 733 TF sparse, FP32 91.6 TF
    (("L40S",), GPUSpec("L40S", 864 * G, {"bf16": 366.5 * T, "fp16": 366.5 * T, "fp32": 91.6 * T},
                        "NVIDIA L40S datasheet", 48 * GiB)),
    # NVIDIA L4 datasheet: 300 GB/s, BF16 242 TF sparse, FP32 30.3 TF
    (("L4",), GPUSpec("L4", 300 * G, {"bf16": 121 * T, "fp16": 121 * T, "fp32": 30.3 * T},
                      "NVIDIA L4 datasheet", 24 * GiB)),
    # NVIDIA A10 datasheet: 600 GB/s, BF16 250 TF sparse, FP32 31.2 TF
    (("A10",), GPUSpec("A10", 600 * G, {"bf16": 125 * T, "fp16": 125 * T, "fp32": 31.2 * T},
                       "NVIDIA A10 datasheet", 24 * GiB)),
    # NVIDIA T4 datasheet: 320 GB/s, FP16 mixed precision 65 TF, FP32 8.1 TF; no bf16 tensor cores
    (("T4",), GPUSpec("T4", 320 * G, {"fp16": 65 * T, "fp32": 8.1 * T}, "NVIDIA T4 datasheet", 16 * GiB)),
    # NVIDIA V100 datasheet (SXM2): 900 GB/s, tensor 125 TF, FP32 15.7 TF; 32 GB (a 16 GB model exists too)
    (("V100",),
     GPUSpec("V100 SXM2", 900 * G, {"fp16": 125 * T, "fp32": 15.7 * T}, "NVIDIA V100 datasheet", 32 * GiB)),
    # NVIDIA Ada whitepaper (RTX 4090): 1,008 GB/s, FP16/BF16 tensor with FP32 accumulate 165.2 TF, FP32 82.6
    # TF
    (("4090",),
     GPUSpec("GeForce RTX 4090", 1008 * G, {"bf16": 165.2 * T, "fp16": 165.2 * T, "fp32": 82.6 * T},
             "NVIDIA Ada Lovelace architecture whitepaper", 24 * GiB)),
    # NVIDIA Ampere GA102 whitepaper (RTX 3090): 936 GB/s, FP16 tensor with FP32 accumulate 71 TF, FP32 35.6
    # TF
    (("3090",), GPUSpec("GeForce RTX 3090", 936 * G, {"bf16": 71 * T, "fp16": 71 * T, "fp32": 35.6 * T},
                        "NVIDIA Ampere GA102 whitepaper", 24 * GiB)),
    # NVIDIA Blackwell (GeForce RTX 5090) whitepaper: 1,792 GB/s, FP16/BF16 tensor FP32-accumulate 209.5 TF,
    # FP32 104.8 TF
    (("5090",),
     GPUSpec("GeForce RTX 5090", 1792 * G, {"bf16": 209.5 * T, "fp16": 209.5 * T, "fp32": 104.8 * T},
             "NVIDIA RTX Blackwell GPU architecture whitepaper", 32 * GiB)),
    # NVIDIA RTX A6000 datasheet: 768 GB/s, tensor 309.7 TF sparse, FP32 38.7 TF
    (("A6000",), GPUSpec("RTX A6000", 768 * G, {"bf16": 154.8 * T, "fp16": 154.8 * T, "fp32": 38.7 * T},
                         "NVIDIA RTX A6000 datasheet", 48 * GiB)),
]


def lookup_gpu_spec(name: str) -> GPUSpec | None:
    """Match an NVML / torch device name ("NVIDIA H100 80GB HBM3", "Tesla T4") to the table.
    Rows are ordered most-specific first; every key word of a row must occur in the name."""
    up = name.upper().replace("-", " ")
    words = set(up.split())
    for keys, spec in GPU_SPECS:
        # short keys (L4, A10, T4) must be whole words, or "L40S" would match "L4"
        if all((k in words) if len(k) <= 3 else (k in up) for k in keys):
            return spec
    return None


# ----------------------------------------------------------------------------- NVML and the CPU

def nvml_info(device: torch.device | str | int = 0) -> dict | None:
    """Name, memory, memory clock and bus width from NVML (the nvidia-ml-py package), or None
    when NVML is not there (no NVIDIA driver, or a non-NVIDIA machine)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        handle = _nvml_handle(pynvml, device)
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        info = {"name": name, "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)}
        try:
            info["mem_clock_mhz"] = int(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM))
            info["bus_width_bits"] = int(pynvml.nvmlDeviceGetMemoryBusWidth(handle))
        except Exception:
            pass
        try:
            drv = pynvml.nvmlSystemGetDriverVersion()
            info["driver"] = drv.decode() if isinstance(drv, bytes) else drv
        except Exception:
            pass
        return info
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _nvml_handle(pynvml, device):
    """NVML numbers GPUs physically; torch numbers what CUDA_VISIBLE_DEVICES shows. Match by UUID."""
    index = device if isinstance(device, int) else (torch.device(device).index or 0)
    if torch.cuda.is_available():
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        if uuid is not None:
            try:
                return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            except Exception:
                pass
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def nvml_spec_bandwidth(info: dict | None) -> float | None:
    """Spec bandwidth = memory clock × 2 (double data rate) × bus width / 8, in bytes/s.
    NVML reports the memory clock at half the effective data rate for both HBM and GDDR
    (e.g. an A100 80GB: 1593 MHz × 2 × 5120 bit / 8 = 2.04 TB/s, its datasheet's 2,039 GB/s)."""
    if not info or not info.get("mem_clock_mhz") or not info.get("bus_width_bits"):
        return None
    return info["mem_clock_mhz"] * 1e6 * 2 * info["bus_width_bits"] / 8


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=5).stdout.strip() or platform.processor()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown CPU"


# Instructions that compute in bf16 natively (x86: AVX512-BF16 dot products, AMX tiles; Arm:
# the BF16 extension). Without them a bf16 matmul converts to fp32 in software: bf16 halves the
# bytes read but not the time, so on such a CPU bf16 decode is no faster than fp32.
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_bf16_instructions() -> list[str] | None:
    """The CPU's native bf16 instruction sets ([] when it has none), or None when the flags
    cannot be read (no /proc/cpuinfo and not a Mac)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("flags", "features"):          # x86 "flags", Arm "Features"
                    have = set(line.split(":", 1)[1].split())
                    return [x for x in BF16_FLAGS if x in have]
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True,
                                 text=True, timeout=5).stdout.strip()
            return ["bf16"] if out == "1" else []
        except (OSError, subprocess.SubprocessError):
            pass
    return None


# ----------------------------------------------------------------------------- what machine is this

@dataclass
class HardwareInfo:
    device: str                             # "cuda:0", "mps", "cpu"
    kind: str                               # cuda | mps | cpu
    name: str                               # GPU name, "Apple MPS" or the CPU model
    memory_bytes: int | None
    cpu_model: str
    cpu_cores: int
    torch_threads: int
    spec_bandwidth: float | None = None     # bytes/s
    spec_bandwidth_source: str | None = None
    spec_flops: dict | None = None          # FLOP/s by dtype name
    spec_source: str | None = None
    nvml: dict | None = None
    extra: dict = field(default_factory=dict)

    def summary(self) -> str:
        mem = f"{self.memory_bytes / 2**30:.0f} GiB" if self.memory_bytes else "memory unknown"
        if self.kind == "cpu":
            return f"CPU {self.cpu_model} ({self.cpu_cores} cores, {self.torch_threads} torch threads, {mem})"
        bw = (f", spec {self.spec_bandwidth / 1e12:.2f} TB/s ({self.spec_bandwidth_source})"
              if self.spec_bandwidth else ", no spec bandwidth known")
        return f"{self.name} ({mem}{bw})"


def describe_hardware(device: torch.device | str | None = None) -> HardwareInfo:
    dev = pick_device(device)
    common = dict(cpu_model=cpu_model(), cpu_cores=cpu_cores(), torch_threads=torch.get_num_threads())
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        nv = nvml_info(dev)
        name = (nv or {}).get("name") or props.name
        spec = lookup_gpu_spec(name)
        nv_bw = nvml_spec_bandwidth(nv)
        bw, bw_src = (nv_bw, "NVML memory clock x bus width") if nv_bw else (
            (spec.bandwidth, spec.source) if spec else (None, None))
        return HardwareInfo(str(dev), "cuda", name, int(props.total_memory), **common,
                            spec_bandwidth=bw, spec_bandwidth_source=bw_src,
                            spec_flops=dict(spec.flops) if spec else None,
                            spec_source=spec.source if spec else None, nvml=nv,
                            extra={"compute_capability": f"{props.major}.{props.minor}",
                                   "cuda": torch.version.cuda,
                                   "table_bandwidth": spec.bandwidth if spec else None})
    if dev.type == "mps":
        # Apple publishes bandwidth per chip (M1 68 GB/s … M2 Ultra 800 GB/s), but torch does not say
        # which chip this is: the measured ceilings are what we use.
        return HardwareInfo("mps", "mps", f"Apple MPS ({common['cpu_model']})", host_total_bytes(), **common)
    return HardwareInfo("cpu", "cpu", common["cpu_model"], host_total_bytes(), **common)


# ----------------------------------------------------------------------------- measured ceilings

@dataclass
class Measurement:
    value: float                 # the median of the samples
    unit: str                    # "B/s" or "FLOP/s"
    samples: list[float]
    params: dict
    method: str

    def __str__(self) -> str:
        scale, prefix = (1e12, "T") if self.value >= 1e12 else (1e9, "G")
        return f"{self.value / scale:.2f} {prefix}{self.unit} (median of {len(self.samples)}; {self.method})"


def _time_s(fn, device: torch.device) -> float:
    """Wall time of fn() with the device drained before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def last_level_cache_bytes(device: torch.device | str | None = None) -> int | None:
    """The largest cache in front of the device's memory: a CPU's L3 (or L2), a GPU's L2.
    None where the system does not say (then the defaults below are large anyway)."""
    dev = pick_device(device)
    if dev.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0)) or None
    if dev.type != "cpu":
        return None
    best = (0, 0)                                    # (level, bytes)
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for idx in os.listdir(base):
            try:
                with open(f"{base}/{idx}/level") as f:
                    level = int(f.read())
                with open(f"{base}/{idx}/size") as f:
                    size = f.read().strip()
            except (OSError, ValueError):
                continue
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:].upper(), 1)
            digits = size[:-1] if mult > 1 else size
            if digits.isdigit():
                best = max(best, (level, int(digits) * mult))
    except OSError:
        pass
    if best[1]:
        return best[1]
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            v = os.sysconf(name)
            if v and v > 0:
                return int(v)
        except (ValueError, OSError, AttributeError):
            pass
    return None


def default_read_bytes(device: torch.device) -> int:
    """At least twice the last-level cache (a server CPU's L3 can be hundreds of MB: this one
    reports 480 MiB), so a streaming read cannot be served from cache; 512 MiB at least on a CPU,
    2 GiB on a GPU; never more than an eighth of the free host memory (a quarter of a GPU's)."""
    if device.type != "cpu":
        return default_copy_bytes(device)
    llc = last_level_cache_bytes(device) or 0
    return int(min(max(512 * 2**20, 2 * llc), _measurement_room_bytes(device)))


def decode_read_bytes(device: torch.device, step_bytes: int) -> int:
    """The buffer every command measures the decode bound over: one decode step's bytes, as a
    step reads them, but at least twice the last-level cache (a smaller buffer is served from the
    cache, which the weights of a larger model are not) and at least 64 MiB; capped by the free
    memory the measurements keep to. One rule for ``roofline``, ``bench``, ``prefill-decode`` and
    the notebooks, where two commands once measured different buffers and disagreed on the bound.
    Measured on the project's AMD EPYC VM (2 threads, medians of 5, two rounds a minute apart):
    33.5 and 39.9 GB/s over 64 MiB, 32.3–35.6 GB/s over 256 MiB to 2 GiB; ``doctor`` prints the
    same scan for the machine it runs on."""
    llc = last_level_cache_bytes(device) or 0
    return int(min(max(int(step_bytes), 2 * llc, 64 * 2**20), _measurement_room_bytes(device)))


def read_bandwidth_by_size(device: torch.device | str | None = None,
                           sizes: tuple[int, ...] = (64 * 2**20, 256 * 2**20, 1024 * 2**20),
                           repeats: int = 3) -> list[tuple[int, float]]:
    """(bytes, read B/s) over buffers of each size that fits: how much the bound depends on the
    buffer on this machine (``doctor`` prints it)."""
    dev = pick_device(device)
    room = _measurement_room_bytes(dev)
    return [(n, measure_read_bandwidth(dev, nbytes=n, repeats=repeats, warmup=1, name_pages=False).value)
            for n in sizes if n <= room]


def default_copy_bytes(device: torch.device) -> int:
    """Well past the last-level cache (a server CPU's L3 can exceed 100 MB; an H100's L2 is 50 MB)."""
    if device.type == "cuda":
        return min(2 * 2**30, _measurement_room_bytes(device))
    if device.type == "mps":
        return _measurement_room_bytes(device)
    return min(512 * 2**20, _measurement_room_bytes(device))


def _measurement_room_bytes(device: torch.device) -> int:
    """The most a bandwidth buffer may take: an eighth of the host's free memory, a quarter of a
    GPU's, 512 MiB on MPS (which reports none)."""
    if device.type == "cuda":
        return free_memory_bytes(device) // 4
    if device.type == "mps":
        return 512 * 2**20
    return host_available_bytes() // 8


def measure_copy_bandwidth(device: torch.device | str | None = None, nbytes: int | None = None,
                           repeats: int = 10, warmup: int = 2) -> Measurement:
    """Copy a large buffer into another and count bytes read + written (2 × size) per copy.
    The median of ``repeats`` copies, after ``warmup`` untimed ones (first-touch page faults)."""
    dev = pick_device(device)
    nbytes = int(nbytes or default_copy_bytes(dev))
    if nbytes < 2**20:
        raise ValueError(f"a copy of {nbytes} bytes measures the cache, not memory: use at least 1 MiB")
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=dev)                   # [n]
    dst = torch.empty_like(src)                                             # [n]
    for _ in range(warmup):
        dst.copy_(src)
    samples = [2 * n * 4 / _time_s(lambda: dst.copy_(src), dev) for _ in range(repeats)]  # noqa: F821 (deleted below, after use)
    del src, dst
    return Measurement(statistics.median(samples), "B/s", samples,
                       {"bytes": n * 4, "repeats": repeats, "warmup": warmup, "device": str(dev)},
                       "tensor copy, bytes read + written")


def measure_read_bandwidth(device: torch.device | str | None = None, nbytes: int | None = None,
                           repeats: int = 10, warmup: int = 2, name_pages: bool = True) -> Measurement:
    """Read a large buffer and count bytes read (1 × size) per pass: a sum reduction, whose
    output is one number, so nothing is written back. This is the traffic of a decode step,
    which reads every weight once and writes only activations. The median of ``repeats``
    passes after ``warmup`` untimed ones. On CUDA the reduction is one read kernel (torch's
    sum), labelled as such: the closest a framework gets to a pure device read. ``name_pages``: the
    method says which pages the buffer sat in (read from ``/proc/self/smaps``, about 12 ms in an
    engine's process); a caller that keeps only the value, sampling again and again, skips it."""
    dev = pick_device(device)
    nbytes = int(nbytes or default_read_bytes(dev))
    if nbytes < 2**20:
        raise ValueError(f"a read of {nbytes} bytes measures the cache, not memory: use at least 1 MiB")
    n = nbytes // 4
    buf = _read_buffer(n, dev)                                              # [n], every page touched
    pages = _page_size_note(buf) if dev.type == "cpu" and name_pages else ""
    for _ in range(warmup):
        buf.sum()
    samples = [n * 4 / _time_s(buf.sum, dev) for _ in range(repeats)]
    del buf
    kernel = "a CUDA sum-reduction kernel" if dev.type == "cuda" else "a sum reduction"
    llc = last_level_cache_bytes(dev)
    return Measurement(statistics.median(samples), "B/s", samples,
                       {"bytes": n * 4, "repeats": repeats, "warmup": warmup, "device": str(dev),
                        "last_level_cache_bytes": llc},
                       f"{kernel} over {n * 4 / 2**20:.0f} MiB{pages}, bytes read")


def _read_buffer(n: int, dev: torch.device) -> torch.Tensor:
    """n floats of ones. On a CPU in 2 MiB pages where the system gives them, as the engine holds the
    weights a decode reads (hardware/pages.py: a sum over 164 MiB read 1.21× faster in them on the
    project's AMD EPYC VM), so a decode and its bound are read through the same pages."""
    if dev.type != "cpu":
        return torch.ones(n, dtype=torch.float32, device=dev)
    return huge_page_empty(n * 4).view(torch.float32).fill_(1.0)


def _page_size_note(buf: torch.Tensor) -> str:
    huge = huge_page_bytes(buf)
    if huge is None:
        return ""
    share = huge / buf.nbytes
    return " in 2 MiB pages" if share > 0.9 else f" in base pages ({share:.0%} in 2 MiB ones)"


def measure_step_read_bandwidth(device: torch.device | str | None, bytes_per_step: int) -> Measurement | None:
    """Read bandwidth over a buffer the size of one decode step's bytes (at least 1 MiB), read
    again and again as decode re-reads its weights. Where the weights fit in part in the
    last-level cache this is above :func:`measure_read_bandwidth`'s figure, and a decode can pass
    that bound: measured on the 2-core Xeon VM, 40.6 GB/s over a 164 MiB buffer (about cpu-small's
    bf16 weights) against 27-29 GB/s over 329 MiB and more.

    None where it could tell nothing new or would not fit: a step of at least twice the last-level
    cache (then the bound's own large-buffer figure is the answer), or a buffer over the same share
    of free memory that the other measurements keep to (an eighth of the host's, a quarter of a GPU's)."""
    dev = pick_device(device)
    nbytes = max(int(bytes_per_step), 2**20)
    llc = last_level_cache_bytes(dev)
    if llc and nbytes >= 2 * llc:
        return None
    if nbytes > _measurement_room_bytes(dev):
        return None
    return measure_read_bandwidth(dev, nbytes=nbytes)


def measure_matmul_peak(device: torch.device | str | None = None, dtype: str | torch.dtype = "fp32",
                        n: int | None = None, repeats: int = 10, warmup: int = 2) -> Measurement:
    """FLOP/s of an n×n×n matmul (2n³ FLOPs) in the model's dtype: the compute roof we can reach."""
    dev = pick_device(device)
    dt = parse_dtype(dtype)
    # 1024 on a CPU varied ±10 % run to run
    n = int(n or (8192 if dev.type == "cuda" else 4096 if dev.type == "mps" else 2048))
    a = torch.randn(n, n, device=dev).to(dt)                                # [n, n]
    b = torch.randn(n, n, device=dev).to(dt)                                # [n, n]
    for _ in range(warmup):
        a @ b
    samples = [2 * n**3 / _time_s(lambda: a @ b, dev) for _ in range(repeats)]  # noqa: F821 (deleted below, after use)
    del a, b
    return Measurement(statistics.median(samples), "FLOP/s", samples,
                       {"n": n, "dtype": dtype_name(dt), "repeats": repeats, "warmup": warmup,
                        "device": str(dev)},
                       f"{n}x{n} matmul in {dtype_name(dt)}")


def ceilings(device: torch.device | str | None = None, dtype: str | torch.dtype | None = None,
             measure: bool = True, copy_bytes: int | None = None, matmul_n: int | None = None,
             read_bytes: int | None = None) -> dict:
    """Spec and measured bandwidth and peak side by side, plus which one the roofline uses:
    the measured ones (bandwidth = the *read* bandwidth, what decode does; the copy figure
    beside it), or the spec where nothing was measured; 'unknown' when neither exists."""
    dev = pick_device(device)
    dt = parse_dtype(dtype) if dtype is not None else default_dtype(dev)
    hw = describe_hardware(dev)
    out = {"device": str(dev), "dtype": dtype_name(dt), "hardware": hw.summary(),
           "spec_bandwidth": hw.spec_bandwidth, "spec_flops": (hw.spec_flops or {}).get(dtype_name(dt))}
    if measure:
        rd = measure_read_bandwidth(dev, read_bytes)
        bw = measure_copy_bandwidth(dev, copy_bytes)
        pk = measure_matmul_peak(dev, dt, matmul_n)
        out.update(measured_bandwidth=rd.value, read_bandwidth=rd.value, copy_bandwidth=bw.value,
                   measured_flops=pk.value, bandwidth=rd.value, bandwidth_kind="read",
                   peak_flops=pk.value, source="measured")
    else:
        out.update(bandwidth=out["spec_bandwidth"], peak_flops=out["spec_flops"],
                   source="spec" if out["spec_bandwidth"] and out["spec_flops"] else "unknown")
    return out
