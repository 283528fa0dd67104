"""Timeouts and limits on *receiving* requests (serving/guard.py, chapter 10.1).

Raw sockets against a real server (tiny model, CPU fp32): slowloris clients — silent, half a
head, a head trickled a byte at a time, half a body, blank lines on a kept-alive connection — are
closed by the server within a generous bound (10× the deadline; no tighter timing asserts);
``max_connections`` answers 503 beyond the limit and recovers; and a long response is never cut:
the deadlines cover receiving a request, not generating its answer.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from argparse import Namespace

import httpx
import pytest

from minillm.engine.config import EngineConfig
from minillm.serving.config import config_from_args
from minillm.serving.guard import GuardCounters, guarded_protocol
from minillm.serving.server import ServerConfig, ServerThread

T = 0.5                 # header_timeout_s and body_timeout_s of the `quick` server
BOUND = 10 * T          # "closed within a generous bound"
HOLD = 60.0             # deadlines of the `limited` server: long enough to hold connections
PATIENT = 5.0           # deadlines of the `patient` server: a slow client's 0.3 s is far inside them


def _config(**kw) -> ServerConfig:
    return ServerConfig(model="tiny", device="cpu", dtype="fp32", port=0, **kw)


@pytest.fixture(scope="module")
def quick():
    srv = ServerThread(_config(max_model_len=1024, max_batch_size=4, header_timeout_s=T,
                               body_timeout_s=T)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def patient():
    srv = ServerThread(_config(max_model_len=1024, max_batch_size=4, header_timeout_s=PATIENT,
                               body_timeout_s=PATIENT)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def limited():
    srv = ServerThread(_config(max_model_len=256, max_connections=4, header_timeout_s=HOLD,
                               body_timeout_s=HOLD,
                               keep_alive_timeout_s=HOLD)).start()
    yield srv
    srv.stop()


# ---- raw-socket helpers ---------------------------------------------------------------------

def connect(srv) -> socket.socket:
    s = socket.create_connection((srv.host, srv.port), timeout=BOUND)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def wait_closed(s: socket.socket, bound: float = BOUND) -> bytes:
    """Read until the server closes the connection (b"" or a reset); fail after ``bound`` s.
    Returns what the server sent before closing."""
    got = b""
    t_end = time.monotonic() + bound
    while True:
        s.settimeout(max(0.01, t_end - time.monotonic()))
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            return got
        except TimeoutError:
            raise AssertionError(f"the server did not close the connection within {bound} s (got "
                                 f"{got[:80]!r})")
        if not data:
            return got
        got += data


def assert_dropped(got: bytes) -> None:
    """Closed with nothing, or with a 408 (connection: close) and nothing after it."""
    assert got == b"" or got.startswith(b"HTTP/1.1 408 "), got[:200]
    if got:
        assert b"connection: close" in got.lower()


def read_response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One Content-Length response from a raw socket, not a byte more (the connection stays open
    and a pipelined response after it stays unread)."""
    buf = b""
    while not buf.endswith(b"\r\n\r\n"):
        chunk = s.recv(1)
        assert chunk, f"closed before a response: {buf!r}"
        buf += chunk
    lines = buf[:-4].decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    n, body = int(headers.get("content-length", "0")), b""
    while len(body) < n:
        chunk = s.recv(n - len(body))
        assert chunk, "closed in the middle of a response"
        body += chunk
    return status, headers, body


def get_models(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: test\r\n\r\n")
    return read_response(s)


HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Ty"
BODY = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()


def head(content_length: int) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % content_length)


def wait_idle(srv, timeout: float = 15.0) -> None:
    t_end = time.monotonic() + timeout
    while not srv.state.idle():
        assert time.monotonic() < t_end, f"the server did not become idle: {srv.state.stats()}"
        time.sleep(0.02)


# ---- slow clients are dropped ---------------------------------------------------------------

def test_silent_connection_is_closed(quick):
    before = quick.guard_counters.header_timeouts
    with connect(quick) as s:
        assert_dropped(wait_closed(s))
    assert quick.guard_counters.header_timeouts > before


def test_half_a_head_then_silence_is_closed(quick):
    before = quick.guard_counters.header_timeouts
    with connect(quick) as s:
        s.sendall(HALF_HEAD)
        got = wait_closed(s)
    assert_dropped(got)
    assert b"header_timeout_s" in got or got == b""
    assert quick.guard_counters.header_timeouts > before


