"""The server's own view from Prometheus /metrics (minillm/loadgen/server_metrics.py): the text parser
fed in pieces, histogram deltas and bucket quantiles, each engine's names, what a server lacks said as
"not available", and ``diagnose --base-url`` against a stub server that has only /metrics."""
from __future__ import annotations

import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from minillm.loadgen.server_metrics import (
    NOT_AVAILABLE,
    Histogram,
    PromTextParser,
    parse_metrics,
    parse_sample,
    server_view,
)
from minillm.metrics.diagnose import ServerStage, diagnose_server_histograms
from minillm.metrics.findings import NO_DATA, START_LATE

FIX = Path(__file__).parent / "fixtures" / "metrics"


def text(name: str) -> str:
    return (FIX / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("name", ["vllm_after.txt", "llamacpp_after.txt"])
def test_parser_fed_in_pieces_reads_what_it_reads_whole(name):
    whole = parse_metrics(text(name), t_s=0.0)
    rng = random.Random(0)
    for _ in range(5):
        p, s, i = PromTextParser(), text(name), 0
        while i < len(s):
            n = rng.randint(1, 40)                 # cuts mid-line, mid-label, mid-number
            p.feed(s[i:i + n])
            i += n
        pieces = p.close(t_s=0.0)
        assert pieces.samples == whole.samples and pieces.types == whole.types
    assert len(whole.samples) > 10


def test_sample_lines_with_labels_escapes_and_infinity():
    s = parse_sample('x_bucket{le="+Inf",model_name="a \\"b\\", c"} 7')
    assert s.name == "x_bucket" and s.value == 7 and s.label("le") == "+Inf"
    assert s.label("model_name") == 'a "b", c'
    assert parse_sample("# HELP x y") is None and parse_sample("") is None
    assert parse_sample("up 1 1712345678000").value == 1       # a timestamp after the value


def test_histogram_quantile_interpolates_inside_the_bucket():
    h = Histogram([(0.1, 10.0), (1.0, 30.0), (float("inf"), 40.0)], count=40, sum=20.0)
    assert h.mean == pytest.approx(0.5)
    assert h.quantile(0.125) == pytest.approx(0.05)           # rank 5 of the first 10, from 0
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.9 * 10 / 20)
    assert h.quantile(0.99) == pytest.approx(1.0)             # in +Inf: the largest finite bound
    assert Histogram([], 0, 0).quantile(0.5) is None and Histogram([], 0, 0).mean is None


def test_vllm_histogram_deltas_between_two_scrapes():
    before, after = parse_metrics(text("vllm_before.txt"), 0.0), parse_metrics(text("vllm_after.txt"), 30.0)
    d = after.histogram("vllm:request_queue_time_seconds").minus(before.histogram(
        "vllm:request_queue_time_seconds"))
    assert d.count == 20                                       # the burst only
    assert d.mean == pytest.approx(0.6 + 0.1 * 9.5)            # generate.py's queue times
    assert dict(d.buckets)[0.3] == 0 and dict(d.buckets)[float("inf")] == 20
    v = server_view(after, before)
    assert v.engine == "vLLM" and "vLLM names" in v.source and "30.0 s apart" in v.window
    assert v.stages["prefill"].count == 20 and v.stages["prefill"].mean_s == pytest.approx(0.05)
    assert v.stages["ttft"].mean_s == pytest.approx(1.6)
    assert 0.5 < v.stages["queue"].p50_s < 2.5 and v.stages["queue"].p99_s <= 2.5
    assert v.counters["generation_tokens"] == 1000 and v.gauges == {"running": 8, "waiting": 12}
    assert v.missing() == ["tpot"]                           # a family the fixture lacks


def test_llamacpp_has_no_histograms_so_its_stages_are_not_available():
    before, after = parse_metrics(text("llamacpp_before.txt"), 0.0), parse_metrics(text("llamacpp_after.txt"))
    v = server_view(after, before)
    assert v.engine == "llama.cpp" and "llama.cpp names" in v.source
    assert set(v.missing()) == {"queue", "prefill", "decode", "ttft", "itl", "tpot", "e2e"}
    out = "\n".join(v.lines())
    assert f"queue    {NOT_AVAILABLE}" in out and "0.0 ms" not in out
    assert "prefill: 1500.0 tok/s" in out                      # (3600-1200) / (2.4-0.8)
    assert "decode: 66.7 tok/s" in out                         # (6000-2000) / (100-40)
    assert v.gauges == {"running": 4, "waiting": 2}


def test_an_unknown_server_reports_nothing_as_zero():
    v = server_view(parse_metrics("# TYPE up gauge\nup 1\n"))
    assert v.engine is None and all(s is None for s in v.stages.values())
    assert all(NOT_AVAILABLE in line for line in v.lines()[1:])


