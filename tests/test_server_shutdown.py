"""A graceful drain on SIGTERM: admitted streams finish, nothing new gets in, the traces are kept,
and the process exits 0; past ``--shutdown-timeout-s`` the rest end with the error event."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from minillm.loadgen.serve_process import ServeProcess
from minillm.serving.config import ServerConfig
from minillm.serving.server import ServerThread

STREAMS = 4


def _stream(url: str, key: str | None, max_tokens: int, out: list, started: threading.Event) -> None:
    """One streamed completion: collects (finish_reason, error code, tokens) into ``out``."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny", "prompt": "a rolling restart", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}
    finish, error, chunks = None, None, 0
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    error = d["error"].get("code")
                    continue
                chunks += 1
                started.set()
                finish = d["choices"][0].get("finish_reason") or finish
    except httpx.HTTPError as e:
        error = f"transport: {type(e).__name__}"
    out.append((finish, error, chunks))


def _start_streams(url: str, key: str | None, max_tokens: int):
    out: list = []
    started = [threading.Event() for _ in range(STREAMS)]
    threads = [threading.Thread(target=_stream,
                                args=(url, key, max_tokens, out, started[i])) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(60), "a stream never started"
    return threads, out


def test_sigterm_drains_in_flight_streams_and_exits_zero():
    with ServeProcess(["--model", "tiny", "--shutdown-timeout-s", "60", "--max-model-len", "1024"]) as srv:
        threads, out = _start_streams(srv.url, srv.key, max_tokens=600)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):          # the listening socket is closed at once
            httpx.get(srv.url + "/health", timeout=2)
        for t in threads:
            t.join(120)
        code = srv.proc.wait(60)
    assert code == 0
    assert len(out) == STREAMS
    for finish, error, chunks in out:
        assert (finish, error) == ("length", None) and chunks >= 2, out


def test_past_the_shutdown_timeout_the_rest_end_with_the_error_event():
    with ServeProcess(["--model", "tiny", "--shutdown-timeout-s", "0.5", "--max-model-len", "2048"]) as srv:
        threads, out = _start_streams(srv.url, srv.key, max_tokens=1900)
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        code = srv.proc.wait(60)
    assert code != 0                                      # not a clean drain
    assert sorted(e for _, e, _ in out) == ["server_shutting_down"] * STREAMS, out


def test_draining_refuses_new_work_says_so_on_health_and_keeps_every_trace():
    srv = ServerThread(ServerConfig(model="tiny", port=0, max_model_len=1024)).start()
    state = srv.app.state.minillm
    try:
        threads, out = _start_streams(srv.url, None, max_tokens=400)
        drained: list[bool] = []
        drainer = threading.Thread(target=lambda: drained.append(state.drain(60)))
        drainer.start()
        while not state.draining:
            time.sleep(0.01)
        health = httpx.get(srv.url + "/health", timeout=5)
        assert (health.status_code, health.json()) == (503, {"status": "draining"})
        late = httpx.post(srv.url + "/v1/completions",
                          json={"model": "tiny", "prompt": "late", "max_tokens": 4},
                          timeout=30)
        assert late.status_code == 503 and late.json()["error"]["code"] == "server_shutting_down"
        assert late.headers.get("retry-after") == "1"
        for t in threads:
            t.join(120)
        drainer.join(120)
        assert drained == [True]
        assert [f for f, _, _ in out] == ["length"] * STREAMS
        finished = [t for t in srv.traces() if t.first("finished") is not None]
        assert len(finished) == STREAMS                    # every admitted stream's trace is stored
        assert all(t.first("finished").extra.get("reason") == "length" for t in finished)
    finally:
        srv.stop()