def test_a_head_trickled_byte_by_byte_is_closed_at_its_deadline(quick):
    # the classic slowloris: bytes keep coming, but the deadline is not extended by them
    request = head(len(BODY)) + BODY
    with connect(quick) as s:
        t0 = time.monotonic()
        closed = False
        for b in request[:-len(BODY) - 4]:
            try:
                s.sendall(bytes([b]))
            except OSError:             # reset: the server closed while we were still sending
                closed = True
                break
            s.settimeout(0.02)
            try:
                got = s.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                closed = True
                break
            assert_dropped(got)
            closed = True
            break
        assert closed, "the server let a trickled head run past its deadline"
        assert time.monotonic() - t0 < BOUND


def test_headers_then_part_of_the_body_is_closed(quick):
    before = quick.guard_counters.body_timeouts
    with connect(quick) as s:
        s.sendall(head(100) + b"0123456789")
        got = wait_closed(s)
    assert_dropped(got)
    assert quick.guard_counters.body_timeouts > before
    wait_idle(quick)                    # the handler that waited for the body is gone too


def test_blank_lines_on_a_kept_alive_connection_do_not_keep_it(quick):
    # uvicorn's keep-alive timer is cancelled by any byte, and llhttp skips blank lines between
    # requests: "\r\n" every so often would hold the connection forever without the guard
    with connect(quick) as s:
        assert get_models(s)[0] == 200
        t_end = time.monotonic() + BOUND
        s.settimeout(0.05)
        while True:
            assert time.monotonic() < t_end, "blank lines kept a connection open"
            try:
                s.sendall(b"\r\n")
                got = s.recv(65536)
            except TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                break
            assert_dropped(got)
            break


