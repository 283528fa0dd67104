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

import hashlib
import hmac
import math
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

from minillm.core.trace import Trace

Clock = Callable[[], float]


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def _default_error_type(status: int) -> str:
    # The "type" field of OpenAI's error JSON. 429 and 5xx get their own types so that a client
    # can decide to retry from the body alone; every other 4xx means "the request is wrong".
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


class GatewayError(Exception):
    """A request turned away by the gateway.

    ``status`` is the HTTP status, ``code`` a stable machine-readable reason (``invalid_api_key``,
    ``rate_limited``, ``queue_full``, ``invalid_request``, ``context_length_exceeded``,
    ``model_not_found``, ``request_too_large``), ``param`` the offending request field if any,
    and ``headers`` extra response headers (``Retry-After`` for 429/503).
    """

    def __init__(self, status: int, code: str, message: str, *, param: str | None = None,
                 headers: Mapping[str, str] | None = None, type: str | None = None) -> None:
        message = message if len(message) <= 500 else message[:497] + "..."   # never echo a huge value back
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})
        self.type = type or _default_error_type(status)

    def to_openai_error(self) -> dict[str, Any]:
        """The JSON body OpenAI-compatible clients expect."""
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"GatewayError(status={self.status}, code={self.code!r}, message={self.message!r})"


def _invalid(param: str | None, message: str) -> GatewayError:
    return GatewayError(400, "invalid_request", message, param=param)


def _retry_after(seconds: float) -> dict[str, str]:
    # Retry-After is an integer number of seconds (RFC 9110). Round *up*, and never say 0:
    # a client told "retry in 0 s" would hammer us in a tight loop.
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


# ---------------------------------------------------------------------------------------------
# Authentication: API keys
# ---------------------------------------------------------------------------------------------

ANONYMOUS = "anonymous"
ADMIN = "admin"      # the admin key's id: it reads every caller's traces and the engine's steps


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _split_keys(values: Iterable[str]) -> list[str]:
    out: list[str] = []
    for value in values:
        for key in value.split(","):
            key = key.strip()
            if key and key not in out:
                out.append(key)
    return out


def keys_from_env_and_args(arg_keys: str | Iterable[str] | None = None,
                           env: Mapping[str, str] | None = None) -> list[str]:
    """API keys from ``--api-key`` arguments plus the ``MINILLM_API_KEY`` environment variable.

    Both may hold several comma-separated keys; blanks are dropped and duplicates removed, so an
    empty ``MINILLM_API_KEY=`` means "no key from the environment", not "the empty key".
    An environment variable is the better place for a secret: command lines are visible to every
    user of the machine in ``ps``.
    """
    env = os.environ if env is None else env
    if isinstance(arg_keys, str):
        arg_keys = [arg_keys]
    return _split_keys([*(arg_keys or []), env.get("MINILLM_API_KEY", "")])


