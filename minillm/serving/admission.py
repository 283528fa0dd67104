"""Admission: a bounded queue in front of the engine (503 with ``Retry-After`` when it is full)."""
from __future__ import annotations

import threading
from typing import Any

from minillm.serving.errors import GatewayError, retry_after
from minillm.serving.validation import is_int

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
        if not is_int(max_queue_depth) or max_queue_depth < 1:
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
                    f"retry shortly.", headers=retry_after(1))
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
