"""``python -m minillm serve``: an OpenAI-compatible HTTP server (chapter 10.1's first and last stages).

    HTTP request ─► gateway (auth, validate, tokenize, rate limit, admission) ─► engine queue
                                                                                  │ EngineLoop thread:
    SSE chunks ◄── handler (detokenized deltas, one `sent` per chunk) ◄── StepOutputs ┘ one step at a time

One thread, the :class:`EngineLoop`, calls ``engine.step()``; HTTP handlers only admit requests and
stream what the loop hands them. So the engine never sees two steps at once, and a slow client
never slows the batch. A client that goes away aborts its request, which frees its KV slot.

Every request keeps its trace (received → authenticated → tokenized → admitted → enqueued →
scheduled → prefill → tokens → detokenized → sent → finished); the last ones are served at
``GET /v1/traces`` for the notebooks.
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
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request   # module level: FastAPI resolves the (string) annotations here

from .engine import LLM, RequestError, StepOutput
from .gateway import (AdmissionControl, APIKeyAuth, CompletionRequest, Gateway, GatewayError, RateLimiter,
                      keys_from_env_and_args)
from .sampling import SamplingParams
from .tokenizer import apply_chat, encode_prompt
from .trace import Trace

log = logging.getLogger("minillm.server")
MAX_BODY_BYTES = 1 << 20          # 1 MiB: a prompt far longer than any context we serve


# ----------------------------------------------------------------------------- the engine loop

@dataclass
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EngineLoop:
    """The one place that steps the engine. Outputs go to each request's asyncio queue
    through ``call_soon_threadsafe`` (the queue lives on the HTTP event loop)."""

    def __init__(self, llm: LLM, history: int = 10_000):
        self.llm, self.engine = llm, llm.engine
        self.finished_traces: collections.deque[Trace] = collections.deque(maxlen=history)
        self._subs: dict[str, _Subscriber] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="minillm-engine-loop", daemon=True)
        self.steps = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, seq, sub: _Subscriber) -> None:
        with self._wake:
            if self._stop:
                raise RuntimeError("the server is shutting down")
            self._subs[seq.request_id] = sub
            self.engine.enqueue(seq)
            self._wake.notify()

    def abort(self, request_id: str) -> bool:
        """The client went away: stop generating and free the KV slot."""
        with self._lock:
            sub = self._subs.pop(request_id, None)
            aborted = self.engine.abort(request_id)
            if aborted:
                self._retire(request_id)
        return aborted or sub is not None

    def _retire(self, request_id: str) -> None:
        with contextlib.suppress(KeyError, RuntimeError):
            self.finished_traces.append(self.engine.pop_finished(request_id).trace)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self.engine.has_unfinished():
                    self._wake.wait(0.5)
                if self._stop:
                    break
            try:
                outs = self.engine.step()      # takes the engine's own lock; aborts wait for it
            except Exception:                   # the engine fails batches itself; this is a bug guard
                log.exception("engine step failed")
                time.sleep(0.01)
                continue
            self.steps += 1
            self._deliver(outs)
        self._shutdown()

    def _deliver(self, outs: list[StepOutput]) -> None:
        with self._lock:
            for o in outs:
                sub = self._subs.get(o.request_id)
                if o.finished:
                    self._subs.pop(o.request_id, None)
                    seq = self.engine.get(o.request_id) if o.request_id in self.engine._seqs else None
                    n_out = len(seq.output_ids) if seq is not None else 0
                    error = getattr(seq, "error", None)
                    self._retire(o.request_id)
                    item = (o, n_out, error)
                else:
                    item = (o, None, None)
                if sub is not None:
                    with contextlib.suppress(RuntimeError):       # the event loop is closed
                        sub.loop.call_soon_threadsafe(sub.queue.put_nowait, item)

    def _shutdown(self) -> None:
        with self._lock:
            for rid, sub in list(self._subs.items()):
                self.engine.abort(rid)
                self._retire(rid)
                item = (StepOutput(rid, None, "", True, "abort"), 0, "server shutting down")
                with contextlib.suppress(RuntimeError):
                    sub.loop.call_soon_threadsafe(sub.queue.put_nowait, item)
            self._subs.clear()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._subs)


# ----------------------------------------------------------------------------- the server state

@dataclass
class ServerConfig:
    model: str = "tiny"
    tokenizer: str | None = None
    device: str | None = None
    dtype: str | None = None
    api_keys: list[str] = field(default_factory=list)
    requests_per_s: float | None = None
    tokens_per_min: float | None = None
    max_queue_depth: int = 256
    max_batch_size: int = 64
    max_model_len: int | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    served_model_name: str | None = None
    trace_history: int = 10_000


class MiniServer:
    """The model, the gateway and the engine loop; :func:`create_app` puts HTTP in front."""

    def __init__(self, config: ServerConfig, llm: LLM | None = None):
        self.config = config
        self.llm = llm or LLM(model=config.model, tokenizer=config.tokenizer, device=config.device,
                              dtype=config.dtype, max_batch_size=config.max_batch_size,
                              max_model_len=config.max_model_len)
        self.model_name = config.served_model_name or config.model
        self.auth = APIKeyAuth(config.api_keys)
        limiter = RateLimiter(config.requests_per_s, config.tokens_per_min) \
            if (config.requests_per_s or config.tokens_per_min) else None
        self.gateway = Gateway(self.auth, limiter, AdmissionControl(config.max_queue_depth), [self.model_name],
                               self.llm.engine.max_model_len, self._count_tokens)
        self.loop = EngineLoop(self.llm, config.trace_history)
        self.rejected_traces: collections.deque[Trace] = collections.deque(maxlen=config.trace_history)
        self._tokenized = threading.local()     # the ids the gateway's token count produced
        self.created = int(time.time())

    # The gateway counts prompt tokens to check the context; keep those ids, so the prompt is
    # tokenized once, and stamp `tokenized` on the request's trace (the tokenize stage of 10.1).
    def _count_tokens(self, req: CompletionRequest) -> int:
        tok = self.llm.tokenizer
        if req.chat:
            ids = list(tok.encode(apply_chat(tok, req.prompt), add_special_tokens=False))
        else:
            ids = encode_prompt(tok, req.prompt)
        self._tokenized.ids = ids
        trace = getattr(self._tokenized, "trace", None)
        if trace is not None:
            trace.record("tokenized", n_tokens=len(ids))
        return len(ids)

    def admit(self, authorization: str | None, body: Any, chat: bool, trace: Trace):
        self._tokenized.trace, self._tokenized.ids = trace, None
        try:
            admitted = self.gateway.admit(authorization, body, chat=chat, trace=trace)
            return admitted, self._tokenized.ids
        finally:
            self._tokenized.trace = None

    def start(self) -> None:
        if self.auth.open:
            banner = ("WARNING: no API key configured (--api-key or MINILLM_API_KEY): this server accepts "
                      "requests from anyone who can reach it")
            print("!" * len(banner) + "\n" + banner + "\n" + "!" * len(banner), file=sys.stderr, flush=True)
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()

    def traces(self) -> list[Trace]:
        return list(self.loop.finished_traces) + list(self.rejected_traces)


# ----------------------------------------------------------------------------- HTTP

def _error(e: GatewayError):
    from fastapi.responses import JSONResponse
    return JSONResponse(e.to_openai_error(), status_code=e.status, headers=e.headers)


async def _read_json(request, limit: int) -> Any:
    """The body as JSON, refusing more than ``limit`` bytes before reading them all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, "request_too_large", f"The request body is {declared} bytes; the limit is {limit}.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, "request_too_large", f"The request body exceeds the limit of {limit} bytes.")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks) or b"null")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GatewayError(400, "invalid_request", f"The request body is not valid JSON ({e}).") from None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(server: MiniServer):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        server.start()
        try:
            yield
        finally:
            server.stop()

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.server = server

    def check_key(request: Request) -> None:
        server.auth.check(request.headers.get("authorization"))

    @app.exception_handler(GatewayError)
    async def _gateway_error(_request, e: GatewayError):
        return _error(e)

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "minillm", "max_model_len": server.gateway.max_model_len}]}

    @app.get("/v1/traces")
    async def traces(request: Request, limit: int = 1000):
        """The last ``limit`` traces (finished and rejected requests), as plain data."""
        check_key(request)
        items = server.traces()[-max(1, min(limit, 100_000)):]
        return {"object": "list", "data": [{"request_id": t.request_id, "events": t.to_records()} for t in items]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": server.llm.engine.num_running, "waiting": server.llm.engine.num_waiting}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(request, chat=True)

    async def _handle(request: Request, chat: bool):
        rid = uuid.uuid4().hex[:16]
        trace = Trace(rid)
        trace.record("received")
        try:
            body = await _read_json(request, server.config.max_body_bytes)
            admitted, ids = server.admit(request.headers.get("authorization"), body, chat, trace)
        except GatewayError as e:
            if trace.last("rejected") is None:
                trace.record("rejected", status=e.status, code=e.code)
            server.rejected_traces.append(trace)
            return _error(e)
        try:
            params = SamplingParams(**admitted.sampling_kwargs())
            seq = server.llm.engine.prepare(ids, params, request_id=rid, trace=trace)
            seq.prompt = admitted.request.prompt if not chat else None
            sub = _Subscriber(asyncio.get_running_loop(), asyncio.Queue())
            server.loop.submit(seq, sub)
        except (RequestError, ValueError) as e:
            server.gateway.release(admitted)
            trace.record("rejected", status=400, code="invalid_request")
            server.rejected_traces.append(trace)
            return _error(GatewayError(400, "invalid_request", str(e)))
        except RuntimeError as e:           # shutting down
            server.gateway.release(admitted)
            return _error(GatewayError(503, "unavailable", str(e)))
        meta = dict(id=("chatcmpl-" if chat else "cmpl-") + rid, created=int(time.time()),
                    model=admitted.request.model)
        if admitted.request.stream:
            return StreamingResponse(_stream(request, admitted, sub, trace, meta, chat), media_type="text/event-stream",
                                     headers={"X-Request-Id": rid, "Cache-Control": "no-cache"})
        return await _complete(request, admitted, sub, trace, meta, chat)

    async def _outputs(request: Request, admitted, sub: _Subscriber, rid: str) -> AsyncIterator[tuple]:
        """The request's StepOutputs as they come; aborts the request if the client leaves."""
        finished = False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(sub.queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                yield item
                if item[0].finished:
                    finished = True
                    return
        finally:
            if not finished:
                server.loop.abort(rid)      # client gone (or cancelled): free the KV slot now
            server.gateway.release(admitted)

    async def _complete(request, admitted, sub, trace: Trace, meta: dict, chat: bool):
        text, reason, n_out, error = [], None, 0, None
        async for o, n, err in _outputs(request, admitted, sub, trace.request_id):
            text.append(o.delta)
            if o.finished:
                reason, n_out, error = o.finish_reason, n or 0, err
        if reason is None:                  # the client left: nobody reads this
            return JSONResponse({}, status_code=499)
        if reason in ("error", "abort"):
            return _error(GatewayError(500 if reason == "error" else 503, "engine_error",
                                       f"the request failed in the engine: {error}"))
        out = "".join(text)
        choice = ({"index": 0, "message": {"role": "assistant", "content": out}, "finish_reason": reason}
                  if chat else {"index": 0, "text": out, "logprobs": None, "finish_reason": reason})
        body = {**meta, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                "usage": _usage(admitted.prompt_tokens, n_out)}
        trace.record("sent", n_chars=len(out))
        return JSONResponse(body, headers={"X-Request-Id": trace.request_id})

    async def _stream(request, admitted, sub, trace: Trace, meta: dict, chat: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, reason: str | None) -> dict:
            if chat:
                d = {} if delta is None else {"content": delta}
                c = {"index": 0, "delta": d, "finish_reason": reason}
            else:
                c = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
            return {**meta, "object": obj, "choices": [c]}

        if chat:   # OpenAI sends the role first, with empty content
            yield _sse({**meta, "object": obj, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                            "finish_reason": None}]})
        async for o, n, err in _outputs(request, admitted, sub, trace.request_id):
            if o.finished and o.finish_reason in ("error", "abort"):
                yield _sse({"error": {"message": f"the request failed in the engine: {err}", "type": "server_error",
                                      "param": None, "code": "engine_error"}})
                return
            if o.delta or o.finished:
                yield _sse(chunk(o.delta if (o.delta or not chat) else None, o.finish_reason if o.finished else None))
                trace.record("sent", n_chars=len(o.delta))
            if o.finished:
                if admitted.request.include_usage:
                    yield _sse({**meta, "object": obj, "choices": [], "usage": _usage(admitted.prompt_tokens, n or 0)})
                yield "data: [DONE]\n\n"
                return

    return app


