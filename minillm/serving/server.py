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
thousand abandoned browser tabs cannot hold the batch hostage.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request   # module level: FastAPI resolves string annotations here

from minillm.engine.config import EngineConfig
from minillm.engine.step_record import PHASES
from minillm.measure.trace import Trace
from minillm.serving.gateway import (APIKeyAuth, AdmissionControl, AdmittedRequest, CompletionRequest, Gateway,
                                     GatewayError, RateLimiter, keys_from_env_and_args)

log = logging.getLogger("minillm.serving.server")

MAX_BODY_BYTES = 1 << 20       # 1 MiB: far more than any prompt our contexts can hold
MAX_STEPS_LIMIT = 10_000       # StepRecords one GET /v1/steps returns at most (a larger limit is capped)
_STEP_COPY_TRIES = 5           # lock-free copies of the step history before taking the engine's lock
_DRAIN_FACTOR = 8              # read on (and drop) up to 8× the limit, so the client reads our 413


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

@dataclass
class _ServerOptions:
    """The HTTP side's own options (the engine's are in :class:`EngineConfig`, defined once)."""
    host: str = "127.0.0.1"            # loopback: exposing a server is a decision, not a default
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)
    requests_per_s: float | None = None
    tokens_per_min: float | None = None
    burst: float | None = None
    max_queue_depth: int = 256         # requests inside the server (waiting + running), else 503
    max_tokens_cap: int = 256          # max_tokens of a request that does not say
    max_body_bytes: int = MAX_BODY_BYTES
    trace_history: int = 10_000        # traces kept for /v1/traces (a bounded deque)
    served_model_name: str | None = None
    log_level: str = "warning"
    graceful_timeout_s: float = 5.0    # at shutdown, how long open connections may take to close
    # torch's intra-op threads (process-wide; None: torch's default, one per core). On a machine
    # with few cores, leaving one core to the HTTP side keeps streaming smooth: with every core
    # in torch, each chunk written competes with the next step (see `python -m minillm bench-http`).
    torch_threads: int | None = None

    def __post_init__(self) -> None:
        if self.max_queue_depth < 1:
            raise ValueError(f"max_queue_depth must be ≥ 1, got {self.max_queue_depth}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.trace_history < 1:
            raise ValueError(f"trace_history must be ≥ 1, got {self.trace_history}")
        if self.port is not None and not 0 <= self.port <= 65535:   # before loading a model
            raise ValueError(f"port must be in 0..65535 (0: any free port), got {self.port}")


_ENGINE_OPTIONS = frozenset(EngineConfig.names())


@dataclass(init=False)
class ServerConfig(_ServerOptions):
    """Everything ``python -m minillm serve`` can be told. ``port=0`` binds a free port.

    The engine's options live in ``engine`` (an :class:`EngineConfig`: every engine option is
    defined once, there). For convenience they are also accepted as keywords and read as
    attributes: ``ServerConfig(model="tiny", max_batch_size=16, port=0).max_batch_size == 16``.
    """
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __init__(self, engine: EngineConfig | None = None, **options: Any) -> None:
        engine_options = {k: options.pop(k) for k in list(options) if k in _ENGINE_OPTIONS}
        if engine is not None and engine_options:
            raise TypeError("give either engine=EngineConfig(...) or engine keywords "
                            f"({', '.join(engine_options)}), not both")
        unknown = sorted(set(options) - {f.name for f in fields(_ServerOptions)})
        if unknown:
            raise TypeError(f"ServerConfig got unknown option(s): {', '.join(unknown)}")
        super().__init__(**options)       # the server's own fields
        self.engine = engine if engine is not None else EngineConfig(**engine_options)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: ``config.model`` reads ``config.engine.model``.
        engine = self.__dict__.get("engine")
        if engine is not None and name in _ENGINE_OPTIONS:
            return getattr(engine, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def config_from_args(a, engine: EngineConfig | None = None) -> ServerConfig:
    """``argparse`` namespace of ``python -m minillm serve`` → :class:`ServerConfig`. The engine's
    flags are generated from :class:`EngineConfig` (``minillm.cli.engine_config_from_args``)."""
    if engine is None:
        from minillm.cli import engine_config_from_args
        engine = engine_config_from_args(a)

    def opt(name: str, default=None):
        return getattr(a, name, default)
    return ServerConfig(engine=engine, host=opt("host", "127.0.0.1"), port=opt("port", 8000),
                        api_keys=keys_from_env_and_args(opt("api_key")),
                        requests_per_s=opt("requests_per_s"), tokens_per_min=opt("tokens_per_min"),
                        burst=opt("burst"), max_queue_depth=opt("max_queue_depth", 256),
                        log_level=opt("log_level", "info"),
                        torch_threads=opt("torch_threads") or default_server_threads(engine.device))


def default_server_threads(device: str | None) -> int | None:
    """For ``serve`` on a CPU: one core fewer than we may use, for the HTTP side (min 1).

    Why: the engine thread is not the main thread, and OpenMP regions started from another
    thread compete badly with the main thread's idle OpenMP workers. Measured on a 2-core Xeon
    (torch 2.13 CPU, the tiny model): a prefill took 2.0 ms from the main thread, 5.3 ms from a
    second thread with 2 OpenMP threads, 2.2 ms from a second thread with 1. Only the CLI server
    (a process of its own) gets this default; a ServerThread inside a notebook leaves torch alone.
    On an accelerator the intra-op threads barely matter: None (torch's default)."""
    from minillm.measure.hardware import cpu_cores, pick_device
    try:
        if pick_device(device).type != "cpu":
            return None
    except ValueError:
        return None            # LLM(...) reports the bad device with its own message
    return max(1, cpu_cores() - 1)


# ---------------------------------------------------------------------------------------------
# The engine thread
# ---------------------------------------------------------------------------------------------

class _Closed:
    """Pushed into a request's queue instead of a StepOutput when the engine lets it go
    without finishing it (server shutdown, engine failure)."""

    def __init__(self, message: str) -> None:
        self.message = message


@dataclass(eq=False)
class _Stream:
    """One request as the engine thread sees it: its sequence and where its outputs go."""
    seq: Any                                  # minillm.engine.sequence.Sequence
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    every_output: bool = True                 # False (non-streaming): only the final output


@dataclass
class _Abort:
    request_id: str
    then: Callable[[], None] | None = None    # runs on the engine thread once the slot is free


class EngineLoop:
    """The one thread that owns the engine and runs ``engine.step()`` while there is work."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: list[_Stream] = []
        self._aborts: list[_Abort] = []
        self._streams: dict[str, _Stream] = {}       # touched by the engine thread only
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.failures = 0

    # -- called from the event loop (or any thread) -------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def submit(self, seq, every_output: bool = True) -> _Stream:
        """Hand a prepared sequence to the engine thread. Its outputs arrive in the returned
        stream's queue; call this on the event loop that should receive them."""
        stream = _Stream(seq, asyncio.get_running_loop(), asyncio.Queue(), every_output)
        with self._cv:
            if not self.alive:
                raise GatewayError(503, "server_shutting_down", "The server is shutting down; retry later.",
                                   headers={"Retry-After": "1"})
            self._inbox.append(stream)
            self._cv.notify()
        return stream

    def abort(self, request_id: str, then: Callable[[], None] | None = None) -> None:
        """Ask the engine thread to abort a request; ``then`` runs after its KV slot is free."""
        with self._cv:
            queued = self.alive
            if queued:
                self._aborts.append(_Abort(request_id, then))
                self._cv.notify()
        if not queued and then is not None:    # stopped: the engine has let everything go already
            then()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current step; every request still inside gets a :class:`_Closed`."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
            if t.is_alive():
                log.error("the engine thread did not stop within %.0f s", timeout)

    def stats(self) -> dict[str, int]:
        """A snapshot for tests and notebooks (read without the engine's lock: approximate)."""
        e = self.engine
        return {"running": e.num_running, "waiting": e.num_waiting, "free_slots": e.allocator.num_free,
                "num_slots": e.cache.num_slots, "streams": len(self._streams), "inbox": len(self._inbox),
                "sequences": len(e._seqs), "steps": self.steps}

    # -- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stopping or self._inbox or self._aborts or self.engine.has_unfinished()):
                        self._cv.wait()           # idle: sleep until a request (or stop) arrives
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                for s in inbox:
                    self._admit(s)
                for a in aborts:                  # after the inbox: an abort may follow its submit
                    self._abort(a)
                if self.engine.has_unfinished():
                    self._step()
        finally:
            self._close_all("The server is shutting down; the request was not completed.")

    def _admit(self, s: _Stream) -> None:
        try:
            self.engine.enqueue(s.seq)            # records `enqueued`
        except Exception as e:                    # e.g. a duplicate request id: fail this one only
            self._push(s, _Closed(f"{type(e).__name__}: {e}"))
            return
        self._streams[s.seq.request_id] = s

    def _abort(self, a: _Abort) -> None:
        if self._streams.pop(a.request_id, None) is not None:
            self.engine.abort(a.request_id)       # records `finished` reason=abort, frees the slot
            self.engine.pop_finished(a.request_id)
        if a.then is not None:
            try:
                a.then()
            except Exception:
                log.exception("abort callback failed for %s", a.request_id)

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:   # a bug below step() (it fails a batch itself): end those requests, go on
            self.failures += 1
            log.exception("engine step failed")
            for rid, s in list(self._streams.items()):
                with contextlib.suppress(Exception):
                    self.engine.abort(rid)
                    self.engine.pop_finished(rid)
                self._push(s, _Closed(f"engine error: {type(e).__name__}: {e}"))
            self._streams.clear()
            return
        self.steps += 1
        # One wake-up of each event loop per step, not one per token: at batch 64 that is one
        # self-pipe write (and one loop iteration) per step instead of 64.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for o in outs:
            s = self._streams.get(o.request_id)
            if s is None:
                continue
            if o.finished:
                del self._streams[o.request_id]
                self.engine.pop_finished(o.request_id)   # the engine keeps no history by itself
            if s.every_output or o.finished:
                by_loop.setdefault(s.loop, []).append((s.queue, o))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _push(self, s: _Stream, item: Any) -> None:
        _call_soon(s.loop, _put_all, [(s.queue, item)])

    def _close_all(self, message: str) -> None:
        with self._cv:
            self._stopping = True
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for s in inbox:
            self._push(s, _Closed(message))
        for rid, s in list(self._streams.items()):
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
                self.engine.pop_finished(rid)
            self._push(s, _Closed(message))
        self._streams.clear()
        for a in aborts:
            if a.then is not None:
                with contextlib.suppress(Exception):
                    a.then()


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:      # that event loop is closed: nobody is listening any more
        pass


# ---------------------------------------------------------------------------------------------
# What the app holds
# ---------------------------------------------------------------------------------------------

class ServingState:
    """The model, the gateway, the engine thread and the recent traces; :func:`create_app`
    puts HTTP in front of it."""

    def __init__(self, config: ServerConfig | None = None, llm=None) -> None:
        from minillm.engine.llm import LLM
        config = config or ServerConfig()
        self.config = config
        if config.torch_threads:
            import torch
            torch.set_num_threads(config.torch_threads)
        self.llm = llm if llm is not None else LLM(config=config.engine)
        self.engine = self.llm.engine
        self.tokenizer = self.llm.tokenizer
        self.model_name = config.served_model_name or str(config.engine.model)
        self.created = int(time.time())
        self.auth = APIKeyAuth(config.api_keys)
        limiter = (RateLimiter(config.requests_per_s, config.tokens_per_min, config.burst)
                   if config.requests_per_s or config.tokens_per_min else None)
        self.gateway = Gateway(self.auth, limiter, AdmissionControl(config.max_queue_depth), [self.model_name],
                               self.engine.max_model_len, self._count_tokens,
                               max_tokens_cap=config.max_tokens_cap)
        self.loop = EngineLoop(self.engine)
        self._traces: collections.deque[Trace] = collections.deque(maxlen=config.trace_history)
        self._traces_lock = threading.Lock()

    # -- prompts -------------------------------------------------------------------------
    def prompt_text(self, req: CompletionRequest) -> str:
        from minillm.engine.tokenizer import apply_chat
        return apply_chat(self.tokenizer, req.prompt) if req.chat else req.prompt

    def _count_tokens(self, req: CompletionRequest) -> int:
        # The gateway needs the prompt length to check the context *before* queueing (vLLM's
        # frontend does the same). prepare() tokenizes again: we pay twice (tens of µs for a
        # chat-sized prompt) so that the trace's `tokenize` stage is the tokenizer's time.
        from minillm.engine.tokenizer import encode_prompt
        return len(encode_prompt(self.tokenizer, self.prompt_text(req)))

    # -- traces --------------------------------------------------------------------------
    def remember(self, trace: Trace) -> None:
        with self._traces_lock:
            self._traces.append(trace)

    def traces(self, request_ids: list[str] | None = None, limit: int | None = None) -> list[Trace]:
        """Traces of completed (and rejected) requests, oldest first. A trace is stored once its
        response is complete and is never written to afterwards."""
        with self._traces_lock:
            out = list(self._traces)
        if request_ids:
            want = set(request_ids)
            out = [t for t in out if t.request_id in want]
        if limit is not None:
            out = out[-limit:] if limit > 0 else []
        return out

    def trace(self, request_id: str) -> Trace:
        found = self.traces([request_id])
        if not found:
            raise KeyError(f"no trace for request {request_id!r} (yet): a trace is stored when its response is complete")
        return found[-1]

    def clear_traces(self) -> None:
        with self._traces_lock:
            self._traces.clear()

    # -- steps ---------------------------------------------------------------------------
    def steps(self, limit: int | None = None) -> list[dict]:
        """The engine's last ``limit`` StepRecords (all it keeps, if None) as dicts, oldest first.
        Call it off the event loop: turning thousands of records into dicts takes a while."""
        records = self._step_snapshot()
        if limit is not None:
            records = records[max(0, len(records) - limit):]    # (records[-0:] would be all of them)
        return [r.to_dict() for r in records]

    def _step_snapshot(self) -> list:
        """A copy of the engine's step history. The engine thread appends to it while we read,
        and copying a deque that changes underneath raises RuntimeError. A copy takes
        microseconds, so a retry almost always succeeds; the last try holds the engine's lock
        (step() appends under it), which waits for at most one step. A record is complete
        when it is appended and never changes afterwards."""
        history = self.engine.step_history
        for _ in range(_STEP_COPY_TRIES):
            try:
                return list(history)
            except RuntimeError:
                continue
        with self.engine._lock:
            return list(history)

    # -- health --------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return {**self.loop.stats(), "admitted": self.gateway.admission.depth}

    def idle(self) -> bool:
        """True when nothing is inside: no stream, no sequence, every KV slot free, no admission held."""
        s = self.stats()
        return (s["running"] == 0 and s["waiting"] == 0 and s["streams"] == 0 and s["inbox"] == 0
                and s["sequences"] == 0 and s["free_slots"] == s["num_slots"] and s["admitted"] == 0)

    def start(self) -> None:
        if self.auth.open:
            log.warning("no API key configured: the server is OPEN to anyone who can reach it")
        self.loop.start()

    def shutdown(self) -> None:
        self.loop.stop()

    # the names of an earlier draft of this module
    stop = shutdown


MiniServer = ServingState


# ---------------------------------------------------------------------------------------------
# HTTP helpers
# ---------------------------------------------------------------------------------------------

def _error_response(e: GatewayError, request_id: str | None = None):
    from fastapi.responses import JSONResponse
    headers = dict(e.headers)
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(e.to_openai_error(), status_code=e.status, headers=headers)


class _BodyTooLarge(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(size, limit)
        self.size, self.limit = size, limit


async def _read_body(request, limit: int) -> bytes:
    """The body, at most ``limit`` bytes. A larger one is read on (up to a hard cap) and dropped,
    so that the client, which may still be writing, reads our 413 rather than a reset socket."""
    declared = request.headers.get("content-length", "")
    declared_n = int(declared) if declared.isdigit() else 0
    too_large = declared_n > limit
    chunks: list[bytes] = []
    size = 0
    if declared_n > _DRAIN_FACTOR * limit:        # not worth reading at all
        raise _BodyTooLarge(declared_n, limit)
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            too_large = True
            chunks.clear()
            if size > _DRAIN_FACTOR * limit:
                break
        elif not too_large:
            chunks.append(chunk)
    if too_large:
        raise _BodyTooLarge(max(size, declared_n), limit)
    return b"".join(chunks)


async def _wait_disconnect(receive) -> None:
    """Return when the client has gone (or the response is complete): after the body, the
    server's next ASGI message is ``http.disconnect``."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


def _limit_param(request, cap: int | None = None) -> int | None:
    """``?limit=N``: a non-negative integer (None when absent), at most ``cap``; else 400."""
    limit = request.query_params.get("limit")
    if limit is None:
        return None
    if not (limit.isascii() and limit.isdigit()):       # "²".isdigit() is True; int("²") fails
        raise GatewayError(400, "invalid_request", f"'limit' must be a non-negative integer, got {limit!r}."[:300],
                           param="limit")
    digits = limit.lstrip("0") or "0"
    n = int(digits) if len(digits) <= 18 else 10 ** 18   # int() refuses over 4300 digits: a 500
    return n if cap is None else min(n, cap)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object. ``cached_tokens``: prompt tokens whose K/V came from the prefix
    cache (whole 16-token blocks) instead of being computed: the hit, as a number."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class _Job:
    """One admitted request on the HTTP side. ``close`` runs once, whatever path ends it."""
    state: ServingState
    trace: Trace
    admitted: AdmittedRequest
    stream: _Stream
    chat: bool
    created: int
    done: bool = False             # the engine has let it go (finished, failed): nothing to abort
    closed: bool = False
    n_sent: int = 0

    @property
    def request_id(self) -> str:
        return self.trace.request_id

    @property
    def seq(self):
        return self.stream.seq

    def sent(self, n_chars: int) -> None:
        self.trace.record("sent", n_chars=n_chars)
        self.n_sent += 1

    def close(self, reason: str) -> None:
        """Free the gateway's queue slot and end the trace; abort first if the engine still runs it."""
        if self.closed:
            return
        self.closed = True
        self.state.gateway.release(self.admitted)

        def finish() -> None:
            self.trace.record("finished", where="server", reason=reason, n_sent=self.n_sent)
            self.state.remember(self.trace)

        if self.done:
            finish()
        else:
            # The engine thread frees the KV slot and records the engine's `finished` (abort);
            # only then is the trace ended and stored, so a stored trace never changes again.
            self.state.loop.abort(self.request_id, then=finish)

    # -- bodies --------------------------------------------------------------------------
    def chunk(self, delta: str, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.admitted.request.model, "choices": [choice]}

    def usage(self) -> dict[str, Any]:
        # read once the engine has let the request go: nothing writes these any more
        seq = self.seq
        return _usage(self.admitted.prompt_tokens, len(seq.output_ids), seq.num_cached_tokens)

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.admitted.request.model, "choices": [],
                "usage": self.usage()}

    def final_body(self) -> dict[str, Any]:
        seq = self.seq
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": seq.text},
                      "logprobs": None, "finish_reason": seq.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": seq.text, "logprobs": None, "finish_reason": seq.finish_reason}
            obj = "text_completion"
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.admitted.request.model, "choices": [choice],
                "usage": self.usage()}


def _engine_error(job: _Job) -> GatewayError:
    return GatewayError(500, "engine_error", f"The engine failed on this request: {job.seq.error}")


async def _sse_body(job: _Job) -> AsyncIterator[str]:
    """The event stream of one request. Each ``sent`` is recorded when the generator is resumed,
    which Starlette does only after the previous chunk was handed to the socket."""
    queue = job.stream.queue
    reason = "disconnected"         # unless we reach the end
    try:
        if job.chat:                # OpenAI's first chat chunk carries the role only
            yield _sse(job.chunk("", None, role=True))
            job.sent(0)
        while True:
            item = await queue.get()
            if isinstance(item, _Closed):
                job.done, reason = True, "error"
                yield _sse(GatewayError(503, "server_shutting_down", item.message).to_openai_error())
                break
            if item.finished:
                job.done = True
            if item.finish_reason == "error":
                reason = "error"
                yield _sse(_engine_error(job).to_openai_error())
                break
            if item.delta or item.finished:
                yield _sse(job.chunk(item.delta, item.finish_reason if item.finished else None))
                job.sent(len(item.delta))
            if item.finished:
                reason = item.finish_reason
                if job.admitted.request.include_usage:
                    yield _sse(job.usage_chunk())
                    job.sent(0)
                break
        yield "data: [DONE]\n\n"
        job.sent(0)
    finally:
        job.close(reason)


def _response_classes():
    from fastapi.responses import JSONResponse, StreamingResponse

    class TracedJSONResponse(JSONResponse):
        """A complete (non-streamed) body whose `sent` is stamped once it is on the socket."""

        def __init__(self, job: _Job, content: Any) -> None:
            self.job = job
            super().__init__(content, headers={"x-request-id": job.request_id})

        async def __call__(self, scope, receive, send) -> None:
            reason = self.job.seq.finish_reason or "stop"
            try:
                await super().__call__(scope, receive, send)
                self.job.sent(len(self.body))
            except BaseException:
                reason = "disconnected"
                raise
            finally:
                self.job.close(reason)

    class SSEResponse(StreamingResponse):
        """Server-sent events. Starlette cancels the body when the client disconnects; this
        ``finally`` also closes the job when the body generator never got to start."""

        def __init__(self, job: _Job) -> None:
            self.job = job
            super().__init__(_sse_body(job), media_type="text/event-stream",
                             headers={"x-request-id": job.request_id, "cache-control": "no-cache"})

        async def __call__(self, scope, receive, send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                with contextlib.suppress(BaseException):
                    await self.body_iterator.aclose()
                self.job.close("disconnected")      # a no-op when the generator closed it

    return TracedJSONResponse, SSEResponse


# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------

def create_app(config: ServerConfig | ServingState | None = None, *, llm=None):
    """The FastAPI app over a :class:`ServingState` (built from ``config`` unless given one).
    ``llm`` reuses an already built :class:`minillm.LLM`; its engine then belongs to the server."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect

    state = config if isinstance(config, ServingState) else ServingState(config, llm=llm)
    TracedJSONResponse, SSEResponse = _response_classes()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # Pay the first request's one-off costs now, not on its TTFT: anyio (under Starlette's
        # streaming responses) imports its asyncio backend lazily, ~10 ms on a laptop CPU (10.1).
        with contextlib.suppress(Exception):
            import anyio
            anyio.get_current_task()
        state.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.shutdown)

    app = FastAPI(title="minillm", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.minillm = state
    app.state.server = state          # the name of an earlier draft

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, e: GatewayError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return _error_response(GatewayError(e.status_code, code, str(e.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return _error_response(GatewayError(400, "invalid_request", str(e)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(GatewayError(500, "internal_error", f"Internal server error ({type(e).__name__})."))

    @app.get("/health")
    async def health():
        ok = state.loop.alive
        return JSONResponse({"status": "ok" if ok else "stopped", **state.stats()}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        state.auth.check(request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "minillm", "max_model_len": state.engine.max_model_len}]}

    @app.get("/v1/traces")
    async def traces(request: Request):
        """Plain-JSON traces of recent requests: ``?request_id=a&request_id=b`` (or ``a,b``), ``?limit=N``."""
        state.auth.check(request.headers.get("authorization"))
        ids = [i for v in request.query_params.getlist("request_id") for i in v.split(",") if i]
        found = state.traces(ids or None, _limit_param(request))
        return {"object": "list",
                "data": [{"request_id": t.request_id, "events": [e.as_dict() for e in t.events]} for t in found]}

    @app.get("/v1/steps")
    async def steps(request: Request):
        """The engine's recent steps (StepRecords, oldest first): ``?limit=N`` (at most
        MAX_STEPS_LIMIT). Each has its phases' end timestamps and its prefill/decode tokens."""
        state.auth.check(request.headers.get("authorization"))
        limit = _limit_param(request, cap=MAX_STEPS_LIMIT)
        # Off the event loop: thousands of records to turn into dicts would stall every stream.
        records = await asyncio.to_thread(state.steps, MAX_STEPS_LIMIT if limit is None else limit)
        return {"object": "list", "phases": list(PHASES), "data": records}

    async def handle(request: Request, chat: bool):
        from minillm.engine.engine import RequestError
        from minillm.engine.sampling import SamplingParams
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        trace = Trace(rid)
        trace.record("received", path=request.url.path)
        authorization = request.headers.get("authorization")
        admitted: AdmittedRequest | None = None
        try:
            try:
                body = json.loads(await _read_body(request, state.config.max_body_bytes))
            except ClientDisconnect:        # gone while sending the body: nobody to answer
                trace.record("rejected", status=499, code="client_disconnected")
                state.remember(trace)
                return Response(status_code=499)
            except (_BodyTooLarge, ValueError, RecursionError) as e:
                # Auth first even here: a stranger learns nothing, not even that the body was bad.
                trace.record("authenticated", key_id=state.auth.check(authorization))
                if isinstance(e, _BodyTooLarge):
                    raise GatewayError(413, "request_too_large",
                                       f"The request body has {e.size} bytes; this server accepts at most "
                                       f"{e.limit} bytes (max_body_bytes).") from None
                raise GatewayError(400, "invalid_request",
                                   f"The request body is not valid JSON ({type(e).__name__}: {e})."[:300]) from None
            admitted = state.gateway.admit(authorization, body, chat=chat, trace=trace)
            try:
                params = SamplingParams(**admitted.sampling_kwargs())
                seq = state.engine.prepare(state.prompt_text(admitted.request), params, request_id=rid, trace=trace)
            except (RequestError, ValueError) as e:
                raise GatewayError(400, "invalid_request", str(e)) from None
            stream = state.loop.submit(seq, every_output=admitted.request.stream)
        except GatewayError as e:
            if admitted is not None:
                state.gateway.release(admitted)
            if trace.last("rejected") is None:
                trace.record("rejected", status=e.status, code=e.code)
            state.remember(trace)
            return _error_response(e, rid)

        job = _Job(state, trace, admitted, stream, chat, int(time.time()))
        if admitted.request.stream:
            return SSEResponse(job)
        return await complete(job, request)

    async def complete(job: _Job, request: Request):
        """Not streamed: wait for the final output — or for the client to give up."""
        gone = asyncio.ensure_future(_wait_disconnect(request.receive))
        got = asyncio.ensure_future(job.stream.queue.get())
        try:
            done, _ = await asyncio.wait({gone, got}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:               # cancelled (e.g. a forced shutdown): leave nothing behind
            got.cancel()
            job.close("disconnected")
            raise
        finally:
            gone.cancel()
        if got not in done:
            got.cancel()
            job.close("disconnected")       # aborts: the KV slot is free by the next step
            return Response(status_code=499)   # nobody will read it
        item = got.result()
        job.done = True
        if isinstance(item, _Closed):
            job.close("error")
            return _error_response(GatewayError(503, "server_shutting_down", item.message,
                                                headers={"Retry-After": "1"}), job.request_id)
        if item.finish_reason == "error":
            job.close("error")
            return _error_response(_engine_error(job), job.request_id)
        return TracedJSONResponse(job, job.final_body())

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


# ---------------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _uvicorn_server(app, host: str, port: int, log_level: str, graceful_timeout_s: float):
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            # Stop the engine *before* waiting for connections to drain: each open stream then
            # ends at once (an error event, then [DONE]) instead of running on to max_tokens.
            await asyncio.to_thread(app.state.minillm.shutdown)
            await super().shutdown(sockets)

    cfg = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                         timeout_graceful_shutdown=graceful_timeout_s, access_log=log_level == "debug")
    return _Server(cfg)


class ServerThread:
    """Run the server in a background thread (notebooks, tests, benchmarks)::

        srv = ServerThread(ServerConfig(model="tiny", port=0)).start()
        httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 8})
        srv.traces()          # the requests' traces, as Trace objects
        srv.stop()

    Takes a :class:`ServerConfig` (``port=0``: a free port; ``url`` says which one), a
    :class:`ServingState` or an app from :func:`create_app`. ``stop()`` stops the engine thread,
    ends the open streams, lets uvicorn finish and joins its thread: nothing is left running.
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
        self._server = _uvicorn_server(self.app, self.host, self._port_asked, log_level or cfg.log_level,
                                       cfg.graceful_timeout_s)
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

    def stop(self, timeout: float = 30.0) -> None:
        t = self._thread
        if t is None:
            return
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
    print(f"minillm serving {st.model_name} ({st.llm.device}, max_model_len {st.engine.max_model_len}, "
          f"{st.engine.cache.num_slots} KV slots, {len(st.auth.key_ids)} API key(s)) at http://{host}:{port}/v1",
          file=sys.stderr, flush=True)
    _uvicorn_server(app, host, port, config.log_level, config.graceful_timeout_s).run()
    return 0
