"""The FastAPI app: routes over a :class:`ServingState` (chapter 10.1's first and last stage).

The event loop only admits and streams. On the loop: the ``received`` stamp (ASGI middleware,
when the request's headers reach the app, before its body is read), the API key and request
rate (microseconds), reading the body. Off the loop (a worker thread): JSON parsing, validation,
tokenizing (once: the engine takes the ids the gateway counted), trace serialization. A 1 MiB
prompt then costs its own request seconds of tokenizing, and every other stream nothing.

Routes: ``/v1/completions``, ``/v1/chat/completions`` (OpenAI), ``/v1/models`` and
``/v1/models/{id}``, ``/tokenize`` and ``/detokenize`` (vLLM's shapes), ``/v1/traces`` (a key's
own traces, paginated), ``/v1/steps`` (the engine's StepRecords), ``/health`` (no key, no
counters), ``/metrics`` (Prometheus, vLLM's names), ``/docs`` and ``/openapi.json``.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid

from starlette.requests import (
    Request,  # module level: FastAPI resolves string annotations here
)

from minillm.core.step_record import PHASES
from minillm.core.trace import Trace, now_ns
from minillm.serving.config import ServerConfig
from minillm.serving.engine_loop import Closed
from minillm.serving.errors import GatewayError, parse_json_body
from minillm.serving.gateway import AdmittedRequest
from minillm.serving.protocol import (
    ChatCompletionBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    error_responses,
    request_body,
)
from minillm.serving.responses import (
    BodyTooLarge,
    Job,
    closed_error,
    engine_error,
    error_response,
    limit_param,
    read_body,
    response_classes,
    wait_disconnect,
)
from minillm.serving.state import ServingState

log = logging.getLogger(__name__)
MAX_STEPS_LIMIT = 10_000       # StepRecords one GET /v1/steps returns at most (a larger limit is capped)
MAX_TRACES_PAGE = 1_000        # traces one GET /v1/traces returns at most (then ?after= the cursor)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")   # what we accept from X-Request-Id


class ReceivedStamp:
    """Pure ASGI middleware: stamp the moment a request reaches the app (its headers parsed,
    its body not yet read). The handler's own start can be much later under load (the loop is
    busy with other streams), and clients start their clock before that: this is as early as
    the app can know (chapter 10.1; the README says what still lies before it)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["received_ns"] = now_ns()
        await self.app(scope, receive, send)


