"""``bench-serve`` (minillm/loadgen/bench_serve.py): the SSE parser on recorded streams, the open-loop
schedule, failures that must be counted (not crash), and runs against a real tiny ``minillm`` server."""
from __future__ import annotations

import json
import math
import socket
import threading

import httpx
import numpy as np
import pytest

from minillm.loadgen.bench_serve import BenchConfig, parse_goodput, run_bench
from minillm.loadgen.datasets import arrival_schedule, range_bounds, sample_requests
from minillm.loadgen.sse import SSEParser, StreamCollector
from minillm.metrics.definitions import client_request_metrics
from minillm.serving.server import ServerConfig, ServerThread

KEY = "sk-bench-serve-0123456789"


# ---- servers --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    srv = ServerThread(ServerConfig(model="tiny", device="cpu", dtype="fp32", port=0, api_keys=[KEY],
                                    max_model_len=512, max_batch_size=8)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def limited():
    srv = ServerThread(ServerConfig(model="tiny", device="cpu", dtype="fp32", port=0, api_keys=[KEY],
                                    max_model_len=512, requests_per_s=1, burst=1)).start()
    yield srv
    srv.stop()


def _cfg(url: str, **kw) -> BenchConfig:
    base = dict(base_url=url, api_key=KEY, num_prompts=8, random_input_len=16, random_output_len=8,
                random_range_ratio=0.5, ignore_eos=True, timeout_s=120,
                prompt_nonce=0)  # the same prompts every run: a random tiny model may stream no text for some
    base.update(kw)
    return BenchConfig(**base)


# ---- against the real server ----------------------------------------------------------------

@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_every_request_accounted_and_usage_counts(server, endpoint):
    res = run_bench(_cfg(server.url, endpoint=endpoint, num_prompts=12, request_rate=200, max_concurrency=4,
                         warmup=2))
    assert res.model == "tiny"                       # from GET /v1/models
    assert len(res.records) == 12 and len(res.warmup_records) == 2
    assert res.n_ok + res.n_failed == 12
    # the random-weight model may emit only tokens that decode to no text: no TTFT, so failed
    # (vLLM's rule), with that reason; nothing else may fail
    assert all(r.error == "never received a non-empty chunk" for r in res.records if not r.ok), \
        [r.error for r in res.records if not r.ok]
    assert res.n_ok >= 6
    assert all(r.status == 200 and r.record.ok for r in res.records)     # the stream itself was complete
    for r in res.records:
        m = client_request_metrics(r.record)
        assert r.usage is not None
        assert m.output_tokens == r.usage["completion_tokens"] == r.output_len       # ignore_eos: all of them
        assert m.prompt_tokens == r.usage["prompt_tokens"] > 0
        assert m.ttft_s is None or m.e2e_s >= m.ttft_s
    # the summary's totals are the sums of the server's usage (over the successful requests, as vLLM)
    assert res.summary.output_tokens == sum(r.usage["completion_tokens"] for r in res.records if r.ok)
    assert res.summary.input_tokens == sum(r.usage["prompt_tokens"] for r in res.records if r.ok)
    # the warm-up is excluded from every number
    ids = {r.record.request_id for r in res.records}
    assert not ids & {r.record.request_id for r in res.warmup_records}


def test_goodput_and_percentiles(server):
    res = run_bench(_cfg(server.url, goodput={"ttft": 1e7, "e2el": 1e7}, metric_percentiles=(50, 99.9)))
    assert res.summary.n_good == res.summary.n_ok > 0
    res2 = run_bench(_cfg(server.url, goodput={"ttft": 1e-6}))
    assert res2.summary.n_good == 0 and res2.summary.goodput_rps == 0
    assert set(res.percentiles) == {"ttft", "tpot", "itl", "e2el"}
    assert set(res.percentiles["ttft"]) == {"mean", "median", "p50", "p99.9"}
    assert res.percentiles["e2el"]["p50"] >= res.percentiles["ttft"]["p50"] > 0
    assert "Request goodput" in res.table()


