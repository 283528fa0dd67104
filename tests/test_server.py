"""The HTTP server (chapter 10.1), through real HTTP on a free loopback port, tiny model, CPU fp32.

Two servers, each started once for the module: ``server`` (one API key, generous limits) for the
happy paths, the official ``openai`` client, 64 concurrent streams with disconnects and the
traces; ``strict`` (a request-rate limit and a queue of depth 2) for 429 and 503.
"""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest

from minillm.loadgen.http_overhead import arun_concurrent, astream_completion, stream_completion
from minillm.loadgen.server_api import fetch_traces
from minillm.serving.server import ServerConfig, ServerThread

KEY = "sk-test-server-0123456789"
STRICT_KEYS = ["sk-strict-a-000000", "sk-strict-b-111111", "sk-strict-c-222222", "sk-strict-d-333333"]
MAX_LEN = 256


def _config(**kw) -> ServerConfig:
    return ServerConfig(model="tiny", device="cpu", dtype="fp32", port=0, max_model_len=MAX_LEN, **kw)


@pytest.fixture(scope="module")
def server():
    srv = ServerThread(_config(api_keys=[KEY], max_batch_size=16, max_queue_depth=512)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def strict():
    # one request per 30 s per key (burst 1); at most 2 requests inside the server
    srv = ServerThread(_config(api_keys=STRICT_KEYS, requests_per_s=1 / 30, burst=1, max_queue_depth=2,
                               max_batch_size=4)).start()
    yield srv
    srv.stop()


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def post(srv, body, headers=None, path="/v1/completions", **kw) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=auth() if headers is None else headers, timeout=60,
                      **kw)


def wait_idle(srv, timeout: float = 15.0) -> dict:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if srv.state.idle():
            return srv.state.stats()
        time.sleep(0.02)
    raise AssertionError(f"the server did not become idle: {srv.state.stats()}")


class EngineGate:
    """Holds the engine between steps once ``hold()`` is called, until ``release()``: a test
    that needs requests to stay in flight gets that by construction, not by racing their tokens."""

    def __init__(self, srv) -> None:
        self.runner = srv.state.engine.runner
        self.real = self.runner.execute
        self.held, self.open = threading.Event(), threading.Event()
        self.runner.execute = self._execute

    def _execute(self, *args, **kwargs):
        if self.held.is_set():
            self.open.wait(timeout=60)
        return self.real(*args, **kwargs)

    def hold(self) -> None:
        self.held.set()

    def release(self) -> None:
        self.open.set()
        self.runner.execute = self.real


def assert_openai_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == code, err
    assert err["message"]
    return err


# ---- the gateway's rejections, through HTTP ----------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}],
                         ids=["missing", "wrong", "not-bearer"])
def test_401_bad_or_missing_key(server, headers):
    for path, method in (("/v1/completions", "post"), ("/v1/models", "get"), ("/v1/traces", "get")):
        kw = {"json": {"prompt": "hi", "max_tokens": 2}} if method == "post" else {}
        r = getattr(httpx, method)(server.url + path, headers=headers, timeout=30, **kw)
        err = assert_openai_error(r, 401, "invalid_api_key")
        assert err["type"] == "invalid_request_error"
        assert KEY not in r.text


def test_400_invalid_params_name_the_field(server):
    for body, param in (({"prompt": "hi", "temperature": 500}, "temperature"),
                        ({"prompt": "hi", "n": 3}, "n"),
                        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
                        ({"max_tokens": 4}, "prompt")):
        err = assert_openai_error(post(server, body), 400, "invalid_request")
        assert err["param"] == param, err
    err = assert_openai_error(post(server, {"messages": "hello"}, path="/v1/chat/completions"), 400,
                              "invalid_request")
    assert err["param"] == "messages"


def test_400_prompt_longer_than_the_context_names_the_limit(server):
    prompt = "the cache holds every token " * 200            # far more than 256 tokens
    err = assert_openai_error(post(server, {"prompt": prompt, "max_tokens": 8}), 400,
                              "context_length_exceeded")
    assert str(MAX_LEN) in err["message"] and "tokens" in err["message"], err
    assert err["param"] == "prompt", err                      # no max_tokens could make it fit
    # without max_tokens too (the default must fit what is left of the context)
    err = assert_openai_error(post(server, {"prompt": prompt}), 400, "context_length_exceeded")
    assert str(MAX_LEN) in err["message"] and err["param"] == "prompt", err
    # a short prompt asking for more than is left: then max_tokens is the field to change
    err = assert_openai_error(post(server, {"prompt": "hi", "max_tokens": MAX_LEN}), 400,
                              "context_length_exceeded")
    assert err["param"] == "max_tokens", err
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
    err = assert_openai_error(post(server, chat, path="/v1/chat/completions"), 400, "context_length_exceeded")
    assert err["param"] == "messages", err


