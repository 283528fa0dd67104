"""Metrics are pure functions over recorded timestamps: every expected value below is worked
out by hand from the timestamps in the test (1 ms = 1_000_000 ns)."""
import json
import math

import numpy as np
import pytest

from minillm.core.trace import Trace
from minillm.metrics.definitions import (
    STAGES,
    ClientRecord,
    client_request_metrics,
    metrics_from_traces,
    request_metrics,
    ttft_breakdown,
)
from minillm.metrics.summary import (
    SLO,
    SteadyWindow,
    breakdown_at_percentile,
    distribution,
    explain_ttft,
    summarize,
    to_rows,
)

MS = 1_000_000


def make_trace(rid, events):
    """events: (name, t_ms, extra) or (name, t_ms); times may be floats (ms)."""
    tr = Trace(rid)
    for ev in events:
        name, t_ms, extra = ev if len(ev) == 3 else (*ev, {})
        tr.record(name, t_ns=round(t_ms * MS), **extra)
    return tr


def engine_trace(rid, token_ms, received_ms=0.0, prompt=8, reason="length", finished_ms=None):
    """An in-process request: received → tokenized → enqueued → scheduled → prefill → tokens."""
    t0 = received_ms
    ev = [("received", t0), ("tokenized", t0 + 1, {"n_tokens": prompt}), ("enqueued", t0 + 1),
          ("scheduled", t0 + 2), ("prefill_start", t0 + 2, {"batch_size": 1, "n_tokens": prompt}),
          ("prefill_end", token_ms[0] - 0.5)]
    ev += [("token", t, {"index": i, "token_id": 5}) for i, t in enumerate(token_ms)]
    ev.append(("finished", token_ms[-1] if finished_ms is None else finished_ms, {"reason": reason}))
    return make_trace(rid, ev)


# ----------------------------------------------------------------------------- one request
def test_single_token_request_has_no_tpot_and_no_itl():
    tr = make_trace("one", [("received", 0), ("tokenized", 1, {"n_tokens": 7}), ("enqueued", 1),
                            ("scheduled", 3), ("prefill_start", 3), ("prefill_end", 8),
                            ("token", 10, {"index": 0, "token_id": 1}), ("finished", 10, {"reason": "stop"})])
    m = request_metrics(tr)
    assert m.ok and m.finish_reason == "stop" and m.side == "engine"
    assert m.prompt_tokens == 7 and m.output_tokens == 1
    assert m.ttft_s == pytest.approx(0.010, abs=1e-12)
    assert m.e2e_s == m.ttft_s
    assert m.tpot_s is None and m.itl_s == []
    assert m.breakdown == pytest.approx({"gateway": 0.0, "body": 0.0, "tokenize": 0.001, "queue": 0.002,
                                         "prefill": 0.005, "first_token": 0.002}, abs=1e-12)


def test_four_tokens_at_known_times():
    m = request_metrics(engine_trace("four", [10, 30, 60, 100]))
    assert m.output_tokens == 4
    assert m.ttft_s == pytest.approx(0.010, abs=1e-12)
    assert m.e2e_s == pytest.approx(0.100, abs=1e-12)
    assert m.tpot_s == pytest.approx((0.100 - 0.010) / 3, abs=1e-12)   # 30 ms
    assert m.itl_s == pytest.approx([0.020, 0.030, 0.040], abs=1e-12)
    assert m.tpot_s == pytest.approx(np.mean(m.itl_s), abs=1e-12)      # one request: TPOT = mean ITL


def test_request_weighted_tpot_differs_from_token_weighted_itl():
    short = engine_trace("short", [10, 110])                       # 2 tokens, one 100 ms gap
    long = engine_trace("long", [10 + 10 * i for i in range(11)])  # 11 tokens, ten 10 ms gaps
    s = summarize(metrics_from_traces([short, long]))
    # TPOT: one value per request -> (100 ms + 10 ms) / 2 = 55 ms
    assert s.tpot.count == 2 and s.tpot.mean == pytest.approx(0.055, abs=1e-12)
    # ITL: every gap pooled -> (100 ms + 10 × 10 ms) / 11 gaps = 18.18 ms
    assert s.itl.count == 11 and s.itl.mean == pytest.approx(0.200 / 11, abs=1e-12)
    assert s.itl.p50 == pytest.approx(0.010, abs=1e-12) and s.itl.max == pytest.approx(0.100, abs=1e-12)
    assert s.tpot.mean != pytest.approx(s.itl.mean)


