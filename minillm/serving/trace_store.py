"""The server's store of recent traces: whose they are, and how much memory they may take.

A trace shows what a request asked and got (its token ids decode to the completion), so it
belongs to the API key that sent it: a key reads only its own traces; an optional admin key
reads all. Rejected requests that never showed a valid key are counted, never stored — a
stranger sending 10,000 bad keys must not evict the real traces.

The store is bounded twice, by count (``max_traces``) and by bytes (``max_bytes``, an estimate
of each trace's size: its events and their extras), oldest evicted first, and it says what it
dropped. ``GET /v1/traces`` pages through a key's traces with ``?after=<next>``: the cursor counts
that key's own traces only (the admin's counts every trace), so it says nothing about anyone else's
traffic. A trace is found by (key, the id that key gave it).
"""
from __future__ import annotations

import itertools
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass

from minillm.core.trace import Trace
from minillm.serving.auth import ADMIN


def trace_bytes(trace: Trace) -> int:
    """A cheap estimate of a trace's memory: the event objects, their dicts and their values."""
    n = sys.getsizeof(trace) + sys.getsizeof(trace.events)
    for e in trace.events:
        n += 120 + sys.getsizeof(e.extra)                       # the event object, its name and time
        n += sum(sys.getsizeof(v) for v in e.extra.values())
    return n


@dataclass
class StoredTrace:
    seq: int                     # over every trace: the admin's cursor
    owner: str                   # key id of the caller ("anonymous" on an open server)
    trace: Trace
    nbytes: int
    owner_seq: int = 0           # over this owner's traces only: the owner's cursor
    request_id: str = ""         # the id the owner knows it by (its X-Request-Id, else the trace's)

    def cursor(self, reader: str) -> int:
        return self.seq if reader == ADMIN else self.owner_seq


class TraceStore:
    def __init__(self, max_traces: int = 10_000, max_bytes: int = 64 << 20):
        if max_traces < 1 or max_bytes < 1:
            raise ValueError("max_traces and max_bytes must be ≥ 1")
        self.max_traces, self.max_bytes = max_traces, max_bytes
        self._items: OrderedDict[int, StoredTrace] = OrderedDict()
        self._seq = itertools.count(1)
        self._owner_seq: dict[str, int] = {}
        self._lock = threading.Lock()
        self.nbytes = 0
        self.dropped = 0             # evicted to stay within the bounds
        self.dropped_bytes = 0
        self.unauthenticated = 0     # rejected before showing a valid key: counted, not stored

    def __len__(self) -> int:
        return len(self._items)

    def add(self, trace: Trace, owner: str | None, request_id: str | None = None) -> None:
        """Store a finished trace for ``owner`` under ``request_id`` (default: the trace's);
        ``None`` (no valid key) only counts it."""
        if owner is None:
            with self._lock:
                self.unauthenticated += 1
            return
        item = StoredTrace(0, owner, trace, trace_bytes(trace), request_id=request_id or trace.request_id)
        with self._lock:
            item.seq = next(self._seq)
            item.owner_seq = self._owner_seq[owner] = self._owner_seq.get(owner, 0) + 1
            self._items[item.seq] = item
            self.nbytes += item.nbytes
            while (len(self._items) > self.max_traces
                   or (self.nbytes > self.max_bytes and len(self._items) > 1)):
                _, old = self._items.popitem(last=False)
                self.nbytes -= old.nbytes
                self.dropped += 1
                self.dropped_bytes += old.nbytes

    def query(self, reader: str, request_ids: list[str] | None = None, after: int = 0,
              limit: int | None = None) -> tuple[list[StoredTrace], int | None]:
        """The traces ``reader`` may see, oldest first, past the cursor ``after`` (the reader's
        own: see the module docstring), at most ``limit``; and the cursor for the next page
        (None when this page is the last). ``request_ids``: the ids the owners gave (the admin
        may also use the engine's)."""
        with self._lock:
            items = list(self._items.values())
        if reader != ADMIN:
            items = [it for it in items if it.owner == reader]
        items = [it for it in items if it.cursor(reader) > after]
        if request_ids:
            want = set(request_ids)
            items = [it for it in items
                     if it.request_id in want or (reader == ADMIN and it.trace.request_id in want)]
        if limit is not None and len(items) > limit:
            return items[:limit], (items[limit - 1].cursor(reader) if limit > 0 else after)
        return items, None

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.nbytes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"traces": len(self._items), "bytes": self.nbytes, "max_traces": self.max_traces,
                    "max_bytes": self.max_bytes, "dropped": self.dropped, "dropped_bytes": self.dropped_bytes,
                    "unauthenticated": self.unauthenticated}
