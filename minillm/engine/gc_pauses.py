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
from collections import deque

from minillm.core.trace import now_ns


class GcClock:
    """When the cyclic garbage collector ran, whichever thread ran it (each collection holds the
    GIL): the total since :meth:`install` (``spent_ns``, ``collections``) and the last collections'
    ``[start, stop]`` on the traces' clock, so a step can ask how much of *its* window they covered
    (:meth:`in_window_ns`).

    Why intervals rather than a running total read at a step's start and end: the ``stop``
    callback is Python code, and the engine thread, which has waited for the GIL through the whole
    collection, may take it before that code runs; a total read then misses a collection that
    is over, and the next step is charged for it. An interval still open (started, not yet
    stopped) counts up to the end of the window asked about, so a step's share never exceeds
    its own wall time."""

    def __init__(self, keep: int = 256) -> None:
        self.total_ns = 0
        self.collections = 0
        self.recent: deque[tuple[int, int]] = deque(maxlen=keep)   # (start, stop), oldest first
        self._started_ns: int | None = None

    def _callback(self, phase: str, info: dict) -> None:
        # Runs in whichever thread triggered the collection, with the GIL held: no lock needed.
        if phase == "start":
            self._started_ns = now_ns()
        elif self._started_ns is not None:
            stop = now_ns()
            self.recent.append((self._started_ns, stop))
            self.total_ns += stop - self._started_ns
            self.collections += 1
            self._started_ns = None

    def install(self) -> GcClock:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def spent_ns(self) -> int:
        """Nanoseconds spent in collections since :meth:`install` (read before and after)."""
        return self.total_ns

    def in_window_ns(self, t0_ns: int, t1_ns: int) -> int:
        """How much of ``[t0_ns, t1_ns]`` (the traces' clock) collections covered, one still
        running included up to ``t1_ns``."""
        covered = 0
        started = self._started_ns
        if started is not None:
            covered += max(0, t1_ns - max(started, t0_ns))
        for start, stop in reversed(self.recent):                    # newest first
            if stop <= t0_ns:
                break
            covered += max(0, min(stop, t1_ns) - max(start, t0_ns))
        return covered


GC_CLOCK = GcClock().install()   # one per process: the collector is one per process


def freeze_startup_heap() -> int:
    """Collect, then freeze what is alive (``gc.freeze``), so later full collections skip it.
    Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