def test_bad_traces_are_refused():
    with pytest.raises(ValueError, match="empty"):
        request_metrics(Trace("nothing"))
    with pytest.raises(ValueError, match="backwards"):
        request_metrics(make_trace("b", [("received", 0), ("token", 5), ("token", 3)]))
    with pytest.raises(TypeError):
        request_metrics({"events": []})


# ----------------------------------------------------------------------------- client side
def test_client_side_ignores_empty_chunks_and_counts_packed_tokens():
    rec = ClientRecord("c1", t_sent_ns=0, prompt_tokens=12, t_done_ns=95 * MS, chunks=[
        (5 * MS, 0, ""),          # role header: no text
        (20 * MS, 1, "Hel"),
        (50 * MS, 3, "lo wo"),    # three tokens in one chunk
        (55 * MS, 0, ""),         # keep-alive
        (90 * MS, 2, "rld!"),
    ])
    m = client_request_metrics(rec)
    assert m.side == "client" and m.ok and m.breakdown == {}
    assert m.output_tokens == 6 and m.prompt_tokens == 12
    assert m.ttft_s == pytest.approx(0.020, abs=1e-12)
    assert m.e2e_s == pytest.approx(0.090, abs=1e-12)
    assert m.itl_s == pytest.approx([0.030, 0.040], abs=1e-12)      # ICL: 2 gaps for 6 tokens
    assert len(m.itl_s) < m.output_tokens - 1                        # fewer than the 5 token gaps
    assert m.tpot_s == pytest.approx((0.090 - 0.020) / 5, abs=1e-12)
    assert m.t_end_ns == 95 * MS
    s = summarize([m])
    assert "ICL" in s.table() and s.itl.count == 2


def test_client_side_unknown_token_counts_and_usage_override():
    chunks = [(10 * MS, None, "a"), (15 * MS, None, ""), (30 * MS, None, "b"), (70 * MS, None, "c")]
    m = client_request_metrics(ClientRecord("c2", 0, chunks, 80 * MS, prompt_tokens=3))
    assert m.output_tokens == 3                                      # one per non-empty chunk
    assert m.tpot_s == pytest.approx(0.060 / 2, abs=1e-12)
    m = client_request_metrics(ClientRecord("c3", 0, chunks, 80 * MS, prompt_tokens=3, completion_tokens=7))
    assert m.output_tokens == 7
    assert m.tpot_s == pytest.approx(0.060 / 6, abs=1e-12)


def test_client_failures_and_bad_records():
    m = client_request_metrics(ClientRecord("f", 0, [], 5 * MS, 3, ok=False, error="HTTP 429"))
    assert not m.ok and m.error == "HTTP 429" and m.ttft_s is None
    m = client_request_metrics(ClientRecord("g", 0, [(1 * MS, 0, "")], 5 * MS, 3))
    assert not m.ok and "non-empty" in m.error
    with pytest.raises(ValueError, match="backwards"):
        client_request_metrics(ClientRecord("h", 0, [(5 * MS, 1, "a"), (2 * MS, 1, "b")], 9 * MS, 1))
    with pytest.raises(ValueError, match="before"):
        client_request_metrics(ClientRecord("i", 10 * MS, [(5 * MS, 1, "a")], 20 * MS, 1))
    with pytest.raises(ValueError, match="mix|together"):
        summarize([request_metrics(engine_trace("e", [10, 20])),
                   client_request_metrics(ClientRecord("c", 0, [(1 * MS, 1, "a")], 2 * MS, 1))])


# ----------------------------------------------------------------------------- distributions
def test_percentiles_are_numpys_linear_interpolation():
    d = distribution([1.0, 2.0, 3.0, 4.0])
    assert (d.count, d.mean, d.min, d.max) == (4, 2.5, 1.0, 4.0)
    assert d.p50 == pytest.approx(2.5) and d.p90 == pytest.approx(3.7)   # 1 + 0.9 · 3
    assert d.p95 == pytest.approx(3.85) and d.p99 == pytest.approx(3.97)
    assert d.std == pytest.approx(math.sqrt(1.25))                      # population std (ddof=0)
    xs = np.random.default_rng(0).exponential(size=101)
    d = distribution(xs)
    for q in (50, 90, 95, 99):
        assert d.percentile(q) == pytest.approx(float(np.percentile(xs, q)), abs=1e-15)


def test_empty_distribution_and_bad_values():
    d = distribution([])
    assert d.count == 0 and math.isnan(d.mean) and math.isnan(d.p99)
    with pytest.raises(ValueError, match="NaN"):
        distribution([0.1, None])


