"""`bench-client` (minillm/loadgen/client_overhead.py): the stub server is a valid OpenAI-compatible
stream (every request ok, usage counted), and the command runs end to end. No speed is asserted:
the figure is a benchmark's, printed beside wrk's bound, not a test's."""
from __future__ import annotations

import httpx

from minillm.loadgen.bench_serve import BenchConfig, run_bench
from minillm.loadgen.client_overhead import ClientOverhead, StubServer, measure_client_overhead, stub_app


def test_stub_stream_is_what_bench_serve_expects():
    res = run_bench(BenchConfig(base_url="http://stub", num_prompts=20, max_concurrency=20,
                                random_input_len=4,
                                random_output_len=1), transport=httpx.ASGITransport(app=stub_app()))
    assert res.model == "stub" and res.n_ok == 20 and res.n_failed == 0
    assert res.summary.output_tokens == 20 and res.summary.input_tokens == 80


def test_many_small_pools_serve_every_request():
    # 100 in flight → 14 httpx clients of 8 connections: every request still gets an answer
    with StubServer() as url:
        res = run_bench(BenchConfig(base_url=url, num_prompts=150, max_concurrency=100, random_input_len=4,
                                    random_output_len=1, timeout_s=60))
    assert res.n_ok == 150 and len({r.record.request_id for r in res.records}) == 150


def test_measure_and_table():
    out = measure_client_overhead(num_prompts=40, max_concurrency=8, rounds=1, wrk_duration_s=1)
    assert len(out.bench_serve_rps) == 1 and out.bench_serve_rps[0] > 0 and out.bench_serve_failed == [0]
    assert (out.wrk_rps and out.wrk_missing is None) or (not out.wrk_rps and "wrk" in out.wrk_missing)
    assert "bench-serve (this client)" in out.table()
    fake = ClientOverhead(10, 2, bench_serve_rps=[400, 600, 500], wrk_rps=[1000, 1000])
    assert fake.ratio() == 0.5 and "met (500)" in fake.table(target=500)
    assert "NOT met" in fake.table(target=501)
