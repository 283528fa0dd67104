"""The server's defences (keys, ownership, limits, timeouts), through real HTTP on a free loopback port (tiny
model, CPU fp32).

Three servers, each started once for the module:

* ``server``: two API keys (A, B) and an admin key; the happy paths, trace ownership, pagination,
  parsing limits, interop (models, tokenize, X-Request-Id, /health, /metrics, logprobs, OpenAPI);
* ``small_store``: a trace store bounded at 64 KiB;
* ``strict``: no admin key, one request per 10 minutes per key (burst 1: a key's second request
  is refused however slow the machine), 100 tokens per minute.

No timing asserts: every check is about values, order and counts. Where the question is "did the
event loop stall?", the answer comes from the server's own records (trace events and the engine's
StepRecords, all on one clock), not from a duration.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid

import httpx
import pytest
import torch

from minillm.core.trace import Trace
from minillm.loadgen.http_overhead import stream_completion
from minillm.metrics.definitions import request_metrics
from minillm.serving.server import ServerConfig, ServerThread

KEY_A = "sk-hard-a-0123456789abcdef"
KEY_B = "sk-hard-b-fedcba9876543210"
ADMIN = "sk-hard-admin-5555555555"
STRICT_1 = "sk-hard-strict-1-000000"
STRICT_2 = "sk-hard-strict-2-111111"
STRICT_3 = "sk-hard-strict-3-222222"
SMALL = "sk-hard-small-33333333"
SEED = 0


def _config(**kw) -> ServerConfig:
    return ServerConfig(model="tiny", device="cpu", dtype="fp32", port=0, seed=SEED, **kw)


@pytest.fixture(scope="module")
def server():
    # max_model_len 2048 (the tiny model's): a streamer can run for a long while (test 2)
    srv = ServerThread(_config(api_keys=[KEY_A, KEY_B], admin_key=ADMIN, max_batch_size=8,
                               max_queue_depth=64)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def small_store():
    srv = ServerThread(_config(api_keys=[SMALL], trace_store_bytes=65536, max_model_len=128,
                               max_batch_size=8)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def strict():
    srv = ServerThread(_config(api_keys=[STRICT_1, STRICT_2, STRICT_3], requests_per_s=1 / 600, burst=1,
                               tokens_per_min=100, max_model_len=256, max_batch_size=4)).start()
    yield srv
    srv.stop()


# ---- helpers ----------------------------------------------------------------------------------

def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def post(srv, body, key: str = KEY_A, path: str = "/v1/completions", headers=None, **kw) -> httpx.Response:
    h = {**auth(key), **(headers or {})}
    return httpx.post(srv.url + path, json=body, headers=h, timeout=120, **kw)


def post_raw(srv, content: bytes, key: str = KEY_A, path: str = "/v1/completions",
             content_type: str = "application/json") -> httpx.Response:
    return httpx.post(srv.url + path, content=content, headers={**auth(key), "Content-Type": content_type},
                      timeout=120)


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None,
                        param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def wait_idle(srv, timeout: float = 30.0) -> dict:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if srv.state.idle():
            return srv.state.stats()
        time.sleep(0.02)
    raise AssertionError(f"the server did not become idle: {srv.state.stats()}")


def traces_json(srv, key: str, **params) -> dict:
    r = httpx.get(srv.url + "/v1/traces", params=params, headers=auth(key), timeout=60)
    assert r.status_code == 200, r.text[:500]
    return r.json()


def get_trace(srv, request_id: str, key: str, timeout: float = 30.0) -> Trace:
    """The stored trace of ``request_id`` over HTTP (a trace is stored once its response is
    complete, which can be a moment after the client has read it)."""
    t_end = time.monotonic() + timeout
    while True:
        data = traces_json(srv, key, request_id=request_id)["data"]
        if data:
            assert len(data) == 1, data
            return Trace.from_records(data[0]["request_id"], data[0]["events"])
        assert time.monotonic() < t_end, f"no trace for {request_id}"
        time.sleep(0.02)


def all_traces(srv, key: str) -> list[dict]:
    out, after = [], None
    while True:
        page = traces_json(srv, key, **({"after": after} if after is not None else {}))
        out += page["data"]
        after = page["next"]
        if after is None:
            return out


def key_of(trace_json: dict) -> str | None:
    for e in trace_json["events"]:
        if e["event"] == "authenticated":
            return e.get("key_id")
    return None


def sha_prefixes(*keys: str) -> list[str]:
    # an 8-hex-digit prefix is part of every longer one
    return [hashlib.sha256(k.encode()).hexdigest()[:8] for k in keys]


def completion_ids(srv, key: str, n: int, **body) -> list[str]:
    ids = []
    for i in range(n):
        r = post(srv, {"prompt": f"request {i} of {key[-4:]}", "max_tokens": 2, **body}, key=key)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
        assert r.headers["x-request-id"] == ids[-1]
    return ids


def wait_for_ids(srv, key: str, ids: list[str], timeout: float = 30.0) -> None:
    t_end = time.monotonic() + timeout
    while True:
        have = {d["request_id"] for d in all_traces(srv, key)}
        if set(ids) <= have:
            return
        assert time.monotonic() < t_end, set(ids) - have
        time.sleep(0.02)


# ---- 1. traces belong to their key --------------------------------------------------------------

def test_a_key_reads_only_its_own_traces_and_admin_reads_all(server):
    ids_a = completion_ids(server, KEY_A, 3)
    ids_b = completion_ids(server, KEY_B, 2)
    bad_a = post(server, {"prompt": "hi", "top_p": 7}, key=KEY_A)        # a rejection is A's too
    assert_openai_error(bad_a, 400, "invalid_request", "top_p")
    ids_a.append(bad_a.headers["x-request-id"])
    wait_for_ids(server, KEY_A, ids_a)
    wait_for_ids(server, KEY_B, ids_b)

    seen_a, seen_b, seen_adm = all_traces(server, KEY_A), all_traces(server, KEY_B), all_traces(server, ADMIN)
    def rid(ts):
        return {t["request_id"] for t in ts}
    assert set(ids_a) <= rid(seen_a) and not rid(seen_a) & set(ids_b)
    assert set(ids_b) <= rid(seen_b) and not rid(seen_b) & set(ids_a)
    assert set(ids_a) | set(ids_b) <= rid(seen_adm)
    assert not rid(seen_a) & rid(seen_b)
    # key ids are aliases, in the order the keys were given
    assert {key_of(t) for t in seen_a} == {"key-1"}
    assert {key_of(t) for t in seen_b} == {"key-2"}
    assert {key_of(t) for t in seen_adm} >= {"key-1", "key-2"}
    # asking for another key's request by id shows nothing
    assert traces_json(server, KEY_A, request_id=ids_b[0])["data"] == []
    assert traces_json(server, KEY_B, request_id=",".join(ids_a))["data"] == []
    assert len(traces_json(server, ADMIN, request_id=f"{ids_a[0]},{ids_b[0]}")["data"]) == 2


def test_no_key_material_in_any_trace_response(server):
    completion_ids(server, KEY_A, 1)
    completion_ids(server, KEY_B, 1)
    texts = [httpx.get(server.url + "/v1/traces", params=p, headers=auth(k), timeout=60).text
             for k in (KEY_A, KEY_B, ADMIN) for p in ({}, {"limit": 3}, {"limit": 1, "after": 1})]
    for text in texts:
        for secret in (KEY_A, KEY_B, ADMIN, *sha_prefixes(KEY_A, KEY_B, ADMIN)):
            assert secret not in text, secret


def test_401_is_counted_and_never_stored(server):
    before = server.state.trace_store.stats()
    r = post(server, {"prompt": "hi", "max_tokens": 2}, key="sk-not-a-key")
    assert_openai_error(r, 401, "invalid_api_key")
    rid = r.headers["x-request-id"]
    after = server.state.trace_store.stats()
    assert after["unauthenticated"] == before["unauthenticated"] + 1
    assert traces_json(server, ADMIN, request_id=rid)["data"] == []
    assert rid not in json.dumps(all_traces(server, ADMIN))


def test_trace_store_is_bounded_by_bytes(small_store):
    limits = httpx.Limits(max_keepalive_connections=4)
    with httpx.Client(timeout=60, limits=limits) as c:
        for i in range(300):
            body = {"prompt": f"fill the store {i}",
                    "max_tokens": 1} if i % 3 else {"prompt": "bad", "top_p": 9}
            r = c.post(small_store.url + "/v1/completions", json=body, headers=auth(SMALL))
            assert r.status_code in (200, 400), r.text
    wait_idle(small_store)
    st = small_store.state.trace_store.stats()
    print("small trace store:", st)
    assert st["max_bytes"] == 65536
    assert 0 < st["bytes"] <= 65536, st
    assert st["dropped"] > 0 and st["dropped_bytes"] > 0, st
    assert st["traces"] + st["dropped"] >= 300, st
    # what is left is readable, and the newest is there
    data = all_traces(small_store, SMALL)
    assert len(data) == st["traces"]


def test_pagination_with_limit_and_after(server):
    completion_ids(server, KEY_A, 5)
    everything = all_traces(server, KEY_A)
    full = [t["request_id"] for t in everything]
    assert len(full) >= 5 and len(set(full)) == len(full)
    page = traces_json(server, KEY_A, limit=2)
    assert len(page["data"]) == 2 and page["next"] is not None
    assert [t["request_id"] for t in page["data"]] == full[:2]
    got = [t["request_id"] for t in page["data"]]
    n_pages = 1
    while page["next"] is not None:
        page = traces_json(server, KEY_A, limit=2, after=page["next"])
        assert 1 <= len(page["data"]) <= 2 or (page["data"] == [] and page["next"] is None)
        got += [t["request_id"] for t in page["data"]]
        n_pages += 1
        assert n_pages < 10_000
    assert len(got) == len(set(got)), "a page repeated a trace"
    assert got == full
    # the key's pages never show another key's trace
    assert {key_of(t) for t in everything} == {"key-1"}


def test_steps_need_the_admin_key_when_one_is_configured(server, strict):
    assert_openai_error(httpx.get(server.url + "/v1/steps", headers=auth(KEY_A)), 403, "permission_denied")
    assert_openai_error(httpx.get(server.url + "/v1/steps", headers=auth(KEY_B)), 403, "permission_denied")
    r = httpx.get(server.url + "/v1/steps", params={"limit": 3}, headers=auth(ADMIN))
    assert r.status_code == 200 and r.json()["object"] == "list" and len(r.json()["data"]) <= 3
    # no admin key configured: any valid key reads them; a bad key still cannot
    r = httpx.get(strict.url + "/v1/steps", headers=auth(STRICT_3))
    assert r.status_code == 200 and isinstance(r.json()["data"], list)
    assert_openai_error(httpx.get(strict.url + "/v1/steps", headers=auth("nope")), 401, "invalid_api_key")


# ---- 2. the event loop only admits and streams ----------------------------------------------

def big_prompt_body(n_bytes: int = 900_000) -> bytes:
    words = ["the", "scheduler", "admits", "a", "request", "then", "prefill", "fills", "the", "cache", "and",
             "decode", "streams", "tokens"]
    text = " ".join(words[i % len(words)] + str(i % 97) for i in range(n_bytes // 6))[:n_bytes]
    body = json.dumps({"prompt": text, "max_tokens": 4}).encode()
    assert 850_000 < len(body) < 1 << 20
    return body


def test_a_huge_prompt_is_tokenized_off_the_event_loop(server):
    """While a 900 KB prompt is read, parsed and tokenized (for seconds, on a small CPU), a
    concurrent stream keeps getting tokens *and* chunks: the engine's steps and the event loop
    both went on. Measured by the server's own records, not by durations."""
    big = big_prompt_body()
    stream_id = f"streamer-{uuid.uuid4().hex[:8]}"
    first_token = threading.Event()
    stop = threading.Event()
    streamer_out: dict = {}

    def streamer():
        body = {"prompt": "keep streaming", "max_tokens": 1900, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=120) as c, c.stream("POST", server.url + "/v1/completions", json=body,
                                                     headers={**auth(KEY_A), "X-Request-Id": stream_id}) as r:
            streamer_out["status"] = r.status_code
            n = 0
            for line in r.iter_lines():
                if line.startswith("data:") and '"choices"' in line:
                    n += 1
                    first_token.set()
                if stop.is_set() or line == "data: [DONE]":
                    break                         # hang up: the server aborts the request
            streamer_out["chunks"] = n
        first_token.set()

    t = threading.Thread(target=streamer)
    t.start()
    try:
        assert first_token.wait(60) and streamer_out.get("status") == 200, streamer_out
        r = post_raw(server, big)
        err = assert_openai_error(r, 400, "context_length_exceeded")
        assert "2048" in err["message"]
        big_id = r.headers["x-request-id"]
    finally:
        stop.set()
        t.join(120)
    assert not t.is_alive()
    big_tr = get_trace(server, big_id, KEY_A)
    stream_tr = get_trace(server, stream_id, KEY_A)
    t_body = big_tr.first("body_read").t_ns
    end = big_tr.first("tokenized") or big_tr.first("rejected")
    assert big_tr.first("tokenized") is not None, [e.event for e in big_tr.events]
    t_end = end.t_ns
    assert t_body < t_end
    assert big_tr.first("body_read").extra["n_bytes"] == len(big)
    tokens = [t for t in stream_tr.times("token") if t_body <= t <= t_end]
    sent = [t for t in stream_tr.times("sent") if t_body <= t <= t_end]
    # every engine step in that window (only the streamer was running) gave the streamer a token
    sample = 4                                    # PHASES index of "sample": a token's time
    steps = httpx.get(server.url + "/v1/steps", headers=auth(ADMIN), timeout=60).json()
    assert steps["phases"][sample] == "sample"
    in_window = [s for s in steps["data"] if len(s["t_ns"]) > sample and t_body <= s["t_ns"][sample] <= t_end]
    print(f"while tokenizing the big prompt: {len(in_window)} steps, {len(tokens)} streamer tokens, "
          f"{len(sent)} chunks sent")
    assert len(tokens) >= 1, "the streamer got no token while the big prompt was tokenized"
    assert len(tokens) >= len(in_window) - 1, (len(tokens), len(in_window))
    assert len(sent) >= 1, "no chunk was written while the big prompt was tokenized: the event loop stalled"
    wait_idle(server)