def test_unique_prompts_and_same_prompt():
    reqs = sample_requests(50, input_len=20, output_len=5, seed=3)
    firsts = [r.prompt.split()[0] for r in reqs]
    assert len(set(firsts)) == 50                    # no two share even a first word
    same = sample_requests(50, input_len=20, output_len=5, range_ratio=0.5, seed=3, same_prompt=True)
    assert len({r.prompt for r in same}) == 1
    assert sample_requests(5, seed=1, nonce=7)[0].prompt == sample_requests(5, seed=1, nonce=7)[0].prompt
    # a fresh nonce each run: same seed, same lengths and words, but a new unique prefix, so a second
    # run against the same server finds nothing of the first in its prefix cache
    a, b = sample_requests(5, seed=1), sample_requests(5, seed=1)
    assert [r.input_len for r in a] == [r.input_len for r in b]
    assert [r.prompt.split()[1:] for r in a] == [r.prompt.split()[1:] for r in b]
    assert all(x.prompt.split()[0] != y.prompt.split()[0] for x, y in zip(a, b))
    assert range_bounds(100, 0.25) == (75, 125)
    outs = [r.output_len for r in sample_requests(400, input_len=10, output_len=100, range_ratio=0.25,
                                                  seed=0)]
    assert min(outs) >= 75 and max(outs) <= 125 and max(outs) - min(outs) > 30
    with pytest.raises(ValueError):
        range_bounds(10, 1.0)


def test_jsonl_dataset(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "hello there", "output_len": 3}\n\n{"prompt": "b c d", "output_len": 7}\n')
    reqs = sample_requests(3, dataset="jsonl", dataset_path=str(p))
    assert [(r.prompt, r.output_len) for r in reqs] == [("hello there", 3), ("b c d", 7), ("hello there", 3)]
    p.write_text('{"prompt": 5}\n')
    with pytest.raises(ValueError):
        sample_requests(1, dataset="jsonl", dataset_path=str(p))


def test_429_is_a_failed_request(limited):
    res = run_bench(_cfg(limited.url, model="tiny", num_prompts=4, request_rate=math.inf))
    assert len(res.records) == 4
    assert res.n_ok + res.n_failed == 4
    assert res.n_ok >= 1                              # the burst of one got through
    r429 = [r for r in res.records if r.status == 429]
    assert r429, [(r.status, r.error) for r in res.records]
    for r in r429:
        assert not r.ok and r.error.startswith("HTTP 429")
        assert client_request_metrics(r.record).ok is False
    assert res.failures().get("HTTP 429") == len(r429)
    assert "HTTP 429" in res.table()