def test_404_unknown_model_and_route(server):
    err = assert_openai_error(post(server, {"model": "gpt-9", "prompt": "hi", "max_tokens": 2}), 404,
                              "model_not_found")
    assert "tiny" in err["message"] and err["param"] == "model"
    assert_openai_error(httpx.get(server.url + "/v1/nothing-here", headers=auth()), 404, "not_found")


def test_429_rate_limit_with_retry_after(strict):
    body = {"prompt": "hi", "max_tokens": 2}
    key = STRICT_KEYS[0]
    assert post(strict, body, auth(key)).status_code == 200
    r = post(strict, body, auth(key))
    err = assert_openai_error(r, 429, "rate_limited")
    assert err["type"] == "rate_limit_error"
    assert int(r.headers["Retry-After"]) >= 1
    assert "requests per second" in err["message"]
    wait_idle(strict)


def test_503_when_the_queue_is_full_then_recovers(strict):
    # two long streams fill the queue (depth 2); a third caller (its own key, so no 429) gets 503
    long = {"prompt": "hold the slot", "max_tokens": 240, "temperature": 0, "ignore_eos": True,
            "stream": True}
    gate = EngineGate(strict)
    try:
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", strict.url + "/v1/completions", json=long,
                          headers=auth(STRICT_KEYS[1])) as r1, \
                    c.stream("POST", strict.url + "/v1/completions", json=long,
                             headers=auth(STRICT_KEYS[2])) as r2:
                assert r1.status_code == r2.status_code == 200
                # keep the iterators: dropping one closes its connection, i.e. hangs up
                lines1, lines2 = r1.iter_lines(), r2.iter_lines()
                next(lines1), next(lines2)                        # both are inside and generating
                gate.hold()                                       # and stay so, however slow this thread is
                assert strict.state.gateway.admission.depth == 2
                r3 = httpx.post(strict.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                headers=auth(STRICT_KEYS[3]), timeout=30)
                err = assert_openai_error(r3, 503, "queue_full")
                assert err["type"] == "server_error" and int(r3.headers["Retry-After"]) >= 1
                gate.release()
    finally:
        gate.release()
    # leaving the `with` hung up both streams: their slots and queue places must come back
    stats = wait_idle(strict)
    assert stats["free_slots"] == stats["num_slots"]
    aborted = [t for t in strict.traces()
               if t.last("finished") and t.last("finished").extra.get("reason") == "disconnected"]
    assert len(aborted) >= 2
    assert all(any(e.event == "finished" and e.extra.get("reason") == "abort" for e in t) for t in aborted)


