"""Decode matmuls that read each weight once per step, whatever the batch: chosen per machine by
measurement (chapter 10.3).

Decode is bound by the weight read: one step reads every weight once, so a batch of B requests
should cost nearly what one costs, until compute catches up (the crossover B*). That holds only if
the matmul library streams a weight once for all B rows. On a CPU it depends on the library and
the CPU, not on the roofline. Measured on the project's VM (AMD EPYC, 2 cores, AVX-512 and
AVX512-BF16, no AMX), torch 2.13.0+cpu, 2 threads, 24 weights of 4096×768 (302 MB fp32, far past
the 32 MiB cache), median of 30 passes:

=====  ==================  ==================  =======================
rows   fp32 ``F.linear``   fp32 oneDNN packed  bf16 oneDNN packed
=====  ==================  ==================  =======================
1      24.4 ms (12 GB/s)   12.8 ms (24 GB/s)   4.6 ms (33 GB/s)
2      43.6 ms             13.7 ms             5.6 ms
4      34.1 ms             11.2 ms             4.4 ms
8      28.7 ms             12.6 ms             6.2 ms
64     79.1 ms             47.5 ms             24.6 ms
=====  ==================  ==================  =======================

MKL's sgemm behind ``F.linear`` costs almost twice as much for a second row: a batch does not share
its read, and a learner's per-request line falls from B = 1, which the chapter never describes.
oneDNN with the weight reordered once ahead of time (what Inductor's ``freezing`` does) stays flat
to B = 8, but reads slowly at 1 and 2 rows; the project's own kernel (``engine/tiled_kernel.py``) wins
both. On the Intel Xeon MKL was the good one at B = 1, so the choice is made by measurement on the
machine that runs, never by vendor name.

:func:`choose` times every candidate this torch build offers (:data:`CANDIDATES`) for each weight shape of
the model at each decode row bucket and one prefill-sized bucket, over a stack of copies larger than the
cache (a single 12 MB weight would be timed from cache, at a speed decode never sees), and checks each
against ``F.linear``. A candidate holds its weight in a layout (plain, transposed, oneDNN's blocked one),
and one layout is held per weight: the one whose fastest candidate at each bucket has the least geometric
mean, over the buckets, of its time ÷ the best time there (the tiled layout wins a near tie:
``TILED_WITHIN``). Then each row bucket runs the fastest candidate of that layout
(:attr:`ShapeChoice.by_rows`): on the Intel Xeon VM (2 threads, fp32) oneDNN's 1-row kernel read an 8192×768
weight in 0.98 ms against 1.13 ms padded to 4 rows, while at 4 rows the padded one won, 1.23 against 1.27
ms. A second layout for the rows where it wins is not held: torch's own ``F.linear`` ran ``cpu-small``'s
batch-1 forward faster there (18.3–19.4 ms against 22.1–22.9, three runs each), but it would double the
memory the weights take, and at 4 rows and more it costs up to twice the read. The choice is cached per
machine, torch, threads, dtype and shapes (:func:`cache_path`), so a second run pays nothing.
:func:`apply` then swaps the chosen modules for
:class:`PackedLinear`; the plain ``nn.Linear`` (``EngineConfig.matmul="aten"``, or ``enforce_eager``) stays
the readable reference, and the tests pin the chosen path's tokens to it.

Only a CPU has a choice here: on CUDA, cuBLAS already reads a weight once for a small batch.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from minillm.core.result import Result
from minillm.engine import attention_kernel, tiled_kernel
from minillm.engine.config import MATMUL_MODES
from minillm.engine.cpp_build import build_side_by_side
from minillm.engine.matmul_kernels import (  # noqa: F401  (_onednn_ok: the tests skip on it)
    CANDIDATES,
    INDUCTOR_FP32,
    ONE_ROW_REDUCTION,
    TILED_WITHIN,
    PackedLinear,
    _mkl_packed,
    _onednn_ok,
    inductor_packing_timed,
    one_row_reduction,
    route,
)
from minillm.engine.matmul_timing import (  # noqa: F401  (choose_decode_attention: the tests call it here)
    STACK_BYTES,
    choose_decode_attention,
    compiled_one_row_reduction,
    disagreement,
    pass_ms,
    tolerance,
    weight_stack,
)
from minillm.hardware.quiet import busy_now

log = logging.getLogger("minillm.engine")

DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)  # the decode buckets the choice is timed at
PREFILL_ROWS = 256                      # one prefill-sized bucket: the packed weight serves prefill too


# ---------------------------------------------------------------------------------------------
# The choice, per weight shape
@dataclass
class ShapeChoice:
    out_features: int
    in_features: int
    bias: bool
    chosen: str
    ms: dict[str, dict[str, float]] = field(default_factory=dict)    # candidate → {rows: ms per copy}
    rejected: dict[str, str] = field(default_factory=dict)           # candidate → why (wrong or failed)
    by_rows: dict[str, str] = field(default_factory=dict)            # row bucket → chosen's layout's kernel
    inductor_ms: dict[str, float] = field(default_factory=dict)      # rows → ms of INDUCTOR_FP32 (fp32, MKL)
    count: int = 1                                                   # nn.Linear layers of this shape
    reduction_ms: float | None = None            # ONE_ROW_REDUCTION at 1 row, compiled (a compiled decode's)
    reduction_beside_ms: float | None = None     # the kernel chosen for 1 row, timed in turn with it

    def reduces_one_row(self) -> bool:
        """A compiled decode of one row reads this shape through ONE_ROW_REDUCTION: it was timed faster
        than the kernel the choice runs at 1 row, the two in turn."""
        return (self.reduction_ms is not None and self.reduction_beside_ms is not None
                and self.reduction_ms < self.reduction_beside_ms)

    def chosen_ms(self, rows: int) -> float:
        """ms per weight of the kernel this shape runs at ``rows`` rows."""
        return self.ms[self.by_rows[str(rows)]][str(rows)]

    @property
    def shape(self) -> str:
        return f"{self.out_features}x{self.in_features}" + ("+bias" if self.bias else "")

    def described(self) -> str:
        """``chosen``, and the row buckets that run another kernel of its layout."""
        other = [r for r, n in self.by_rows.items() if n != self.chosen]
        if not other:
            return self.chosen
        names = sorted({self.by_rows[r] for r in other})
        return f"{self.chosen} ({', '.join(names)} at {'/'.join(other)} rows)"


@dataclass
class MatmulChoice(Result):
    key: str
    machine: str
    torch_version: str
    threads: int
    dtype: str
    row_counts: list[int]
    rows: list[ShapeChoice]                 # one per weight shape
    seconds: float = 0.0
    cached: bool = False
    attention: str = "native"               # decode attention: "native" (the model's dtype) or "fp32"
    attention_us: dict[str, dict[str, float]] = field(default_factory=dict)   # way → {rows: µs per layer}
    load: float | None = None               # cores other programs kept busy just before it was measured
    busy: bool = False                      # measured on a busy machine: measured again once it is quiet
    row_type: ClassVar[type] = ShapeChoice

    def chosen(self, out_features: int, in_features: int, bias: bool) -> str:
        s = self.for_shape(out_features, in_features, bias)
        return s.chosen if s is not None else "aten"

    def for_shape(self, out_features: int, in_features: int, bias: bool) -> ShapeChoice | None:
        for s in self.rows:
            if (s.out_features, s.in_features, s.bias) == (out_features, in_features, bias):
                return s
        return None

    def compiled_speedup(self) -> float | None:
        """How many times faster the chosen kernels run one decode step's matmuls than the MKL
        packing Inductor's freezing would put in their place: Σ over the shapes of layers × ms,
        chosen against MKL's, the geometric mean over the decode row buckets. None where that
        packing was not timed (bf16; a torch without MKL, whose frozen fp32 graph keeps F.linear,
        which the choice already beat)."""
        rows = [r for r in self.row_counts if r in DECODE_ROWS]
        if not rows or not all(str(r) in s.inductor_ms for s in self.rows for r in rows):
            return None
        ratios = [sum(s.count * s.inductor_ms[str(r)] for s in self.rows)
                  / sum(s.count * s.chosen_ms(r) for s in self.rows) for r in rows]
        return math.prod(ratios) ** (1 / len(ratios))

    def kept_when_compiled(self) -> bool:
        """Whether a compiled decode runs these kernels (frozen) rather than Inductor's. bf16: where every
        shape is tiled (``cpu-small``'s compiled step, AMD VM, 128 cached tokens, median of 8 rounds: 7.05,
        8.11 ms at 1 row, 12.43, 11.01 at 8; Inductor's bf16 GEMMs 7.88, 9.00 and 14.19, 13.91)."""
        if self.dtype != "float32":
            return all(s.chosen == "tiled" for s in self.rows)
        speedup = self.compiled_speedup()
        return speedup is None or speedup > 1

    def compiled_line(self) -> str:
        speedup = self.compiled_speedup()
        if speedup is None:
            kept = "keeps these kernels" if self.kept_when_compiled() else "Inductor's own GEMMs"
            return f"compiled decode: {kept} (Inductor's MKL packing not timed here)"
        reduced = [s.shape for s in self.rows if s.reduces_one_row()]
        one_row = (f"; at 1 row {len(reduced)} of {len(self.rows)} shapes as a fused reduction"
                   if speedup > 1 and any(s.reduction_ms is not None for s in self.rows) else "")
        return (f"compiled decode: {'keeps these kernels' if speedup > 1 else 'packs for MKL (Inductor)'}, "
                f"{speedup:.2f}× the speed of MKL's packed sgemm over the decode buckets{one_row}")

    def summary(self) -> str:
        """One line: which candidate each weight shape uses, and what a compiled decode runs."""
        how = ("cached" if self.cached else f"measured in {self.seconds:.1f} s") + (
            " on a busy machine: measured again when it is quiet" if self.busy else "")
        # the project's attention kernel runs where it builds; the measured SDPA choice is its stand-in
        kernel = attention_kernel.available(getattr(torch, self.dtype))
        att = ("; decode attention: the project's kernel" if kernel
               else f"; SDPA decode attention in {self.attention}" if self.attention_us else "")
        compiled = f"; {self.compiled_line()}" if self.compiled_speedup() is not None else ""
        return (f"decode matmuls ({self.dtype}, {self.threads} threads, {how}): "
                + ", ".join(f"{s.shape} → {s.described()}" for s in self.rows) + att + compiled)

    def table(self) -> str:
        """ms per weight at each row count, every candidate, the chosen one marked."""
        lines = [self.summary(),
                 f"{'shape':<16}{'candidate':<21}" + "".join(f"{r:>9}" for r in self.row_counts)]
        for s in self.rows:
            for name, by_rows in s.ms.items():
                mark = " *" if name == s.chosen else ""
                lines.append(f"{s.shape:<16}{name + mark:<21}"
                             + "".join(f"{by_rows.get(str(r), float('nan')):>9.3f}"
                                       + ("<" if s.by_rows.get(str(r)) == name else " ")
                                       for r in self.row_counts))
            if s.inductor_ms:
                lines.append(f"{s.shape:<16}{INDUCTOR_FP32 + ' (compiled)':<21}"
                             + "".join(f"{s.inductor_ms.get(str(r), float('nan')):>9.3f} "
                                       for r in self.row_counts))
            if s.reduction_ms is not None:
                lines.append(f"{s.shape:<16}{'reduction (compiled)':<21}{s.reduction_ms:>9.3f}"
                             + ("<" if s.reduces_one_row() else " "))
            for name, why in s.rejected.items():
                lines.append(f"{s.shape:<16}{name:<21} rejected: {why}")
        for way, by_rows in self.attention_us.items():
            mark = " *" if way == self.attention else ""
            lines.append(f"{'attention':<16}{way + mark:<21}"
                         + "".join(f"{by_rows.get(str(r), float('nan')) / 1e3:>9.3f}"
                                   for r in self.row_counts))
        lines.append("(ms per weight, attention ms per layer at 256 cached tokens, median; * the chosen one, "
                     "whose layout is held: the least geometric mean of time ÷ the best at each row count; "
                     "< the kernel each row count runs, the fastest of that layout; "
                     f"{INDUCTOR_FP32} (compiled): what Inductor's freezing would run instead, "
                     "packed per row count; reduction (compiled): one row as a sum Inductor fuses, "
                     "timed at 1 row)")
        return "\n".join(lines)


def linear_shapes(model: nn.Module) -> list[tuple[int, int, bool]]:
    """The distinct (out, in, bias) shapes of the model's untied ``nn.Linear`` layers."""
    return list(linear_shape_counts(model))


def linear_shape_counts(model: nn.Module) -> dict[tuple[int, int, bool], int]:
    """How many untied ``nn.Linear`` layers have each (out, in, bias) shape, in the model's order."""
    seen: dict[tuple[int, int, bool], int] = {}
    for _, mod in _linears(model):
        key = (mod.out_features, mod.in_features, mod.bias is not None)
        seen[key] = seen.get(key, 0) + 1
    return seen


def _linears(model: nn.Module):
    """(parent, name) of every nn.Linear whose weight is its own: a tied lm_head shares the
    embedding's storage, which must stay plain for the embedding lookup."""
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for parent in model.modules():
        for name, mod in parent.named_children():
            if isinstance(mod, nn.Linear) and id(mod.weight) not in tied:
                yield (parent, name), mod


def machine_id() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one) and the core count: a choice
    made on one CPU is not reused on another."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}; {os.cpu_count()} cores"