def test_minillm_serve_is_named_as_exporting_vllm_names():
    from minillm.serving.prom import ServingMetrics
    m = ServingMetrics("tiny")
    body, _ = m.render()
    v = server_view(parse_metrics(body.decode()))
    assert v.engine == "vLLM" and "minillm serve" in v.source


def stage(count, mean, p50=None, p99=None):
    return ServerStage(count, mean, p50 if p50 is not None else mean, p99 if p99 is not None else mean)


def test_diagnosis_from_histograms_names_queue_or_prefill_by_their_means():
    queue_heavy = {"ttft": stage(20, 1.6, 1.5, 2.4), "queue": stage(20, 1.55), "prefill": stage(20, 0.05),
                   "itl": stage(980, 0.025, 0.025, 0.03)}
    d = diagnose_server_histograms(queue_heavy, "the server's /metrics (vLLM names)", "w")
    assert d.cause == START_LATE and d.stage == "queue"
    assert "from the server's /metrics (vLLM names)" in d.verdict
    prefill_heavy = {"ttft": stage(20, 0.6, 0.1, 2.0), "queue": stage(20, 0.01), "prefill": stage(20, 0.59)}
    d = diagnose_server_histograms(prefill_heavy, "s", "w")
    assert d.cause == START_LATE and d.stage == "prefill"
    calm = {"ttft": stage(20, 0.1, 0.1, 0.12), "queue": stage(20, 0.001), "prefill": stage(20, 0.099)}
    assert diagnose_server_histograms(calm, "s", "w").cause != START_LATE


def test_diagnosis_says_what_the_server_lacks():
    d = diagnose_server_histograms({k: None for k in ("queue", "prefill", "ttft", "itl")},
                                   "the server's /metrics (llama.cpp names)", "w")
    assert d.cause == NO_DATA and NOT_AVAILABLE in d.verdict
    sglang_like = {"ttft": stage(10, 1.0, 0.9, 1.8), "queue": stage(10, 0.8), "prefill": None}
    d = diagnose_server_histograms(sglang_like, "s", "w")
    assert d.stage == "queue"
    assert any(f"prefill: {NOT_AVAILABLE}" in e for e in d.finding(START_LATE).evidence)


# ------------------------------------------------------------------ diagnose --base-url, /metrics only
class _MetricsOnly(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path.split("?")[0] == "/metrics":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(self.body)))
            self.end_headers()
            self.wfile.write(self.body)
        else:
            msg = b'{"detail":"Not Found"}'
            self.send_response(404)
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)

    def log_message(self, *args):
        pass


@pytest.fixture
def metrics_only_server():
    _MetricsOnly.body = text("vllm_after.txt").encode()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _MetricsOnly)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_diagnose_base_url_falls_back_to_metrics_and_names_the_queue(metrics_only_server, capsys, tmp_path):
    from minillm.cli import main
    save = tmp_path / "saved.json"
    assert main(["diagnose", "--base-url", metrics_only_server, "--save", str(save)]) == 0
    out = capsys.readouterr().out
    verdict = out.splitlines()[0]
    assert verdict.startswith(f"verdict: {START_LATE}: queue")
    assert "from the server's /metrics (vLLM names)" in verdict
    assert "since the server started" in out and "/v1/traces answered 404" in out
    assert f"outside the device: {NOT_AVAILABLE}" in out
    assert save.is_file()


def test_bench_serve_view_without_metrics_says_not_available():
    from minillm.loadgen.bench_serve import _server_view
    view, lines = _server_view((None, "x"), (None, "GET /metrics answered 404"))
    assert view is None and NOT_AVAILABLE in lines[0] and "404" in lines[0]
    before, after = parse_metrics(text("vllm_before.txt"), 0.0), parse_metrics(text("vllm_after.txt"), 5.0)
    view, lines = _server_view((before, None), (after, None))
    assert view["stages"]["queue"]["count"] == 20 and "vLLM names" in lines[0]


def test_a_quantile_from_a_wide_first_bucket_never_contradicts_the_exact_mean():
    from minillm.loadgen.server_metrics import Histogram
    # 32 queue times averaging 3.2 ms, all in vLLM's first bucket (le 0.3 s): interpolation alone says 150 ms
    h = Histogram([(0.3, 32.0), (0.5, 32.0), (float("inf"), 32.0)], 32.0, 32 * 0.0032)
    assert h.quantile(0.5) == pytest.approx(0.15)
    st = h.stage()
    assert st.mean_s == pytest.approx(0.0032)
    assert st.p50_s == pytest.approx(2 * 0.0032)          # at most half the values exceed twice the mean
    assert st.p99_s == pytest.approx(0.3 * 0.99)          # the bucket's estimate, under 100 × the mean
    # buckets narrow enough keep their own estimate
    narrow = Histogram([(0.01, 10.0), (0.02, 20.0), (float("inf"), 20.0)], 20.0, 20 * 0.01)
    assert narrow.stage().p50_s == pytest.approx(narrow.quantile(0.5)) == pytest.approx(0.01)
