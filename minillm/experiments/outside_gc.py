"""What Python's garbage collector costs a decode (chapter 10.5: time on the host, outside the
accelerator, that no phase of a step names).

CPython's cyclic collector runs when allocations pass a threshold, in whichever thread allocated, and holds
the GIL while it runs: the engine thread's Python stops mid-step (an operator already running in C++ goes on;
the next one waits), and every stream's next token waits. A full (generation-2) collection walks every tracked
object, so its cost grows with the heap, whatever the model. Three measurements:

- :func:`collection_cost_by_heap`: a full collection's time in this process, with more live
  objects added (small lists, as an application's state would be). It grows with the heap.
- :func:`freeze_effect`: in a fresh process holding ``minillm serve``'s app, a full collection
  before and after :func:`minillm.engine.gc_pauses.freeze_startup_heap` (``gc.freeze()``). A
  subprocess, so that the caller's heap is never frozen for good (a notebook's must not be).
- :func:`gc_in_decode`: a decode while full collections run beside it (as a busy server's
  allocations would trigger them), with the heap frozen or not: the steps' ``gc_ms``
  (StepRecord), how many steps held one and the longest, beside the median and the slowest step.
  A full collection lands in one step: it is the ITL tail, not the median.
"""
from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field


def _full_collection_ms() -> float:
    t0 = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t0) * 1e3


def _live_objects(n: int) -> list[list]:
    """``n`` small lists that stay alive: tracked objects the collector must walk, as an
    application's state would be (a dict holding only numbers and strings is not tracked)."""
    return [[i] for i in range(n)]


@dataclass
class HeapPoint:
    extra: int               # live (tracked) objects added for this point
    objects: int             # tracked objects in the heap (gc.get_objects())
    full_ms: float           # a full collection, median of the repeats
    samples_ms: list[float] = field(default_factory=list)

    def line(self) -> str:
        return (f"+{self.extra:>9,} live objects → {self.objects:>9,} tracked: a full collection takes "
                f"{self.full_ms:6.1f} ms")


def collection_cost_by_heap(extras: tuple[int, ...] = (0, 250_000, 500_000, 1_000_000),
                            repeats: int = 5) -> list[HeapPoint]:
    """A full collection's time in this process, with each of ``extras`` live objects added."""
    out = []
    for extra in extras:
        ballast = _live_objects(extra)
        gc.collect()                                   # collect what is garbage now, then time clean passes
        samples = [_full_collection_ms() for _ in range(repeats)]
        out.append(HeapPoint(extra, len(gc.get_objects()), statistics.median(samples), samples))
        del ballast
    gc.collect()
    return out


def _freeze_in_this_process(model: str, repeats: int) -> dict:
    """What :func:`freeze_effect` runs in its subprocess (``python -m minillm.experiments.outside_gc``)."""
    from minillm.engine.gc_pauses import freeze_startup_heap
    from minillm.serving.app import create_app
    from minillm.serving.server import ServerConfig
    app = create_app(ServerConfig(model=model, device="cpu", port=0))     # noqa: F841 (kept alive: the heap)
    gc.collect()
    before = [_full_collection_ms() for _ in range(repeats)]
    objects = len(gc.get_objects())
    frozen = freeze_startup_heap()
    after = [_full_collection_ms() for _ in range(repeats)]
    return {"objects": objects, "frozen": frozen, "before_ms": before, "after_ms": after}


@dataclass
class FreezeEffect:
    model: str
    objects: int             # tracked objects after start-up
    frozen: int              # moved to the permanent generation
    before_ms: float         # a full collection before the freeze (median)
    after_ms: float          # and after it
    before_samples_ms: list[float] = field(default_factory=list)
    after_samples_ms: list[float] = field(default_factory=list)

    def line(self) -> str:
        return (f"a fresh server process ({self.model}): {self.objects:,} objects after start-up; a full "
                f"collection {self.before_ms:.1f} ms, after freezing {self.frozen:,} of them "
                f"{self.after_ms:.2f} ms")


def freeze_effect(model: str = "tiny", repeats: int = 5, timeout_s: float = 300) -> FreezeEffect:
    """A full collection in a fresh process holding the server's app, before and after the
    start-up heap is frozen (in a subprocess: the caller's heap stays as it is)."""
    r = subprocess.run([sys.executable, "-m", "minillm.experiments.outside_gc", model, str(int(repeats))],
                       capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit status {r.returncode}"
        raise RuntimeError(f"the server process failed: {last}")
    d = json.loads(r.stdout.strip().splitlines()[-1])
    return FreezeEffect(model, d["objects"], d["frozen"], statistics.median(d["before_ms"]),
                        statistics.median(d["after_ms"]), d["before_ms"], d["after_ms"])


@dataclass
class DecodeGc:
    frozen: bool             # the heap was frozen (gc.freeze) during the decode
    objects: int             # objects a full collection walked (gc.get_objects(): the unfrozen ones)
    collections: int         # full collections run during the decode
    steps: int
    steps_with_1ms: int      # steps that held at least 1 ms of collection
    gc_ms_max: float         # the longest collection time inside one step
    step_ms_p50: float
    step_ms_max: float

    def line(self) -> str:
        return (f"{'frozen' if self.frozen else 'not frozen':>10} ({self.objects:>9,} objects to walk): "
                f"{self.collections} full collections, {self.steps_with_1ms} of {self.steps} steps held ≥ 1 "
                f"ms of one (longest {self.gc_ms_max:.1f} ms); step p50 {self.step_ms_p50:.2f} ms, max "
                f"{self.step_ms_max:.2f} ms")


def gc_in_decode(llm, every_s: float = 0.05, freeze: bool = False, batch: int = 4,
                 new_tokens: int = 64) -> DecodeGc:
    """Decode ``batch`` requests for ``new_tokens`` tokens while a side thread runs a full
    collection every ``every_s`` seconds, as a busy server's allocations would trigger them; read
    each step's ``gc_ms``. ``freeze``: the heap is frozen for the decode (``gc.freeze()``), then
    unfrozen (``gc.unfreeze()``), so the caller's process is left as it was. A heap the caller
    had frozen already stays frozen (``gc.unfreeze`` would release all of it), and the result
    says so (``frozen`` is then True whatever ``freeze`` asked)."""
    import threading

    from minillm.engine.sampling import SamplingParams
    history = llm.engine.step_history
    last = history[-1].step if history else -1
    prompts = [list(range(3 + i, 19 + i)) for i in range(batch)]
    stop, runs = threading.Event(), []

    def collector() -> None:
        while not stop.wait(every_s):
            gc.collect()
            runs.append(1)

    gc.collect()
    frozen_before = gc.get_freeze_count() > 0
    ours = freeze and not frozen_before
    if ours:
        gc.freeze()
    objects = len(gc.get_objects())
    side = threading.Thread(target=collector, daemon=True)
    side.start()
    try:
        llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    finally:
        stop.set()
        side.join()
        if ours:
            gc.unfreeze()
    recs = [r for r in history if r.step > last and r.num_prefill_tokens == 0]
    if not recs:
        raise RuntimeError("no decode step was recorded")
    walls = [r.wall_ms for r in recs]
    gcs = [r.gc_ms for r in recs]
    return DecodeGc(freeze or frozen_before, objects, len(runs), len(recs), sum(g >= 1.0 for g in gcs),
                    max(gcs),
                    statistics.median(walls), max(walls))


# freeze_effect's subprocess: python -m minillm.experiments.outside_gc MODEL REPEATS
if __name__ == "__main__":
    print(json.dumps(_freeze_in_this_process(sys.argv[1], int(sys.argv[2]))))