def cache_dir() -> Path:
    return Path(os.environ.get("MINILLM_CACHE_DIR") or Path.home() / ".cache" / "minillm") / "matmul"


def choice_key(shapes: list[tuple[int, int, bool]], dtype: torch.dtype, rows: tuple[int, ...],
               heads: tuple[int, int, int] | None = None) -> str:
    what = {"machine": machine_id(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "dtype": str(dtype), "shapes": sorted(shapes), "rows": list(rows), "heads": heads,
            "candidates": sorted(CANDIDATES),
            "routed": f"by layout (tiled within {TILED_WITHIN}), then by row bucket",
            "compiled": INDUCTOR_FP32 if inductor_packing_timed(dtype) else None}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(key: str) -> Path:
    return cache_dir() / f"{key}.json"


def choose_for_shape(out_features: int, in_features: int, bias: bool, dtype: torch.dtype,
                     rows: tuple[int, ...], repeats: int = 3, stack_bytes: int = STACK_BYTES,
                     candidates: tuple[str, ...] | None = None) -> ShapeChoice:
    """Time each available candidate for one weight shape at each row count; keep the fastest correct."""
    g = torch.Generator().manual_seed(0)
    weights, b, probe, want = weight_stack(out_features, in_features, bias, dtype, stack_bytes, g)
    rtol, atol = tolerance(dtype)
    sc = ShapeChoice(out_features, in_features, bias, "aten")
    ready: dict[str, list[torch.Tensor]] = {}
    for name in candidates or tuple(CANDIDATES):
        c = CANDIDATES[name]
        if not c.available(dtype):
            continue
        try:
            held = [c.prepare(w) for w in weights]
            got = c.forward(probe, held[0], b).float()
        except (RuntimeError, ValueError) as e:   # a kernel this build, CPU or shape lacks: not a choice
            sc.rejected[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            continue
        if got.shape != want.shape or not torch.allclose(got, want, rtol=rtol, atol=atol):
            sc.rejected[name] = f"differs from F.linear by {(got - want).abs().max().item():.3g}"
            continue
        ready[name] = held
    inductor = inductor_packing_timed(dtype) and _inductor_packing_agrees(weights[0], probe, b, want, sc)
    # candidates interleaved within each repeat, so a burst of other work hits them all alike
    for r in rows:
        x = torch.randn(r, in_features, generator=g).to(dtype)
        timed = {name: (CANDIDATES[name].forward, held) for name, held in ready.items()}
        if inductor:                       # packed for exactly r rows, as a frozen graph of r rows is
            timed[INDUCTOR_FP32] = (_mkl_packed(r), [(torch.ops.mkl._mkl_reorder_linear_weight(w, r), w)
                                                     for w in weights])
        samples: dict[str, list[float]] = {name: [] for name in timed}
        for i in range(repeats + 1):
            for name, (forward, held) in timed.items():
                ms = pass_ms(forward, held, x, b)
                if i:                      # the first pass warms up
                    samples[name].append(ms)
        for name, xs in samples.items():
            if name == INDUCTOR_FP32:
                sc.inductor_ms[str(r)] = statistics.median(xs)
            else:
                sc.ms.setdefault(name, {})[str(r)] = statistics.median(xs)
        timed.clear()
    ready.clear()
    if sc.ms:
        sc.chosen, sc.by_rows = route(sc.ms)
    return sc


def _inductor_packing_agrees(w: torch.Tensor, probe: torch.Tensor, b: torch.Tensor | None,
                             want: torch.Tensor, sc: ShapeChoice) -> bool:
    """MKL's packed sgemm gives F.linear's result here (else it is recorded as rejected, not timed)."""
    n = probe.shape[0]
    why = disagreement(lambda: _mkl_packed(n)(probe, (torch.ops.mkl._mkl_reorder_linear_weight(w, n), w), b),
                       want)
    if why:
        sc.rejected[INDUCTOR_FP32] = why
    return why is None


def time_one_row_reduction(sc: ShapeChoice, dtype: torch.dtype, repeats: int = 3,
                           stack_bytes: int = STACK_BYTES) -> None:
    """Time :data:`ONE_ROW_REDUCTION` compiled for this shape at 1 row, in turn with the kernel the choice
    runs there (``sc.reduction_ms``, ``sc.reduction_beside_ms``). Only a compiled decode can use it, so
    it is timed when one is built (``reduce_one_row``), not by every choice: each shape is a compile."""
    weights, b, probe, want = weight_stack(sc.out_features, sc.in_features, sc.bias, dtype, stack_bytes,
                                           torch.Generator().manual_seed(1))
    fn, why = compiled_one_row_reduction(weights[0], probe, b, want)
    if why:
        sc.rejected[ONE_ROW_REDUCTION] = why
    if fn is None or "1" not in sc.by_rows:
        return
    kernel = CANDIDATES[sc.by_rows["1"]]
    held = [kernel.prepare(w) for w in weights]
    samples: dict[str, list[float]] = {"reduction": [], "kernel": []}
    for i in range(repeats + 1):            # in turn; the first pass warms up
        red, ker = pass_ms(fn, weights, probe[:1], b), pass_ms(kernel.forward, held, probe[:1], b)
        if i:
            samples["reduction"].append(red)
            samples["kernel"].append(ker)
    sc.reduction_ms = statistics.median(samples["reduction"])
    sc.reduction_beside_ms = statistics.median(samples["kernel"])


def choose(model: nn.Module, rows: tuple[int, ...] | None = None, use_cache: bool = True,
           repeats: int = 3, stack_bytes: int = STACK_BYTES) -> MatmulChoice:
    """The candidate for each weight shape of ``model`` on this machine (see the module docstring):
    read from the cache when this machine, torch, thread count, dtype and shapes were measured
    before, else measured (a few seconds for ``cpu-small``) and cached. A choice measured while the
    machine was busy (one made under a load of 5 on 2 cores timed a 25 MB weight at 16–25 ms, a
    quarter of the quiet speed, and ranked the candidates by the noise) is measured again by the
    first run on a quiet machine."""
    dtype = next(model.parameters()).dtype
    rows = tuple(rows or (*DECODE_ROWS, PREFILL_ROWS))
    counts = linear_shape_counts(model)
    shapes = list(counts)
    cfg = getattr(model, "config", None)
    heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) if cfg is not None else None
    key = choice_key(shapes, dtype, rows, heads)
    path = cache_path(key)
    before = None               # the busy check sleeps a quarter second: only when it decides something
    if use_cache and path.exists():
        try:
            ch = MatmulChoice.from_dict(json.loads(path.read_text()))
            ch.cached = True
            # a choice timed while other programs ran is a choice about them: replace it once quiet
            if not ch.busy or (before := busy_now()).busy:
                return ch
        except (ValueError, KeyError, TypeError) as e:       # a damaged cache file: measure again
            log.warning("ignoring the matmul cache %s: %s", path, e)
    before = before or busy_now()
    t0 = time.perf_counter()
    with torch.inference_mode():
        found = [choose_for_shape(n, k, b, dtype, rows, repeats, stack_bytes) for n, k, b in shapes]
        for sc in found:
            sc.count = counts[(sc.out_features, sc.in_features, sc.bias)]
        ch = MatmulChoice(key, machine_id(), torch.__version__, torch.get_num_threads(),
                          str(dtype).replace("torch.", ""), list(rows), found)
        if heads is not None and dtype != torch.float32:
            ch.attention, ch.attention_us = choose_decode_attention(heads, dtype, tuple(r for r in rows
                                                                                    if r in DECODE_ROWS))
    ch.seconds = time.perf_counter() - t0
    # the load before measuring and just after (not during: our own threads raise it). Both, because a
    # job can start in between: a build that began with the choice was quiet before it, and that bf16
    # choice held oneDNN's layout for 8192x768 where a quiet one holds the tiled one. A busy choice is
    # cached but replaced by the first run on a quiet machine.
    after = busy_now()
    worse = after if after.load1 > before.load1 else before
    ch.load, ch.busy = worse.load1, before.busy or after.busy
    if ch.busy:
        log.warning("decode matmuls chosen on a busy machine (%.2f of %d cores busy with other work): "
                    "measured again when it is quiet", worse.load1, worse.cores)
    if use_cache:
        _save(ch)
    log.info("%s", ch.summary())
    return ch


def _save(ch: MatmulChoice) -> None:
    path = cache_path(ch.key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(ch.to_dict(), indent=1))
    except OSError as e:               # a read-only home: the choice still holds for this run
        log.warning("could not cache the matmul choice at %s: %s", path, e)


def apply(model: nn.Module, choice: MatmulChoice) -> int:
    """Swap each ``nn.Linear`` whose shape chose another candidate for a :class:`PackedLinear`.
    Idempotent (a module already swapped is left alone); returns how many were swapped."""
    n = 0
    for (parent, name), mod in list(_linears(model)):
        sc = choice.for_shape(mod.out_features, mod.in_features, mod.bias is not None)
        if sc is not None and sc.chosen != "aten":
            setattr(parent, name, PackedLinear(mod, sc.chosen, sc.by_rows))
            n += 1
    model.matmul_choice = choice
    return n


def restore_plain(model: nn.Module) -> int:
    """Swap every :class:`PackedLinear` back for a plain ``nn.Linear`` (its weight unpacked);
    returns how many."""
    n = 0
    for parent in list(model.modules()):
        for name, mod in list(parent.named_children()):
            if isinstance(mod, PackedLinear):
                lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None,
                                device="meta")
                lin.weight = nn.Parameter(mod.weight.detach().contiguous(), requires_grad=False)
                lin.bias = mod.bias
                setattr(parent, name, lin)
                n += 1
    model.matmul_choice = None
    model.weight_pages = None          # the plain weights are torch's own again (engine/weight_pages.py)
    return n


