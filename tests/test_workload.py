"""Workload helpers (chapter 10.2 / 10.6) and the 10.2 figures.

No timing thresholds: the checks on real runs are about causality and order, read from trace
timestamps (a request is never prepared before it arrived; a stalled gap really contains the
long prefill), so they hold on any machine and fail if the mechanism breaks."""
import json
import math

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from minillm.core.trace import Trace
from minillm.engine.engine import RequestError
from minillm.engine.sampling import SamplingParams
from minillm.loadgen.workload import (
    FIRST_ORDINARY_ID,
    LengthDist,
    WorkloadRequest,
    gamma_arrivals,
    make_prompts,
    make_requests,
    poisson_arrivals,
    run_workload,
    stall_scenario,
)
from minillm.metrics.definitions import metrics_from_traces, request_metrics
from minillm.metrics.stutter import token_gaps
from minillm.metrics.summary import breakdown_at_percentile, distribution
from minillm.plots.metrics import (
    plot_itl_distribution,
    plot_ttft_breakdown,
    save_itl_distribution,
    save_ttft_breakdown,
    stamp_for,
)

MS = 1_000_000


# ----------------------------------------------------------------------------- arrivals
def test_poisson_arrivals_count_order_and_rate():
    rate, n = 50.0, 20_000
    t = poisson_arrivals(rate, n, seed=3)
    assert len(t) == n and t[0] == 0.0
    assert all(b > a for a, b in zip(t, t[1:]))                  # strictly increasing
    gaps = np.diff(t)
    assert np.mean(gaps) == pytest.approx(1 / rate, rel=0.03)    # std of the mean ≈ 0.7 %
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.05)   # exponential: CV = 1
    assert poisson_arrivals(rate, n, seed=3) == t                 # reproducible
    assert np.mean(np.diff(poisson_arrivals(5.0, n, seed=3))) == pytest.approx(0.2, rel=0.03)


def test_gamma_arrivals_keep_the_rate_and_change_burstiness():
    bursty = np.diff(gamma_arrivals(20.0, 20_000, burstiness=0.25, seed=1))
    regular = np.diff(gamma_arrivals(20.0, 20_000, burstiness=4.0, seed=1))
    for g in (bursty, regular):
        assert np.mean(g) == pytest.approx(0.05, rel=0.05)
    assert np.std(bursty) / np.mean(bursty) == pytest.approx(2.0, rel=0.1)    # CV = 1/sqrt(shape)
    assert np.std(regular) / np.mean(regular) == pytest.approx(0.5, rel=0.1)


@pytest.mark.parametrize("rate", [0, -1.0, float("inf"), float("nan")])
def test_bad_rate_is_refused(rate):
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(rate, 10)


def test_zero_and_one_arrival():
    assert poisson_arrivals(3.0, 0) == [] and poisson_arrivals(3.0, 1) == [0.0]


# ----------------------------------------------------------------------------- prompts
@pytest.mark.parametrize("dist", [LengthDist.lognormal(64, 1.0, 8, 300), LengthDist.uniform(5, 40)])
def test_prompts_are_unique_and_within_bounds(dist):
    prompts = make_prompts(300, dist, seed=7, vocab_size=8192)
    lengths = [len(p) for p in prompts]
    assert len(prompts) == 300
    assert min(lengths) == dist.low and max(lengths) == dist.high    # bounds hit (clipped / uniform)
    assert len({p[0] for p in prompts}) == 300                       # no two share even one token of prefix
    assert all(FIRST_ORDINARY_ID <= t < 8192 for p in prompts for t in p)
    assert make_prompts(300, dist, seed=7, vocab_size=8192) == prompts
    assert make_prompts(300, dist, seed=8, vocab_size=8192) != prompts


def test_lognormal_lengths_have_the_asked_median():
    lengths = LengthDist.lognormal(100, 0.5, 1, 10_000).sample(20_000, np.random.default_rng(0))
    assert np.median(lengths) == pytest.approx(100, rel=0.03)


def test_length_dist_and_prompt_errors():
    with pytest.raises(ValueError):
        LengthDist.uniform(0, 10)
    with pytest.raises(ValueError):
        LengthDist.uniform(10, 5)
    with pytest.raises(ValueError, match="distinct first tokens"):
        make_prompts(20, LengthDist.fixed(4), vocab_size=FIRST_ORDINARY_ID + 10)
    assert [len(p) for p in make_prompts(3, LengthDist.fixed(1))] == [1, 1, 1]


def test_make_requests_draws_output_lengths():
    reqs = make_requests(50, LengthDist.fixed(4), LengthDist.uniform(2, 9), seed=2,
                         arrivals=poisson_arrivals(10, 50, 2))
    outs = [r.params.max_tokens for r in reqs]
    assert set(outs) <= set(range(2, 10)) and len(set(outs)) > 3
    assert all(r.params.ignore_eos for r in reqs)
    assert len({r.request_id for r in reqs}) == 50
    assert [r.arrival_s for r in reqs] == poisson_arrivals(10, 50, 2)
    with pytest.raises(ValueError):
        make_requests(3, LengthDist.fixed(4), LengthDist.fixed(2), arrivals=[0.0])


