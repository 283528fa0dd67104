"""Python's garbage collector: time outside the accelerator that no phase names (chapter 10.5).

CPython frees most objects by reference counting; the cyclic collector runs now and then on top,
triggered by allocations in *any* thread. While it runs it holds the GIL: the engine thread's
Python stops mid-step, and so does every stream's next token. (An operator already running in
C++, which releases the GIL, goes on; the next one waits.) A full (generation-2) collection walks every
tracked object: a `minillm serve` process holds about 360k of them after start-up (torch,
transformers, the app), and one such collection took 65-77 ms there; inside a test process
grown to 600k objects, 140-230 ms (2-core Xeon VM, Python 3.11). The CI once saw a 322 ms token
gap with no prefill inside it: a stall of exactly this kind.

Two tools, each a few lines:

* :data:`GC_CLOCK` adds up the time spent in collections (a ``gc.callbacks`` hook), so a step can
  record how long the collector held the GIL during it (``StepRecord.gc_ms``: an upper bound on
  what it cost the step) and a diagnosis can name it instead of blaming "the host".
* :func:`freeze_startup_heap` collects once, then moves everything alive into the permanent
  generation (``gc.freeze()``): later full collections skip the start-up heap (measured: 65-77 ms
  → 0.0 ms for the server's heap). Servers do this after loading the model (vLLM does it at
  start-up as well). It belongs in a process that owns its heap, `minillm serve`; not in a
  notebook or a test process, where the frozen objects that later become cyclic garbage would
  never be freed.
"""
from __future__ import annotations

import gc
import time


class GcClock:
    """Total nanoseconds spent in the cyclic garbage collector since :meth:`install`, whichever
    thread ran it (each holds the GIL while it runs). Read it before and after a stretch of work."""

    def __init__(self) -> None:
        self.total_ns = 0
        self.collections = 0
        self._started_ns: int | None = None

    def _callback(self, phase: str, info: dict) -> None:
        # Runs in whichever thread triggered the collection, with the GIL held: no lock needed.
        if phase == "start":
            self._started_ns = time.perf_counter_ns()
        elif self._started_ns is not None:
            self.total_ns += time.perf_counter_ns() - self._started_ns
            self.collections += 1
            self._started_ns = None

    def install(self) -> GcClock:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def now_ns(self) -> int:
        return self.total_ns


GC_CLOCK = GcClock().install()   # one per process: the collector is one per process


def freeze_startup_heap() -> int:
    """Collect, then freeze what is alive (``gc.freeze``), so later full collections skip it.
    Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
