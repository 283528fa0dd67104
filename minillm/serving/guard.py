"""Deadlines for *receiving* a request: the gateway's first job is to not let strangers hold
resources (chapter 10.1).

A connection costs the server a socket, a file descriptor, a parser and its buffers. Fuzzing the
server with 4,000 slowloris clients (headers or a body sent a byte at a time, or never finished)
left all 4,000 connections open for good. Auth, rate limits and the bounded queue cannot help:
they run once a request has *arrived*, and these never arrive.

What uvicorn offers, and what it does not (read in uvicorn 0.55's ``config.py``,
``protocols/http/httptools_impl.py`` and ``h11_impl.py``, and checked with raw sockets):

* ``timeout_keep_alive`` (5 s): closes a connection that stays idle *after a response*. The timer
  is armed only when a response completes and is cancelled by any byte received. Nothing is armed
  when a connection opens or while a request is being read, so a client that connects and says
  nothing, sends half its headers, or half its body, holds the connection forever (all three
  were still open when the check gave up, with httptools and with h11). With httptools even
  ``"\\r\\n"`` every few seconds after a response keeps a connection open: each byte cancels the
  keep-alive timer and llhttp skips blank lines between requests without starting one.
* ``limit_concurrency``: once ``len(connections)`` or ``len(tasks)`` reaches it, a request whose
  headers are complete is answered 503 and the connection closed. It bounds the work we start, not
  the sockets held by clients that never finish their headers (those never reach the check). Its
  count includes the asking connection, so ``limit_concurrency=N`` serves N-1 connections at once:
  ``server.py`` passes ``max_connections + 1``.
* ``h11_max_incomplete_event_size`` (16 KiB): the h11 parser's bound on a request head. httptools
  (llhttp, what ``http="auto"`` picks when ``uvicorn[standard]`` is installed) has none: a
  10 MiB header is parsed and kept.
* No header-read timeout, no body-read timeout, no limit on header size with httptools.

What this module adds, as a subclass of uvicorn's own HTTP protocol (``Config(http=cls)``;
:func:`guarded_protocol` builds it on whichever class ``http="auto"`` would pick — httptools, or
h11 where httptools is missing):

* **header deadline** (``header_timeout_s``): from the moment a connection opens, or the first
  byte of a next request on a kept-alive connection arrives, the request line and headers must be
  complete within ``header_timeout_s``. Trickling bytes does not extend it.
* **body deadline** (``body_timeout_s``): from headers complete to body complete.
* **header size** (``max_header_bytes``): a request head larger than that gets 431.

A missed deadline answers ``408 Request Timeout`` (``connection: close``, when no response has
started on the connection) and closes the connection. The deadlines cover *receiving* a request
only: once its body is complete nothing is armed, however long the response takes (a stream of
a thousand tokens is not cut), and after the response uvicorn's keep-alive timer takes over.
A deadline does not run while the server is the slow party: while reading is paused by flow
control (a pipelined request waiting for the previous response, a large body the app has not
consumed yet), while the client waits for our ``100 Continue``, or, for the next request's
headers, while the previous response is still being written; it is re-armed instead.

Not covered here: a connection beyond ``max_connections`` is still accepted and holds its socket
until its headers are complete (then 503) or its header deadline passes (then 408), so the most
sockets strangers can hold is what they open per ``header_timeout_s``, within the process's file
descriptor limit (``ulimit -n``) and the listen backlog.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger("minillm.serving.guard")

Phase = Literal["headers", "body"]


@dataclass
class GuardCounters:
    """How many connections the guard closed, and why (shared by all connections of a server)."""
    header_timeouts: int = 0
    body_timeouts: int = 0
    headers_too_large: int = 0


class _RequestDeadlines:
    """Mixin for a uvicorn HTTP/1.1 protocol class (``HttpToolsProtocol`` or ``H11Protocol``).

    ``_g_phase`` is what we wait for from the client: ``"headers"``, ``"body"`` or None (nothing:
    the request is complete, or the connection is idle between requests). One timer per phase,
    armed when the phase begins and never extended by incoming bytes.
    """
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_header_bytes: int = 64 * 1024
    counters: GuardCounters       # set by guarded_protocol(), shared by the server's connections

    # uvicorn's protocol attributes we rely on (present in both implementations since 0.1x)
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    flow: Any
    cycle: Any
    server_state: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._g_phase: Phase | None = None
        self._g_timer: asyncio.TimerHandle | None = None
        self._g_header_bytes = 0

    # -- the timer ----------------------------------------------------------------------------

    def _g_arm(self, phase: Phase) -> None:
        self._g_cancel()
        self._g_phase = phase
        if phase == "headers":
            self._g_header_bytes = 0
        timeout = self.header_timeout_s if phase == "headers" else self.body_timeout_s
        self._g_timer = self.loop.call_later(timeout, self._g_expired, phase)

    def _g_cancel(self) -> None:
        self._g_phase = None
        if self._g_timer is not None:
            self._g_timer.cancel()
            self._g_timer = None

    def _g_waiting_for_us(self, phase: Phase) -> bool:
        """True while the delay is ours, not the client's: then the deadline does not run."""
        if self.flow is not None and self.flow.read_paused:
            return True          # we stopped reading (pipelining, or a body not yet consumed)
        cycle = self.cycle
        if cycle is None:
            return False
        if phase == "headers":   # the next request's head, while the previous response is written
            return not cycle.response_complete
        return bool(cycle.waiting_for_100_continue)

    def _g_expired(self, phase: Phase) -> None:
        self._g_timer = None
        if self.transport is None or self.transport.is_closing() or self._g_phase != phase:
            return
        if self._g_waiting_for_us(phase):
            self._g_arm(phase)
            return
        if phase == "headers":
            self.counters.header_timeouts += 1
            limit = f"header_timeout_s={self.header_timeout_s:g}"
        else:
            self.counters.body_timeouts += 1
            limit = f"body_timeout_s={self.body_timeout_s:g}"
        log.debug("closing %s: request %s not received within %s", self._g_peer(), phase, limit)
        self._g_reject(408, f"Request {phase} not received in time ({limit}).", "request_timeout")

    # -- answering and closing ----------------------------------------------------------------

    def _g_peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "a client"

    def _g_can_answer(self) -> bool:
        """No response bytes of ours are on the wire for the current request, nor owed to an
        earlier one (httptools queues pipelined requests in ``pipeline``)."""
        if getattr(self, "pipeline", None):
            return False
        cycle = self.cycle
        if cycle is None:
            return True
        return cycle.response_complete if self._g_phase == "headers" else not cycle.response_started

    def _g_reject(self, status: int, message: str, code: str) -> None:
        """Answer (when no response has started) with OpenAI's error JSON, as every other error
        of this server, then close."""
        if self._g_can_answer():
            import json
            from http import HTTPStatus
            body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                         "code": code}}).encode()
            head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head += [b"content-type: application/json\r\n",
                     b"content-length: " + str(len(body)).encode() + b"\r\n",
                     b"connection: close\r\n\r\n"]
            self.transport.write(b"".join(head) + body)
        self._g_cancel()
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP: the same error JSON, and nothing from the
        parser's internals."""
        self._g_reject(400, "The request is not valid HTTP/1.1.", "invalid_http_request")

    # -- uvicorn's Protocol interface ---------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._g_arm("headers")              # a stranger that connects and says nothing

    def connection_lost(self, exc: Exception | None) -> None:
        self._g_cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._g_phase is None and self._g_between_requests():
            self._g_arm("headers")   # the first byte of a next request (even a blank line)
        if self._g_phase == "headers":
            # the head's bytes, counted before the parser sees them: up to the blank line ending
            # the head if this chunk holds it (a terminator split across chunks counts in full)
            end = data.find(b"\r\n\r\n")
            self._g_header_bytes += len(data) if end < 0 else end + 4
            if self._g_header_bytes > self.max_header_bytes:
                self.counters.headers_too_large += 1
                log.debug("closing %s: request head over max_header_bytes=%d", self._g_peer(),
                          self.max_header_bytes)
                self._g_reject(431, f"Request headers larger than {self.max_header_bytes} bytes.",
                               "request_header_fields_too_large")
                return
        super().data_received(data)  # type: ignore[misc]

    def handle_websocket_upgrade(self, *args: Any) -> None:
        self._g_cancel()             # the connection is the WebSocket protocol's from here on
        super().handle_websocket_upgrade(*args)  # type: ignore[misc]

    def _g_between_requests(self) -> bool:
        raise NotImplementedError