def test_a_key_over_its_rate_is_refused_before_its_body_is_read(strict):
    big = big_prompt_body()
    assert post(strict, {"prompt": "first", "max_tokens": 1}, key=STRICT_1).status_code == 200
    r = post_raw(strict, big, key=STRICT_1)
    err = assert_openai_error(r, 429, "rate_limited")
    assert int(r.headers["Retry-After"]) >= 1 and err["type"] == "rate_limit_error"
    tr = get_trace(strict, r.headers["x-request-id"], STRICT_1)
    names = [e.event for e in tr.events]
    assert names[:2] == ["received", "authenticated"] and "rejected" in names, names
    assert "body_read" not in names and "tokenized" not in names, names
    assert tr.last("rejected").extra["status"] == 429


# ---- 3. limits and parsing ----------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_415_for_a_body_that_is_not_json(server, path):
    r = post_raw(server, b'{"prompt": "hi"}', path=path, content_type="text/plain")
    assert_openai_error(r, 415, "unsupported_media_type")


def test_405_carries_allow(server):
    for path, allowed in (("/v1/completions", "POST"), ("/v1/chat/completions", "POST"),
                          ("/tokenize", "POST")):
        r = httpx.get(server.url + path, headers=auth(KEY_A))
        assert_openai_error(r, 405, "method_not_allowed")
        assert allowed in r.headers["allow"].upper().replace(" ", "").split(",")
    r = httpx.post(server.url + "/v1/models", headers=auth(KEY_A), json={})
    assert_openai_error(r, 405)
    assert "GET" in r.headers["allow"].upper()