# ----------------------------------------------------------------------------- throughput
def test_throughput_input_and_output_separately_over_first_arrival_to_last_completion():
    a = engine_trace("a", [10, 20], received_ms=0, prompt=10, finished_ms=100)
    b = engine_trace("b", [60, 70, 80, 90], received_ms=50, prompt=30, finished_ms=200)
    s = summarize(metrics_from_traces([a, b]))
    assert s.duration_s == pytest.approx(0.200, abs=1e-12)             # 0 ms → 200 ms
    assert (s.input_tokens, s.output_tokens) == (40, 6)
    assert s.input_tok_s == pytest.approx(40 / 0.2)
    assert s.output_tok_s == pytest.approx(6 / 0.2)
    assert s.requests_s == pytest.approx(2 / 0.2)


def test_steady_state_window_counts_only_what_happens_inside_it():
    a = engine_trace("a", [50, 150, 250], received_ms=0, prompt=10)            # ends at 250 ms
    b = engine_trace("b", [600, 700, 950], received_ms=500, prompt=20, finished_ms=1000)
    ms = metrics_from_traces([a, b])
    s = summarize(ms, steady=SteadyWindow(warmup=0.1, drain=0.1))             # [100, 900] ms
    assert s.steady_window_s == pytest.approx(0.8)
    assert s.steady_output_tok_s == pytest.approx(4 / 0.8)     # tokens at 150, 250, 600, 700
    assert s.steady_input_tok_s == pytest.approx(20 / 0.8)     # only b's first token (600) is inside
    assert s.steady_requests_s == pytest.approx(1 / 0.8)       # only a completes inside (250)
    s = summarize(ms, steady=SteadyWindow(t0_ns=0, t1_ns=1000 * MS))
    assert s.steady_output_tok_s == pytest.approx(6.0) and s.steady_input_tok_s == pytest.approx(30.0)
    with pytest.raises(ValueError):
        SteadyWindow(warmup=0.6, drain=0.5)
    with pytest.raises(ValueError):
        SteadyWindow(t0_ns=5, t1_ns=5)


# ----------------------------------------------------------------------------- goodput
def test_goodput_counts_requests_meeting_every_slo():
    fast = engine_trace("fast", [10, 20, 30], finished_ms=100)       # TTFT 10, TPOT 10, E2E 30
    slow_first = engine_trace("slow_first", [80, 85])                # TTFT 80, TPOT 5,  E2E 85
    slow_decode = engine_trace("slow_decode", [10, 60, 110])         # TTFT 10, TPOT 50, E2E 110
    one = engine_trace("one", [20])                                  # TTFT 20, no TPOT, E2E 20
    ms = metrics_from_traces([fast, slow_first, slow_decode, one])
    window = 0.110                                                   # 0 → 110 ms
    assert summarize(ms).goodput_rps is None
    s = summarize(ms, slo=SLO(ttft_s=0.050))
    assert s.n_good == 3 and s.goodput_rps == pytest.approx(3 / window)
    s = summarize(ms, slo=SLO(tpot_s=0.020))                         # "one" passes: no TPOT
    assert s.n_good == 3
    s = summarize(ms, slo=SLO(ttft_s=0.050, tpot_s=0.020))
    assert s.n_good == 2 and s.goodput_rps == pytest.approx(2 / window)
    s = summarize(ms, slo=SLO(e2e_s=0.030))                          # ≤ is a pass: fast (30 ms) and one
    assert s.n_good == 2
    assert "goodput" in s.table()
    with pytest.raises(ValueError):
        SLO()
    with pytest.raises(ValueError):
        SLO(ttft_s=-1)


# ----------------------------------------------------------------------------- TTFT breakdown
def test_breakdown_with_gateway_events_telescopes_to_ttft():
    tr = make_trace("gw", [("received", 0), ("authenticated", 1), ("admitted", 3, {"prompt_tokens": 9}),
                           ("tokenized", 4, {"n_tokens": 9}), ("enqueued", 4.5), ("scheduled", 10),
                           ("prefill_start", 10.2), ("prefill_end", 15), ("token", 16), ("token", 20),
                           ("sent", 20.1), ("finished", 20, {"reason": "length"})])
    m = request_metrics(tr)
    assert m.breakdown == pytest.approx({"gateway": 0.003, "body": 0, "tokenize": 0.001, "queue": 0.006,
                                         "prefill": 0.005, "first_token": 0.001}, abs=1e-12)
    assert sum(m.breakdown.values()) == pytest.approx(m.ttft_s, abs=1e-12)
    assert list(m.breakdown) == list(STAGES)


