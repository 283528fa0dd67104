"""Unusual client input at the edges of the API, through real HTTP (tiny model, CPU fp32): a chat
the model's template refuses, an integer with more digits than Python reads, logprobs offsets of
a stream. Each must get a clear answer and leave nothing held: no queue place, no request id, no
KV slot.
"""
from __future__ import annotations

import json
import time

import httpx
import pytest

from minillm.serving.server import ServerConfig, ServerThread

KEY = "sk-edges-0123456789abcdef"
# A chat template with a rule, as many models' templates have (Llama 2, Mistral, Gemma): it raises
# through the `raise_exception` that transformers gives templates.
ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}assistant: ")


@pytest.fixture(scope="module")
def server():
    srv = ServerThread(ServerConfig(model="tiny", device="cpu", dtype="fp32", port=0, api_keys=[KEY],
                                    max_model_len=256, max_batch_size=4)).start()
    yield srv
    srv.stop()


def auth(**extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}", **extra}


def wait_idle(srv, timeout: float = 15.0) -> None:
    t_end = time.monotonic() + timeout
    while not srv.state.idle():
        assert time.monotonic() < t_end, srv.state.stats()
        time.sleep(0.02)


def assert_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


def test_a_chat_the_template_refuses_is_400_naming_messages_and_holds_nothing(server, monkeypatch):
    monkeypatch.setattr(server.state.tokenizer, "chat_template", ALTERNATING)
    refused = {"messages": [{"role": "assistant", "content": "first"}], "max_tokens": 2}
    for _ in range(2):          # the same X-Request-Id twice: the first must have let it go
        r = httpx.post(server.url + "/v1/chat/completions", json=refused,
                       headers=auth(**{"X-Request-Id": "edge-template"}), timeout=60)
        err = assert_error(r, 400, "invalid_request")
        assert err["param"] == "messages" and "must alternate" in err["message"], err
        assert r.headers["x-request-id"] == "edge-template"
    r = httpx.post(server.url + "/tokenize", json={"messages": refused["messages"]}, headers=auth(),
                   timeout=60)
    assert assert_error(r, 400, "invalid_request")["param"] == "messages"
    # the rejection is stored like any other, and the id is free for the next request
    assert server.state.trace("edge-template").last("rejected").extra["status"] == 400
    ok = httpx.post(server.url + "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                    headers=auth(**{"X-Request-Id": "edge-template"}), timeout=60)
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "edge-template", ok.text
    wait_idle(server)


def test_an_unexpected_failure_is_500_and_leaves_no_request_id_held(server, monkeypatch):
    def broken(req):
        raise RuntimeError("a bug below the gateway")
    monkeypatch.setattr(server.state.gateway, "tokenize", broken)
    body = {"prompt": "hi", "max_tokens": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=auth(**{"X-Request-Id": "edge-bug"}),
                   timeout=60)
    err = assert_error(r, 500, "internal_error")
    assert "a bug below" not in err["message"]                  # no internals to the client
    assert r.headers["x-request-id"] == "edge-bug"
    monkeypatch.undo()
    r = httpx.post(server.url + "/v1/completions", json=body, headers=auth(**{"X-Request-Id": "edge-bug"}),
                   timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "edge-bug", r.text
    wait_idle(server)
    assert server.state.stats()["admitted"] == 0


@pytest.mark.parametrize("path,before", [("/v1/completions", b'{"prompt": "hi", "max_tokens": '),
                                         ("/v1/chat/completions", b'{"messages": [{"role": "user", '
                                                                  b'"content": "hi"}], "seed": -'),
                                         ("/detokenize", b'{"tokens": [1, ')])
def test_an_integer_with_too_many_digits_is_400_saying_so(server, path, before):
    # Python reads at most 4300 digits of an integer (sys.get_int_max_str_digits); the body is
    # valid JSON and UTF-8, so the error must say what is wrong with it, and where
    raw = before + b"9" * 5000 + (b"]}" if path == "/detokenize" else b"}")
    r = httpx.post(server.url + path, content=raw, headers=auth(**{"Content-Type": "application/json"}),
                   timeout=60)
    err = assert_error(r, 400, "invalid_request")
    assert "5000 digits" in err["message"] and "4300" in err["message"], err
    assert f"column {len(before.rstrip(b'-')) + 1}" in err["message"], err     # where the number starts
    assert "UTF-8" not in err["message"], err


def _stream(srv, body: dict) -> list[dict]:
    with httpx.Client(timeout=60) as c, c.stream("POST", srv.url + "/v1/completions",
                                                 json={**body, "stream": True}, headers=auth()) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("stop", [None, ["o"]], ids=["length", "stop-string"])
def test_streamed_text_offsets_count_from_the_start_of_the_completion(server, stop):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, **({"stop": stop, "min_tokens": 6} if stop else {})}
    whole = httpx.post(server.url + "/v1/completions", json=body, headers=auth(), timeout=60).json()
    lp = whole["choices"][0]["logprobs"]
    chunks = [c["choices"][0]["logprobs"] for c in _stream(server, body) if c["choices"][0]["logprobs"]]
    assert len(chunks) > 1
    assert [t for c in chunks for t in c["tokens"]] == lp["tokens"]
    # OpenAI's text_offset: where each token starts in the completion's text, not in its chunk
    assert [o for c in chunks for o in c["text_offset"]] == lp["text_offset"]
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:k])) for k in range(len(lp["tokens"]))]
    wait_idle(server)


def fail_the_next_step(server, monkeypatch) -> None:
    """The engine's next step raises, as a bug below ``step()`` would; the steps after it run."""
    engine = server.state.loop.engine
    real = engine.step

    def once():
        monkeypatch.setattr(engine, "step", real)
        raise RuntimeError("a bug inside the step")
    monkeypatch.setattr(engine, "step", once)


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_failure_is_a_500_engine_error_not_a_shutdown(server, monkeypatch, stream):
    """The server is not shutting down: a client told 503 "server_shutting_down" would go elsewhere
    and wait. The failed request gets the 500 a failed batch gives, and the server serves on."""
    fail_the_next_step(server, monkeypatch)
    body = {"prompt": "hi", "max_tokens": 4, "stream": stream}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=auth(), timeout=60)
    if not stream:
        err = assert_error(r, 500, "engine_error")
        assert "retry-after" not in r.headers
    else:
        assert r.status_code == 200, r.text
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        err = events[-1]["error"]
        assert err["code"] == "engine_error", events
    assert "a bug inside the step" in err["message"], err
    wait_idle(server)
    again = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers=auth(), timeout=60)
    assert again.status_code == 200, again.text
    assert server.state.loop.failures >= 1
