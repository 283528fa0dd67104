"""``roofline --base-url``: 10.3's crossover through any OpenAI-compatible server
(minillm/loadgen/remote_roofline.py). The steady-state rates from chunk times, the queue and failure
stops, the bound's inputs, and a real ``minillm serve`` whose own traces the client's rates must match."""
from __future__ import annotations

import json
import statistics

import pytest

from minillm.loadgen.bench_serve import RequestRecord
from minillm.loadgen.remote_roofline import (
    _row,
    hardware_bandwidth,
    load_model_config,
    parse_parallel,
    stream_rates,
)
from minillm.metrics.definitions import ClientRecord

MS = 1_000_000


def record(i: int, times_ms: list[float], tokens: int | None = None) -> RequestRecord:
    chunks = [(int(t * MS), None, "x") for t in times_ms]
    rec = ClientRecord(request_id=f"r{i}", t_sent_ns=0, chunks=chunks, t_done_ns=chunks[-1][0] + 1,
                       prompt_tokens=5, ok=True, error=None,
                       completion_tokens=tokens if tokens is not None else len(chunks))
    return RequestRecord(i, 0.0, rec, 200, 5, len(chunks))


def test_steady_rates_drop_the_ends_and_share_one_window():
    # two streams, a token every 10 ms and every 20 ms, after TTFTs of 100 and 105 ms
    a = record(0, [100 + 10 * k for k in range(41)])
    b = record(1, [105 + 20 * k for k in range(41)])
    r = stream_rates([a, b], trim=0.1)
    assert r["per_request"] == pytest.approx(statistics.median([100.0, 50.0]))
    assert r["spread"] == (pytest.approx(50.0), pytest.approx(100.0))
    # middle parts: a [140, 460] ms, b [185, 825] ms → window [185, 460]
    assert r["window_s"] == pytest.approx(0.275)
    n_a = sum(1 for k in range(41) if 185 < 100 + 10 * k <= 460)
    n_b = sum(1 for k in range(41) if 185 < 105 + 20 * k <= 460)
    assert r["aggregate"] == pytest.approx((n_a + n_b) / 0.275)
    assert r["tpc"] == 1


def test_chunks_holding_several_tokens_scale_the_rate():
    r = stream_rates([record(0, [10 * k for k in range(21)], tokens=42)], trim=0.1)
    assert r["tpc"] == pytest.approx(2.0)
    assert r["per_request"] == pytest.approx(200.0)       # 2 tokens per 10 ms chunk


def test_streams_that_ran_one_after_another_are_a_queue():
    first = record(0, [10 * k for k in range(30)])
    second = record(1, [400 + 10 * k for k in range(30)])
    row = _row(2, [first, second], 0.1, {"running": 1.0, "waiting": 1.0})
    assert row.status == "queued" and "queued" in row.note
    assert row.aggregate_tok_s is None and row.server_running == 1.0


def test_a_failed_request_stops_the_sweep_and_says_why():
    bad = record(1, [0, 1, 2])
    bad.record.ok, bad.record.error = False, "HTTP 503: full"
    row = _row(2, [record(0, [10 * k for k in range(30)]), bad], 0.1, {})
    assert row.status == "failed" and "1 of 2" in row.note and "503" in row.note


def test_bound_inputs_parallel_hardware_and_config(tmp_path):
    assert parse_parallel(None) == 1 and parse_parallel("tp=4, pp=1") == 4
    with pytest.raises(ValueError):
        parse_parallel("pp=2")
    bw, peak, src, name = hardware_bandwidth("NVIDIA H100 80GB HBM3", {}, 2)
    assert bw == pytest.approx(2 * 3.35e12) and peak == pytest.approx(2 * 989.5e12) and "tp=2" in src
    bw, _, why, _ = hardware_bandwidth("Some CPU", {}, 1)
    assert bw is None and "--bandwidth" in why
    assert hardware_bandwidth(None, {}, 2, stated_gbs=40)[0] == pytest.approx(80e9)
    cfg, src = load_model_config(None, {"root": "tiny"})
    assert cfg.name == "tiny" and "server-info" in src
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
    cfg, src = load_model_config(str(tmp_path), {})
    assert cfg.num_layers == 2 and str(tmp_path) in src
    assert load_model_config(None, {})[0] is None


