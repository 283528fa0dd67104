"""An optional compiled decode step (``EngineConfig.compile``): ``torch.compile`` of the static decode.

Eager PyTorch runs a decode step as a few hundred small ops, each a Python call and a kernel
launch. ``torch.compile`` (TorchDynamo traces the step, Inductor generates code: C++/OpenMP on a
CPU, Triton on a GPU) fuses the elementwise ops around the matmuls (norms, RoPE, SiLU·up,
residual adds) into fewer kernels and takes Python off the per-op path. The matmuls themselves
stay library calls, so the bytes a step reads do not change: what can shrink is the time outside
the matmuls.

What is compiled: the runner's static decode (``ModelRunner`` with ``static_decode``): on a CPU one
graph per row bucket with the K/V length dynamic, or just two (1 row, and 2 rows up with the rows
dynamic) where every matmul is the tiled kernel (below); on CUDA one per bucket of (rows, K/V length),
each then captured as a CUDA graph. Prefill steps stay eager (their shapes vary with every prompt).
Beside the chosen matmuls the compiled step calls the project's decode attention kernel
(``engine/attention_kernel.py``), as eager steps do; on the plain path in fp32 its decode attention is
written as sums that Inductor fuses with the K/V gather (``attention.decode_attention_by_reduction``,
with its measurements).
The first step of each bucket pays the compilation; that time is logged and kept in the step's
``StepRecord.compile_ms`` and in ``ModelRunner.compile_s``. Eager stays the default and the
reference: the tests pin compiled tokens against eager ones.

Inductor's settings on a CPU (``inductor_options``) were chosen by measurement: batch-1 decode of
``cpu-small`` on the project's 2-core Xeon (AVX512-BF16 and AMX), one setting at a time:

- ``cpp_wrapper``: the generated code calls its kernels from C++ instead of a Python wrapper, so
  the host work between two matmuls shrinks again (fp32: 66.8 → 68.9 tok/s). Its price is a C++
  build of the wrapper at every compile, about 4 s, which no cache saves (frozen weights make each
  graph's wrapper new). Measured per row bucket, three rounds alternating with and without it
  (fresh processes, engine step of ``cpu-small`` at 128 cached tokens, median of 60, 2 threads):
  fp32 at 1 row 12.33–12.52 ms with it against 12.93–13.46 without, compile 15.5–16.0 s against
  11.4–11.8; at 8 rows 22.85–23.40 ms against 22.18–23.96 (no gain), compile 14.4–14.7 s against
  9.3–10.5. bf16 at 8 rows 7.54–7.90 ms against 8.04–9.02: a gain. Between them (the same VM,
  a later day, alternating): fp32 at 2 rows 15.10 and 15.36 ms with it against 15.92 and 16.35
  without; at 4 rows, five rounds, 17.85, 18.54, 18.13, 18.62, 18.04 against 18.02, 18.66,
  18.98, 19.12, 19.41 (ahead in every round, by 0.6–7 %), for 1–5 s more compile (16.8–17.3 s
  against 12.0–15.9 with a warm kernel cache). So fp32 builds the wrapper up to
  ``FP32_WRAPPER_ROWS`` rows, where the host's share of the step is largest, and bf16 at every
  bucket: where it gains, a faster step is worth the seconds (the sweep keeps the faster path).
- bf16: ``freezing`` plus ``max_autotune`` with Inductor's C++ GEMM template. Freezing turns the
  weights into constants, which lets Inductor lay them out ahead of time for the CPU's bf16
  matrix units (AMX); max-autotune times that generated GEMM against ATen's for each matmul
  shape and keeps the faster. Eager bf16 is *not* faster than fp32 on this CPU, although it
  reads half the bytes: torch's one-row bf16 matmul runs at about 14 GB/s, while fp32's
  reaches 27 (the bf16 kernel is limited by its arithmetic, not by memory). Measured, compiled
  bf16: 62.3 tok/s plain, 82.1 frozen (oneDNN's pre-packed bf16 kernels), 89.9 frozen with the
  C++ wrapper, 115.0 with max-autotune, 125.1 once the K/V length became dynamic (one graph
  per row bucket; the runner); the same greedy tokens every time. In ``bench --peers`` (7
  rounds, interleaved): 143.9 tok/s, 1.25× llama.cpp's BF16; on a later, faster day of the same
  VM 189.1 and 189.4 tok/s, 1.25× and 1.26×.
  On the AMD EPYC VM (no AMX) the autotuning misleads at 1 row: with Inductor's C++ template
  alone (``max_autotune_gemm_backends="CPP"``) the 1-row step took 7.29, 7.11, 6.85, 6.92 ms against
  9.75, 7.23, 7.56, 8.32 with ATen's kernels among the choices (``cpu-small``, 128 cached tokens,
  median of 60, fresh processes alternating), but 23.38 and 27.76 ms against 13.06 and 18.18 at 8
  rows. A likely cause, not measured: autotuning times each GEMM alone, where a weight of a few MB
  can sit in the cache, which the step's weights do not. Using it would take a choice per bucket by
  a whole-step measurement, and it has not been measured on the Xeon, so the setting is unchanged.
  Where the machine chose the project's tiled kernel for every shape (``engine/tiled_kernel.py``), the
  compiled bf16 decode keeps it (``MatmulChoice.kept_when_compiled`` has the measurement): the matmuls
  reach Inductor as opaque operator calls, and there is no GEMM left for it to autotune.
  The price: a first compile of about 25 s (the GEMMs are benchmarked; Inductor prints the
  timings), and each compiled row bucket holds a pre-packed copy of the weights beside the
  eager ones that prefill uses (measured: +293 MB of RSS for ``cpu-small``, then flat while
  the K/V length grew through four buckets).
- fp32 is frozen too (no max-autotune). Each row bucket is its own graph, so freezing packs every
  weight for exactly that many rows (MKL's packed sgemm). Measured on the same VM
  (torch 2.13.0+cpu, 2 threads, engine step of ``cpu-small`` at 128 cached tokens, median of 30):
  not frozen 13.8 ms at batch 1 and 33.9 ms at batch 8 (MKL's plain sgemm does not share the
  weight read across rows), frozen 12.9–13.5 ms and 24.3–25.6 ms. Autotuning Inductor's C++
  template against it chose MKL's packed kernel for every shape and only added compile time.
  The price is memory: each compiled row bucket holds its own packed copy of the weights.
  That was the Xeon. On the project's AMD EPYC VM MKL's packed kernel does not share its read
  (one 8192×768 weight: 1.12 ms at 1 row, 3.03 at 8, against 0.95 and 1.06 in oneDNN's), and the
  compiled step took 23.1 ms at 1 row and 54.9 at 8, slower than eager with the chosen kernels. So
  the runner keeps the decode matmuls chosen on the machine (``engine.matmul``) frozen as they are
  wherever they ran a step's matmuls faster than MKL's packing, timed beside them
  (``matmul.prepare``): there 16.6 and 20.0 ms. In the graph of one row each weight is then read
  as a product and a sum over the input features (``matmul_kernels.one_row_reduction``), which
  Inductor generates as one streaming loop, where the machine timed that faster than the chosen
  kernel for the shape (``matmul.reduce_one_row``): on the AMD VM 9.1–11.9 ms a step against
  13.7–17.0 (``cpu-small``, 128 cached tokens, median of 60, the same tokens as eager).
- fp32 without Inductor's C++ tiling heuristics (``cpp.enable_tiling_heuristics``). The fp32 decode
  attention's reductions (``attention.decode_attention_by_reduction``) made code generation 6 s
  longer per bucket: the scheduler's codegen took 10.2 s at 8 rows against 4.0 with the attention
  kernel, almost all of it trying tilings for those kernels. Without the heuristics, alternating
  fresh processes: at 8 rows compile 15.2–15.5 s against 21.5–21.7 and steps 22.87/23.08 ms
  against 22.66/23.75 (the attention kernel: 24.91/25.54 ms, 12.4–12.5 s); at 1 row 19.2 s against
  19.5–19.6 and 13.60/12.86 ms against 13.74/13.10.

What a compile costs, and what did not cut it (fp32, the same VM on a slower day, 2 threads): the
whole step is one graph, so the compile grows with the layers, 17.3 s for ``cpu-small``'s 12 layers
at 8 rows against 6.8 s for the same model cut to 2 (about 1 s per layer; Inductor's scheduling and
code generation take most of it). Inductor settings that shorten scheduling or fusion
(``loop_ordering_after_fusion`` off, ``max_fusion_size`` 8, no horizontal fusion, no size asserts)
each compiled as slowly as the default, from an empty cache, and ran no faster. A kernel cache
left by an earlier run cuts a compile by about a third (35.1 → 23.1 s at 1 row, 22.0 → 15.5 s at
8). Where the rest goes, from ``torch._dynamo.utils.compile_times()`` (8 rows, no wrapper, kernel
cache warm, a normal day: 9.8 s): TorchDynamo's tracing 1.2 s; functionalization, graph passes
and freezing (the weights packed for MKL) 2.7 s; Inductor's scheduler 0.9 s and its code
generation 3.3 s; loading 0.2 s. From an empty kernel cache add about 3.5 s of C++ compiling. The
FX graph cache, which would let a second run skip all of it, is bypassed ("mkldnn tensors
unpickleable": the packed weights are constants of the graph), and so is AOTAutograd's cache
("Cannot cache a graph with freezing enabled"). Compiling one
decoder layer and reusing it for all twelve (the weights as graph inputs) cannot keep the packed
weights frozen: Inductor lowers oneDNN's packed linear only for a constant weight. Called through
an opaque operator instead, the layers still compiled as 12 graphs (the layer index the K/V cache
is read by specialises each), in 11.0 s, and the step ran slower than eager with the same matmuls
(28.7 against 26.1 ms at 1 row). One graph for every row bucket from 2 up (the rows marked dynamic,
as the K/V length is) works where every decode matmul is the project's tiled kernel
(``ModelRunner.rows_dynamic``): its operator takes the row count as a symbol, and the static decode's
metadata says "every row decodes" instead of holding the count as a Python int (which specialised the
graph). Measured from an empty kernel cache (``cpu-small``, AMD EPYC VM, 2 threads): fp32 compiled
the 1-row graph in 17.0 s and the 2-row one in 20.8 s, then ran 4, 8, 16 and 64 rows with no compile
(first steps 0.5–7.1 s, the decode included); per-request 67.2, 71.4, 68.4, 68.2, 38.9, 12.4 tok/s at
1, 2, 4, 8, 16, 64 rows in that process. bf16: 18.3 and 18.8 s, then 105.0, 113.2, 112.4, 87.9, 54.6,
17.3. The cache's slot count is dynamic then too (one size for every layer's K and V: the step says
they are equal, ``ModelRunner._static_step``), so an engine of another batch size on the same model
reuses both graphs (the main job builds one engine per batch: its bf16 sweep from an empty cache took
71 s against 152 s when each batch compiled its own). With oneDNN's packed linear kept it stays one
graph per bucket: Inductor's lowering of it asserts on a symbolic row count (torch 2.13.0+cpu). Nor
can the kept kernels do without freezing: unfrozen, their packed weights are graph inputs and the same
lowering fails. A second engine on the same model with the same bucket and cache shapes does reuse the
graph (a first step of 0.3 s against 17.9).
"""
from __future__ import annotations

