"""The chapter's core measurements are shown inline, on the engine itself, and what they read is right.

1. Notebooks 01-06 each have a code cell that measures with the engine directly: it calls
   ``.step(`` or reads ``step_history``, or it sends an HTTP request and times it, or it sends the
   requests through bench-serve's library on an arrival schedule it builds in the cell (10.6). The cells'
   *code* is read (Python tokens: comments and strings do not count), so a cell that only mentions
   ``step_history`` in a comment or a print does not pass.
2. Running the engine directly on the ``tiny`` preset (not the notebooks): a prefill step's
   ``StepRecord`` counts exactly the prompt's tokens, a decode step's one token per sequence, and
   the phases of a record add up to its wall time.
"""
import io
import json
import tokenize
from pathlib import Path

import pytest

from minillm.core.step_record import PHASES

ROOT = Path(__file__).resolve().parent.parent
INLINE_NOTEBOOKS = ["01_request_lifecycle", "02_four_metrics", "03_decode_roofline", "04_prefill_vs_decode",
                    "05_outside_the_accelerator", "06_honest_benchmarks"]
# stem -> reason, for a notebook whose inline measurement is being written now (others edit them)
NOT_YET: dict[str, str] = {}

HTTP_NAMES = {"httpx", "requests", "urllib", "urlopen", "aiohttp", "HTTPConnection"}
HTTP_CALLS = {"get", "post", "stream", "request", "send", "urlopen"}
CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time_ns", "now_ns"}


def code_tokens(source: str) -> list[tuple[int, str]]:
    """(type, text) of a cell's Python tokens without comments and strings; IPython magics and
    shell lines (``%``, ``!``) are dropped first."""
    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    toks = tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline)
    skip = {tokenize.COMMENT, tokenize.STRING, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
            tokenize.DEDENT, tokenize.ENDMARKER}
    skip |= {getattr(tokenize, n) for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
             if hasattr(tokenize, n)}
    return [(t.type, t.string) for t in toks if t.type not in skip]


def measures_inline(source: str) -> bool:
    toks = code_tokens(source)
    names = {s for t, s in toks if t == tokenize.NAME}
    calls = {toks[i + 1][1] for i in range(len(toks) - 3)
             if toks[i][1] == "." and toks[i + 2][1] == "("}           # .name( : a method call
    if "step" in calls or "step_history" in names:
        return True
    if names & {"run_bench", "arun_bench"} and "arrival_schedule" in names:
        return True
    return bool(names & HTTP_NAMES) and bool(calls & HTTP_CALLS) and bool(names & CLOCKS)


def test_the_detector_reads_code_not_comments():
    assert measures_inline("outs = llm.engine.step()\n")
    assert measures_inline("rec = eng.step_history[-1]\n")
    assert measures_inline("t0 = time.perf_counter()\nr = httpx.post(url, json=body)\n"
                           "ms = (time.perf_counter() - t0) * 1e3\n")
    assert not measures_inline("# engine.step() and step_history are read in section 2\nres = run_sweep()\n")
    assert not measures_inline('print("llm.engine.step() fills step_history")\n')
    assert not measures_inline("r = httpx.post(url, json=body)\n")                 # sent, not timed
    assert not measures_inline("%time res = run_sweep()\nres.table()\n")
    assert not measures_inline("stepper = make(step=3)\n")
    assert measures_inline("sched = arrival_schedule(8, 2.0)\nres = run_bench(cfg, schedule=sched)\n")
    assert not measures_inline("res = run_bench(cfg)\n")                             # no schedule of its own


def _param(stem: str):
    marks = [pytest.mark.xfail(reason=NOT_YET[stem], strict=False)] if stem in NOT_YET else []
    return pytest.param(stem, marks=marks, id=stem)


@pytest.mark.parametrize("stem", [_param(s) for s in INLINE_NOTEBOOKS])
def test_notebook_measures_with_the_engine_inline(stem):
    nb = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text(encoding="utf-8"))
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert any(measures_inline(s) for s in cells), (
        f"{stem}: no code cell calls engine.step() / reads step_history, or sends an HTTP request and times "
        f"it: the core measurement should be done in the notebook, not only inside a library call")


# ------------------------------------------------------------------------- the engine, run directly
@pytest.fixture(scope="module")
def engine():
    from minillm import LLM
    llm = LLM(model="tiny", device="cpu", dtype="fp32", max_batch_size=4, max_model_len=256,
              enable_prefix_caching=False)
    return llm.engine


def _params(n: int):
    from minillm import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_prefill_record_counts_the_prompt_tokens(engine):
    lens = (37, 5, 64)
    prompts = [[(7 * i + j) % 500 + 1 for j in range(n)] for i, n in enumerate(lens)]
    rids = [engine.add_request(p, _params(3)) for p in prompts]
    engine.step()
    rec = engine.step_history[-1]
    assert rec.num_prefill_tokens == sum(lens)
    assert rec.num_prefill_rows == len(lens)
    assert rec.num_decode_tokens == 0 and rec.num_decode_rows == 0
    assert rec.num_sampled == len(lens)                # every prompt finished: one first token each
    while engine.has_unfinished():
        engine.step()
    for rid in rids:
        engine.pop_finished(rid)


def test_decode_record_counts_one_token_per_sequence(engine):
    rids = [engine.add_request([i + 1] * (10 + 3 * i), _params(4)) for i in range(3)]
    engine.step()                                      # the prefills
    for _ in range(2):
        outs = engine.step()
        rec = engine.step_history[-1]
        assert rec.num_prefill_tokens == 0 and rec.num_prefill_rows == 0
        assert rec.num_decode_rows == 3 and rec.num_decode_tokens == 3
        assert rec.num_sampled == 3 and len(outs) == 3
    while engine.has_unfinished():
        engine.step()
    for rid in rids:
        engine.pop_finished(rid)


def test_phases_add_up_to_the_wall_time(engine):
    rid = engine.add_request(list(range(1, 50)), _params(5))
    start = len(engine.step_history)
    while engine.has_unfinished():
        engine.step()
    engine.pop_finished(rid)
    recs = list(engine.step_history)[start:]
    assert len(recs) == 5                              # one prefill step, then four decode steps
    for rec in recs:
        phases = rec.phase_ms
        assert list(phases) == list(PHASES) and len(rec.t_ns) == len(PHASES)
        assert all(ms >= 0 for ms in phases.values())  # consecutive marks of one clock
        assert rec.wall_ms > 0
        assert sum(phases.values()) == pytest.approx(rec.wall_ms, rel=1e-9, abs=1e-9)
        assert rec.wall_ms == pytest.approx((rec.t_ns[-1] - rec.t_start_ns) / 1e6)
