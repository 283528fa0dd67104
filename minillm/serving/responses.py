"""HTTP bodies in and out: reading a bounded body, OpenAI's response shapes (completion, chat,
chunks, usage), the SSE stream of one request and the response classes that stamp ``sent``."""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

from minillm.core.trace import Trace
from minillm.serving.engine_loop import Closed, Stream
from minillm.serving.errors import GatewayError
from minillm.serving.gateway import AdmittedRequest

if TYPE_CHECKING:
    from minillm.serving.state import ServingState

log = logging.getLogger(__name__)
_DRAIN_FACTOR = 8              # read on (and drop) up to 8× the limit, so the client reads our 413

# ---------------------------------------------------------------------------------------------
# HTTP helpers
# ---------------------------------------------------------------------------------------------

def error_response(e: GatewayError, request_id: str | None = None):
    from fastapi.responses import JSONResponse
    headers = dict(e.headers)
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(e.to_openai_error(), status_code=e.status, headers=headers)


class BodyTooLarge(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(size, limit)
        self.size, self.limit = size, limit


async def read_body(request, limit: int) -> bytes:
    """The body, at most ``limit`` bytes. A larger one is read on (up to a hard cap) and dropped,
    so that the client, which may still be writing, reads our 413 rather than a reset socket."""
    declared = request.headers.get("content-length", "")
    declared_n = int(declared) if declared.isdigit() else 0
    too_large = declared_n > limit
    chunks: list[bytes] = []
    size = 0
    if declared_n > _DRAIN_FACTOR * limit:        # not worth reading at all
        raise BodyTooLarge(declared_n, limit)
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
        raise BodyTooLarge(max(size, declared_n), limit)
    return b"".join(chunks)


async def wait_disconnect(receive) -> None:
    """Return when the client has gone (or the response is complete): after the body, the
    server's next ASGI message is ``http.disconnect``."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


def limit_param(request, cap: int | None = None, name: str = "limit") -> int | None:
    """``?limit=N`` (or ``?<name>=N``): a non-negative integer (None when absent), at most
    ``cap``; else 400."""
    limit = request.query_params.get(name)
    if limit is None:
        return None
    if not (limit.isascii() and limit.isdigit()):       # "²".isdigit() is True; int("²") fails
        raise GatewayError(400, "invalid_request",
                           f"'{name}' must be a non-negative integer, got {limit!r}."[:300],
                           param=name)
    digits = limit.lstrip("0") or "0"
    n = int(digits) if len(digits) <= 18 else 10 ** 18   # int() refuses over 4300 digits: a 500
    return n if cap is None else min(n, cap)


def sse_line(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object. ``cached_tokens``: prompt tokens whose K/V came from the prefix
    cache (whole 16-token blocks) instead of being computed: the hit, as a number."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class Job:
    """One admitted request on the HTTP side. ``close`` runs once, whatever path ends it."""
    state: ServingState
    trace: Trace
    admitted: AdmittedRequest
    stream: Stream
    chat: bool
    created: int
    done: bool = False             # the engine has let it go (finished, failed): nothing to abort
    closed: bool = False
    n_sent: int = 0
    pending_logprobs: list = field(default_factory=list)   # tokens not yet on a chunk (empty deltas)
    n_tokens: int = 0              # output tokens streamed so far (continuous_usage_stats)
    n_logprob_chars: int = 0       # chars of the token strings on chunks so far (text_offset)
    client_id: str = ""            # the id the caller knows (its X-Request-Id, else ours): bodies, headers
    key_id: str | None = None

    @property
    def request_id(self) -> str:
        """The engine's id (abort, the trace); the caller sees :attr:`visible_id`."""
        return self.trace.request_id

    @property
    def visible_id(self) -> str:
        return self.client_id or self.trace.request_id

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
            self.state.release_request_id(self.key_id, self.request_id, self.visible_id)
            self.state.remember(self.trace, self.visible_id)

        if self.done:
            finish()
        else:
            # The engine thread frees the KV slot and records the engine's `finished` (abort);
            # only then is the trace ended and stored, so a stored trace never changes again.
            self.state.loop.abort(self.request_id, then=finish)

    # -- bodies --------------------------------------------------------------------------
    def logprobs_body(self, entries: list, offset: int = 0) -> dict[str, Any] | None:
        """OpenAI's logprobs object for ``entries`` (``TokenLogprobs``), or None when the request
        did not ask. Completions: the legacy parallel lists; chat: one object per token. Token
        strings are each id decoded alone (as vLLM does); ids the tokenizer lacks: <unk:ID>.
        ``offset``: the completion's chars before these entries (a stream's earlier chunks), as
        ``text_offset`` counts from the start of the completion, not of the chunk."""
        if self.admitted.sampling_kwargs().get("logprobs") is None:
            return None
        tok = self.state.tokenizer
        known = len(tok)

        def text(i: int) -> str:
            return tok.decode([i]) if i < known else f"<unk:{i}>"
        if self.chat:
            return {"content": [{"token": text(e.token_id), "logprob": e.logprob,
                                 "bytes": list(text(e.token_id).encode()),
                                 "top_logprobs": [{"token": text(i), "logprob": lp,
                                                   "bytes": list(text(i).encode())}
                                                  for i, lp in e.top]} for e in entries]}
        tokens = [text(e.token_id) for e in entries]
        offsets = list(itertools.accumulate(map(len, tokens[:-1]), initial=offset))[:len(tokens)]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{text(i): lp for i, lp in e.top} for e in entries], "text_offset": offsets}

    def take_logprobs(self) -> dict[str, Any] | None:
        entries, self.pending_logprobs = self.pending_logprobs, []
        if not entries:
            return None
        body = self.logprobs_body(entries, self.n_logprob_chars)
        if body is not None and "tokens" in body:
            self.n_logprob_chars += sum(map(len, body["tokens"]))
        return body

    def chunk(self, delta: str, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        lp = self.take_logprobs()
        if self.chat:
            # the role rides on the first chunk that carries a token (vLLM's chat client takes TTFT
            # at the first chunk with choices: a role-only chunk sent before prefill would fake it)
            d: dict[str, Any] = ({"role": "assistant", "content": delta} if role
                                 else ({"content": delta} if delta else {}))
            choice = {"index": 0, "delta": d, "logprobs": lp, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta, "logprobs": lp, "finish_reason": finish_reason}
            obj = "text_completion"
        return {"id": self.visible_id, "object": obj, "created": self.created,
                "model": self.admitted.request.model, "choices": [choice]}

    def usage(self) -> dict[str, Any]:
        # read once the engine has let the request go: nothing writes these any more
        seq = self.seq
        return usage_body(self.admitted.prompt_tokens, len(seq.output_ids), seq.num_cached_tokens)

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.visible_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.admitted.request.model, "choices": [],
                "usage": self.usage()}

    def final_body(self) -> dict[str, Any]:
        seq = self.seq
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": seq.text},
                      "logprobs": self.logprobs_body(seq.logprobs), "finish_reason": seq.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": seq.text, "logprobs": self.logprobs_body(seq.logprobs),
                      "finish_reason": seq.finish_reason}
            obj = "text_completion"
        return {"id": self.visible_id, "object": obj, "created": self.created,
                "model": self.admitted.request.model, "choices": [choice],
                "usage": self.usage()}