# ----------------------------------------------------------------------------- running on the tiny model
@pytest.fixture(scope="module")
def workload_run(tiny_llm):
    n = 8
    reqs = make_requests(n, LengthDist.uniform(4, 64), LengthDist.uniform(2, 8), seed=5,
                         vocab_size=tiny_llm.engine.config.vocab_size,
                         arrivals=poisson_arrivals(200.0, n, seed=5))
    return reqs, run_workload(tiny_llm, reqs, timeout_s=120)


def test_run_workload_finishes_every_request_in_order(workload_run, tiny_llm):
    reqs, res = workload_run
    assert [o.request_id for o in res.outputs] == [r.request_id for r in reqs]
    for r, o in zip(reqs, res.outputs):
        assert o.finish_reason == "length" and len(o.token_ids) == r.params.max_tokens
        assert o.prompt_token_ids == r.prompt
        ts = o.trace.times("token")
        assert len(ts) == r.params.max_tokens
        assert all(b > a for a, b in zip(ts, ts[1:]))           # token events increase in time
    assert not tiny_llm.engine.has_unfinished()
    s = res.summary()
    assert s.n_ok == len(reqs) and s.n_failed == 0
    assert s.input_tokens == sum(len(r.prompt) for r in reqs)
    assert s.output_tokens == sum(r.params.max_tokens for r in reqs)


def test_run_workload_feeds_in_real_time(workload_run):
    """Each request is received exactly at its due time on the trace clock, and nothing happens
    to it before then: a virtual clock (or feeding everything at once) fails this."""
    reqs, res = workload_run
    for r, o in zip(reqs, res.outputs):
        tr = o.trace
        received = tr.first("received").t_ns
        assert received == res.t0_ns + round(r.arrival_s * 1e9)
        order = [tr.first(e).t_ns for e in ("received", "tokenized", "enqueued", "scheduled",
                                            "prefill_start", "prefill_end")] + [tr.times("token")[0]]
        assert order == sorted(order)
        assert tr.first("tokenized").t_ns >= received         # prepared only once it had arrived
    assert all(lag >= 0 for lag in res.arrival_lag_s)
    # requests with later due times were enqueued no earlier
    enq = [o.trace.first("enqueued").t_ns for o in sorted(res.outputs,
                                                          key=lambda o: o.trace.first("received").t_ns)]
    assert enq == sorted(enq)


def test_run_workload_refuses_bad_prompts_before_starting(tiny_llm):
    too_long = [7] * (tiny_llm.engine.max_model_len + 5)
    reqs = [WorkloadRequest([7, 8, 9], SamplingParams(max_tokens=2), "ok-0"),
            WorkloadRequest(too_long, SamplingParams(max_tokens=2), "bad-1")]
    with pytest.raises(RequestError):
        run_workload(tiny_llm, reqs)
    assert not tiny_llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="unique"):
        run_workload(tiny_llm, [reqs[0], reqs[0]])


# ----------------------------------------------------------------------------- the stall
@pytest.fixture(scope="module")
def stall_run(tiny_llm):
    return stall_scenario(tiny_llm, n_short=3, short_prompt_len=8, short_output=12, long_prompt_len=512,
                          long_output=3, arrive_after_tokens=5)


def test_stall_gap_contains_the_long_prefill(stall_run):
    long_tr = next(o.trace for o in stall_run.outputs if o.request_id == stall_run.long_id)
    ps, pe = long_tr.first("prefill_start").t_ns, long_tr.first("prefill_end").t_ns
    assert long_tr.first("tokenized").extra["n_tokens"] == 512
    for rid in stall_run.short_ids:
        tr = next(o.trace for o in stall_run.outputs if o.request_id == rid)
        ts = tr.times("token")
        assert len(ts) == 12
        containing = [k for k, (a, b) in enumerate(zip(ts, ts[1:]), start=1) if a <= ps and pe <= b]
        # prefill-first: exactly one gap of each decoding request spans the long prefill, and it
        # comes after the arrival point (5 tokens in), so the request was mid-decode
        assert len(containing) == 1 and containing[0] >= 5
    assert {(g.request_id, g.index) for g in stall_run.stalled_gaps()} == \
        {(g.request_id, g.index) for g in token_gaps(stall_run.traces)
         if g.request_id in stall_run.short_ids and g.stalled}
    assert len(stall_run.stalled_gaps()) == 3


def test_the_stall_summary_reads_its_numbers_from_the_gaps(stall_run):
    text = stall_run.summary()
    assert len(text.splitlines()) >= 5
    # every stalled gap is listed with its own length, as measured
    for g in stall_run.stalled_gaps():
        assert f"{g.gap_s * 1e3:.1f}" in text
    assert "3 of them contain the 512-token prefill" in text.splitlines()[0]    # one per decoder


def test_stall_scenario_checks_its_arguments(tiny_llm):
    with pytest.raises(ValueError, match="still decoding"):
        stall_scenario(tiny_llm, short_output=4, arrive_after_tokens=4)
    with pytest.raises(ValueError, match="max_model_len"):
        stall_scenario(tiny_llm, long_prompt_len=tiny_llm.engine.max_model_len)
    assert not tiny_llm.engine.has_unfinished()


