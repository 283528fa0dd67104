"""The FastAPI app: routes over a :class:`ServingState`."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

from starlette.requests import Request   # module level: FastAPI resolves string annotations here

from minillm.engine.step_record import PHASES
from minillm.measure.trace import Trace
from minillm.serving.config import ServerConfig
from minillm.serving.engine_loop import Closed
from minillm.serving.gateway import AdmittedRequest, GatewayError
from minillm.serving.responses import (
    BodyTooLarge,
    Job,
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

    app = FastAPI(title="minillm", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.minillm = state
    app.state.server = state          # the name of an earlier draft

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, e: GatewayError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return error_response(GatewayError(e.status_code, code, str(e.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error_response(GatewayError(400, "invalid_request", str(e)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(GatewayError(500, "internal_error", f"Internal server error ({type(e).__name__})."))

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
        found = state.traces(ids or None, limit_param(request))
        return {"object": "list",
                "data": [{"request_id": t.request_id, "events": [e.as_dict() for e in t.events]} for t in found]}

    @app.get("/v1/steps")
    async def steps(request: Request):
        """The engine's recent steps (StepRecords, oldest first): ``?limit=N`` (at most
        MAX_STEPS_LIMIT). Each has its phases' end timestamps and its prefill/decode tokens."""
        state.auth.check(request.headers.get("authorization"))
        limit = limit_param(request, cap=MAX_STEPS_LIMIT)
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
                body = json.loads(await read_body(request, state.config.max_body_bytes))
            except ClientDisconnect:        # gone while sending the body: nobody to answer
                trace.record("rejected", status=499, code="client_disconnected")
                state.remember(trace)
                return Response(status_code=499)
            except (BodyTooLarge, ValueError, RecursionError) as e:
                # Auth first even here: a stranger learns nothing, not even that the body was bad.
                trace.record("authenticated", key_id=state.auth.check(authorization))
                if isinstance(e, BodyTooLarge):
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
            return error_response(e, rid)

        job = Job(state, trace, admitted, stream, chat, int(time.time()))
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
            return error_response(GatewayError(503, "server_shutting_down", item.message,
                                                headers={"Retry-After": "1"}), job.request_id)
        if item.finish_reason == "error":
            job.close("error")
            return error_response(engine_error(job), job.request_id)
        return TracedJSONResponse(job, job.final_body())

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app