def prepare(model: nn.Module, mode: str = "auto", compiled: bool = False) -> MatmulChoice | None:
    """What the engine calls: on a CPU in mode ``auto``, choose and apply; else nothing (None).

    ``compiled`` (the runner compiles its decode): Inductor's freezing lays plain weights out itself,
    for MKL's packed sgemm in fp32 and for oneDNN in bf16, where it also autotunes its own GEMM
    (engine/compiled.py). So bf16 keeps the chosen kernels only where every shape is tiled, else stays plain
    (its decode attention still follows the measured choice: :func:`decode_attention_in_fp32`), and fp32
    keeps them only where they ran one step's matmuls faster than MKL's packing (``kept_when_compiled``).
    Measured on the AMD EPYC VM (2 threads, ``cpu-small`` fp32, compiled step at 128 cached tokens,
    median of 40): 16.6 ms at 1 row and 20.0 at 8 with the chosen oneDNN kernels frozen, against 23.1
    and 54.9 with MKL's packing; one 8192×768 weight took 0.95/1.06 ms (1/8 rows) in oneDNN's and
    1.12/3.03 ms in MKL's. On the Intel Xeon VM MKL's was faster (0.80/1.30 ms against 0.90/1.58)."""
    if mode not in MATMUL_MODES:
        raise ValueError(f"matmul must be one of {', '.join(MATMUL_MODES)}, got {mode!r}")
    done = getattr(model, "matmul_choice", None)
    if done is not None:
        if mode == "auto" and (not compiled or done.kept_when_compiled()):
            if compiled:
                reduce_one_row(model, done)
            return done                    # a second engine on the same model: already swapped
        restore_plain(model)               # the plain path asked for: the model follows the last engine built
    if mode == "aten" or next(model.parameters()).device.type != "cpu":
        return None
    build_side_by_side(tiled_kernel._library, attention_kernel._library)
    ch = choose(model)
    if compiled and not ch.kept_when_compiled():
        return None
    apply(model, ch)
    if compiled:
        reduce_one_row(model, ch)
    return ch