def _is_json(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == "application/json"


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
    TracedJSONResponse, SSEResponse = response_classes()

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

    app = FastAPI(title="minillm", version="0.1.0", lifespan=lifespan, redoc_url=None,
                  redirect_slashes=False)   # a redirect would echo the request's (spoofable) Host
    app.add_middleware(ReceivedStamp)
    app.state.minillm = state
    app.state.server = state          # the name of an earlier draft

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, e: GatewayError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        # keep Starlette's headers: a 405 carries `Allow` (RFC 9110)
        return error_response(GatewayError(e.status_code, code, str(e.detail), headers=dict(e.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error_response(GatewayError(400, "invalid_request", str(e)))

    def internal_error(request: Request, e: Exception) -> GatewayError:
        """A bug, not the client's doing: logged in full, answered without internals."""
        log.exception("unhandled error on %s", request.url.path, exc_info=e)
        return GatewayError(500, "internal_error", f"Internal server error ({type(e).__name__}).")

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        return error_response(internal_error(request, e))

    @app.get("/health", responses={503: {"description": "draining (shutting down) or stopped",
                                         "content": {"application/json": {"schema": {
                                             "type": "object",
                                             "properties": {"status": {"type": "string"}}}}}}})
    async def health():
        """Alive, draining (shutting down: a load balancer should stop sending) or stopped: no key,
        and nothing about the load (that is /metrics' job)."""
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        ok = state.loop.alive
        return JSONResponse({"status": "ok" if ok else "stopped"}, status_code=200 if ok else 503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request):
        body, content_type = await asyncio.to_thread(state.render_metrics)
        return Response(body, media_type=content_type)

    def model_card() -> dict:
        # vLLM's fields: `root` (the weights it serves) and `parent` (None: not a LoRA adapter)
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "minillm",
                "root": str(state.config.engine.model), "parent": None,
                "max_model_len": state.engine.max_model_len}

    @app.get("/v1/server-info", responses=error_responses(401))
    async def server_info(request: Request):
        """The model, precision, hardware, parallel configuration, prefix caching and engine
        options: what `bench-serve`'s report fills in by itself (chapter 10.6)."""
        state.auth.check(request.headers.get("authorization"))
        return await asyncio.to_thread(state.server_info)

    @app.get("/v1/models", responses=error_responses(401))
    async def models(request: Request):
        state.auth.check(request.headers.get("authorization"))
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", responses=error_responses(401, 404))
    async def model(model_id: str, request: Request):
        state.auth.check(request.headers.get("authorization"))
        if model_id != state.model_name:
            raise GatewayError(404, "model_not_found", f"The model '{model_id[:100]}' does not exist.",
                               param="model")
        return model_card()

    async def json_body(request: Request) -> dict:
        """The body of a small JSON endpoint (tokenize, detokenize): bounded, JSON, an object."""
        if not _is_json(request.headers.get("content-type")):
            raise GatewayError(415, "unsupported_media_type", "The request body must be JSON "
                               "(Content-Type: application/json).")
        try:
            raw = await read_body(request, state.config.max_body_bytes)
        except BodyTooLarge as e:
            raise GatewayError(413, "request_too_large", f"The request body has {e.size} bytes; this "
                               f"server accepts at most {e.limit} bytes.") from None
        body = parse_json_body(raw)
        if not isinstance(body, dict):
            raise GatewayError(400, "invalid_request", "The request body must be a JSON object.")
        return body

    @app.post("/tokenize", openapi_extra=request_body(TokenizeBody),
              responses=error_responses(400, 401, 404, 413, 415))
    async def tokenize(request: Request):
        """vLLM's /tokenize: ``{"prompt": ...}`` or ``{"messages": [...]}`` → ``{"count", "max_model_len",
        "tokens"}``. The same tokenizer and chat template as a completion."""
        state.auth.check(request.headers.get("authorization"))
        body = await json_body(request)
        return await asyncio.to_thread(state.tokenize_body, body)

    detokenize_body = request_body(DetokenizeBody)    # token ids: this model's vocabulary, stated
    detokenize_body["requestBody"]["content"]["application/json"]["schema"]["properties"]["tokens"]["items"].update(
        minimum=0, maximum=state.engine.config.vocab_size - 1)

    @app.post("/detokenize", openapi_extra=detokenize_body,
              responses=error_responses(400, 401, 404, 413, 415))
    async def detokenize(request: Request):
        """vLLM's /detokenize: ``{"tokens": [ids]}`` → ``{"prompt": text}``."""
        state.auth.check(request.headers.get("authorization"))
        body = await json_body(request)
        return await asyncio.to_thread(state.detokenize_body, body)

    @app.get("/v1/traces", responses=error_responses(400, 401))
    async def traces(request: Request):
        """The caller's own traces (every caller's for the admin key), oldest first, in pages:
        ``?limit=N`` (at most MAX_TRACES_PAGE), ``?after=<next from the previous page>``,
        ``?request_id=a&request_id=b`` (or ``a,b``)."""
        key_id = state.auth.check(request.headers.get("authorization"))
        ids = [i for v in request.query_params.getlist("request_id") for i in v.split(",") if i]
        limit = limit_param(request, cap=MAX_TRACES_PAGE)
        after = limit_param(request, name="after") or 0
        # Off the event loop: serializing a thousand traces would stall every stream.
        return await asyncio.to_thread(state.traces_page, key_id, ids or None, after,
                                       MAX_TRACES_PAGE if limit is None else limit)

    @app.get("/v1/steps", responses=error_responses(400, 401, 403))
    async def steps(request: Request):
        """The engine's recent steps (StepRecords, oldest first): ``?limit=N`` (at most
        MAX_STEPS_LIMIT). Each has its phases' end timestamps and its prefill/decode tokens.
        Engine-wide: the admin key, or any key on a server without an admin key."""
        key_id = state.auth.check(request.headers.get("authorization"))
        if not state.may_read_steps(key_id):
            raise GatewayError(403, "permission_denied", "The engine's step records need the admin key.")
        limit = limit_param(request, cap=MAX_STEPS_LIMIT)
        # Off the event loop: thousands of records to turn into dicts would stall every stream.
        records = await asyncio.to_thread(state.steps, MAX_STEPS_LIMIT if limit is None else limit)
        return {"object": "list", "phases": list(PHASES), "data": records}

    def client_request_id(request: Request) -> str | None:
        """The client's X-Request-Id when it is well-formed (so its records join the server's
        traces), else None."""
        theirs = request.headers.get("x-request-id")
        return theirs if theirs is not None and _REQUEST_ID.match(theirs) else None

    async def handle(request: Request, chat: bool):
        theirs = client_request_id(request)
        ours = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        trace = Trace(theirs or ours)
        trace.record("received", t_ns=request.state.received_ns, path=request.url.path)
        authorization = request.headers.get("authorization")
        admitted: AdmittedRequest | None = None
        key_id, visible, claimed = None, theirs or ours, False
        try:
            # On the loop, microseconds: who is it, and within its request rate? Nothing else is
            # done for a stranger, or for a caller over its rate (not even reading its 1 MiB body).
            key_id = state.gateway.authenticate(authorization, trace)
            if theirs is not None:     # scoped to the key: another key's ids are neither seen nor probed
                trace.request_id, visible = state.claim_request_id(key_id, theirs)
                claimed = True
            if not _is_json(request.headers.get("content-type")):
                state.gateway.refund_request(key_id)     # refused: it must not use up the caller's rate
                raise GatewayError(415, "unsupported_media_type", "The request body must be JSON "
                                   "(Content-Type: application/json).")
            try:
                raw = await read_body(request, state.config.max_body_bytes)
            except ClientDisconnect:        # gone while sending the body: nobody to answer
                trace.record("rejected", status=499, code="client_disconnected")
                state.gateway.refund_request(key_id)
                if claimed:
                    state.release_request_id(key_id, trace.request_id, visible)
                state.remember(trace, visible)
                return Response(status_code=499)
            except BodyTooLarge as e:
                state.gateway.refund_request(key_id)
                raise GatewayError(413, "request_too_large",
                                   f"The request body has {e.size} bytes; this server accepts at most "
                                   f"{e.limit} bytes (max_body_bytes).") from None
            # Off the loop: parse, validate, tokenize (once), check the context and the token
            # quota, take a place in the queue, build the sequence.
            admitted, seq = await asyncio.to_thread(state.admit, key_id, raw, chat, trace)
            stream = state.loop.submit(seq, every_output=admitted.request.stream)
        except Exception as exc:
            e = exc if isinstance(exc, GatewayError) else internal_error(request, exc)
            # whatever the error, nothing stays held: the queue place, the client's request id
            if admitted is not None:
                state.gateway.release(admitted)
            if trace.last("rejected") is None:
                trace.record("rejected", status=e.status, code=e.code)
            if claimed:
                state.release_request_id(key_id, trace.request_id, visible)
            state.remember(trace, visible)
            return error_response(e, visible)

        job = Job(state, trace, admitted, stream, chat, int(time.time()), client_id=visible, key_id=key_id)
        if admitted.request.stream:
            return SSEResponse(job)
        return await complete(job, request)

    async def complete(job: Job, request: Request):
        """Not streamed: wait for the final output — or for the client to give up."""
        gone = asyncio.ensure_future(wait_disconnect(request.receive))
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
        if isinstance(item, Closed):
            job.close("error")
            return error_response(closed_error(item, headers={"Retry-After": "1"}), job.visible_id)
        if item.finish_reason == "error":
            job.close("error")
            return error_response(engine_error(job), job.visible_id)
        return TracedJSONResponse(job, job.final_body())

    # the 200 of a completion is JSON, or server-sent events with `stream: true`
    completion_errors = error_responses(400, 401, 404, 413, 415, 429, 500, 503)
    # one server-sent event: `data` is a JSON chunk (or an error object), the last one "[DONE]"
    SSE_EVENT_SCHEMA = {"type": "object", "required": ["data"],
                        "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
    streamed = {**completion_errors,
                200: {"content": {"application/json": {}, "text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
 "description": "a completion (JSON), or with `stream: true` its chunks (server-sent "
                "events)"}}

    @app.post("/v1/completions", openapi_extra=request_body(CompletionBody, neutral_only=True),
              responses=streamed)
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionBody, neutral_only=True),
              responses=streamed)
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app
