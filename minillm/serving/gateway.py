"""The gateway: the first stage on a request's path (chapter 10.1, design.md §1).

Before a request costs the engine anything, the gateway decides whether it may enter at all:

    received → authenticate → parse & validate → model? → count tokens & context fits?
             → rate limit (requests/s, tokens/min) → admission (bounded queue) → admitted

Each check is cheap and ordered from cheapest to dearest, so a bad request is turned away before
it costs anything expensive: nobody tokenizes a prompt for a caller without a valid key, and
nobody takes a place in the queue with a prompt that does not fit the context window.
Every rejection is a :class:`GatewayError` carrying the HTTP status, an OpenAI-style error code and
a message that names the limit that was hit, so a client can tell "fix your request" (4xx) from
"come back later" (429/503 with ``Retry-After``).

This module is pure logic: no HTTP framework, no dependencies. Its one engine import (lazy) is
``SamplingParams``'s validation: sampling values are validated in that one place, so the gateway
and the engine cannot disagree on what is valid. The server
(``minillm.serving.server``) turns HTTP into calls to :meth:`Gateway.admit` and errors into JSON.
State shared between request threads (rate-limit buckets, queue depth) is guarded by locks,
and every time-dependent part takes an injectable ``clock`` so tests can move time by hand.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from minillm.core.trace import Trace
from minillm.serving.admission import AdmissionControl
from minillm.serving.auth import APIKeyAuth
from minillm.serving.errors import GatewayError
from minillm.serving.rate_limit import RateLimiter
from minillm.serving.validation import (
    CompletionRequest,
    check_context,
    check_model,
    default_max_tokens,
    is_int,
    parse_completion_body,
)

# ---------------------------------------------------------------------------------------------
# The gateway: all checks, in order, with trace events
# ---------------------------------------------------------------------------------------------

@dataclass
class AdmittedRequest:
    """A request that passed the gateway. ``request.model`` is resolved to a served model;
    ``max_tokens`` is the effective limit (the client's, or the default that fits);
    ``prompt_ids`` the tokens counted here, which the engine takes as they are (one tokenizer pass)."""
    request: CompletionRequest
    key_id: str
    prompt_tokens: int
    max_tokens: int
    prompt_ids: list[int] | None = None
    released: bool = False

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``minillm.SamplingParams`` (kept as a dict: no engine import)."""
        r = self.request
        return dict(max_tokens=self.max_tokens, temperature=r.temperature, top_p=r.top_p,
                    top_k=r.top_k, seed=r.seed, stop=list(r.stop), ignore_eos=r.ignore_eos,
                    include_stop_str_in_output=r.include_stop_str_in_output, **r.extra_sampling)


class Gateway:
    """Runs every gateway check on one request, in order, recording trace events.

    ``tokenize`` turns a request into its prompt's token ids (the server passes the tokenizer,
    with the chat template for chats). ``limiter`` and ``admission`` may be ``None`` to switch
    those stages off; ``auth`` ``None`` means open access.

    Two phases, so the server can keep its event loop free (10.1): :meth:`authenticate` (the key
    and the request rate: microseconds, on the loop, before anything costly is done for a
    stranger or for a caller over its rate), then :meth:`admit_body` (parse, tokenize, context,
    token charge, admission: off the loop). :meth:`admit` runs both.
    """

    def __init__(self, auth: APIKeyAuth | None, limiter: RateLimiter | None,
                 admission: AdmissionControl | None, served_models: Iterable[str],
                 max_model_len: int, tokenize: Callable[[CompletionRequest], list[int]],
                 *, max_tokens_cap: int = 256) -> None:
        self.served_models = list(served_models)
        if not self.served_models:
            raise ValueError("served_models must name at least one model")
        if not is_int(max_model_len) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        self.auth = auth if auth is not None else APIKeyAuth(None)
        self.limiter = limiter
        self.admission = admission
        self.max_model_len = max_model_len
        self.tokenize = tokenize
        self.max_tokens_cap = max_tokens_cap
        self._lock = threading.Lock()

    def admit(self, authorization: str | None, body: Any, *, chat: bool,
              trace: Trace | None = None) -> AdmittedRequest:
        """Admit one request or raise :class:`GatewayError` (after recording ``rejected``).

        The caller must call :meth:`release` when the admitted request finishes, whatever the
        outcome (use ``try/finally``), or the queue slot is lost.
        """
        key_id = self.authenticate(authorization, trace)
        return self.admit_body(key_id, body, chat=chat, trace=trace)

    def authenticate(self, authorization: str | None, trace: Trace | None = None) -> str:
        """Who is calling, and are they within their request rate? Cheapest checks first:
        nothing else runs for strangers or for callers over their rate."""
        if trace is not None and trace.first("received") is None:
            trace.record("received")
        try:
            key_id = self.auth.check(authorization)
            if trace is not None:
                trace.record("authenticated", key_id=key_id)
            if self.limiter is not None:
                self.limiter.take_request(key_id)
            return key_id
        except GatewayError as e:
            if trace is not None:
                trace.record("rejected", status=e.status, code=e.code)
            raise

    def undo(self, admitted: AdmittedRequest) -> None:
        """An admitted request that could not start after all (the engine refused it): free its
        queue place and give back everything it was charged."""
        self.release(admitted)
        if self.limiter is not None:
            self.limiter.refund(admitted.key_id, admitted.prompt_tokens + admitted.max_tokens)

    def refund_request(self, key_id: str) -> None:
        """Give back the request :meth:`authenticate` charged (the client left before its body)."""
        if self.limiter is not None:
            self.limiter.refund(key_id, 0)

    def admit_body(self, key_id: str, body: Any, *, chat: bool,
                   trace: Trace | None = None) -> AdmittedRequest:
        """The rest, for a caller :meth:`authenticate` let in (its request is charged)."""
        try:
            return self._admit_body(key_id, body, chat, trace)
        except GatewayError as e:
            if self.limiter is not None and e.code not in ("rate_limited", "request_too_large", "queue_full"):
                self.limiter.refund(key_id, 0)       # turned away: the request must not use up quota
                # (those three have given back what they charged already)
            if trace is not None:
                trace.record("rejected", status=e.status, code=e.code)
            raise

    def _admit_body(self, key_id: str, body: Any, chat: bool, trace: Trace | None) -> AdmittedRequest:
        # 1. Is the body well-formed, and for a model we serve?
        request = parse_completion_body(body, chat=chat)
        request = replace(request, model=check_model(request.model, self.served_models))
        # 2. Does it fit the context? Needs the prompt length, hence the one tokenizer pass.
        ids = list(self.tokenize(request))
        prompt_tokens = len(ids)
        if trace is not None:
            trace.record("tokenized", n_tokens=prompt_tokens)
        max_tokens = self._effective_max_tokens(request, prompt_tokens)
        # 3. Is this caller within its token quota? Charged on the worst case: prompt + max_tokens.
        cost = prompt_tokens + max_tokens
        if self.limiter is not None:
            self.limiter.take_tokens(key_id, cost)
        # 4. Is there room in the queue? Last, so a slot is only held by a request that will run.
        if self.admission is not None:
            try:
                self.admission.acquire()
            except GatewayError:
                if self.limiter is not None:
                    self.limiter.refund(key_id, cost)   # turned away: it must not use up quota
                raise
        if trace is not None:
            trace.record("admitted", prompt_tokens=prompt_tokens, max_tokens=max_tokens)
        return AdmittedRequest(request, key_id, prompt_tokens, max_tokens, ids)

    def _effective_max_tokens(self, request: CompletionRequest, prompt_tokens: int) -> int:
        """The client's max_tokens (checked against the context), or a default: what is left of
        the context, at most ``max_tokens_cap``, and — under a tokens-per-minute limit — at most
        what a whole minute's quota leaves after the prompt, so a request that did not ask for a
        length is never refused for a default it did not choose (a ``min_tokens`` it did ask for
        raises the cap to it, within the context)."""
        prompt_param = "messages" if request.chat else "prompt"
        if request.max_tokens is not None:
            check_context(prompt_tokens, request.max_tokens, self.max_model_len, prompt_param)
            return request.max_tokens
        wanted = int(request.extra_sampling.get("min_tokens") or 0)
        n = default_max_tokens(prompt_tokens, self.max_model_len, max(self.max_tokens_cap, wanted),
                               prompt_param)
        if self.limiter is not None and self.limiter.tokens_per_min is not None:
            n = max(1, min(n, int(self.limiter.tokens_per_min) - prompt_tokens))
        if wanted > n:
            raise GatewayError(400, "context_length_exceeded",
                               f"min_tokens={wanted} does not fit: with {prompt_tokens} prompt tokens, this "
                               f"model's context of {self.max_model_len} tokens (and the token quota) leaves "
                               f"room for {n}.", param="min_tokens")
        return n

    def release(self, admitted: AdmittedRequest) -> None:
        """Free the queue slot of a finished request. Calling it twice for one request is a
        no-op, so it is safe in every ``finally`` and error path."""
        with self._lock:
            if admitted.released:
                return
            admitted.released = True
        if self.admission is not None:
            self.admission.release()

    def __repr__(self) -> str:
        return (f"Gateway(auth={self.auth!r}, "
                f"limiter={'on' if self.limiter and self.limiter.enabled else 'off'}, "
                f"admission={self.admission!r}, models={self.served_models}, "
                f"max_model_len={self.max_model_len})")
