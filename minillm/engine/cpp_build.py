"""The project's own C++ kernels (``tiled_kernel``, ``attention_kernel``) built with Inductor's toolchain.

``CppCodeCache`` compiles a source with the flags, OpenMP runtime and on-disk cache that Inductor's
generated kernels use, and loads it with ctypes. Where no compiler works, or this torch has no Inductor,
the kernel is simply not offered.

Each kernel is also a torch operator, so that a compiled decode calls it as one opaque kernel. Its CPU
implementation is registered from C++ where torch ships its stable C++ operator API
(``torch/csrc/stable``, torch 2.9 and later): Inductor's C++ wrapper then calls it through the
dispatcher without entering Python. Measured on the AMD EPYC VM (torch 2.13.0+cpu): a call from
Python cost 4.5–6.8 µs against 9.4–10.3 µs through an implementation in Python, and the build 5.2 s
against 1.5 s (once; the cache keeps it). Where that build fails the operator's implementation is the
Python function, which calls the same kernel through ctypes.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger("minillm.engine")

# What both kernels start from: a vector register of floats as GCC's vector type (AVX-512 holds 16, AVX2
# and NEON pairs 8), and loading floats or bf16 into one (bf16 widened: its bits are a float's top half).
VECTORS = r"""
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef __AVX512F__
constexpr int64_t V = 16;
#else
constexpr int64_t V = 8;
#endif
typedef float vec __attribute__((vector_size(V * sizeof(float))));
typedef uint16_t bf16;          // a bfloat16's bits: the top half of a float's
typedef uint16_t hvec __attribute__((vector_size(V * sizeof(bf16))));
typedef uint32_t uvec __attribute__((vector_size(V * sizeof(uint32_t))));

static inline vec load(const float* p) { vec v; std::memcpy(&v, p, sizeof v); return v; }
static inline vec load(const bf16* p) {                      // V bf16 widened to floats (exact)
#if defined(__AVX512F__)
  // one zero-extending load and a shift: GCC's generic conversion, tuned for a CPU that splits 512-bit
  // operations (AMD Zen 4), took four instructions on 256-bit halves
  return (vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
#elif defined(__AVX2__)
  return (vec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
#else
  hvec h; std::memcpy(&h, p, sizeof h);
  return (vec)(__builtin_convertvector(h, uvec) << 16);
#endif
}
static inline float widen(float v) { return v; }
static inline float widen(bf16 v) {
  uint32_t u = uint32_t(v) << 16; float f; std::memcpy(&f, &u, 4); return f;
}
"""

# What a registration needs: the stable API's operator, tensor and library headers, and two helpers that
# keep the dispatcher out of the common case. The stable API's ``contiguous`` and ``new_empty`` each call
# an operator by name through the dispatcher, even for a tensor that is already contiguous: four such
# calls for one attention, two for one matmul, 146 a step of ``cpu-small``. Measured on a decode step of a
# 12-layer model with tiny weights (``cpu-small``'s layers at hidden size 128, so the step is its fixed cost
# alone; compiled bf16, AMD EPYC VM, median of 60): 0.55 ms through the stable API's calls, 0.47 without.
STABLE_HEADERS = r"""
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <vector>
using torch::stable::Tensor;

static Tensor as_contiguous(const Tensor& t) { return t.is_contiguous() ? t : torch::stable::contiguous(t); }

// An uninitialised contiguous CPU tensor of like's dtype and the given sizes, from the C shim directly
static Tensor empty_cpu(const Tensor& like, const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t i = sizes.size(); i-- > 0;) { strides[i] = stride; stride *= sizes[i]; }
  int32_t dtype;
  AtenTensorHandle h;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(like.get(), &dtype));
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(int64_t(sizes.size()), sizes.data(), strides.data(),
                                                         dtype, aoti_torch_device_type_cpu(), 0, &h));
  return Tensor(h);
}
"""


def load_cpp(source: str, what: str) -> ctypes.CDLL | None:
    """The library built from ``source``, or None (logged, naming ``what``) where it cannot be built."""
    try:
        from torch._inductor.codecache import CppCodeCache
        return CppCodeCache.load(source)
    except Exception as e:                # no compiler, no Inductor, a failed build: not offered
        log.info("%s is not available here: %s", what, str(e).splitlines()[0][:200])
        return None


def stable_api_available() -> bool:
    """Whether this torch ships the stable C++ operator API's headers. Checked before building, because a
    build that fails is not cached: without this every process would try it again at start-up."""
    return (Path(torch.__file__).parent / "include" / "torch" / "csrc" / "stable" / "library.h").exists()


def profiling() -> bool:
    """``torch.profiler`` is recording. It records operators by name and never sees a ctypes call: a
    profiled eager ``cpu-small`` step whose matmuls ran the tiled kernel through ctypes read 6 % busy,
    its matmuls' time counted as nobody's (chapter 10.5's device busy). So while it records, the
    project's kernels are called as their operators: the same work, under their names."""
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))


def load_with_operator(source: str, registration: str, what: str, ops: torch.library.Library, name: str,
                       python_impl: Callable) -> ctypes.CDLL | None:
    """``source`` built with ``registration`` (C++ that registers operator ``name``'s CPU kernel), or,
    where that fails, alone, with ``python_impl`` registered as the operator's CPU kernel instead."""
    lib = None
    if stable_api_available():
        lib = load_cpp(source + STABLE_HEADERS + registration, f"{what} as a C++ operator")
    if lib is None:
        lib = load_cpp(source, what)
        if lib is not None:
            ops.impl(name, python_impl, "CPU")
    return lib


def build_side_by_side(*loaders: Callable[[], object]) -> None:
    """Run ``loaders`` (each builds one kernel, or finds it in the cache) at once, one compiler per core,
    after Inductor's checks of which vector instructions build here, also at once. Each is a compiler run
    of its own; one after another they were most of a first run's set-up: from an empty Inductor cache
    (``cpu-small`` fp32, AMD EPYC VM, 2 cores) Inductor's checks took 10.6 s, the tiled matmul 3.0 s and
    the attention kernel 3.3 s. Builds nothing that is not built anyway, and never raises: a loader that
    fails here fails again, with its message, where it is used."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        # the checks first: each kernel's build asks for their answer
        for jobs in ([(bool, isa) for isa in _vector_isas_to_check()], [(load,) for load in loaders]):
            for f in [pool.submit(*job) for job in jobs]:
                f.exception()                                       # waits; an error is not raised here


def _vector_isas_to_check() -> list:
    """The vector instruction sets Inductor will test-build on this CPU (each one a compiler run, cached
    per process); none where this torch's Inductor names them otherwise."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        from torch._inductor import cpu_vec_isa
        flags = cpu_vec_isa.x86_isa_checker()
        return [isa for isa in cpu_vec_isa.supported_vec_isa_list
                if all(flag in flags for flag in str(isa).split())]
    except Exception:                     # another Inductor: it checks them itself, one after another
        return []