def test_trailing_slash_is_404_and_never_a_redirect(server):
    for path in ("/v1/completions/", "/v1/chat/completions/", "/tokenize/"):
        r = httpx.post(server.url + path, json={"prompt": "hi", "max_tokens": 1},
                       headers={**auth(KEY_A), "Host": "evil.example.com"}, follow_redirects=False)
        assert_openai_error(r, 404, "not_found")
        assert "location" not in r.headers
        assert "evil.example" not in r.text and "evil.example" not in str(r.headers)
    for path in ("/health/", "/v1/traces/", "/v1/models/"):
        r = httpx.get(server.url + path, headers={**auth(KEY_A), "Host": "evil.example.com"},
                      follow_redirects=False)
        assert r.status_code == 404 and "location" not in r.headers, (path, r.status_code, r.headers)
        assert "evil.example" not in r.text and "evil.example" not in str(r.headers)


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", b'{"prompt": "a\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": "\\udfff"}', "prompt"),
    ("/v1/completions", b'{"prompt": "ok", "max_tokens": 2, "stop": ["\\ud800x"]}', "stop[0]"),
    ("/v1/completions", b'{"prompt": "ok", "max_tokens": 2, "user": "\\udc00"}', "user"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\ud83d"}], "max_tokens": 2}',
     "messages[0].content"),
    ("/tokenize", b'{"prompt": "a\\ud800"}', "prompt"),
])
def test_lone_surrogates_are_400_naming_the_field(server, path, raw, param):
    err = assert_openai_error(post_raw(server, raw, path=path), 400, "invalid_request")
    assert err["param"] == param, err