def engine_error(job: Job) -> GatewayError:
    return GatewayError(500, "engine_error", f"The engine failed on this request: {job.seq.error}")


def closed_error(item: Closed, headers: dict[str, str] | None = None) -> GatewayError:
    """Why the engine let a request go unfinished: the server is shutting down (retry elsewhere or
    later: a 503), or the engine failed (a 500, as a failed batch gives)."""
    if item.shutting_down:
        return GatewayError(503, "server_shutting_down", item.message, headers=headers)
    return GatewayError(500, "engine_error", item.message)


async def sse_body(job: Job) -> AsyncIterator[str]:
    """The event stream of one request. Each ``sent`` is recorded when the generator is resumed,
    which Starlette does only after the previous chunk was handed to the socket."""
    queue = job.stream.queue
    reason = "disconnected"         # unless we reach the end
    try:
        first = True
        while True:
            item = await queue.get()
            if isinstance(item, Closed):
                job.done, reason = True, "error"
                yield sse_line(closed_error(item).to_openai_error())
                break
            if item.finished:
                job.done = True
            if item.finish_reason == "error":
                reason = "error"
                yield sse_line(engine_error(job).to_openai_error())
                break
            if getattr(item, "logprobs", None) is not None:
                job.pending_logprobs.append(item.logprobs)
            if getattr(item, "token_id", None) is not None:
                job.n_tokens += 1
            if item.delta or item.finished:
                chunk = job.chunk(item.delta, item.finish_reason if item.finished else None, role=first)
                if job.admitted.request.continuous_usage:      # vLLM's: the counts so far, on every chunk
                    p_tok = job.admitted.prompt_tokens
                    chunk["usage"] = {"prompt_tokens": p_tok, "completion_tokens": job.n_tokens,
                                      "total_tokens": p_tok + job.n_tokens}
                yield sse_line(chunk)
                job.sent(len(item.delta))
                first = False
            if item.finished:
                reason = item.finish_reason
                if job.admitted.request.include_usage:
                    yield sse_line(job.usage_chunk())
                    job.sent(0)
                break
        yield "data: [DONE]\n\n"
        job.sent(0)
    finally:
        job.close(reason)


def response_classes():
    from fastapi.responses import JSONResponse, StreamingResponse

    class TracedJSONResponse(JSONResponse):
        """A complete (non-streamed) body whose `sent` is stamped once it is on the socket."""

        def __init__(self, job: Job, content: Any) -> None:
            self.job = job
            super().__init__(content, headers={"x-request-id": job.visible_id})

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

        def __init__(self, job: Job) -> None:
            self.job = job
            super().__init__(sse_body(job), media_type="text/event-stream",
                             headers={"x-request-id": job.visible_id, "cache-control": "no-cache"})

        async def __call__(self, scope, receive, send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                with contextlib.suppress(BaseException):
                    await self.body_iterator.aclose()
                self.job.close("disconnected")      # a no-op when the generator closed it

    return TracedJSONResponse, SSEResponse
