"""What one key can learn about another's traffic through the server: nothing. The traces cursor
counts a key's own traces, and X-Request-Id is scoped to its key (compared with the other key idle
and busy); stream_options keys are served or refused by name."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from minillm.serving.server import ServerConfig, ServerThread

KEY_A = "sk-privacy-a-0123456789abcdef"
KEY_B = "sk-privacy-b-fedcba9876543210"


@pytest.fixture(scope="module")
def server():
    srv = ServerThread(ServerConfig(model="tiny", device="cpu", dtype="fp32", port=0, api_keys=[KEY_A, KEY_B],
                                    max_model_len=2048)).start()
    yield srv
    srv.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(srv, key: str, request_id: str | None = None, max_tokens: int = 2) -> httpx.Response:
    headers = {**auth(key), **({"X-Request-Id": request_id} if request_id else {})}
    return httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": max_tokens},
                      headers=headers, timeout=60)


def traces_page(srv, key: str, **params) -> dict:
    r = httpx.get(srv.url + "/v1/traces", params=params, headers=auth(key), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def what_b_sees(srv) -> tuple:
    page = traces_page(srv, KEY_B, limit=1)
    all_b = traces_page(srv, KEY_B)
    return page["next"], [d["request_id"] for d in all_b["data"]]


def test_the_cursor_counts_only_the_readers_own_traces(server):
    for i in range(2):
        assert complete(server, KEY_B, f"b-{i}").status_code == 200
    idle = what_b_sees(server)
    for _ in range(7):                                    # A is busy
        assert complete(server, KEY_A).status_code == 200
    busy = what_b_sees(server)
    assert idle == busy == (1, ["b-0", "b-1"])             # B's own count: 1 of its 2 traces
    page = traces_page(server, KEY_B, limit=1, after=1)
    assert [d["request_id"] for d in page["data"]] == ["b-1"] and page["next"] is None


def _open_stream(srv, key: str, rid: str, started: threading.Event, stop: threading.Event, out: dict):
    body = {"prompt": "hold the id", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body,
                      headers={**auth(key), "X-Request-Id": rid}, timeout=120) as r:
        out["id"] = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data:") and '"choices"' in line:
                started.set()
            if stop.is_set():
                break


def test_a_request_id_is_scoped_to_its_key(server):
    rid = "shared-id-1"
    idle = complete(server, KEY_B, rid)
    started, stop, out = threading.Event(), threading.Event(), {}
    t = threading.Thread(target=_open_stream, args=(server, KEY_A, rid, started, stop, out))
    t.start()
    try:
        assert started.wait(60)
        busy = complete(server, KEY_B, rid)                # A has the same id in flight
        again_a = complete(server, KEY_A, rid)             # the same key reusing its own id: suffixed
    finally:
        stop.set()
        t.join(120)
    assert idle.headers["x-request-id"] == busy.headers["x-request-id"] == rid
    assert idle.json()["id"] == busy.json()["id"] == rid
    assert out["id"] == rid and again_a.headers["x-request-id"].startswith(rid + "-")
    # each key finds its own traces under the id it gave; B sees none of A's
    b_ids = [d["request_id"] for d in traces_page(server, KEY_B, request_id=rid)["data"]]
    assert b_ids == [rid, rid]
    a_ids = [d["request_id"] for d in traces_page(server, KEY_A, request_id=rid)["data"]]
    assert a_ids == [rid]
    state = server.app.state.minillm
    with pytest.raises(KeyError, match="names traces of 2 keys"):
        state.trace(rid)
    key_a = state.auth.check(f"Bearer {KEY_A}")
    assert state.trace(rid, key_id=key_a).events               # A's one trace, addressed by (key, id)


def _stream_chunks(srv, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=auth(KEY_A), timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def test_continuous_usage_stats_counts_on_every_chunk(server):
    body = {"prompt": "count", "max_tokens": 5, "stream": True, "ignore_eos": True,
            "stream_options": {"continuous_usage_stats": True, "include_usage": True}}
    chunks = _stream_chunks(server, body)
    counted = [c["usage"] for c in chunks if c.get("choices")]
    assert counted and all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in counted)
    steps = [u["completion_tokens"] for u in counted]
    assert steps == sorted(steps) and steps[-1] == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5   # include_usage's


def test_an_unknown_stream_option_is_refused_by_name(server):
    r = httpx.post(server.url + "/v1/completions", headers=auth(KEY_A), timeout=30,
                   json={"prompt": "x", "max_tokens": 2, "stream": True,
                         "stream_options": {"send_faster": True}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "stream_options.send_faster" and "not supported" in err["message"]


# ---- error messages a client can act on ------------------------------------------------------
def test_tool_calls_in_a_conversation_are_refused_by_name(server):
    body = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None,
                          "tool_calls": [{"id": "1", "type": "function",
                                          "function": {"name": "f", "arguments": "{}"}}]}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth(KEY_A), timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages[1].tool_calls" and "function calling" in err["message"]


@pytest.mark.parametrize("calls", [1, "f", {}, True, [{"id": "1"}]])
def test_any_tool_calls_value_but_none_is_refused_by_name(server, calls):
    # the schema allows null or [] (what a client sends back from a reply without calls), nothing else
    body = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "tool", "content": "", "tool_calls": calls}], "max_tokens": 1}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth(KEY_A), timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[1].tool_calls"


@pytest.mark.parametrize("calls", [None, []])
def test_an_empty_tool_calls_is_accepted(server, calls):
    body = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "hello", "tool_calls": calls},
                         {"role": "user", "content": "again"}], "max_tokens": 1}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth(KEY_A), timeout=30)
    assert r.status_code == 200, r.text


def _raw(srv, data: bytes) -> bytes:
    import socket
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(data)
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    return b"".join(chunks)


def test_the_protocol_layer_answers_with_error_json_and_no_internals(server):
    got = _raw(server, b"NOT HTTP AT ALL\r\n\r\n")
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower()
    err = json.loads(body)["error"]
    assert err == {"message": "The request is not valid HTTP/1.1.", "type": "invalid_request_error",
                   "param": None,
                   "code": "invalid_http_request"}
    big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (70 * 1024) + b"\r\n\r\n"
    got = _raw(server, big)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ")
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"


@pytest.mark.parametrize("path, body, says", [
    ("/v1/completions", b'{"prompt": "hi",}', "at line 1, column 17"),
    ("/v1/completions", b'{"prompt":\n  "hi" "x"}', "at line 2, column 8"),
    ("/tokenize", b'{"prompt": ', "at line 1, column 12"),
    ("/v1/completions", b"[" * 100_000, "nested too deeply"),
    ("/v1/completions", b"\xff\xfe\xfa", "not UTF-8 text"),
])
def test_a_json_error_says_where_in_the_clients_terms(server, path, body, says):
    r = httpx.post(server.url + path, content=body, timeout=30,
                   headers={**auth(KEY_A), "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("The request body is not valid JSON: ") and says in message
    for internal in ("Error", "Expecting value", "char ", "Traceback"):
        assert internal not in message