def test_malformed_and_oversized_bodies_get_4xx_and_the_server_goes_on(server):
    url = server.url + "/v1/completions"
    h = {**auth(), "Content-Type": "application/json"}
    for content in (b"{not json", b"", b"\xff\xfe\x00garbage", b"[" * 200_000, b"[1, 2, 3]", b'"a string"'):
        r = httpx.post(url, content=content, headers=h, timeout=60)
        assert_openai_error(r, 400, "invalid_request")
    big = json.dumps({"prompt": "x" * (1 << 20) + "y", "max_tokens": 2}).encode()   # > 1 MiB
    r = httpx.post(url, content=big, headers=h, timeout=60)
    err = assert_openai_error(r, 413, "request_too_large")
    assert str(1 << 20) in err["message"]
    # a stranger gets 401, not a hint about the body
    assert_openai_error(httpx.post(url, content=b"{bad", headers={"Content-Type": "application/json"}), 401,
                        "invalid_api_key")
    r = post(server, {"prompt": "still serving?", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    wait_idle(server)


# ---- the official client -------------------------------------------------------------------

def _openai(srv):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_openai_client_models(server):
    models = _openai(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_openai_client_streamed_completion_equals_non_streamed(server):
    client = _openai(server)
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert full.usage.completion_tokens == 24 and full.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and text
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (full.usage.prompt_tokens, 24)
    assert last.usage.total_tokens == full.usage.prompt_tokens + 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_openai_client_streamed_chat_equals_non_streamed(server):
    client = _openai(server)
    kw = dict(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "What is a KV cache?"}],
              max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 20
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # without include_usage, no usage chunk
    plain = list(client.chat.completions.create(**kw, stream=True))
    assert all(c.choices for c in plain)


# ---- many streams, some of which hang up ----------------------------------------------------

def test_64_concurrent_streams_with_disconnects_leak_nothing(server):
    n = 64
    rng = random.Random(1234)
    bodies, stops = [], []
    for i in range(n):
        words = " ".join(rng.choice(["prefill", "decode", "queue", "slot",
                                     "token"]) for _ in range(rng.randint(1, 60)))
        bodies.append({"prompt": f"{i}: {words}", "max_tokens": rng.randint(8, 24), "temperature": 0,
                       "ignore_eos": True, "stream_options": {"include_usage": True}})
        # a quarter hang up: right after the headers (often still in the queue) or mid-stream
        stops.append(rng.choice([0, 1, 2, 5]) if i % 4 == 0 else None)
    results = asyncio.run(arun_concurrent(server.url, bodies, KEY, stop_after=stops, timeout_s=120))
    stats = wait_idle(server)
    assert stats["free_slots"] == stats["num_slots"] and stats["running"] == stats["waiting"] == 0
    assert stats["sequences"] == 0, "finished sequences must not pile up in the engine"
    for body, stop, res in zip(bodies, stops, results):
        if stop is not None:
            assert res.disconnected
            continue
        # nobody lost: every other stream got its tokens, its finish and [DONE]
        assert res.ok, res.error
        assert res.finish_reason == "length" and res.done
        assert res.usage["completion_tokens"] == body["max_tokens"]
    # and every request's trace was stored, hang-ups included
    ids = {r.request_id for r in results}
    assert None not in ids
    stored = {t.request_id: t for t in server.traces(list(ids))}
    assert set(stored) == ids
    aborted = 0
    for res in results:
        tr = stored[res.request_id]
        fin = tr.last("finished")
        assert fin.extra["where"] == "server"
        if not res.disconnected:
            assert fin.extra["reason"] == "length"
            continue
        # a client that hangs up after the last chunk was written changes nothing ("length");
        # otherwise the server saw it go ("disconnected") and the engine aborted the request
        assert fin.extra["reason"] in ("disconnected", "length")
        if fin.extra["reason"] == "disconnected":
            engine_fin = [e for e in tr.events if e.event == "finished" and "where" not in e.extra]
            assert [e.extra["reason"] for e in engine_fin] in (["abort"], ["length"], [])
            aborted += [e.extra["reason"] for e in engine_fin] == ["abort"]
    assert aborted >= 4, "the hang-ups right after the headers must have aborted requests inside the engine"


def test_non_streaming_client_that_gives_up_frees_its_slot(server):
    body = {"prompt": "a long answer please", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    gate = EngineGate(server)
    gate.hold()                                   # no step until the client has given up, however fast
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", json=body, headers=auth(), timeout=0.05)
    finally:
        gate.release()
    wait_idle(server)
    tr = server.traces()[-1]                      # stored when the server saw the client go
    assert tr.last("finished").extra["reason"] == "disconnected"
    engine_fin = [e.extra["reason"] for e in tr.events if e.event == "finished" and "where" not in e.extra]
    assert engine_fin == ["abort"] and len(tr.times("token")) < 240


# ---- traces --------------------------------------------------------------------------------

STAGES_IN_ORDER = ["received", "authenticated", "body_read", "tokenized", "admitted", "enqueued", "scheduled",
                   "prefill_start", "prefill_end", "token", "detokenized", "sent"]


def test_trace_of_a_served_request_has_every_stage_in_order(server):
    with httpx.Client(timeout=60) as c:
        res = stream_completion(c, server.url, {"prompt": "Trace me", "max_tokens": 6, "temperature": 0,
                                                "ignore_eos": True}, KEY)
    assert res.ok
    (tr,) = fetch_traces(server.url, [res.request_id], KEY)           # over HTTP, as plain JSON
    assert tr.to_records() == server.state.trace(res.request_id).to_records()   # the Python accessor agrees
    firsts = {}
    for e in tr.events:
        firsts.setdefault(e.event, e.t_ns)
    missing = [s for s in STAGES_IN_ORDER if s not in firsts]
    assert not missing, missing
    times = [firsts[s] for s in STAGES_IN_ORDER]
    assert times == sorted(times), list(zip(STAGES_IN_ORDER, times))
    assert tr.events[-1].event == "finished" and tr.events[-1].extra["where"] == "server"
    assert tr.events[-1].t_ns >= max(e.t_ns for e in tr.events)
    assert len(tr.times("token")) == 6
    # one `sent` per SSE event the client read (5-6 text chunks, [DONE])
    assert len(tr.times("sent")) == res.n_events
    # the engine's own `finished` (slot freed) precedes the last chunk
    engine_fin = next(e for e in tr.events if e.event == "finished")
    assert engine_fin.extra["reason"] == "length" and engine_fin.t_ns <= tr.times("sent")[-1]


def test_rejected_requests_are_traced_only_when_the_key_was_valid(server):
    """A stranger's 401 is counted, never stored: 10,000 bad keys must not evict real traces."""
    before = server.state.trace_store.stats()["unauthenticated"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"},
                   headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    with pytest.raises(KeyError):
        server.state.trace(r.headers["x-request-id"])
    assert server.state.trace_store.stats()["unauthenticated"] == before + 1
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "top_p": 7}, headers=auth())
    tr = server.state.trace(r.headers["x-request-id"])
    assert [e.event for e in tr.events] == ["received", "authenticated", "body_read", "rejected"]
    assert tr.events[-1].extra == {"status": 400, "code": "invalid_request"}


def test_traces_endpoint_limit_and_validation(server):
    r = httpx.get(server.url + "/v1/traces", params={"limit": 2}, headers=auth())
    assert r.status_code == 200 and len(r.json()["data"]) == 2
    assert_openai_error(httpx.get(server.url + "/v1/traces", params={"limit": "-1"}, headers=auth()),
                        400, "invalid_request")


# ---- shutdown ------------------------------------------------------------------------------

def test_stop_ends_open_streams_and_leaves_no_thread():
    before = {t.name for t in threading.enumerate()}
    srv = ServerThread(_config(max_batch_size=2)).start()
    events: list[str] = []

    async def one():
        async with httpx.AsyncClient(timeout=60) as c:
            res = await astream_completion(c, srv.url, {"prompt": "never ending", "max_tokens": 240,
                                                        "temperature": 0, "ignore_eos": True})
            events.append(res.error or "no error")

    # once the request runs, the engine waits between steps until the server is stopping: the
    # stream is still open when stop() comes, however slow this thread is
    runner, stopping = srv.state.engine.runner, lambda: srv.state.loop._stopping
    real, hold = runner.execute, threading.Event()

    def execute_until_stopping(*args, **kwargs):
        t_give_up = time.monotonic() + 30
        while hold.is_set() and not stopping() and time.monotonic() < t_give_up:
            time.sleep(0.005)
        return real(*args, **kwargs)

    runner.execute = execute_until_stopping
    t = threading.Thread(target=lambda: asyncio.run(one()))
    t.start()
    t_end = time.monotonic() + 30
    while not srv.state.stats()["running"]:
        assert time.monotonic() < t_end, "the request never started"
        time.sleep(0.01)
    hold.set()
    t0 = time.monotonic()
    srv.stop()
    t.join(30)
    assert time.monotonic() - t0 < 10
    assert events and "shutting down" in events[0]
    assert srv.state.idle() or srv.state.stats()["streams"] == 0
    left = {t.name for t in threading.enumerate()} - before
    assert not {n for n in left if n.startswith("minillm")}, left


# ---- the benchmark (well-formed, not timed) ------------------------------------------------

def test_bench_http_returns_well_formed_results():
    from minillm.loadgen.http_overhead import run_http_overhead
    rep = run_http_overhead(model="tiny", device="cpu", dtype="fp32", n_requests=3, prompt_tokens=8,
                            max_tokens=4,
                            warmup=1, mode="thread", max_batch_size=2, max_model_len=64)
    d = rep.to_dict()
    assert len(rep.samples["ttft_http_s"]) == len(rep.samples["ttft_inproc_s"]) == 3
    assert 0 < len(rep.samples["itl_http_s"]) <= 3 * 3           # 4 tokens → ≤ 3 gaps per request
    for c in (rep.ttft, rep.itl):
        assert c.http_p50_ms > 0 and c.inproc_p50_ms > 0 and c.http_p99_ms >= c.http_p50_ms
    assert d["ttft"]["overhead_p50_ms"] == pytest.approx(rep.ttft.http_p50_ms - rep.ttft.inproc_p50_ms)
    assert set(rep.ttft_split_ms) and all(v["n"] == 3 for v in rep.ttft_split_ms.values())
    table = rep.table()
    assert "target" in table and "≤ 3 ms" in table and "×" in table
    json.dumps(d)


def test_an_abort_counts_as_inside_until_its_callback_has_run():
    """The abort callback stores the request's trace: until it has run, the server is not idle
    (else a test or a client waiting for idle could read the traces a moment too early)."""
    from minillm.engine.llm import LLM
    from minillm.serving.engine_loop import Abort, EngineLoop
    loop = EngineLoop(LLM("tiny", device="cpu", max_batch_size=1).engine)
    seen = []
    with loop._cv:                                   # as the engine thread takes its aborts
        loop._aborts.append(Abort("gone", then=lambda: seen.append(loop.stats()["aborts"])))
        assert loop.stats()["aborts"] == 1
        aborts, loop._aborts = loop._aborts, []
        loop._aborting = len(aborts)
    assert loop.stats()["aborts"] == 1
    loop._abort(aborts[0])
    assert seen == [1] and loop.stats()["aborts"] == 0