class APIKeyAuth:
    """Bearer-token authentication against a fixed set of API keys.

    Only SHA-256 digests of the keys are kept, so neither ``repr`` nor a debugger nor a crash
    dump of this object shows a key. With no keys configured the gateway is open (a local
    notebook needs no key) and every caller is ``"anonymous"``.

    A caller is known by a *key id*: ``key-1``, ``key-2``, … in the order the keys were given,
    and ``admin`` for the optional admin key. The id says nothing about the key itself (an
    earlier version used a hash prefix, which let anyone who saw it test guesses offline).
    """

    def __init__(self, keys: Iterable[str] | None = None, admin_key: str | None = None) -> None:
        keys = list(keys or [])
        if any(not isinstance(k, str) or not k.strip() for k in keys) or (
                admin_key is not None and (not isinstance(admin_key, str) or not admin_key.strip())):
            # An empty key would make "Authorization: Bearer " valid: refuse to start instead.
            raise ValueError("API keys must be non-empty strings")
        self._entries: list[tuple[bytes, str]] = []   # (sha256 digest, key id)
        for i, k in enumerate(dict.fromkeys(k.strip() for k in keys), start=1):
            self._entries.append((_digest(k), f"key-{i}"))
        if admin_key is not None:
            if any(d == _digest(admin_key.strip()) for d, _ in self._entries):
                raise ValueError("the admin key must differ from every API key")
            self._entries.append((_digest(admin_key.strip()), ADMIN))

    @property
    def open(self) -> bool:
        """True when no keys are configured: every request is accepted as ``anonymous``."""
        return not self._entries

    @property
    def key_ids(self) -> list[str]:
        return [kid for _, kid in self._entries]

    @property
    def has_admin(self) -> bool:
        return ADMIN in self.key_ids

    def check(self, authorization_header: str | None) -> str:
        """Return the caller's key id, or raise 401.

        The header must be ``Bearer <key>``. The presented key is compared with *every*
        configured key using :func:`hmac.compare_digest` on SHA-256 digests, and the loop never
        exits early: the time taken then reveals neither how many leading characters matched
        (a plain ``==`` stops at the first difference), nor the key's length (digests all have
        32 bytes), nor which of the keys matched.
        """
        if self.open:
            return ANONYMOUS
        if not authorization_header or not authorization_header.strip():
            raise GatewayError(401, "invalid_api_key",
                               "Missing API key: send an 'Authorization: Bearer <key>' header.")
        # Never echo the header back: it may be a real key sent in the wrong format.
        parts = authorization_header.strip().split(None, 1)
        if len(parts) != 2 or parts[0].lower() != "bearer" or not parts[1].strip():
            raise GatewayError(401, "invalid_api_key",
                               "Malformed Authorization header: expected 'Bearer <key>'.")
        presented = _digest(parts[1].strip())
        matched: str | None = None
        for digest, key_id in self._entries:
            if hmac.compare_digest(digest, presented) and matched is None:
                matched = key_id
        if matched is None:
            raise GatewayError(401, "invalid_api_key", "Incorrect API key provided.")
        return matched

    def __repr__(self) -> str:
        if self.open:
            return "APIKeyAuth(open)"
        return f"APIKeyAuth({len(self._entries)} key(s): {', '.join(self.key_ids)})"


# ---------------------------------------------------------------------------------------------
# Rate limiting: token buckets
# ---------------------------------------------------------------------------------------------

# Float slack: after exactly 0.1 s at 10 tokens/s a bucket holds 0.99999999..., not 1.0.
_EPS = 1e-9


class TokenBucket:
    """A bucket that refills continuously at ``rate_per_s`` up to ``capacity``, starting full.

    ``capacity`` is the burst a caller may spend at once; ``rate_per_s`` the sustained rate.
    Taking ``n`` either succeeds at once or says how long until ``n`` would be there; it never
    blocks, because a server thread that sleeps for a rate limit holds a connection for nothing.
    A request larger than ``capacity`` can never pass, so :meth:`try_take` raises ``ValueError``
    for it instead of returning a wait that would be a lie.
    """

    def __init__(self, rate_per_s: float, capacity: float, clock: Clock = time.monotonic) -> None:
        if not rate_per_s > 0 or not capacity > 0:
            raise ValueError(f"rate_per_s and capacity must be positive, got {rate_per_s} and {capacity}")
        self.rate_per_s = float(rate_per_s)
        self.capacity = float(capacity)
        self._clock = clock
        self._tokens = self.capacity
        self._last = clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self._clock()
        elapsed = max(0.0, now - self._last)      # a clock going backwards must not drain us
        self._tokens = min(self.capacity, self._tokens + elapsed * self.rate_per_s)
        self._last = now

    def try_take(self, n: float = 1.0) -> float:
        """Take ``n`` tokens and return 0.0, or take nothing and return the seconds to wait."""
        if n < 0:
            raise ValueError(f"cannot take a negative number of tokens ({n})")
        if n > self.capacity:
            raise ValueError(f"{n:g} tokens can never fit a bucket of capacity {self.capacity:g}")
        with self._lock:
            self._refill()
            if self._tokens + _EPS >= n:
                self._tokens = max(0.0, self._tokens - n)
                return 0.0
            return max(0.0, (n - self._tokens) / self.rate_per_s)

    def refund(self, n: float) -> None:
        """Put back tokens taken for a request that was rejected later on."""
        with self._lock:
            self._refill()
            self._tokens = min(self.capacity, self._tokens + n)

    @property
    def available(self) -> float:
        with self._lock:
            self._refill()
            return self._tokens