# ----------------------------------------------------------------------------- running it

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """Run the app with uvicorn in a background thread (notebooks, tests, benchmarks).

        srv = ServerThread(create_app(MiniServer(ServerConfig(model="tiny")))).start()
        ... httpx.post(srv.url + "/v1/completions", ...) ...
        srv.stop()
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"):
        import uvicorn
        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level=log_level,
                                                    lifespan="on", timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self.server.run, name="minillm-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        t0 = time.time()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server did not start on {self.url}")
            if time.time() - t0 > timeout:
                raise TimeoutError(f"the server did not start within {timeout} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(config: ServerConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    import uvicorn
    server = MiniServer(config)
    print(f"minillm serving {server.model_name} on http://{host}:{port}/v1 "
          f"(max_model_len {server.gateway.max_model_len}, keys: {len(server.auth.key_ids)})", file=sys.stderr)
    uvicorn.run(create_app(server), host=host, port=port, log_level="info", timeout_graceful_shutdown=5)


def config_from_args(a) -> ServerConfig:
    return ServerConfig(model=a.model, tokenizer=a.tokenizer, device=a.device, dtype=a.dtype,
                        api_keys=keys_from_env_and_args(a.api_key), requests_per_s=a.requests_per_s,
                        tokens_per_min=a.tokens_per_min, max_queue_depth=a.max_queue_depth,
                        max_batch_size=a.max_batch_size, max_model_len=a.max_model_len)