# --------------------------------------------------------------------- against a real minillm serve
TOLERANCE = 0.25   # client (HTTP + SSE) against the server's own token times: within 25 %


def _server_rates(traces, batch: int, trim: float) -> tuple[float, float]:
    """The same two numbers from the server's ``token`` events (GET /v1/traces)."""
    mine = [t for t in traces if f"-b{batch}-" in t.request_id and "warmup" not in t.request_id]
    assert len(mine) == batch
    spans, per = [], []
    for tr in mine:
        times = tr.times("token")
        k = max(1, int(len(times) * trim))
        i, j = k, len(times) - 1 - k
        per.append((j - i) / ((times[j] - times[i]) / 1e9))
        spans.append((times[i], times[j], times))
    w0, w1 = max(s[0] for s in spans), min(s[1] for s in spans)
    n = sum(sum(1 for t in times if w0 < t <= w1) for _, _, times in spans)
    return statistics.median(per), n / ((w1 - w0) / 1e9)


def test_roofline_base_url_against_minillm_serve_matches_its_traces(tmp_path, capsys):
    from minillm.cli import main
    from minillm.loadgen.server_api import fetch_traces
    from minillm.serving.server import ServerConfig, ServerThread
    srv = ServerThread(ServerConfig(model="tiny", device="cpu", dtype="fp32", port=0)).start()
    try:
        rc = main(["roofline", "--base-url", srv.url, "--batches", "1,2,4", "--max-tokens", "96",
                   "--bandwidth", "20", "--out", str(tmp_path), "--figures", str(tmp_path / "fig")])
        out = capsys.readouterr().out
        assert rc == 0, out
        traces = fetch_traces(srv.url)
    finally:
        srv.stop()
    data = json.loads((tmp_path / "roofline-http.json").read_text())
    assert [r["batch"] for r in data["rows"]] == [1, 2, 4]
    assert "through HTTP" in out and "SSE" in out
    assert (tmp_path / "fig" / "10-3-decode-roofline-http.png").is_file()
    assert data["bound"]["config_source"].startswith("preset tiny")
    for row in data["rows"]:
        assert row["status"] == "ok" and row["n_ok"] == row["batch"] and row["tokens_per_chunk"] == 1
        per, agg = _server_rates(traces, row["batch"], data["trim"])
        assert row["per_request_tok_s"] == pytest.approx(per, rel=TOLERANCE)
        assert row["aggregate_tok_s"] == pytest.approx(agg, rel=TOLERANCE)
        # the bound: 20 GB/s over the tiny model's bytes at this batch, B times for the batch
        assert row["bound_aggregate_tok_s"] == pytest.approx(row["batch"] * row["bound_per_request_tok_s"])


def test_the_bound_reads_the_checkpoints_dtype_when_the_server_does_not_say(tmp_path):
    # vLLM has no /v1/server-info: a float32 checkpoint's bound must count 4 bytes a weight, not bf16's 2
    import json

    from minillm.loadgen.remote_roofline import config_dtype, server_bound
    hf = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 128,
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "dtype": "float32"}    # transformers 5: "dtype"
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert config_dtype(str(tmp_path)) == "fp32" and config_dtype(None) is None
    closed = "http://127.0.0.1:9"                       # nothing listens: no /v1/server-info
    b32, _, nbytes, _ = server_bound(closed, None, 64, config=str(tmp_path), bandwidth_gbs=10)
    assert nbytes == 4 and b32.dtype == "fp32"
    b16, _, nbytes16, _ = server_bound(closed, None, 64, config=str(tmp_path), bandwidth_gbs=10, dtype="bf16")
    assert nbytes16 == 2 and b16.weight_bytes * 2 == b32.weight_bytes