def test_50_half_open_connections_are_all_closed_then_a_request_succeeds(quick):
    socks = [connect(quick) for _ in range(50)]
    try:
        for i, s in enumerate(socks):
            s.sendall(HALF_HEAD if i % 2 else head(100) + b"0123456789")
        t_end = time.monotonic() + BOUND
        for s in socks:                 # one bound for all of them
            assert_dropped(wait_closed(s, max(0.1, t_end - time.monotonic())))
    finally:
        for s in socks:
            s.close()
    r = httpx.post(quick.url + "/v1/completions", json={"prompt": "still here?", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    wait_idle(quick)


def test_oversized_head_gets_431(quick):
    before = quick.guard_counters.headers_too_large
    with connect(quick) as s:
        try:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: test\r\nX-Big: ")
            for _ in range(100):                    # 100 × 1 KiB, more than 64 KiB
                s.sendall(b"a" * 1024)
        except OSError:
            pass                                    # closed while we were sending: fine
        got = wait_closed(s)
    assert got == b"" or got.startswith(b"HTTP/1.1 431 "), got[:200]
    assert quick.guard_counters.headers_too_large > before


# ---- clients that are slow but in time, and long answers, are served -------------------------

def test_slow_but_in_time_request_is_served(patient):
    # 0.1 s between pieces against 5 s deadlines: a pause of the test process (a full garbage
    # collection: 322 ms was seen in CI) cannot push it past them, as it could past `quick`'s 0.5 s
    with connect(patient) as s:
        s.sendall(head(len(BODY))[:20])
        time.sleep(0.1)
        s.sendall(head(len(BODY))[20:])
        time.sleep(0.1)
        s.sendall(BODY[:5])
        time.sleep(0.1)
        s.sendall(BODY[5:])
        status, _, body = read_response(s)
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] >= 1
        assert get_models(s)[0] == 200      # and the kept-alive connection serves the next request


def test_a_long_stream_is_not_cut_by_the_request_deadlines(quick):
    body = {"prompt": "go on", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as c:
        t0 = time.monotonic()
        with c.stream("POST", quick.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        elapsed = time.monotonic() - t0
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in ch for ch in chunks), [ch for ch in chunks if "error" in ch][:1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # the same kept-alive connection serves the next request
        assert c.post(quick.url + "/v1/completions",
                      json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    if elapsed <= 2 * T:
        pytest.skip(f"this machine streamed 900 tokens in {elapsed:.2f} s: too fast to outlast the deadlines")


# ---- max_connections ------------------------------------------------------------------------

def test_max_connections_503_beyond_the_limit_then_recovers(limited):
    held = [connect(limited) for _ in range(3)]    # three strangers, silent (deadline HOLD)
    try:
        s4 = connect(limited)
        held.append(s4)
        assert get_models(s4)[0] == 200              # the 4th connection is still served...
        for _ in range(3):                           # ...a request on a 5th, 6th, 7th is not
            with connect(limited) as extra:
                status, headers, _ = get_models(extra)
                assert status == 503
                assert headers.get("connection") == "close"
                assert wait_closed(extra) == b""
        assert get_models(s4)[0] == 200              # the held ones still work
    finally:
        for s in held:
            s.close()
    t_end = time.monotonic() + BOUND                 # once released, a request succeeds
    while True:
        r = httpx.get(limited.url + "/v1/models", timeout=30)
        if r.status_code == 200:
            break
        assert r.status_code == 503 and time.monotonic() < t_end, r.status_code
        time.sleep(0.05)
    assert r.json()["data"][0]["id"] == "tiny"


def test_max_connections_counts_streams_in_flight(limited):
    # four streams in flight: the limit is full, a fifth request gets 503, then all recovers
    long = {"prompt": "hold the line", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=8)) as c:
            streams = [c.stream("POST", limited.url + "/v1/completions", json=long) for _ in range(4)]
            responses = [await st.__aenter__() for st in streams]
            try:
                assert [r.status_code for r in responses] == [200] * 4
                async with httpx.AsyncClient(timeout=30) as other:
                    assert (await other.get(limited.url + "/v1/models")).status_code == 503
            finally:
                for st in streams:
                    await st.__aexit__(None, None, None)

    asyncio.run(scenario())
    wait_idle(limited)
    t_end = time.monotonic() + BOUND
    while (r := httpx.get(limited.url + "/v1/models", timeout=30)).status_code != 200:
        assert time.monotonic() < t_end, r.status_code
        time.sleep(0.05)


# ---- the options ----------------------------------------------------------------------------

def test_options_are_validated_and_read_from_the_cli_namespace():
    for bad in ({"header_timeout_s": 0}, {"body_timeout_s": -1}, {"keep_alive_timeout_s": float("inf")},
                {"max_connections": 0}, {"max_header_bytes": 100}, {"header_timeout_s": "10"}):
        with pytest.raises(ValueError):
            ServerConfig(**bad)
    cfg = ServerConfig()
    assert (cfg.header_timeout_s, cfg.body_timeout_s, cfg.max_connections, cfg.keep_alive_timeout_s) == \
        (10.0, 30.0, 1024, 5.0)
    ns = Namespace(header_timeout_s=2.5, body_timeout_s=7.0, max_connections=0, keep_alive_timeout_s=1.0,
                   max_header_bytes=8192)
    cfg = config_from_args(ns, engine=EngineConfig(model="tiny", device="cpu"))
    assert (cfg.header_timeout_s, cfg.body_timeout_s, cfg.max_connections, cfg.keep_alive_timeout_s,
            cfg.max_header_bytes) == (2.5, 7.0, None, 1.0, 8192)
    cfg = config_from_args(Namespace(), engine=EngineConfig(model="tiny", device="cpu"))
    assert (cfg.header_timeout_s, cfg.max_connections) == (10.0, 1024)


# ---- the guard on uvicorn's other parser (h11: where httptools is not installed) --------------

@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_the_guard_on_either_uvicorn_parser(http):
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/slow":
            await asyncio.sleep(3 * T)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    counters = GuardCounters()
    cfg = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", ws="none", lifespan="off",
                         http=guarded_protocol(T, T, 4096, http=http, counters=counters))
    srv = uvicorn.Server(cfg)
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    try:
        t_end = time.monotonic() + 30
        while not srv.started:
            assert th.is_alive() and time.monotonic() < t_end
            time.sleep(0.01)
        addr = srv.servers[0].sockets[0].getsockname()[:2]

        class _Srv:
            host, port = addr

        for payload in (b"", HALF_HEAD, head(100) + b"0123456789"):
            with connect(_Srv) as s:
                s.sendall(payload)
                assert_dropped(wait_closed(s))
        assert counters.header_timeouts == 2 and counters.body_timeouts == 1
        with connect(_Srv) as s:                     # a pipelined pair, then a slow-but-in-time one
            s.sendall(head(len(BODY)) + BODY + head(len(BODY)) + BODY)
            assert read_response(s)[2] == b"ok" and read_response(s)[2] == b"ok"
            s.sendall(head(len(BODY)))
            time.sleep(T / 10)                       # in time with 0.45 s to spare (a process pause)
            s.sendall(BODY)
            assert read_response(s)[2] == b"ok"
        with connect(_Srv) as s:
            # pipelined behind a slow response, a large body waits for us (reading is paused):
            # its deadline must not run out meanwhile
            big = b"x" * 300_000
            s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + head(len(big)) + big)
            assert read_response(s)[2] == b"ok" and read_response(s)[2] == b"ok"
        assert counters.body_timeouts == 1
        with connect(_Srv) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8192 + b"\r\n\r\n")
            got = wait_closed(s)
            assert got.startswith(b"HTTP/1.1 431 "), got[:100]      # even when it comes in one piece
        assert counters.headers_too_large == 1
    finally:
        srv.should_exit = True
        th.join(10)