def test_breakdown_with_other_orders_and_missing_events():
    # enqueue before tokenize, no prefill events: every gap goes to the event closing it
    tr = make_trace("x", [("received", 0), ("enqueued", 2), ("tokenized", 3, {"n_tokens": 4}),
                          ("scheduled", 7), ("token", 20)])
    bd = ttft_breakdown(tr)
    assert bd == pytest.approx({"gateway": 0, "body": 0, "tokenize": 0.001, "queue": 0.006,
                                "prefill": 0.013, "first_token": 0}, abs=1e-12)
    # no `received`: the clock starts at the earliest event
    tr = make_trace("y", [("tokenized", 5, {"n_tokens": 4}), ("scheduled", 9), ("token", 12)])
    m = request_metrics(tr)
    assert m.ttft_s == pytest.approx(0.007, abs=1e-12) and m.prompt_tokens == 4
    assert sum(m.breakdown.values()) == pytest.approx(m.ttft_s, abs=1e-12)
    # awkward nanosecond values, with and without gateway events: still exact to 1e-12
    rng = np.random.default_rng(1)
    for names in (["received", "authenticated", "admitted", "tokenized", "enqueued", "scheduled",
                   "prefill_start", "prefill_end"], ["received", "tokenized", "enqueued", "scheduled",
                                                     "prefill_start", "prefill_end"]):
        for _ in range(20):
            ts = np.cumsum(rng.integers(1, 10**9, size=len(names) + 1))
            tr = Trace("r")
            for n, t in zip(names, ts):
                tr.record(n, t_ns=int(t))
            tr.record("token", t_ns=int(ts[-1]))
            m = request_metrics(tr)
            assert abs(sum(m.breakdown.values()) - m.ttft_s) < 1e-12
            assert all(v >= 0 for v in m.breakdown.values())


def test_breakdown_at_percentile_uses_nearest_rank_and_explain_names_biggest_stage():
    ms = []
    for i in range(1, 11):                       # TTFT = 10 + 1 + i·i ms; queue grows as i²
        tr = make_trace(f"r{i}", [("received", 0), ("tokenized", 1, {"n_tokens": 4}),
                                  ("scheduled", 1 + i * i), ("prefill_end", 11 + i * i),
                                  ("token", 11 + i * i)])
        ms.append(request_metrics(tr))
    rid, bd = breakdown_at_percentile(ms, 99)
    assert rid == "r10"                          # rank ⌈0.99 · 10⌉ = 10
    assert bd["queue"] == pytest.approx(0.100, abs=1e-12) and bd["prefill"] == pytest.approx(0.010, abs=1e-12)
    assert breakdown_at_percentile(ms, 50)[0] == "r5"
    assert breakdown_at_percentile(ms, 0)[0] == "r1"
    text = explain_ttft(ms, 99)
    assert "p99" in text and "r10" in text and "100.0 ms" in text and "in the queue" in text
    # at p10 the request is r1: 1 ms queue, 10 ms prefill -> prefill is the biggest stage
    assert "in prefill" in explain_ttft(ms, 10)
    with pytest.raises(ValueError):
        breakdown_at_percentile(ms, 101)
    with pytest.raises(ValueError, match="breakdown"):
        breakdown_at_percentile([], 99)


# ----------------------------------------------------------------------------- failures, empty
def test_failed_requests_are_counted_but_excluded_from_latency():
    good = engine_trace("good", [10, 20], finished_ms=30)
    err = engine_trace("err", [5], reason="error", finished_ms=400)
    rejected = make_trace("rej", [("received", 0), ("rejected", 1, {"status": 429, "code": "rate_limited"})])
    ms = metrics_from_traces([good, err, rejected])
    assert [m.ok for m in ms] == [True, False, False]
    assert "429" in ms[2].error
    s = summarize(ms)
    assert (s.n_ok, s.n_failed) == (1, 2)
    assert s.ttft.count == 1 and s.ttft.mean == pytest.approx(0.010, abs=1e-12)
    assert s.output_tokens == 2 and s.input_tokens == 8          # successful requests only
    assert s.duration_s == pytest.approx(0.400, abs=1e-12)       # the window spans failures too
    assert "1 ok / 2 failed" in s.table()


def test_empty_summary_does_not_crash():
    s = summarize([], slo=SLO(ttft_s=1.0), steady=SteadyWindow())
    assert (s.n_ok, s.n_failed, s.ttft.count) == (0, 0, 0)
    assert math.isnan(s.output_tok_s) and math.isnan(s.ttft.p99)
    assert "0 ok / 0 failed" in s.table()
    d = s.to_dict()
    assert d["ttft"]["p99"] is None
    json.dumps(d, allow_nan=False)