def _httptools_guard(base: type) -> type:
    class GuardedHttpToolsProtocol(_RequestDeadlines, base):  # type: ignore[valid-type, misc]
        """uvicorn's httptools protocol with deadlines for a request's headers and body."""

        def _g_between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        # llhttp's callbacks: message begin (first byte of a request), headers complete, message
        # complete (body complete; right after headers complete when there is no body).
        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._g_phase != "headers":
                self._g_arm("headers")

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._g_arm("body")

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._g_cancel()

    return GuardedHttpToolsProtocol


def _h11_guard(base: type) -> type:
    import h11

    class GuardedH11Protocol(_RequestDeadlines, base):  # type: ignore[valid-type, misc]
        """uvicorn's h11 protocol with deadlines for a request's headers and body."""

        def _g_between_requests(self) -> bool:
            return self.conn.their_state is h11.IDLE

        def handle_events(self) -> None:
            # h11 tells the client's state: IDLE (no complete request head yet), SEND_BODY
            # (head received, body not complete), then DONE / MUST_CLOSE / CLOSED / ERROR.
            super().handle_events()
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                if self._g_phase != "body":
                    self._g_arm("body")
            elif state is h11.IDLE:
                if self._g_phase is None and self.conn.trailing_data[0]:
                    self._g_arm("headers")   # a pipelined request's first bytes, now parsed
            else:
                self._g_cancel()

    return GuardedH11Protocol


def guarded_protocol(header_timeout_s: float = 10.0, body_timeout_s: float = 30.0,
                     max_header_bytes: int = 64 * 1024, *, http: str = "auto",
                     counters: GuardCounters | None = None) -> type[asyncio.Protocol]:
    """A uvicorn HTTP protocol class for ``uvicorn.Config(http=...)`` with the deadlines above.

    ``http``: ``"auto"`` (httptools if installed, else h11: uvicorn's own choice), ``"httptools"``
    or ``"h11"``. ``counters`` (a :class:`GuardCounters`) counts the connections closed.
    """
    if header_timeout_s <= 0 or body_timeout_s <= 0:
        raise ValueError("header_timeout_s and body_timeout_s must be > 0")
    if http == "auto":
        try:
            import httptools  # noqa: F401
            http = "httptools"
        except ImportError:
            http = "h11"
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        cls = _httptools_guard(HttpToolsProtocol)
    elif http == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol
        cls = _h11_guard(H11Protocol)
    else:
        raise ValueError(f"http must be 'auto', 'httptools' or 'h11', got {http!r}")
    cls.header_timeout_s = float(header_timeout_s)
    cls.body_timeout_s = float(body_timeout_s)
    cls.max_header_bytes = int(max_header_bytes)
    cls.counters = counters if counters is not None else GuardCounters()
    return cls
