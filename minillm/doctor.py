"""``python -m minillm doctor``: is this machine ready for the notebooks?

One line per check: [OK], [FAIL] (something the project needs is missing or broken) or [--]
(optional and absent, e.g. no GPU). Exit status 1 if any check failed. Four lines measure or
inspect rather than import: the memory bandwidth (read, the decode bound's, and copy), whether
the CPU has native bf16 instructions, whether the system gives 2 MiB pages, and the decode matmuls
chosen on this CPU (cached).
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

# (import name, distribution name, required?, what it is for)
DEPENDENCIES = [
    ("torch", "torch", True, "the engine"),
    ("transformers", "transformers", True, "configs, tokenizers, the reference implementation"),
    ("tokenizers", "tokenizers", True, "the default byte-level BPE tokenizer"),
    ("safetensors", "safetensors", True, "checkpoint loading"),
    ("numpy", "numpy", True, "metrics and percentiles"),
    ("matplotlib", "matplotlib", True, "the chapter's figures"),
    ("tqdm", "tqdm", True, "progress bars"),
    ("fastapi", "fastapi", True, "the OpenAI-compatible server"),
    ("uvicorn", "uvicorn", True, "the HTTP server"),
    ("httpx", "httpx", True, "the notebooks' HTTP client"),
    ("jupyterlab", "jupyterlab", True, "running the notebooks"),
    ("ipywidgets", "ipywidgets", True, "the notebooks' calculators"),
    ("pynvml", "nvidia-ml-py", True, "GPU name, memory and spec bandwidth (NVML)"),
    ("openai", "openai", False, "the official client used in tests and notebook 01"),
    ("pytest", "pytest", False, "running the tests"),
]


@dataclass
class Check:
    name: str
    status: str          # "OK" | "FAIL" | "--"
    detail: str

    def line(self) -> str:
        return f"[{self.status}] {self.name}: {self.detail}"


def check_dependencies() -> list[Check]:
    from importlib.metadata import PackageNotFoundError, version
    out = []
    for mod, dist, required, why in DEPENDENCIES:
        try:
            importlib.import_module(mod)
        except Exception as e:       # a broken install raises more than ImportError
            out.append(Check(dist, "FAIL" if required else "--",
                             f"not importable ({type(e).__name__}: {e}); needed for {why}"))
            continue
        try:
            v = version(dist)
        except PackageNotFoundError:
            v = "version unknown"
        out.append(Check(dist, "OK", f"{v} ({why})"))
    return out


def check_torch_build() -> list[Check]:
    try:
        import torch
    except Exception:
        return []
    cuda = torch.version.cuda
    mps_built = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_built())
    build = f"torch {torch.__version__}, " + (f"CUDA {cuda} build" if cuda else "CPU-only build (no CUDA)")
    build += ", MPS built" if mps_built else ""
    return [Check("torch build", "OK", build)]


def check_devices() -> list[Check]:
    try:
        import torch
    except Exception:
        return []
    import minillm.core.device as device
    import minillm.hardware.machine as hw
    out = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            nv = hw.nvml_info(i)
            if nv:
                bw = hw.nvml_spec_bandwidth(nv)
                detail = f"{nv['name']}, {nv['memory_bytes'] / 2**30:.1f} GiB (NVML)"
                detail += f", spec bandwidth {bw / 1e12:.2f} TB/s" if bw else ""
                detail += f", driver {nv['driver']}" if nv.get("driver") else ""
                out.append(Check(f"cuda:{i}", "OK", detail))
            else:
                p = torch.cuda.get_device_properties(i)
                out.append(Check(f"cuda:{i}", "OK", f"{p.name}, {p.total_memory / 2**30:.1f} GiB "
                                                    f"(NVML unavailable: no spec bandwidth)"))
    else:
        out.append(Check("cuda", "--", "no CUDA GPU visible to torch"))
    out.append(Check("mps", "OK", "Apple MPS available") if device.mps_available()
               else Check("mps", "--", "no Apple MPS device"))
    mem = device.host_total_bytes()
    out.append(Check("cpu", "OK", f"{hw.cpu_model()}, {device.cpu_cores()} cores usable, "
                                  f"{torch.get_num_threads()} torch threads"
                                  + (f", {mem / 2**30:.0f} GiB RAM" if mem else "")))
    dev = device.pick_device()
    out.append(Check("default device", "OK", f"{dev} (picked cuda → mps → cpu), default dtype "
                                             f"{device.dtype_name(device.default_dtype(dev))}"))
    return out


def check_bandwidth(measure: bool = True) -> list[Check]:
    """The two measured bandwidths of the default device: read (a sum reduction: what decode
    does with its weights, so the roofline's bound) and copy (read + write), both labelled."""
    if not measure:
        return []
    try:
        import minillm.core.device as device
        import minillm.hardware.machine as hw
        dev = device.pick_device()
        rd = hw.measure_read_bandwidth(dev, repeats=5, warmup=1)
        cp = hw.measure_copy_bandwidth(dev, repeats=5, warmup=1)
    except Exception as e:           # a measurement must not make doctor fail
        return [Check("memory bandwidth", "--", f"not measured ({type(e).__name__}: {e})")]
    checks = [Check("memory bandwidth", "OK",
                    f"{dev}: read {rd.value / 1e9:.1f} GB/s ({rd.method}), "
                    f"copy {cp.value / 1e9:.1f} GB/s ({cp.method}); medians of 5, a busy machine reads low")]
    try:         # the decode bound is a read over one step's bytes: how much does the buffer matter here?
        by_size = hw.read_bandwidth_by_size(dev)
    except Exception as e:
        return checks + [Check("read bandwidth by buffer", "--", f"not measured ({type(e).__name__}: {e})")]
    checks.append(Check("read bandwidth by buffer", "OK",
                        ", ".join(f"{n / 2**20:.0f} MiB: {v / 1e9:.1f} GB/s" for n, v in by_size)
                        + " (the decode bound reads one step's bytes, at least twice the last-level cache)"))
    return checks + check_read_drift(dev, rd.params["bytes"])


def check_read_drift(dev, nbytes: int, samples: int = 8, every_s: float = 0.25) -> list[Check]:
    """The same read, sampled ``samples`` times ``every_s`` apart: does this machine's memory keep
    one speed? A VM shares it with other machines (hardware/read_probe.py: 25–51 GB/s on the
    project's AMD EPYC VM, moving over seconds to minutes), and then every % of a bound moves too."""
    import time

    from minillm.hardware.read_probe import ReadProbe
    probe = ReadProbe(dev, nbytes)
    if not probe.active:
        return []
    for i in range(samples):
        if i:
            time.sleep(every_s)
        probe.sample()
    probe.close()
    drift = probe.drift()
    seen = (f"{drift.low / 1e9:.1f}–{drift.high / 1e9:.1f} GB/s (×{drift.ratio:.2f}) over {samples} reads "
            f"in {samples * every_s:.0f} s")
    if drift.moved:
        return [Check("read speed over time", "--",
                      f"{seen}: it moved, so will every % of a bound measured now; "
                      "`roofline` and `bench` sample it around each measurement")]
    return [Check("read speed over time", "OK", f"{seen}: steady for now (`roofline` and `bench` sample it "
                                                "around each measurement, in case it moves later)")]


def check_cpu_bf16() -> list[Check]:
    """Does this CPU compute in bf16 natively? Without AVX512-BF16 / AMX-BF16 (x86) or BF16 (Arm)
    a bf16 matmul converts to fp32 in software: half the bytes, not half the time."""
    import minillm.hardware.machine as hw
    have = hw.cpu_bf16_instructions()
    if have is None:
        return [Check("cpu bf16", "--", "could not read the CPU's instruction flags")]
    if not have:
        return [Check("cpu bf16", "--", "no native bf16 instructions (no avx512_bf16 / amx_bf16 / Arm bf16): "
                                        "bf16 matmuls are converted to fp32 in software, so bf16 decode on "
                                        "this CPU is no faster than fp32 though it reads half the bytes; use "
                                        "fp32 here")]
    return [Check("cpu bf16", "OK", f"native bf16 instructions: {', '.join(have)} (oneDNN uses them for bf16 "
                                    f"matmuls; the CPU default dtype stays fp32)")]


def check_huge_pages() -> list[Check]:
    """Whether the system gives 2 MiB pages (hardware/pages.py): the engine holds its chosen matmuls'
    weights in them, and the read bound's buffer is read through them, where it does."""
    from minillm.hardware.pages import can_ask, thp_mode
    mode = thp_mode()
    if can_ask():
        return [Check("2 MiB pages", "OK", f"transparent huge pages: {mode}; the engine asks for them for "
                                           "its weights, and the read bound is measured in them")]
    return [Check("2 MiB pages", "--", f"transparent huge pages: {mode or 'not available'}; weights and the "
                                       "read bound stay in base pages (on the project's AMD EPYC VM, 2 MiB "
                                       "pages read 1.1–1.2× faster: hardware/pages.py)")]


def check_matmul_choice() -> list[Check]:
    """The decode matmuls chosen on this CPU (engine/matmul.py), as cached by earlier runs: which
    kernel each weight shape uses. Nothing is measured here; the first engine on a CPU does that."""
    import json

    from minillm.engine import matmul
    here, found = matmul.machine_id(), []
    for p in sorted(matmul.cache_dir().glob("*.json")) if matmul.cache_dir().is_dir() else []:
        try:
            ch = matmul.MatmulChoice.from_dict(json.loads(p.read_text()))
        except (ValueError, KeyError, TypeError):
            continue
        if ch.machine == here:
            ch.cached = True
            found.append(ch)
    if not found:
        return [Check("decode matmuls", "--",
                      f"none chosen on this CPU yet ({here}): the first engine measures "
                      f"them (about 8 s for cpu-small) and caches the choice in "
                      f"{matmul.cache_dir()}")]
    return [Check("decode matmuls", "OK", ch.summary()) for ch in found]


def check_default_assets() -> list[Check]:
    try:
        from minillm.engine.tokenizer import DEFAULT_TOKENIZER_DIR, load_tokenizer
        tok = load_tokenizer(None)
        ids = tok.encode("hello 你好")
        assert tok.decode(ids) == "hello 你好"
        return [Check("default tokenizer", "OK",
                      f"{len(tok)} tokens, round-trips text ({DEFAULT_TOKENIZER_DIR.name})")]
    except Exception as e:
        return [Check("default tokenizer", "FAIL", f"{type(e).__name__}: {e}")]


def run_checks(measure: bool = True) -> list[Check]:
    """``measure=False`` skips the bandwidth measurement (a second or two of large buffers)."""
    return (check_dependencies() + check_torch_build() + check_devices() + check_cpu_bf16()
            + check_bandwidth(measure) + check_huge_pages() + check_matmul_choice() + check_default_assets())


def main(argv: list[str] | None = None) -> int:
    checks = run_checks()
    for c in checks:
        print(c.line())
    failed = [c for c in checks if c.status == "FAIL"]
    print(f"\n{len(failed)} check(s) failed" if failed else "\nall required checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