import functools
import os
import shutil
import types
import weakref
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
        return ("Inductor compiles C++ on a CPU, and no C++ compiler (g++, c++, clang++ or $CXX) "
                "is on the PATH")
    if dev.type == "cuda":
        try:
            import triton  # noqa: F401
        except Exception:
            return "Inductor generates Triton kernels on a GPU, and triton is not importable"
    if dev.type == "mps":
        return "the compiled decode is tested on CPU and CUDA only"
    return None


FP32_WRAPPER_ROWS = 4      # fp32 decode buckets up to this many rows build the C++ wrapper


def inductor_options(device: torch.device | str, dtype: torch.dtype, rows: int) -> dict:
    """Inductor settings for a decode bucket of ``rows`` rows (why each, with the measurements:
    the module docstring)."""
    if torch.device(device).type != "cpu":
        return {}                                 # on CUDA the step is captured as a CUDA graph anyway
    options = {"cpp_wrapper": dtype != torch.float32 or rows <= FP32_WRAPPER_ROWS, "freezing": True}
    if dtype == torch.bfloat16:
        options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    if dtype == torch.float32:
        options["cpp.enable_tiling_heuristics"] = False
    return options


def compiling(device: torch.device | str, dtype: torch.dtype, rows: int):
    """A context in which a bucket's first step compiles with ``inductor_options``. They are set
    for the whole call, not passed as ``torch.compile(options=...)``: freezing must already be on
    while TorchDynamo traces (it then keeps the weights as constants instead of graph inputs),
    and ``options`` reach Inductor only after tracing. Later steps replay the compiled code and
    need no setting (a patch costs about 20 µs, so it is not paid every step)."""
    import torch._inductor.config
    return torch._inductor.config.patch(inductor_options(device, dtype, rows))


