"""Rate limits per key: token buckets for requests per second and prompt tokens per minute, each
taking an injectable clock so tests can move time by hand."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from minillm.serving.errors import GatewayError, retry_after

Clock = Callable[[], float]


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
        for name, v in (("requests_per_s", requests_per_s), ("tokens_per_min", tokens_per_min),
                        ("burst", burst)):
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
                    f"Retry in {wait:.2f} s.", headers=retry_after(wait))
            self._take_request_locked(b)

    def take_tokens(self, key_id: str, n_tokens: int) -> None:
        """Charge ``n_tokens`` (prompt + effective max_tokens) once the prompt is counted. On a
        429 the request charged by :meth:`take_request` is given back too."""
        if self._never_fits(n_tokens):
            self.refund(key_id, 0)
            raise self._too_large(n_tokens)
        with self._lock:
            self._take_tokens_locked(self._buckets_for(key_id), n_tokens)

    def check(self, key_id: str, n_tokens: int) -> None:
        """Charge one request and ``n_tokens`` tokens to ``key_id``, or raise (charging nothing)."""
        if self._never_fits(n_tokens):
            raise self._too_large(n_tokens)
        # One lock around both buckets: "take a request, then take tokens, else give the request
        # back" must look atomic to other threads of the same caller.
        with self._lock:
            b = self._buckets_for(key_id)
            self._take_request_locked(b)
            self._take_tokens_locked(b, n_tokens)

    def _never_fits(self, n_tokens: int) -> bool:
        return self.tokens_per_min is not None and n_tokens > self.tokens_per_min

    def _too_large(self, n_tokens: int) -> GatewayError:
        return GatewayError(
            400, "request_too_large",
            f"This request needs {n_tokens} tokens (prompt + max_tokens) but the rate limit is "
            f"{self.tokens_per_min:g} tokens per minute, so it can never be served; "
            f"reduce the prompt or max_tokens.", param="max_tokens")

    def _take_request_locked(self, b: _Buckets) -> None:
        if b.requests is not None:
            wait = b.requests.try_take(1)
            if wait > 0:
                raise GatewayError(
                    429, "rate_limited",
                    f"Rate limit reached: {self.requests_per_s:g} requests per second "
                    f"(burst {self.burst:g}). Retry in {wait:.2f} s.", headers=retry_after(wait))

    def _take_tokens_locked(self, b: _Buckets, n_tokens: int) -> None:
        if b.tokens is not None:
            wait = b.tokens.try_take(n_tokens)
            if wait > 0:
                if b.requests is not None:
                    b.requests.refund(1)      # a rejected request must not use up quota
                raise GatewayError(
                    429, "rate_limited",
                    f"Rate limit reached: {self.tokens_per_min:g} tokens per minute; this request "
                    f"needs {n_tokens} tokens (prompt + max_tokens). Retry in {wait:.2f} s.",
                    headers=retry_after(wait))

    def refund(self, key_id: str, n_tokens: int) -> None:
        """Give back what :meth:`check` charged, for a request rejected at a later stage."""
        with self._lock:
            b = self._buckets_for(key_id)
            if b.requests is not None:
                b.requests.refund(1)
            if b.tokens is not None:
                b.tokens.refund(n_tokens)