def reduce_one_row(model: nn.Module, choice: MatmulChoice) -> int:
    """Let each :class:`PackedLinear` whose shape measured :data:`ONE_ROW_REDUCTION` faster at 1 row read
    its weight that way in a compiled graph of one row; returns how many. Measured on the AMD EPYC VM
    (``cpu-small`` fp32, 2 threads, the compiled step at 128 cached tokens, median of 60, fresh processes
    alternating): 11.31 and 11.43 ms at 1 row against 17.03 and 13.65 ms with the chosen oneDNN kernels,
    352 MB read at 31 GB/s where a sum over 960 MiB read 31.8–34.2 that hour. One 8192×768 weight alone:
    1.015–1.059 ms against 1.119–1.178 for oneDNN's padded kernel, a smaller gain than the step's (where
    the rest comes from is not measured yet)."""
    untimed = [s for s in choice.rows if s.reduction_ms is None and ONE_ROW_REDUCTION not in s.rejected]
    if untimed and inductor_packing_timed(getattr(torch, choice.dtype)):
        with torch.inference_mode():
            for sc in untimed:
                time_one_row_reduction(sc, getattr(torch, choice.dtype))
        _save(choice)
    n = 0
    for mod in model.modules():
        if isinstance(mod, PackedLinear) and mod.plain is None:
            sc = choice.for_shape(mod.out_features, mod.in_features, mod.bias is not None)
            if sc is not None and sc.reduces_one_row():
                mod.reduce_one_row_when_compiled()
                n += 1
    return n


def decode_attention_in_fp32(model: nn.Module, mode: str, choice: MatmulChoice | None) -> bool:
    """Whether decode attention upcasts to fp32 (:func:`choose_decode_attention`): the applied choice's
    answer, and for a bf16/fp16 model whose compiled decode keeps Inductor's matmuls (``prepare``
    returned None) the same machine's measured answer, read from the cache. Measured on the AMD EPYC
    VM (``cpu-small`` bf16, compiled step at 128 cached tokens, median of 40, two rounds alternating):
    8 rows 23.05 and 21.70 ms with the bf16 attention kernel, 16.67 and 14.76 ms upcast; 1 row 8.09
    and 8.63 against 8.64 and 7.50."""
    if choice is not None:
        return choice.attention == "fp32"
    param = next(model.parameters())
    if mode != "auto" or param.device.type != "cpu" or param.dtype == torch.float32:
        return False
    return choose(model).attention == "fp32"