def test_cli_writes_json_that_loads_back(server, tmp_path, capsys):
    from minillm.cli import main
    rc = main(["bench-serve", "--base-url", server.url, "--api-key", KEY, "--num-prompts", "8",
               "--random-input-len", "12", "--random-output-len", "6", "--ignore-eos", "--request-rate",
               "100",
               "--burstiness", "2", "--goodput", "ttft:10000", "--save-result", "--result-dir", str(tmp_path),
               "--result-filename", "r.json", "--warmup", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "Successful requests:" in out and "Output token throughput" in out
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["model"] == "tiny" and d["config"]["num_prompts"] == 8
    assert d["config"]["api_key"] == "***"           # the key is never written to disk
    assert len(d["requests"]) == 8 and len(d["warmup_requests"]) == 1
    assert d["summary"]["n_ok"] + d["summary"]["n_failed"] == 8
    assert d["summary"]["n_ok"] == sum(r["ok"] for r in d["requests"]) > 0
    assert d["summary"]["output_tokens"] == sum(r["usage"]["completion_tokens"]
                                                for r in d["requests"] if r["ok"])
    assert all(r["usage"]["completion_tokens"] == 6 for r in d["requests"])     # --ignore-eos
    assert all(r["status"] == 200 and r["chunks"] for r in d["requests"])


def test_cli_bad_goodput_is_exit_2(capsys):
    from minillm.cli import main
    assert main(["bench-serve", "--goodput", "ttft=5"]) == 2
    with pytest.raises(ValueError):
        parse_goodput(["foo:3"])


# ---- the open-loop schedule -------------------------------------------------------------------

@pytest.mark.parametrize("burstiness,cv", [(1.0, 1.0), (4.0, 0.5)])
def test_schedule_gaps(burstiness, cv):
    t = arrival_schedule(2000, request_rate=10, burstiness=burstiness, seed=0)
    assert len(t) == 2000 and t[0] == 0 and all(b >= a for a, b in zip(t, t[1:]))
    gaps = np.diff(t)
    assert abs(gaps.mean() - 0.1) <= 0.005
    assert abs(gaps.std() / gaps.mean() - cv) <= 0.07 * cv
    assert arrival_schedule(2000, 10, burstiness, seed=0) == t        # seeded
    assert arrival_schedule(2000, 10, burstiness, seed=1) != t


def test_schedule_inf_is_all_at_once():
    assert arrival_schedule(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_schedule(5, 0)


# ---- the SSE parser on recordings -------------------------------------------------------------

# vLLM's /v1/completions with include_usage: several tokens may share a chunk, the usage comes in a
# last chunk with empty choices, then [DONE].
VLLM = (
    'data: '
    '{"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
    '"choices":[{"index":0,"text":"Hello","logprobs":null,"finish_reason":null}],"usage":null}\n\ndata: '
    '{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" world, '
    'how","logprobs":null,"finish_reason":null}],"usage":null}\n\ndata: '
    '{"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
    '"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":null}],"usage":null}\n\ndata: '
    '{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" '
    'are","logprobs":null,"finish_reason":"length"}],"usage":null}\n\ndata: '
    '{"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
    '"choices":[],"usage":{"prompt_tokens":7,"total_tokens":13,"completion_tokens":6}}\n\ndata: '
    '[DONE]\n\n')

# SGLang-style chat stream: CRLF line endings, a role-only first chunk, keep-alive comments.
SGLANG = (
    ': keep-alive\r\n\r\n'
    'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant",'
    '"content":""},"finish_reason":null}],"usage":null}\r\n\r\n'
    'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hi"},'
    '"finish_reason":null}],"usage":null}\r\n\r\n'
    ':ping\r\n\r\n'
    'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" there!"},'
    '"finish_reason":"stop"}],"usage":null}\r\n\r\n'
    'data: {"id":"c1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":5,'
    '"completion_tokens":3,"total_tokens":8}}\r\n\r\n'
    'data: [DONE]\r\n\r\n')


def _replay(stream: str, chat: bool, piece: int):
    """Feed the recording in pieces of ``piece`` characters, one fake millisecond per piece."""
    p = SSEParser()
    col = StreamCollector("r", 0, chat)
    for k, i in enumerate(range(0, len(stream), piece)):
        for data in p.feed(stream[i:i + piece]):
            col.event(data, (k + 1) * 1_000_000)
    for data in p.close():
        col.event(data, 10**12)
    return p, col


@pytest.mark.parametrize("piece", [1, 2, 7, 10_000])
def test_sse_vllm_completions(piece):
    _, col = _replay(VLLM, chat=False, piece=piece)
    assert col.done and col.error is None
    assert "".join(t for _, _, t in col.chunks) == "Hello world, how are"
    assert [t for _, _, t in col.chunks] == ["Hello", " world, how", "", " are"]  # usage chunk has no choices
    rec = col.record(t_done_ns=10**12)
    m = client_request_metrics(rec)
    assert m.ok and m.output_tokens == 6 and m.prompt_tokens == 7       # from usage, not counted chunks
    assert len(m.itl_s) == 2                                            # the empty chunk is no gap
    assert col.finish_reason == "length"


@pytest.mark.parametrize("piece", [1, 3, 10_000])
def test_sse_sglang_chat_crlf_keepalive(piece):
    p, col = _replay(SGLANG, chat=True, piece=piece)
    assert col.done and col.error is None and p.n_comments == 2
    assert [t for _, _, t in col.chunks] == ["", "Hi", " there!"]
    m = client_request_metrics(col.record(10**12))
    assert m.ok and m.output_tokens == 3 and m.prompt_tokens == 5
    # TTFT at the first non-empty text, not at the role-only chunk (where vLLM's chat client stops it)
    assert m.ttft_s == pytest.approx(col.chunks[1][0] / 1e9)


def test_sse_parser_details():
    p = SSEParser()
    assert p.feed("data: a\r") == []                 # a lone CR at the end may be half a CRLF
    assert p.feed("\n\r\n") == ["a"]
    assert p.feed("data: x\ndata: y\nevent: msg\nid: 3\n\n") == ["x\ny"]
    assert p.feed("data: x\r\ndata: y\r\n\r\n") == ["x\ny"]     # CRLF is one line end, not two
    assert p.feed("data: {\"a\": 1}\r\n") == [] and p.feed("\r\n") == ['{"a": 1}']
    assert p.feed("data:no-space\r\rdata: tail") == ["no-space"]
    assert p.close() == ["tail"]                     # the stream ended without a blank line


def test_stream_without_done_or_with_error_event_fails():
    col = StreamCollector("r", 0, False)
    col.event('{"choices":[{"text":"a"}]}', 1)
    rec = col.record(2)
    assert not rec.ok and "before [DONE]" in rec.error
    col = StreamCollector("r", 0, False)
    col.event('{"choices":[{"text":"a"}]}', 1)
    col.event('{"error":{"message":"engine died","code":500}}', 2)
    rec = col.record(3)
    assert not rec.ok and "server error event" in rec.error and "engine died" in rec.error
    assert client_request_metrics(rec).ok is False


# ---- misbehaving servers: failed requests, never a crash ---------------------------------------

_MODELS = b'{"object":"list","data":[{"id":"fake"}]}'


def _chunked(body: bytes) -> bytes:
    return f"{len(body):x}\r\n".encode() + body + b"\r\n"


class _RawServer:
    """A socket server that answers each POST in one of several broken ways, chosen by a counter:
    0 ok, 1 an error event mid-stream, 2 the connection closed mid-stream, 3 HTTP 500, 4 a stall."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.n = 0
        self.lock = threading.Lock()
        self.stop_ev = threading.Event()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop_ev.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _read_request(self, c: socket.socket) -> bytes | None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            d = c.recv(65536)
            if not d:
                return None
            buf += d
        head, _, rest = buf.partition(b"\r\n\r\n")
        n = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                n = int(line.split(b":")[1])
        while len(rest) < n:
            rest += c.recv(65536)
        return head

    def _serve(self, c: socket.socket) -> None:
        try:
            while True:
                head = self._read_request(c)
                if head is None:
                    return
                if head.startswith(b"GET"):
                    c.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                              + str(len(_MODELS)).encode() + b"\r\n\r\n" + _MODELS)
                    continue
                with self.lock:
                    mode, self.n = self.n % 5, self.n + 1
                if mode == 3:
                    body = b'{"error":{"message":"boom"}}'
                    c.sendall(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
                              b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                    continue
                c.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: "
                          b"chunked\r\n\r\n")
                c.sendall(_chunked(b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'))
                if mode == 0:
                    c.sendall(_chunked(b'data: '
                                       b'{"choices":[],'
                                       b'"usage":{"prompt_tokens":2,"completion_tokens":1}}\n\ndata: '
                                       b'[DONE]\n\n') + b"0\r\n\r\n")
                elif mode == 1:
                    c.sendall(_chunked(b'data: {"error":{"message":"engine failed","code":500}}\n\n'
                                       b'data: [DONE]\n\n') + b"0\r\n\r\n")
                elif mode == 2:
                    c.shutdown(socket.SHUT_RDWR)
                    c.close()
                    return
                else:                                # mode 4: never finishes; the client times out
                    self.stop_ev.wait(30)
                    return
        except OSError:
            return

    def close(self) -> None:
        self.stop_ev.set()
        self.sock.close()
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass


def test_broken_server_gives_failed_requests_not_a_crash():
    srv = _RawServer()
    try:
        # one cycle of the five modes; 3 s for the one that never finishes, so a pause of this process
        # (a full garbage collection) cannot turn one of the others into a timeout
        res = run_bench(BenchConfig(base_url=srv.url, num_prompts=5, random_input_len=4, random_output_len=2,
                                    max_concurrency=1, timeout_s=3.0))
    finally:
        srv.close()
    assert res.model == "fake"
    assert len(res.records) == 5 and res.n_ok + res.n_failed == 5
    by_index = sorted(res.records, key=lambda r: r.index)
    kinds = [r.error.split(":")[0] if r.error else "ok" for r in by_index]
    # max_concurrency=1: requests reach the server in order, so mode = index % 5
    assert kinds == ["ok", "server error event mid-stream", "connection closed", "HTTP 500", "timeout"], kinds
    assert res.n_ok == 1 and res.n_failed == 4
    assert res.summary.output_tokens == 1
    assert by_index[3].status == 500
    json.dumps(res.to_dict())                       # failed records serialise too


def test_asgi_app_raising_mid_stream_is_a_failed_request():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def gen():
        yield 'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
        raise RuntimeError("the engine crashed")

    async def completions(request):
        return StreamingResponse(gen(), media_type="text/event-stream")

    async def models(request):
        return JSONResponse({"data": [{"id": "asgi"}]})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/models", models)])
    res = run_bench(BenchConfig(base_url="http://asgi", num_prompts=3, random_input_len=4,
                                random_output_len=2),
                    transport=httpx.ASGITransport(app=app))
    assert res.model == "asgi" and len(res.records) == 3
    assert res.n_failed == 3 and res.n_ok == 0
    assert all("the engine crashed" in r.error or "closed" in r.error for r in res.records), \
        [r.error for r in res.records]


def test_the_clients_own_garbage_collection_is_reported():
    """A collection in the client's process (here forced by the ASGI app, which runs in it) pauses
    the client's event loop: the result counts it, the table and the JSON say so."""
    import gc

    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def gen():
        gc.collect()
        yield 'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
        yield "data: [DONE]\n\n"

    async def completions(request):
        return StreamingResponse(gen(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    gc.disable()                                      # only the app's collections
    try:
        res = run_bench(BenchConfig(base_url="http://asgi", model="m", num_prompts=3, warmup=1,
                                    random_input_len=4,
                                    random_output_len=1), transport=httpx.ASGITransport(app=app))
    finally:
        gc.enable()
    assert res.n_ok == 3
    assert res.client_gc_collections == 3 and res.client_gc_ms > 0    # the warm-up's is not counted
    assert "Client-process GC (ms):" in res.table()
    d = res.to_dict()
    assert d["client_gc_collections"] == 3 and d["client_gc_ms"] == res.client_gc_ms


def test_keepalive_trickle_times_out_as_a_failed_request():
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def gen():
        yield 'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
        while True:                                   # alive, but never finishing
            await asyncio.sleep(0.02)
            yield ": ping\n\n"

    async def completions(request):
        return StreamingResponse(gen(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    res = run_bench(BenchConfig(base_url="http://asgi", model="m", num_prompts=2, random_input_len=4,
                                random_output_len=2, timeout_s=0.3), transport=httpx.ASGITransport(app=app))
    assert res.n_failed == 2 and all(r.error.startswith("timeout") for r in res.records), \
        [r.error for r in res.records]


def test_cli_unreachable_server_is_exit_2(capsys):
    from minillm.cli import main
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                                         # nothing listens there now
    assert main(["bench-serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_cli_has_vllm_flag_names():
    from minillm.cli import build_parser
    sub = build_parser()._subparsers._group_actions[0].choices["bench-serve"]
    flags = {s for action in sub._actions for s in action.option_strings}
    for f in ("--base-url", "--endpoint", "--api-key", "--model", "--num-prompts", "--request-rate",
              "--burstiness",
              "--max-concurrency", "--seed", "--ignore-eos", "--percentile-metrics", "--metric-percentiles",
              "--goodput", "--save-result", "--result-dir", "--warmup", "--dataset-name", "--dataset-path",
              "--random-input-len", "--random-output-len", "--random-range-ratio", "--same-prompt"):
        assert f in flags, f
    a = build_parser().parse_args(["bench-serve", "--request-rate", "inf", "--goodput", "ttft:100",
                                   "tpot:20"])
    assert math.isinf(a.request_rate) and a.goodput == ["ttft:100", "tpot:20"]
    assert parse_goodput(a.goodput) == {"ttft": 100.0, "tpot": 20.0}


def test_lognormal_lengths_have_a_right_tail():
    reqs = sample_requests(2000, dataset="lognormal", input_len=50, output_len=20, lognormal_sigma=0.8,
                           seed=0)
    ins = np.array([r.input_len for r in reqs])
    assert abs(np.median(ins) - 50) <= 5 and ins.mean() > np.median(ins) and ins.min() >= 1
    assert all(len(r.prompt.split()) == r.input_len for r in reqs[:50])


# ---- datasets, tokenizer counts, progress, sweeps -----------------------

def test_sharegpt_shipped_file_and_tokenizer_counts():
    from minillm.engine.tokenizer import load_tokenizer
    from minillm.loadgen.datasets import SHAREGPT_DEFAULT, count_tokens
    conv = json.loads(SHAREGPT_DEFAULT.read_text(encoding="utf-8"))
    assert len(conv) >= 20
    reqs = sample_requests(40, "sharegpt", seed=3)                     # cycles past the file's length
    assert len(reqs) == 40 and {r.prompt for r in reqs} <= {c["conversations"][0]["value"] for c in conv}
    assert sample_requests(40, "sharegpt", seed=3) == reqs             # deterministic per seed
    tok = load_tokenizer("default")
    counted = sample_requests(5, "sharegpt", seed=3, tokenizer=tok)
    replies = {c["conversations"][0]["value"]: c["conversations"][1]["value"] for c in conv}
    for r in counted:
        assert r.input_len == count_tokens(tok, r.prompt)
        assert r.output_len == max(1, count_tokens(tok, replies[r.prompt]))
    lens = [r.output_len for r in sample_requests(28, "sharegpt", seed=0, tokenizer=tok)]
    assert max(lens) > 10 * min(lens)                                  # uneven, as real chat is
    assert all(r.output_len == 7 for r in sample_requests(4, "sharegpt", sharegpt_output_len=7))


def test_sharegpt_bad_files_are_clear_errors(tmp_path):
    p = tmp_path / "s.json"
    p.write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="JSON list"):
        sample_requests(2, "sharegpt", dataset_path=str(p))
    p.write_text('[{"conversations": [{"from": "gpt", "value": "no human turn"}]}]')
    with pytest.raises(ValueError, match="no human"):
        sample_requests(2, "sharegpt", dataset_path=str(p))
    with pytest.raises(ValueError, match="cannot read"):
        sample_requests(2, "sharegpt", dataset_path=str(tmp_path / "missing.json"))


def test_random_prompts_have_exact_token_lengths_with_a_tokenizer(server):
    res = run_bench(_cfg(server.url, num_prompts=6, random_input_len=24, random_range_ratio=0.0,
                         tokenizer="default", max_concurrency=3))
    assert len(res.records) == 6 and all(r.status == 200 and r.usage for r in res.records)
    # (a random tiny model may stream only empty text for a request: that one fails, as in vLLM)
    # the server (same shipped BPE) processed the target, plus its BOS; a re-encoding at the cut
    # may merge a token, never add words
    for r in res.records:
        assert r.input_len == 24
        assert 23 <= r.usage["prompt_tokens"] <= 25, r.usage


def test_tokenizer_counts_a_server_without_usage():
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def gen():
        for piece in (" the queue", " is", " long"):          # several tokens in one chunk, no usage
            yield 'data: ' + json.dumps({"choices": [{"index": 0, "text": piece}]}) + "\n\n"
        yield "data: [DONE]\n\n"

    async def completions(request):
        return StreamingResponse(gen(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    cfg = BenchConfig(base_url="http://asgi", model="m", num_prompts=2, random_input_len=5,
                      random_output_len=8)
    without = run_bench(cfg, transport=httpx.ASGITransport(app=app))
    assert without.summary.output_tokens == 2 * 3                 # one per chunk: an undercount
    from dataclasses import replace

    from minillm.engine.tokenizer import load_tokenizer
    from minillm.loadgen.datasets import count_tokens
    counted = run_bench(replace(cfg, tokenizer="default"), transport=httpx.ASGITransport(app=app))
    n = count_tokens(load_tokenizer("default"), " the queue is long")
    assert n > 3 and counted.summary.output_tokens == 2 * n


def test_progress_bar_and_sweep(server, capsys):
    from minillm.loadgen.rate_sweep import run_rate_sweep, sweep_configs, sweep_row, sweep_table
    res = run_rate_sweep(_cfg(server.url, num_prompts=4, progress=True), concurrencies=[1, 3])
    assert [r.config.max_concurrency for r in res] == [1, 3]
    assert all(math.isinf(r.config.request_rate) and r.n_ok == 4 for r in res)
    rows = [sweep_row(r) for r in res]
    assert all(r["achieved_rate"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0 for r in rows)
    table = sweep_table(rows)
    assert table.count("\n") == 2 and "achieved/s" in table
    assert "requests" in capsys.readouterr().err                   # tqdm's bar went to stderr
    cfgs = sweep_configs(_cfg(server.url, max_concurrency=2), rates=[1, 2.5])
    assert [c.request_rate for c in cfgs] == [1, 2.5] and all(c.max_concurrency == 2 for c in cfgs)
    with pytest.raises(ValueError, match="one of"):
        sweep_configs(_cfg(server.url), rates=[1], concurrencies=[2])
    with pytest.raises(ValueError, match="> 0"):
        sweep_configs(_cfg(server.url), rates=[0])


def test_cli_sweep_writes_one_json_per_point_and_a_table(server, tmp_path, capsys):
    from minillm.cli import main
    rc = main(["bench-serve", "--base-url", server.url, "--api-key", KEY, "--num-prompts", "3",
               "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos", "--sweep-rate",
               "50,100",
               "--save-result", "--result-dir", str(tmp_path), "--disable-tqdm"])
    out = capsys.readouterr().out
    assert rc == 0, out
    points = sorted(tmp_path.glob("*-point*.json"))
    assert len(points) == 2
    assert [json.loads(p.read_text())["config"]["request_rate"] for p in points] == [50.0, 100.0]
    sweep = [p for p in tmp_path.glob("bench-serve-sweep-*.json") if "point" not in p.name]
    assert len(sweep) == 1 and len(json.loads(sweep[0].read_text())["points"]) == 2
    assert "offered/s" in out and "achieved/s" in out
    assert main(["bench-serve", "--base-url", server.url, "--sweep-rate", "1,x"]) == 2
    assert "comma-separated" in capsys.readouterr().err


def test_drawn_and_completion_rates_tell_whether_the_server_kept_up():
    from minillm.loadgen.bench_serve import BenchResult, RequestRecord
    from minillm.loadgen.rate_sweep import drawn_rate, kept_up, served_completion_rate
    from minillm.metrics.definitions import ClientRecord
    from minillm.metrics.summary import summarize

    def result(done_s: list[float], rate: float = 1.0) -> BenchResult:
        recs = []
        for i, d in enumerate(done_s):
            t0 = int(i / rate * 1e9)
            cr = ClientRecord(f"r{i}", t0, [(t0 + 1000, None, "x"), (int(d * 1e9), None, "y")], int(d * 1e9),
                              4)
            recs.append(RequestRecord(i, i / rate, cr, 200, 4, 2))
        cfg = BenchConfig(base_url="http://x", request_rate=rate)
        return BenchResult(cfg, "m", recs, [], summarize([client_request_metrics(r.record) for r in recs]),
                           {})

    steady = result([i + 0.5 for i in range(10)])              # each done 0.5 s after its arrival
    assert drawn_rate(steady) == pytest.approx(1.0) and served_completion_rate(steady) == pytest.approx(1.0)
    assert kept_up(steady) is True
    assert steady.summary.requests_s == pytest.approx(10 / 9.5)  # N over first send → last completion
    growing = result([0.5 + 1.5 * i for i in range(10)])        # the queue grows: one done per 1.5 s
    assert served_completion_rate(growing) == pytest.approx(1 / 1.5) and kept_up(growing) is False
    closed = result([i + 0.5 for i in range(10)], rate=math.inf)
    assert drawn_rate(closed) is None and kept_up(closed) is None