@dataclass
class _Buckets:
    requests: TokenBucket | None
    tokens: TokenBucket | None


class RateLimiter:
    """Per-caller limits on requests per second and tokens per minute (either may be ``None``).

    Each key id gets its own pair of buckets, so one busy caller cannot use up another's quota.
    The request bucket holds ``burst`` requests (default: one second's worth, at least 1); the
    token bucket holds one minute's worth of tokens, refilled continuously (not reset each minute,
    which would let a caller spend two minutes' worth across a minute boundary).

    A request is charged ``prompt tokens + max_tokens`` when admitted: the worst case, because
    the output length is unknown until it has been generated (OpenAI estimates the same way).
    A request rejected anywhere is charged nothing (see :meth:`refund`).

    A request whose token cost exceeds a whole minute's capacity could never pass however long
    it waited, so it gets **400** ``request_too_large`` (no ``Retry-After``) rather than a 429:
    clients such as the ``openai`` SDK retry 429s automatically, and would retry this in vain.
    """

    def __init__(self, requests_per_s: float | None = None, tokens_per_min: float | None = None,
                 burst: float | None = None, clock: Clock = time.monotonic) -> None:
        for name, v in (("requests_per_s", requests_per_s), ("tokens_per_min", tokens_per_min), ("burst", burst)):
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be positive or None, got {v}")
        if burst is not None and burst < 1:
            raise ValueError(f"burst must be at least 1 request, got {burst}")
        self.requests_per_s = requests_per_s
        self.tokens_per_min = tokens_per_min
        self.burst = burst if burst is not None else (max(1.0, requests_per_s) if requests_per_s else None)
        self._clock = clock
        self._buckets: dict[str, _Buckets] = {}   # one entry per key id: bounded by the keys configured
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.requests_per_s is not None or self.tokens_per_min is not None

    def _buckets_for(self, key_id: str) -> _Buckets:
        b = self._buckets.get(key_id)
        if b is None:
            b = _Buckets(
                TokenBucket(self.requests_per_s, self.burst, self._clock) if self.requests_per_s else None,
                TokenBucket(self.tokens_per_min / 60.0, self.tokens_per_min, self._clock)
                if self.tokens_per_min else None)
            self._buckets[key_id] = b
        return b

    def take_request(self, key_id: str) -> None:
        """Charge one request, before anything costly (tokenizing) is done for it; also refuse
        at once a caller whose token bucket is empty. Raise 429 charging nothing."""
        with self._lock:
            b = self._buckets_for(key_id)
            if b.tokens is not None and b.tokens.available < 1:
                wait = b.tokens.try_take(1)
                raise GatewayError(
                    429, "rate_limited",
                    f"Rate limit reached: {self.tokens_per_min:g} tokens per minute are used up. "
                    f"Retry in {wait:.2f} s.", headers=_retry_after(wait))
            if b.requests is not None:
                wait = b.requests.try_take(1)
                if wait > 0:
                    raise GatewayError(
                        429, "rate_limited",
                        f"Rate limit reached: {self.requests_per_s:g} requests per second "
                        f"(burst {self.burst:g}). Retry in {wait:.2f} s.", headers=_retry_after(wait))

    def take_tokens(self, key_id: str, n_tokens: int) -> None:
        """Charge ``n_tokens`` (prompt + effective max_tokens) once the prompt is counted. On a
        429 the request charged by :meth:`take_request` is given back too."""
        if self.tokens_per_min is not None and n_tokens > self.tokens_per_min:
            self.refund(key_id, 0)
            raise GatewayError(
                400, "request_too_large",
                f"This request needs {n_tokens} tokens (prompt + max_tokens) but the rate limit is "
                f"{self.tokens_per_min:g} tokens per minute, so it can never be served; "
                f"reduce the prompt or max_tokens.", param="max_tokens")
        with self._lock:
            b = self._buckets_for(key_id)
            if b.tokens is not None:
                wait = b.tokens.try_take(n_tokens)
                if wait > 0:
                    if b.requests is not None:
                        b.requests.refund(1)      # a rejected request must not use up quota
                    raise GatewayError(
                        429, "rate_limited",
                        f"Rate limit reached: {self.tokens_per_min:g} tokens per minute; this request "
                        f"needs {n_tokens} tokens (prompt + max_tokens). Retry in {wait:.2f} s.",
                        headers=_retry_after(wait))

    def check(self, key_id: str, n_tokens: int) -> None:
        """Charge one request and ``n_tokens`` tokens to ``key_id``, or raise (charging nothing)."""
        if self.tokens_per_min is not None and n_tokens > self.tokens_per_min:
            raise GatewayError(
                400, "request_too_large",
                f"This request needs {n_tokens} tokens (prompt + max_tokens) but the rate limit is "
                f"{self.tokens_per_min:g} tokens per minute, so it can never be served; "
                f"reduce the prompt or max_tokens.", param="max_tokens")
        # One lock around both buckets: "take a request, then take tokens, else give the request
        # back" must look atomic to other threads of the same caller.
        with self._lock:
            b = self._buckets_for(key_id)
            if b.requests is not None:
                wait = b.requests.try_take(1)
                if wait > 0:
                    raise GatewayError(
                        429, "rate_limited",
                        f"Rate limit reached: {self.requests_per_s:g} requests per second "
                        f"(burst {self.burst:g}). Retry in {wait:.2f} s.", headers=_retry_after(wait))
            if b.tokens is not None:
                wait = b.tokens.try_take(n_tokens)
                if wait > 0:
                    if b.requests is not None:
                        b.requests.refund(1)      # a rejected request must not use up quota
                    raise GatewayError(
                        429, "rate_limited",
                        f"Rate limit reached: {self.tokens_per_min:g} tokens per minute; this request "
                        f"needs {n_tokens} tokens (prompt + max_tokens). Retry in {wait:.2f} s.",
                        headers=_retry_after(wait))

    def refund(self, key_id: str, n_tokens: int) -> None:
        """Give back what :meth:`check` charged, for a request rejected at a later stage."""
        with self._lock:
            b = self._buckets_for(key_id)
            if b.requests is not None:
                b.requests.refund(1)
            if b.tokens is not None:
                b.tokens.refund(n_tokens)