def _trace(rid, tokens_ms, prefill_ms=None, received_ms=0.0):
    tr = Trace(rid)
    tr.record("received", t_ns=round(received_ms * MS))
    tr.record("tokenized", t_ns=round(received_ms * MS), n_tokens=4)
    if prefill_ms:
        tr.record("prefill_start", t_ns=round(prefill_ms[0] * MS))
        tr.record("prefill_end", t_ns=round(prefill_ms[1] * MS))
    for i, t in enumerate(tokens_ms):
        tr.record("token", t_ns=round(t * MS), index=i, token_id=9)
    tr.record("finished", t_ns=round(tokens_ms[-1] * MS), reason="length")
    return tr


def test_token_gaps_on_hand_made_traces():
    a = _trace("a", [10, 12, 30, 32], prefill_ms=(5, 9))
    b = _trace("b", [28, 29], prefill_ms=(13, 27), received_ms=11)   # prefill inside a's 2nd gap
    gaps = token_gaps([a, b])
    assert [(g.request_id, g.index, g.prefills) for g in gaps] == \
        [("a", 1, ()), ("a", 2, ("b",)), ("a", 3, ()), ("b", 1, ())]
    assert gaps[1].gap_s == pytest.approx(0.018) and gaps[1].stalled


# ----------------------------------------------------------------------------- figures
def test_figures_are_written(tmp_path, stall_run, workload_run, tiny_llm):
    stamp = stamp_for(tiny_llm, "test")
    assert "tiny" in stamp and "CPU" in stamp
    p1 = save_itl_distribution(stall_run.traces, stamp, out_dir=tmp_path)
    p2 = save_ttft_breakdown(workload_run[1].metrics, stamp, out_dir=tmp_path)
    names = sorted(p.name for p in p1 + p2)
    assert names == ["10-2-itl-distribution.png", "10-2-itl-distribution.svg",
                     "10-2-ttft-breakdown.png", "10-2-ttft-breakdown.svg"]
    for p in p1 + p2:
        assert p.parent == tmp_path and p.stat().st_size > 1000
    assert p1[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the data each figure was drawn from, beside it
    itl = json.loads((tmp_path / "data" / "10-2-itl-distribution.json").read_text())
    ttft = json.loads((tmp_path / "data" / "10-2-ttft-breakdown.json").read_text())
    assert (len(itl["traces"]) == len(stall_run.traces)
            and len(ttft["requests"]) == len(workload_run[1].metrics))


def test_itl_figure_marks_the_metrics_mean_and_p99(stall_run):
    import matplotlib.pyplot as plt
    fig = plot_itl_distribution(stall_run.traces)
    d = distribution(g for m in metrics_from_traces(stall_run.traces) for g in m.itl_s)
    for ax in fig.axes:
        lines = {ln.get_label().split(" =")[0]: ln.get_xdata()[0] for ln in ax.get_lines()
                 if " = " in ln.get_label()}
        assert lines["mean"] == pytest.approx(d.mean * 1e3)
        assert lines["p99"] == pytest.approx(d.p99 * 1e3)
        assert lines["p50"] == pytest.approx(d.p50 * 1e3)
    # the histogram holds every gap once, stalled ones in their own series
    counts = sum(p.get_height() for p in fig.axes[0].patches)
    assert counts == pytest.approx(d.count)
    plt.close(fig)


def test_ttft_breakdown_bars_are_the_p50_and_p99_requests():
    import matplotlib.pyplot as plt
    # ten requests, TTFT 10..100 ms; queue grows with the index, prefill is 5 ms each
    traces = []
    for i in range(10):
        tr = Trace(f"r{i}")
        tr.record("received", t_ns=0)
        tr.record("tokenized", t_ns=1 * MS, n_tokens=4 + i)
        tr.record("enqueued", t_ns=1 * MS)
        tr.record("scheduled", t_ns=(5 + 10 * i) * MS)
        tr.record("prefill_start", t_ns=(5 + 10 * i) * MS)
        tr.record("prefill_end", t_ns=(10 + 10 * i) * MS)
        tr.record("token", t_ns=(10 + 10 * i) * MS, index=0, token_id=1)
        tr.record("finished", t_ns=(10 + 10 * i) * MS, reason="length")
        traces.append(tr)
    ms = [request_metrics(t) for t in traces]
    fig = plot_ttft_breakdown(ms)
    ax = fig.axes[0]
    heights = np.zeros(2)
    for p in ax.patches:
        heights[round(p.get_x() + p.get_width() / 2)] += p.get_height()
    for i, q in enumerate((50, 99)):
        rid, bd = breakdown_at_percentile(ms, q)
        assert heights[i] == pytest.approx(sum(bd.values()) * 1e3)
        assert rid in ax.get_xticklabels()[i].get_text()
    assert heights.tolist() == pytest.approx([50.0, 100.0])     # nearest rank: r4 and r9
    plt.close(fig)
    assert math.isclose(sum(breakdown_at_percentile(ms, 99)[1].values()), 0.1)