def raise_recompile_limit(graphs: int) -> None:
    """Let TorchDynamo keep at least ``graphs`` graphs of one function (past its limit it silently
    runs the function eagerly)."""
    import torch._dynamo
    cfg = torch._dynamo.config
    if hasattr(cfg, "recompile_limit"):
        cfg.recompile_limit = max(cfg.recompile_limit, graphs)
    else:                                     # older torch: the same setting's old name
        cfg.cache_size_limit = max(cfg.cache_size_limit, graphs)


# One code object per model: TorchDynamo keeps its compiled graphs on the code object it traced, and the
# guards no longer check the model (below), so two models of the same shapes sharing one code object
# share graphs, and the second ran the first one's frozen weights (measured: a second `tiny` model's
# compiled greedy tokens were neither its own eager ones nor the first model's). Engines on one model
# still share its graphs.
_STEP_CODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _step(fn: Callable, *args):
    return fn(*args)


def compile_step(fn: Callable, max_buckets: int, model: torch.nn.Module) -> Callable:
    """``torch.compile(fn)`` with static shapes, except what the runner marks dynamic (the K/V
    length on a CPU): one graph per decode bucket. TorchDynamo keeps at most ``recompile_limit``
    graphs per function (8 by default) and then silently runs eager; the runner has up to
    ``max_buckets`` buckets, so the limit is raised to cover them.

    Guards: before each call TorchDynamo checks that what it traced still holds. Checking every
    weight and module attribute of the model cost about 0.29 ms per step (2 % of a batch-1 fp32
    step on ``cpu-small``); the model is never modified once an engine runs, so those guards are
    dropped (``skip_guard_on_all_nn_modules_unsafe``, 0.08 ms). Guards on the step's own inputs,
    the bucket's buffers and the cache, stay; which model ran is told by the code object instead
    (``_STEP_CODES``)."""
    raise_recompile_limit(max_buckets)
    code = _STEP_CODES.setdefault(model, _step.__code__.replace())       # a new code object per model
    step = types.FunctionType(code, _step.__globals__, "decode_step")
    compiled = torch.compile(step, dynamic=False,
                             options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
    return functools.partial(compiled, fn)