# ---------------------------------------------------------------------------------------------
# Validation: the request body
# ---------------------------------------------------------------------------------------------

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4                                         # OpenAI's limit on stop sequences

Message = dict[str, str]


@dataclass
class CompletionRequest:
    """A validated, normalised ``/v1/completions`` or ``/v1/chat/completions`` body.

    ``prompt`` is the text for a completion, or the list of ``{"role", "content"}`` messages for
    a chat (the server applies the chat template). ``max_tokens`` stays ``None`` when the client
    did not ask: the gateway picks a default that fits the context (:func:`default_max_tokens`).
    ``model`` ``None`` means "the served model".
    """
    prompt: str | list[Message]
    chat: bool = False
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                   # -1: off (vLLM's convention)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False       # stream_options.include_usage: a final chunk with token counts
    ignore_eos: bool = False          # benchmarks: generate exactly max_tokens (chapter 10.6)
    include_stop_str_in_output: bool = False   # vLLM's: keep the matched stop string in the text
    n: int = 1
    user: str | None = None
    extra_sampling: dict[str, Any] = field(default_factory=dict)   # logprobs, min_tokens: SamplingParams' names


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)      # True is an int in Python; not here


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _get_int(body: dict, name: str, *, minimum: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise _invalid(name, f"'{name}' must be an integer, got {type(v).__name__} {v!r}.")
    if minimum is not None and v < minimum:
        raise _invalid(name, f"'{name}' must be at least {minimum}, got {v}.")
    return v


def _get_bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _invalid(name, f"'{name}' must be a boolean, got {type(v).__name__} {v!r}.")
    return v


def _get_str(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise _invalid(name, f"'{name}' must be a string, got {type(v).__name__} {v!r}.")
    return v


def _parse_prompt(body: dict) -> str:
    p = body.get("prompt")
    if p is None or p == "":
        raise _invalid("prompt", "'prompt' is required and must be a non-empty string.")
    if isinstance(p, list):
        # The OpenAI API allows a batch of prompts (or token ids) in one request. minillm serves
        # one prompt per request so that one request has one trace and one set of metrics.
        if p and all(isinstance(x, str) for x in p):
            raise _invalid("prompt", f"Batched prompts are not supported: 'prompt' is a list of {len(p)} "
                                     "strings; send one request per prompt.")
        raise _invalid("prompt", "'prompt' must be a single string; lists (batches, token ids) are not supported.")
    if not isinstance(p, str):
        raise _invalid("prompt", f"'prompt' must be a string, got {type(p).__name__}.")
    return p


def _message_content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # The newer "content parts" form: [{"type": "text", "text": "..."}, ...]. Text only.
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _invalid(f"{param}[{j}]", "Only text content parts ({'type': 'text', 'text': ...}) are supported.")
            texts.append(part["text"])
        return "".join(texts)
    raise _invalid(param, f"'{param}' must be a string, got {type(content).__name__}.")


def _parse_messages(body: dict) -> list[Message]:
    msgs = body.get("messages")
    if msgs is None or msgs == []:
        raise _invalid("messages", "'messages' is required and must be a non-empty list.")
    if not isinstance(msgs, list):
        raise _invalid("messages", f"'messages' must be a list of messages, got {type(msgs).__name__}.")
    out: list[Message] = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _invalid(where, f"'{where}' must be an object with 'role' and 'content'.")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise _invalid(f"{where}.role", f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}; got {role!r}.")
        if "content" not in m or m["content"] is None:
            raise _invalid(f"{where}.content", f"'{where}.content' is required.")
        out.append({"role": role, "content": _message_content(m["content"], f"{where}.content")})
    return out


def _parse_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise _invalid("stop", f"'stop' must be a string or a list of strings, got {type(stop).__name__}.")
    if len(stop) > MAX_STOP:
        raise _invalid("stop", f"'stop' may hold at most {MAX_STOP} sequences, got {len(stop)}.")
    return list(stop)             # its strings are checked with the other sampling fields


def _undecodable_text(body: Any) -> str | None:
    """The path of the first string that is not valid Unicode text (JSON allows lone surrogate
    escapes such as "\\ud800", which no tokenizer can encode), or None. Iterative: a deeply
    nested body cannot blow the stack here."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                todo.append((f"{path}.{k}" if path else str(k), x))
                todo.append((path or "body", k))
        elif isinstance(v, list):
            todo.extend((f"{path}[{i}]", x) for i, x in enumerate(v))
    return None


# OpenAI fields this server does not implement, with the values that mean "not used". A body
# that sets one to anything else gets a 400 naming it: silently ignoring a penalty or a
# response_format would return something other than what the client asked for.
_UNSUPPORTED_UNLESS_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (False,), "best_of": (1,), "suffix": ("",),
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logit_bias": ({},), "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",),
    "functions": ([],), "function_call": ("none",), "parallel_tool_calls": (False,),
    "prompt_logprobs": (0,), "min_p": (0, 0.0), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "modalities": (["text"],), "audio": (), "prediction": (),
}


def _check_unsupported(body: dict) -> None:
    for name, neutral in _UNSUPPORTED_UNLESS_NEUTRAL.items():
        v = body.get(name)
        if v is not None and not any(v == n and type(v) is type(n) for n in neutral):
            raise _invalid(name, f"'{name}' is not supported by this server (got {v!r}); leave it out or "
                                 f"use its neutral value{'s' if len(neutral) > 1 else ''} "
                                 f"{', '.join(map(repr, neutral)) or 'null'}."[:300])


def parse_completion_body(body: Any, *, chat: bool) -> CompletionRequest:
    """Validate a decoded JSON body; raise 400 ``invalid_request`` naming the bad field.

    Unknown fields are ignored (clients send many optional OpenAI fields), but every field
    minillm does use is checked here, at the door, so the engine never sees a bad value and a
    client gets a 400 naming its mistake instead of a 500 from deep inside sampling. Sampling
    fields are checked by ``SamplingParams``'s own rules (see :func:`_parse_sampling`).
    """
    if not isinstance(body, dict):
        raise _invalid(None, f"The request body must be a JSON object, got {type(body).__name__}.")
    bad = _undecodable_text(body)
    if bad is not None:
        raise _invalid(bad, f"'{bad}' holds text that is not valid Unicode (a lone surrogate escape?).")
    _check_unsupported(body)

    prompt: str | list[Message] = _parse_messages(body) if chat else _parse_prompt(body)

    model = _get_str(body, "model")
    if model == "":
        raise _invalid("model", "'model' must be a non-empty string (or omitted).")

    sampling = _parse_sampling(body, chat)

    n = _get_int(body, "n")
    if n is not None and n != 1:
        raise _invalid("n", f"Only n=1 is supported (one completion per request), got n={n}.")

    stream = _get_bool(body, "stream")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise _invalid("stream_options", "'stream_options' is only allowed when 'stream' is true.")
        if not isinstance(opts, dict):
            raise _invalid("stream_options", "'stream_options' must be an object.")
        include_usage = _get_bool(opts, "include_usage")

    return CompletionRequest(prompt=prompt, chat=chat, model=model, stream=stream, include_usage=include_usage,
                             n=1, user=_get_str(body, "user"), extra_sampling=_parse_logprobs_min_tokens(body, chat),
                             **sampling)


def _parse_logprobs_min_tokens(body: dict, chat: bool) -> dict[str, Any]:
    """``logprobs`` (completions: an integer, the top-N alternatives; chat: a boolean, with
    ``top_logprobs`` the N) and ``min_tokens`` (vLLM's), as SamplingParams fields."""
    out: dict[str, Any] = {}
    if chat:
        want = _get_bool(body, "logprobs")
        top = body.get("top_logprobs")
        if top is not None and not want:
            raise _invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true.")
        if want:
            out["logprobs"] = 0 if top is None else top
            _check_sampling_field("top_logprobs", "logprobs", out["logprobs"])
    elif body.get("logprobs") is not None:
        out["logprobs"] = body["logprobs"]
        _check_sampling_field("logprobs", "logprobs", out["logprobs"])
    if body.get("min_tokens") is not None:   # against max_tokens: when SamplingParams is built
        out["min_tokens"] = _get_int(body, "min_tokens", minimum=0)
    return out


# Body fields that are SamplingParams fields of the same name and meaning (vLLM's extensions
# top_k, ignore_eos and include_stop_str_in_output included). ``stop`` and ``max_tokens`` are
# sampling fields too, with rules of the API's own first (a list of at most 4; an alias).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "ignore_eos", "include_stop_str_in_output")


def _parse_sampling(body: dict, chat: bool) -> dict[str, Any]:
    """The sampling fields of a body, validated by ``SamplingParams``'s one validation function
    (``minillm.engine.sampling.sampling_problems``), so that the gateway and the engine can never
    disagree on what is valid. A missing or null field takes SamplingParams's default, except
    ``max_tokens``, which stays None (the gateway picks a default that fits the context)."""
    max_tokens = None
    # The chat API renamed max_tokens to max_completion_tokens; the new name wins (as in vLLM).
    for key in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        if body.get(key) is not None:
            _check_sampling_field(key, "max_tokens", body[key])
            max_tokens = body[key]
    given = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
    for name, value in given.items():
        _check_sampling_field(name, name, value)
    stop = _parse_stop(body)
    _check_sampling_field("stop", "stop", stop)
    for name in ("temperature", "top_p"):
        if name in given:
            given[name] = float(given[name])          # JSON's 1 is the float 1.0 here
    return {**given, "stop": stop, "max_tokens": max_tokens}


def _check_sampling_field(key: str, name: str, value: Any) -> None:
    """400 naming body field ``key`` if SamplingParams rejects ``value`` for its field ``name``.

    One field at a time, on top of the defaults (all valid), so each problem belongs to the
    field that was set; the message is SamplingParams's own."""
    from minillm.engine.sampling import (  # lazy: it imports torch
        SamplingParams,
        sampling_problems,
    )
    probe = SamplingParams()              # the defaults, all valid...
    setattr(probe, name, value)           # ...with one field set, unchecked: the check is next
    problems = sampling_problems(probe)
    if problems:
        message = problems[0] if key == name else problems[0].replace(name, key, 1)
        raise _invalid(key, f"Invalid '{key}': {message}.")


def check_model(name: str | None, served: list[str]) -> str:
    """Return the model to use (``None`` means the first served model), or raise 404."""
    if name is None:
        return served[0]
    if name not in served:
        raise GatewayError(404, "model_not_found",
                           f"The model '{name[:100]}' does not exist. Available models: {', '.join(served)}.",
                           param="model")
    return name


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Raise 400 ``context_length_exceeded`` if prompt + output would not fit the KV cache
    positions the model has. Checked here, before queueing, because finding out after a long
    prefill would waste the prefill and the client's time."""
    total = prompt_tokens + max_tokens
    if total > max_model_len:
        raise GatewayError(
            400, "context_length_exceeded",
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_tokens} tokens and max_tokens asks for {max_tokens} more ({total} in total). "
            f"Reduce the prompt or max_tokens.", param="max_tokens")


def default_max_tokens(prompt_tokens: int, max_model_len: int, cap: int = 256) -> int:
    """``max_tokens`` for a request that did not set it: what is left of the context, at most ``cap``.

    (The OpenAI completions API defaults to 16; vLLM to "the rest of the context". A cap keeps
    one forgetful client from holding a batch slot for thousands of steps.)
    """
    room = max_model_len - prompt_tokens
    if room < 1:
        raise GatewayError(
            400, "context_length_exceeded",
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_tokens} tokens, which leaves no room for any output token. Reduce the prompt.")
    return min(cap, room)


# ---------------------------------------------------------------------------------------------
# Admission: a bounded queue
# ---------------------------------------------------------------------------------------------

class AdmissionControl:
    """Bounds the number of requests inside the server (waiting + running).

    Without a bound, a traffic spike grows the queue without limit: every queued request waits
    longer, TTFT explodes for all of them, and memory fills up. Rejecting early with 503 and
    ``Retry-After`` (load shedding) keeps the latency of admitted requests bounded and tells the
    client, or its load balancer, to try later or elsewhere.
    """

    def __init__(self, max_queue_depth: int) -> None:
        if not _is_int(max_queue_depth) or max_queue_depth < 1:
            raise ValueError(f"max_queue_depth must be an integer ≥ 1, got {max_queue_depth!r}")
        self.max_queue_depth = max_queue_depth
        self._depth = 0
        self._lock = threading.Lock()

    @property
    def depth(self) -> int:
        return self._depth

    def acquire(self) -> None:
        with self._lock:
            if self._depth + 1 > self.max_queue_depth:
                raise GatewayError(
                    503, "queue_full",
                    f"The server is at capacity ({self.max_queue_depth} requests in flight); "
                    f"retry shortly.", headers=_retry_after(1))
            self._depth += 1

    def release(self) -> None:
        with self._lock:
            if self._depth == 0:
                # A double release would silently raise the bound by one: fail loudly instead.
                raise RuntimeError("AdmissionControl.release() called more often than acquire()")
            self._depth -= 1

    def __enter__(self) -> "AdmissionControl":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"AdmissionControl(depth={self._depth}/{self.max_queue_depth})"


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
        if not _is_int(max_model_len) or max_model_len < 1:
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

    def admit_body(self, key_id: str, body: Any, *, chat: bool, trace: Trace | None = None) -> AdmittedRequest:
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
        length is never refused for a default it did not choose."""
        if request.max_tokens is not None:
            check_context(prompt_tokens, request.max_tokens, self.max_model_len)
            return request.max_tokens
        n = default_max_tokens(prompt_tokens, self.max_model_len, self.max_tokens_cap)
        if self.limiter is not None and self.limiter.tokens_per_min is not None:
            n = max(1, min(n, int(self.limiter.tokens_per_min) - prompt_tokens))
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
        return (f"Gateway(auth={self.auth!r}, limiter={'on' if self.limiter and self.limiter.enabled else 'off'}, "
                f"admission={self.admission!r}, models={self.served_models}, max_model_len={self.max_model_len})")
