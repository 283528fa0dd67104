"""Python's garbage collector as a stage of its own (10.5): the clock that adds up its pauses, the
step records that carry them, and `minillm serve`'s frozen start-up heap."""
from __future__ import annotations

import gc

import httpx
import pytest

from minillm.engine.gc_pauses import GC_CLOCK, GcClock
from minillm.loadgen.serve_process import ServeProcess


def test_the_clock_counts_a_collection():
    gc.disable()                                      # no automatic collection in between
    try:
        before_ns, before_n = GC_CLOCK.spent_ns(), GC_CLOCK.collections
        garbage = [[] for _ in range(1000)]
        for a, b in zip(garbage, garbage[1:]):        # cycles: only the collector frees these
            a.append(b)
            b.append(a)
        del garbage, a, b
        assert gc.collect() >= 1000
    finally:
        gc.enable()
    assert GC_CLOCK.collections == before_n + 1        # one full collection, stamped start and stop
    assert GC_CLOCK.spent_ns() > before_ns
    start, stop = GC_CLOCK.recent[-1]
    assert GC_CLOCK.in_window_ns(start, stop) == stop - start > 0
    assert GC_CLOCK.in_window_ns(stop, stop + 10**9) == 0                      # nothing collected since


def test_a_window_counts_the_collections_inside_it_and_one_still_running():
    c = GcClock()
    c.recent.extend([(100, 200), (300, 400)])
    assert c.in_window_ns(150, 350) == 50 + 50
    assert c.in_window_ns(0, 1000) == 200
    assert c.in_window_ns(400, 500) == 0                 # touching an end is not inside
    c._started_ns = 450                                  # started, its stop callback not run yet
    assert c.in_window_ns(400, 500) == 50 and c.in_window_ns(460, 470) == 10


def test_installing_twice_hooks_once():
    clock = GcClock().install().install()
    gc.disable()
    try:
        assert gc.callbacks.count(clock._callback) == 1
        gc.collect()
        assert clock.collections == 1
    finally:
        gc.enable()
        gc.callbacks.remove(clock._callback)


def test_a_collection_inside_a_step_lands_in_its_record():
    from minillm.engine.llm import LLM
    from minillm.engine.sampling import SamplingParams
    llm = LLM("tiny", device="cpu", max_batch_size=2)
    engine = llm.engine
    real = engine.runner.execute
    calls = {"n": 0}

    def execute_with_a_collection(batch, rec):
        calls["n"] += 1
        if calls["n"] == 3:
            gc.collect()                              # what an allocation-triggered collection does
        return real(batch, rec)

    engine.runner.execute = execute_with_a_collection
    gc.disable()                                      # no collection but ours
    try:
        llm.generate(["a prompt"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    finally:
        gc.enable()
    recs = list(engine.step_history)[-5:]
    assert [r.gc_ms > 0 for r in recs] == [False, False, True, False, False]
    assert recs[2].to_dict()["gc_ms"] == recs[2].gc_ms


def test_serve_freezes_its_start_up_heap(tmp_path):
    """`minillm serve` owns its process: after loading it freezes what is alive, and says so in
    /v1/server-info; a full collection there then walks only what came later."""
    srv = ServeProcess(["--model", "tiny", "--device", "cpu", "--max-model-len", "128"], auth=False,
                       stderr_path=tmp_path / "err.txt")
    try:
        srv.start()
    except (RuntimeError, TimeoutError) as e:
        raise AssertionError((tmp_path / "err.txt").read_text()) from e
    try:
        url = srv.url
        info = httpx.get(url + "/v1/server-info", timeout=10).json()
        assert info["gc_frozen_objects"] > 10_000, info     # torch and the app: hundreds of thousands
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
        steps = httpx.get(url + "/v1/steps", timeout=10).json()["data"]
        assert steps and all(s["gc_ms"] >= 0 for s in steps)
    finally:
        srv.stop()
    assert "froze" in (tmp_path / "err.txt").read_text()


def test_a_server_thread_leaves_the_heap_alone():
    """In a notebook or a test the process is not the server's: nothing is frozen there."""
    from minillm.serving.server import ServerConfig, ServerThread
    srv = ServerThread(ServerConfig(model="tiny", device="cpu", dtype="fp32", port=0,
                                    max_model_len=128)).start()
    try:
        assert httpx.get(srv.url + "/v1/server-info",
                         timeout=10).json()["gc_frozen_objects"] == gc.get_freeze_count() == 0
    finally:
        srv.stop()


# ---- notebook 05's measurements (minillm.experiments.outside_gc) -------------------------------------

def test_the_heap_measurement_adds_tracked_objects():
    from minillm.experiments.outside_gc import collection_cost_by_heap
    a, b = collection_cost_by_heap((0, 50_000), repeats=2)
    assert 49_000 <= b.objects - a.objects <= 51_000          # small lists are tracked (atomic dicts are not)
    assert len(a.samples_ms) == len(b.samples_ms) == 2 and a.full_ms > 0


@pytest.mark.parametrize("freeze", [False, True])
def test_a_decode_beside_collections_reads_them_from_the_steps(freeze):
    from minillm.engine.llm import LLM
    from minillm.experiments.outside_gc import gc_in_decode
    llm = LLM("tiny", device="cpu", max_batch_size=4)
    d = gc_in_decode(llm, every_s=0.01, freeze=freeze, batch=2, new_tokens=16)
    assert gc.get_freeze_count() == 0                        # the caller's heap is left as it was
    assert d.frozen == freeze and d.steps == 15              # 16 tokens: a prefill step, then 15 decode steps
    assert d.gc_ms_max <= d.step_ms_max                      # a step's collection is inside its wall time
    if freeze:
        assert d.objects < 1_000                               # frozen: nothing old left to walk


def test_freeze_effect_runs_in_a_process_of_its_own():
    from minillm.experiments.outside_gc import freeze_effect
    fe = freeze_effect("tiny", repeats=2)
    assert gc.get_freeze_count() == 0
    assert fe.objects > 100_000 and abs(fe.frozen - fe.objects) <= 0.01 * fe.objects
    assert len(fe.before_samples_ms) == len(fe.after_samples_ms) == 2