def test_summary_table_rows_and_breakdown_mean():
    ms = metrics_from_traces([engine_trace("a", [10, 20, 40]), engine_trace("b", [30, 35])])
    s = summarize(ms)
    # means are linear: the mean stages add up to the mean TTFT exactly
    assert sum(s.breakdown_mean.values()) == pytest.approx(s.ttft.mean, abs=1e-12)
    assert s.breakdown_p99 == ms[1].breakdown                    # b has the larger TTFT
    table = s.table()
    for word in ("TTFT", "TPOT", "ITL", "E2E", "queue", "p99"):
        assert word in table
    assert "20.00" in table                                      # mean TTFT 20 ms
    rows = to_rows(ms)
    assert [r["request_id"] for r in rows] == ["a", "b"]
    assert rows[0]["tpot_s"] == pytest.approx(0.015) and rows[0]["n_gaps"] == 2
    assert rows[1]["ttft_queue_s"] == pytest.approx(0.001)
    json.dumps(s.to_dict(), allow_nan=False)


def test_aborted_requests_are_counted_apart_from_completed_and_failed():
    good = engine_trace("good", [10, 20], finished_ms=30)
    gone = engine_trace("gone", [12, 25, 31], reason="abort", finished_ms=40)
    err = engine_trace("err", [5], reason="error", finished_ms=50)
    s = summarize(metrics_from_traces([good, gone, err]))
    assert (s.n_ok, s.n_failed, s.n_aborted) == (1, 1, 1)
    assert s.output_tokens == 2 and s.ttft.count == 1            # the aborted one adds no latency sample
    assert "1 ok / 1 failed / 1 aborted" in s.table()


def test_ttft_ends_at_the_first_non_empty_token():
    """Token 0 is half a UTF-8 character (no text yet); token 1 completes it: TTFT = 20 ms."""
    tr = make_trace("utf8", [("received", 0), ("tokenized", 1, {"n_tokens": 4}), ("scheduled", 2),
                             ("token", 10, {"index": 0}), ("token", 20, {"index": 1}),
                             ("detokenized", 20.1, {"n_chars": 1}), ("token", 30, {"index": 2}),
                             ("detokenized", 30.1, {"n_chars": 2}), ("finished", 30, {"reason": "length"})])
    m = request_metrics(tr)
    assert m.ttft_s == pytest.approx(0.020, abs=1e-12)
    assert m.output_tokens == 3 and m.e2e_s == pytest.approx(0.030, abs=1e-12)
    # the stages still add up to TTFT: the step that completed the character is the first token's
    assert sum(m.breakdown.values()) == pytest.approx(m.ttft_s, abs=1e-12)
    assert m.breakdown["first_token"] == pytest.approx(0.010, abs=1e-12)
    assert m.breakdown["prefill"] == pytest.approx(0.008, abs=1e-12)
    # TPOT keeps vLLM's definition, (E2E − TTFT) ÷ (N − 1): below the mean gap (10 ms) for such a request
    assert m.tpot_s == pytest.approx(0.005, abs=1e-12) and sum(m.itl_s) / len(m.itl_s) == pytest.approx(0.010)


def test_body_read_is_its_own_ttft_stage():
    """Server side: received (headers) → authenticated → body_read → tokenized …: the body's
    arrival and parsing is the `body` stage, and the stages still add up to TTFT."""
    tr = make_trace("srv", [("received", 0), ("authenticated", 0.1), ("body_read", 4.1),
                            ("tokenized", 5.1, {"n_tokens": 7}), ("admitted", 5.2), ("enqueued", 5.3),
                            ("scheduled", 6), ("prefill_start", 6), ("prefill_end", 9),
                            ("token", 10, {"index": 0}), ("finished", 10, {"reason": "stop"})])
    bd = request_metrics(tr).breakdown
    assert bd["body"] == pytest.approx(0.004, abs=1e-12) and bd["gateway"] == pytest.approx(0.0002, abs=1e-12)
    assert sum(bd.values()) == pytest.approx(request_metrics(tr).ttft_s, abs=1e-12)


def test_explain_ttft_names_every_stage_it_can_find_largest():
    """A request whose body took longest (a slow client's upload) is explained, not a KeyError."""
    tr = make_trace("slow-body", [("received", 0), ("authenticated", 0.1), ("body_read", 40),
                                  ("tokenized", 41, {"n_tokens": 7}), ("enqueued", 41.5), ("scheduled", 42),
                                  ("prefill_start", 42), ("prefill_end", 45), ("token", 46, {"index": 0}),
                                  ("finished", 46, {"reason": "stop"})])
    text = explain_ttft([request_metrics(tr)], 50)
    assert "reading the request body" in text and "slow-body" in text