def test_a_surrogate_pair_is_fine(server):
    r = post_raw(server, b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text


BAD_LIMITS = [{"limit": v} for v in ("²", "-1", "1.5", "0x10", " 3", "٣", "")]
BAD_CURSORS = [{"after": v} for v in ("x", "-5", "²", "1e3")]


@pytest.mark.parametrize("route,params", [("/v1/traces", p) for p in BAD_LIMITS + BAD_CURSORS]
                         + [("/v1/steps", p) for p in BAD_LIMITS], ids=repr)
def test_bad_query_params_are_400_never_500(server, route, params):
    r = httpx.get(server.url + route, params=params, headers=auth(ADMIN), timeout=60)
    err = assert_openai_error(r, 400, "invalid_request")
    assert err["param"] == next(iter(params))


def test_huge_query_numbers_are_capped_not_500(server):
    for params in ({"limit": "9" * 5000}, {"after": "9" * 5000}, {"limit": "0" * 100 + "2"}):
        r = httpx.get(server.url + "/v1/traces", params=params, headers=auth(ADMIN), timeout=60)
        assert r.status_code == 200, r.text[:300]
    r = httpx.get(server.url + "/v1/steps", params={"limit": "9" * 5000}, headers=auth(ADMIN), timeout=60)
    assert r.status_code == 200


UNSUPPORTED = [("logit_bias", {"50256": -100}, {}), ("presence_penalty", 0.5, 0),
               ("frequency_penalty", -1.0, 0.0),
               ("response_format", {"type": "json_object"}, {"type": "text"}),
               ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], []),
               ("best_of", 3, 1), ("echo", True, False)]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("field,bad,neutral", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_fields_are_refused_by_name_and_neutral_values_accepted(server, chat, field, bad,
                                                                            neutral):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    base["max_tokens"] = 2
    err = assert_openai_error(post(server, {**base, field: bad}, path=path), 400, "invalid_request")
    assert err["param"] == field and field in err["message"]
    r = post(server, {**base, field: neutral}, path=path)
    assert r.status_code == 200, r.text


def test_tokens_per_min_without_max_tokens_is_served(strict):
    r = post(strict, {"prompt": "no max_tokens given"}, key=STRICT_2)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert 1 <= usage["prompt_tokens"] + usage["completion_tokens"] <= 100
    r = post(strict, {"messages": [{"role": "user", "content": "hi"}]}, key=STRICT_3,
             path="/v1/chat/completions")
    assert r.status_code == 200, r.text


# ---- 4. honest stamps -------------------------------------------------------------------------

def test_received_is_stamped_before_the_body_is_read_and_the_breakdown_has_body(server):
    with httpx.Client(timeout=60) as c:
        res = stream_completion(c, server.url, {"prompt": "stamp me", "max_tokens": 4, "temperature": 0,
                                                "ignore_eos": True}, KEY_A)
    assert res.ok, res.error
    tr = get_trace(server, res.request_id, KEY_A)
    names = [e.event for e in tr.events]
    assert names[0] == "received" and tr.events[0].extra.get("path") == "/v1/completions"
    t = {n: tr.first(n).t_ns for n in ("received", "authenticated", "body_read", "tokenized", "admitted")}
    assert t["received"] <= t["authenticated"] < t["body_read"] <= t["tokenized"] <= t["admitted"], t
    m = request_metrics(tr)
    assert m.ok and "body" in m.breakdown, m.breakdown
    assert m.breakdown["body"] > 0
    assert sum(m.breakdown.values()) == pytest.approx(m.ttft_s, abs=1e-6)


def sse_events(r: httpx.Response) -> list:
    out = []
    for line in r.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_streamed_chat_first_chunk_has_role_and_content(server):
    body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/chat/completions", json=body,
                                                 headers=auth(KEY_A)) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    with_choices = [e for e in events[:-1] if e.get("choices")]
    first = with_choices[0]["choices"][0]["delta"]
    assert first.get("role") == "assistant", first
    assert isinstance(first.get("content"), str) and first["content"], first
    assert all("role" not in e["choices"][0]["delta"] for e in with_choices[1:])
    # and through the official client: the first chunk with choices has both too
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)
    chunks = [c for c in client.chat.completions.create(model="tiny", messages=body["messages"], max_tokens=6,
                                                        temperature=0, stream=True,
                                                        extra_body={"ignore_eos": True}) if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content


# ---- 5. interop ---------------------------------------------------------------------------------

def test_models_and_model_by_id(server):
    r = httpx.get(server.url + "/v1/models", headers=auth(KEY_A))
    (card,) = r.json()["data"]
    assert card["id"] == "tiny" and card["object"] == "model"
    assert {"root", "parent", "max_model_len"} <= set(card)
    assert card["root"] == "tiny" and card["parent"] is None and card["max_model_len"] == 2048
    one = httpx.get(server.url + "/v1/models/tiny", headers=auth(KEY_A))
    assert one.status_code == 200 and one.json() == card
    assert_openai_error(httpx.get(server.url + "/v1/models/gpt-9", headers=auth(KEY_A)), 404,
                        "model_not_found")
    assert_openai_error(httpx.get(server.url + "/v1/models/tiny", headers=auth("nope")), 401,
                        "invalid_api_key")
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_tokenize_and_detokenize(server):
    from minillm.engine.tokenizer import apply_chat, encode_prompt, load_tokenizer
    tok = load_tokenizer(None)
    text = "The KV cache holds every token's keys and values. Ünïcödé ✓ 数字"
    r = post(server, {"prompt": text}, path="/tokenize")
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"count", "max_model_len", "tokens"}
    assert out["tokens"] == encode_prompt(tok, text) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 2048
    # the same count a completion reports
    usage = post(server, {"prompt": text, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == out["count"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is prefill?"}]
    r = post(server, {"messages": msgs}, path="/tokenize")
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == encode_prompt(tok, apply_chat(tok, msgs))
    chat_usage = post(server, {"messages": msgs, "max_tokens": 1},
                      path="/v1/chat/completions").json()["usage"]
    assert chat_usage["prompt_tokens"] == r.json()["count"]
    # round trip
    back = post(server, {"tokens": out["tokens"]}, path="/detokenize")
    assert back.status_code == 200 and back.json() == {"prompt": tok.decode(out["tokens"])}
    assert back.json()["prompt"] == text
    assert_openai_error(post(server, {"tokens": [10**9]}, path="/detokenize"), 400, "invalid_request",
                        "tokens")
    assert_openai_error(post(server, {"tokens": "abc"}, path="/detokenize"), 400, "invalid_request", "tokens")
    assert_openai_error(post(server, {}, path="/tokenize"), 400, "invalid_request", "prompt")
    assert_openai_error(post(server, {"prompt": "hi"}, key="nope", path="/tokenize"), 401, "invalid_api_key")


def test_x_request_id_is_echoed_and_names_the_trace(server):
    rid = f"client-{uuid.uuid4().hex[:12]}"
    r = post(server, {"prompt": "hello", "max_tokens": 2}, headers={"X-Request-Id": rid})
    assert r.status_code == 200 and r.headers["x-request-id"] == rid and r.json()["id"] == rid
    tr = get_trace(server, rid, KEY_A)
    assert tr.request_id == rid and tr.first("token") is not None
    # once finished, the same id may be used again (both traces carry it)
    r2 = post(server, {"prompt": "hello again", "max_tokens": 2}, headers={"X-Request-Id": rid})
    assert r2.status_code == 200
    # a malformed id is replaced by the server's own
    r3 = post(server, {"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "bad id with spaces"})
    assert r3.status_code == 200 and r3.headers["x-request-id"] != "bad id with spaces"
    # on an error response too
    r4 = post(server, {"prompt": "x", "top_p": 5}, headers={"X-Request-Id": rid + "-err"})
    assert r4.status_code == 400 and r4.headers["x-request-id"] == rid + "-err"


def test_a_concurrent_duplicate_request_id_gets_a_suffixed_id(server):
    rid = f"dup-{uuid.uuid4().hex[:12]}"
    body = {"prompt": "hold on", "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as c, c.stream("POST", server.url + "/v1/completions", json=body,
                                                 headers={**auth(KEY_A), "X-Request-Id": rid}) as r1:
        assert r1.status_code == 200 and r1.headers["x-request-id"] == rid
        lines = r1.iter_lines()
        next(line for line in lines if line.startswith("data:"))         # it is running
        r2 = post(server, {"prompt": "me too", "max_tokens": 2}, headers={"X-Request-Id": rid})
        assert r2.status_code == 200, r2.text
        other = r2.headers["x-request-id"]
        assert other != rid and other.startswith(rid) and r2.json()["id"] == other
    first, second = get_trace(server, rid, KEY_A), get_trace(server, other, KEY_A)
    assert first.request_id == rid and second.request_id == other
    assert first.last("finished").extra["reason"] == "disconnected"
    assert second.last("finished").extra["reason"] == "length"
    wait_idle(server)


def test_health_needs_no_key_and_says_only_ok(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = httpx.get(server.url + "/health", headers=auth("garbage"))
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def scrape(srv) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families
    r = httpx.get(srv.url + "/metrics", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(samples, name: str, **labels) -> float:
    want = {"model_name": "tiny", "engine": "0", **labels}
    found = [v for (n, lab), v in samples.items() if n == name and dict(lab) == want]
    assert len(found) == 1, (name, [k for k in samples if k[0] == name][:5])
    return found[0]


def test_metrics_in_prometheus_text(server):
    before = scrape(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:time_to_first_token_seconds_count",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        sample(before, name)
    ids = completion_ids(server, KEY_A, 3)
    n_prompt = 0
    for rid in ids:
        n_prompt += get_trace(server, rid, KEY_A).first("admitted").extra["prompt_tokens"]
    t_end = time.monotonic() + 30
    while True:
        after = scrape(server)
        if sample(after, "vllm:time_to_first_token_seconds_count") >= sample(
                before, "vllm:time_to_first_token_seconds_count") + 3:
            break
        assert time.monotonic() < t_end, "TTFT count did not increase"
        time.sleep(0.05)
    assert sample(after, "vllm:prompt_tokens_total") >= sample(before, "vllm:prompt_tokens_total") + n_prompt
    assert sample(after, "vllm:generation_tokens_total") >= sample(before, "vllm:generation_tokens_total") + 6
    assert (sample(after, "vllm:prefix_cache_queries_total")
            >= sample(before, "vllm:prefix_cache_queries_total") + n_prompt)
    assert sample(after, "vllm:num_requests_running") >= 0
    # no key needed (like vLLM), and nothing secret in it
    text = httpx.get(server.url + "/metrics").text
    for secret in (KEY_A, KEY_B, ADMIN, *sha_prefixes(KEY_A, KEY_B, ADMIN), "key-1", "key-2"):
        assert secret not in text


@pytest.fixture(scope="module")
def reference_model():
    from minillm.model.loader import load_model
    return load_model("tiny", "cpu", "fp32", seed=SEED)


def ref_logprobs(model, prompt_ids: list[int], out_ids: list[int]) -> torch.Tensor:
    """[len(out), V]: log_softmax of the full-sequence forward's logits that chose each output
    token (no KV cache, no paging: an independent path through the same weights)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + out_ids]))[0].float()
    return logits[len(prompt_ids) - 1: len(prompt_ids) + len(out_ids) - 1].log_softmax(-1)


def trace_token_ids(srv, rid: str) -> list[int]:
    tr = get_trace(srv, rid, KEY_A)
    return [e.extra["token_id"] for e in tr.events if e.event == "token"]


def test_completion_logprobs_over_http_match_a_reference(server, reference_model):
    from minillm.engine.tokenizer import encode_prompt, load_tokenizer
    tok = load_tokenizer(None)
    prompt = "The engine computes logprobs for"
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    r = post(server, body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    out_ids = trace_token_ids(server, r.json()["id"])
    assert len(out_ids) == 8 and len(lp["token_logprobs"]) == 8 and len(lp["top_logprobs"]) == 8
    ref = ref_logprobs(reference_model, encode_prompt(tok, prompt), out_ids)
    for j, tid in enumerate(out_ids):
        assert lp["token_logprobs"][j] == pytest.approx(ref[j, tid].item(), abs=1e-4)
        assert lp["tokens"][j] == tok.decode([tid])
        top_vals, top_ids = ref[j].topk(3)
        assert sorted(lp["top_logprobs"][j].values(),
                      reverse=True) == pytest.approx(top_vals.tolist(), abs=1e-4) \
            or len(lp["top_logprobs"][j]) < 3            # two ids that decode alike share a key
        for text, v in lp["top_logprobs"][j].items():
            assert any(tok.decode([i]) == text and abs(v - ref[j, i].item()) < 1e-4 for i in top_ids.tolist())
        # greedy: the chosen token is the most likely one
        assert lp["token_logprobs"][j] == pytest.approx(max(lp["top_logprobs"][j].values()), abs=1e-6)
    # streamed: the same logprobs, chunk by chunk
    with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/completions",
                                                 json={**body, "stream": True}, headers=auth(KEY_A)) as rs:
        events = sse_events(rs)
    streamed = [v for e in events[:-1] if e.get("choices") and e["choices"][0]["logprobs"]
                for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-6)


def test_chat_logprobs_over_http_match_a_reference(server, reference_model):
    from minillm.engine.tokenizer import apply_chat, encode_prompt, load_tokenizer
    tok = load_tokenizer(None)
    msgs = [{"role": "user", "content": "Tell me about logprobs."}]
    body = {"messages": msgs, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 3}
    r = post(server, body, path="/v1/chat/completions")
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    out_ids = trace_token_ids(server, r.json()["id"])
    assert len(content) == len(out_ids) == 6
    ref = ref_logprobs(reference_model, encode_prompt(tok, apply_chat(tok, msgs)), out_ids)
    for j, (entry, tid) in enumerate(zip(content, out_ids)):
        assert entry["logprob"] == pytest.approx(ref[j, tid].item(), abs=1e-4)
        assert entry["token"] == tok.decode([tid]) and entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 3
        top_vals, _ = ref[j].topk(3)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top_vals.tolist(), abs=1e-4)
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-6)   # greedy
    # logprobs=true alone: the chosen tokens, no alternatives
    r = post(server, {**body, "top_logprobs": None}, path="/v1/chat/completions")
    assert r.status_code == 200, r.text
    assert all(e["top_logprobs"] == [] for e in r.json()["choices"][0]["logprobs"]["content"])
    assert_openai_error(post(server, {**body, "logprobs": False}, path="/v1/chat/completions"), 400,
                        "invalid_request", "top_logprobs")


def test_min_tokens_over_http(server):
    """A stop string equal to the greedy first token ends the request at once; with min_tokens
    the stop string is ignored until min_tokens tokens are out (EOS honoured: ignore_eos false)."""
    prompt, first = None, None
    for p in ("Once upon a time", "The cache", "Hello there", "A request arrives", "Tokens flow"):
        out = post(server, {"prompt": p, "max_tokens": 1, "temperature": 0}).json()["choices"][0]["text"]
        if out.strip() and "\ufffd" not in out:
            prompt, first = p, out
            break
    assert prompt is not None, "no prompt with a printable greedy first token"
    base = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "stop": [first]}
    without = post(server, base).json()
    assert without["usage"]["completion_tokens"] == 1 and without["choices"][0]["finish_reason"] == "stop"
    with_min = post(server, {**base, "min_tokens": 6}).json()
    assert with_min["usage"]["completion_tokens"] >= 6, with_min
    assert_openai_error(post(server, {**base, "min_tokens": 17}), 400, "invalid_request")
    assert_openai_error(post(server, {**base, "min_tokens": -1}), 400, "invalid_request", "min_tokens")


def test_docs_and_openapi(server):
    r = httpx.get(server.url + "/docs")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"] and "swagger" in r.text.lower()
    spec = httpx.get(server.url + "/openapi.json").json()
    paths = spec["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model_id}",
                 "/tokenize",
                 "/detokenize", "/v1/traces", "/v1/steps", "/health"):
        assert path in paths, path
    def schema(p):
        return paths[p]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert ("prompt" in schema("/v1/completions")["properties"]
            and "prompt" in schema("/v1/completions")["required"])
    assert "messages" in schema("/v1/chat/completions")["properties"]
    for p in ("max_tokens", "temperature", "top_p", "stream", "logprobs", "min_tokens"):
        assert p in schema("/v1/completions")["properties"], p
    assert "top_logprobs" in schema("/v1/chat/completions")["properties"]
    assert "tokens" in schema("/detokenize")["properties"]
    assert "$ref" not in json.dumps(schema("/v1/chat/completions"))      # inlined: resolvable
