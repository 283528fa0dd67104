"""``python -m minillm serve``: an OpenAI-compatible HTTP server, the first and the last stage of
a request's path (chapter 10.1).

    client ──HTTP──► handler (event loop)                      engine thread (exactly one)
                     received                                   ┌──────────────────────────┐
                     gateway: auth → validate → rate limit      │ while running:           │
                              → admission (bounded queue)       │   take new requests      │
                     engine.prepare (tokenize) ──inbox───────►  │   take aborts            │
                                                                │   engine.step()          │
                     asyncio.Queue ◄──call_soon_threadsafe───── │   push the StepOutputs   │
                     one SSE chunk per delta ("sent") ─► client └──────────────────────────┘

Why one engine thread? A forward pass is one long blocking call. Run on the event loop, it would
stall every other connection for a whole step; run in a thread per request, the requests could
not share a batch. So one thread owns the engine and runs the step loop (continuous batching:
every step serves everybody), and the event loop does only the cheap work — the gateway,
tokenizing, JSON, writing bytes. They talk through an inbox (new requests, aborts) one way and
``loop.call_soon_threadsafe`` into one ``asyncio.Queue`` per request the other way.

Only the engine thread touches the engine once the server runs. Handlers do not take the
engine's lock to enqueue: ``step()`` holds that lock for a whole forward pass, and waiting for it
would block the event loop — and with it every other stream — for a step. The inbox costs at most
one step of waiting, which the trace shows as ``queue`` time (it *is* queueing).

Every stage leaves trace events (design.md §1): ``received`` on arrival; ``authenticated`` and
``admitted`` or ``rejected`` from the gateway; the engine's ``tokenized``, ``enqueued``,
``scheduled``, ``prefill_start``/``prefill_end``, ``token``, ``detokenized``; ``sent`` once each SSE
chunk (or the JSON body) has been handed to the socket; and a last ``finished`` with
``where="server"`` when the response is complete. (The engine records its own ``finished`` a
little earlier, when it lets the request go and frees the KV slot; ``request_metrics`` uses the
last one.) The traces of the last ``trace_history`` requests stay reachable at ``GET /v1/traces``
and through :meth:`ServingState.traces`, so a notebook can walk one request stage by stage.
The engine's side of the same story, one record per step (its phases' timestamps, its prefill
and decode tokens), is at ``GET /v1/steps`` and :meth:`ServingState.steps`.

A client that disconnects aborts its request, and its KV slot is free by the next step: a
thousand abandoned browser tabs cannot hold the batch hostage. Nor can a client that never
finishes sending its request: its headers must arrive within ``header_timeout_s`` and its body
within ``body_timeout_s`` (else 408 and the connection is closed; :mod:`minillm.serving.guard`),
and at most ``max_connections`` connections are served at once (a request on one more gets 503).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import sys
import threading
import time
from typing import Any

from minillm.core.trace import Trace
from minillm.engine.gc_pauses import freeze_startup_heap
from minillm.serving.app import create_app
from minillm.serving.config import (  # noqa: F401 (the public names)
    ServerConfig,
    config_from_args,
)
from minillm.serving.state import ServingState

log = logging.getLogger("minillm.serving.server")
DRAIN_CLOSE_S = 5.0    # after the drain, how long connections may take to close before uvicorn cancels them

# ---------------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _uvicorn_server(app, host: str, port: int, config: ServerConfig, log_level: str | None = None):
    """The uvicorn server for ``app``, with the limits of ``config`` on receiving requests.

    * ``header_timeout_s``, ``body_timeout_s``, ``max_header_bytes``: our protocol class
      (:mod:`minillm.serving.guard`: uvicorn has no deadline for receiving a request).
    * ``max_connections`` → uvicorn's ``limit_concurrency``, which answers 503 (and closes) a request
      once ``len(connections) >= limit`` — a count that includes the asking connection, so
      ``limit_concurrency=N`` serves only N-1 connections at once. We pass ``max_connections + 1``:
      ``max_connections`` connections are served, a request on one more gets 503.
    * ``keep_alive_timeout_s`` → uvicorn's ``timeout_keep_alive`` (idle after a response).
    * ``ws="none"``: the API has no WebSocket route; an Upgrade header is a plain HTTP request.
    """
    import uvicorn

    from minillm.serving.guard import GuardCounters, guarded_protocol

    class _Server(uvicorn.Server):
        drained: bool | None = None          # after a shutdown: did every admitted request finish?
        drain_on_shutdown = True             # False: end open streams at once (ServerThread.stop)

        async def shutdown(self, sockets=None) -> None:
            # A graceful drain (a rolling restart loses no work): stop accepting connections,
            # refuse new requests on open ones (503, /health says "draining"), let the admitted
            # ones finish up to shutdown_timeout_s, then stop the engine, which ends what is left
            # with an error event; every trace is stored on the way out.
            for server in self.servers:
                server.close()
            state = app.state.minillm
            timeout = config.shutdown_timeout_s if self.drain_on_shutdown else 0.0
            self.drained = await asyncio.to_thread(state.drain, timeout)
            await asyncio.to_thread(state.shutdown)
            await super().shutdown(sockets)
            if self.drained:
                # uvicorn raises the caught SIGTERM/SIGINT again once it has shut down, so the
                # process would end "killed by signal 15": after a clean drain it exits 0 instead.
                self._captured_signals.clear()

    log_level = log_level or config.log_level
    counters = GuardCounters()
    protocol = guarded_protocol(config.header_timeout_s, config.body_timeout_s, config.max_header_bytes,
                                counters=counters)
    limit = None if config.max_connections is None else config.max_connections + 1
    cfg = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                         timeout_graceful_shutdown=DRAIN_CLOSE_S, access_log=log_level == "debug",
                         http=protocol, ws="none", limit_concurrency=limit,
                         timeout_keep_alive=config.keep_alive_timeout_s,
                         h11_max_incomplete_event_size=config.max_header_bytes)
    server = _Server(cfg)
    server.guard_counters = counters
    return server


class ServerThread:
    """Run the server in a background thread (notebooks, tests, benchmarks)::

        srv = ServerThread(ServerConfig(model="tiny", port=0)).start()
        httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 8})
        srv.traces()          # the requests' traces, as Trace objects
        srv.stop()

    Takes a :class:`ServerConfig` (``port=0``: a free port; ``url`` says which one), a
    :class:`ServingState` or an app from :func:`create_app`. ``stop()`` stops the engine thread,
    ends the open streams, lets uvicorn finish and joins its thread: nothing is left running.
    ``guard_counters`` counts the connections closed for sending their request too slowly.
    """

    def __init__(self, app_or_config: Any = None, *, host: str | None = None, port: int | None = None,
                 log_level: str | None = None) -> None:
        if app_or_config is None:
            app_or_config = ServerConfig(port=0)
        if isinstance(app_or_config, (ServerConfig, ServingState)):
            self.app = create_app(app_or_config)
        else:
            self.app = app_or_config
        cfg: ServerConfig = self.app.state.minillm.config
        self.config = cfg
        self.host = host or cfg.host
        self._port_asked = cfg.port if port is None else port
        self._server = _uvicorn_server(self.app, self.host, self._port_asked, cfg, log_level)
        self.guard_counters = self._server.guard_counters   # connections closed by serving/guard.py
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    @property
    def state(self) -> ServingState:
        return self.app.state.minillm

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the server is not started: call start() first")
        return f"http://{self.host}:{self.port}"

    def traces(self, request_ids: list[str] | None = None) -> list[Trace]:
        return self.state.traces(request_ids)

    def start(self, timeout: float = 120.0) -> "ServerThread":
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._server.run, name="minillm-uvicorn", daemon=True)
        self._thread.start()
        t_end = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                self._thread = None
                raise RuntimeError(f"the server failed to start on {self.host}:{self._port_asked}")
            if time.monotonic() > t_end:
                self.stop()
                raise TimeoutError(f"the server did not start within {timeout:.0f} s")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 30.0, drain: bool = False) -> None:
        """Stop now, ending open streams with the error event; ``drain=True``: first let admitted
        requests finish, up to ``shutdown_timeout_s``, as ``minillm serve`` does on SIGTERM."""
        t = self._thread
        if t is None:
            return
        self._server.drain_on_shutdown = drain
        self._server.should_exit = True
        t.join(timeout)
        if t.is_alive():
            self._server.force_exit = True
            t.join(5)
        self.state.shutdown()          # idempotent; covers a server that never reached shutdown()
        self._thread = None

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def open_warning(config: ServerConfig) -> str | None:
    """The banner printed when no API key is configured."""
    if config.api_keys:
        return None
    bar = "!" * 96
    return (f"{bar}\n!! WARNING: no API key configured (--api-key or MINILLM_API_KEY): this server is OPEN.\n"
            f"!! Anyone who can reach http://{config.host}:{config.port} can use it.\n{bar}")


def serve(config: ServerConfig, host: str | None = None, port: int | None = None) -> int:
    """Run in the foreground until Ctrl-C (``python -m minillm serve``)."""
    host = host or config.host
    port = config.port if port is None else port
    config.host, config.port = host, port
    logging.basicConfig(level=getattr(logging, config.log_level.upper(), logging.INFO),
                        format="%(levelname)s:     %(name)s: %(message)s")
    warning = open_warning(config)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    app = create_app(config)
    st: ServingState = app.state.minillm
    # This process is the server's own: freeze the start-up heap so that full garbage collections,
    # which stop the engine thread mid-step, skip it (10.5; minillm.engine.gc_pauses).
    frozen = freeze_startup_heap()
    log.info("froze %d start-up objects out of the garbage collector's full collections", frozen)
    print(f"minillm serving {st.model_name} ({st.llm.device}, max_model_len {st.engine.max_model_len}, "
          f"{st.engine.cache.num_slots} KV slots, {len(st.auth.key_ids)} API key(s)) at "
          f"http://{host}:{port}/v1",
          file=sys.stderr, flush=True)
    server = _uvicorn_server(app, host, port, config)
    server.run()
    if server.drained is False:
        log.warning("shut down before every request finished (shutdown_timeout_s=%s)",
                    config.shutdown_timeout_s)
        return 1
    return 0
