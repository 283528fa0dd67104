"""Per-request traces (design.md §1).

Every request carries a :class:`Trace`: an append-only list of ``(event, t_ns, extra)``
records. Metrics (``minillm.metrics.definitions``) are computed from traces only, never from ad-hoc
timers, so the numbers a notebook shows can always be traced back to recorded events.

Timestamps come from :func:`now_ns` (``time.perf_counter_ns``: CLOCK_MONOTONIC on Linux,
so a client and a server on the same machine share one clock).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

# The stages of one request, in the order a request normally meets them (design.md §1).
EVENTS = (
    "received", "authenticated", "body_read", "admitted", "rejected",   # gateway (and the body)
    "tokenized",                                           # tokenizer
    "enqueued", "scheduled", "preempted",                  # scheduling queue
    "prefill_start", "prefill_chunk", "prefill_end", "first_token",   # prefill (chunk by chunk)
    "token",                                               # decode loop, one per output token
    "detokenized",                                         # incremental detokenizer, one per text delta
    "sent", "finished",                                    # streaming return
)


def now_ns() -> int:
    """The one clock every trace uses."""
    return time.perf_counter_ns()


@dataclass(frozen=True)
class TraceEvent:
    event: str
    t_ns: int
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"event": self.event, "t_ns": self.t_ns, **self.extra}


@dataclass
class Trace:
    request_id: str
    events: list[TraceEvent] = field(default_factory=list)

    def record(self, event: str, t_ns: int | None = None, **extra: Any) -> TraceEvent:
        if event not in EVENTS:
            raise ValueError(f"unknown trace event {event!r}; known events: {', '.join(EVENTS)}")
        ev = TraceEvent(event, now_ns() if t_ns is None else int(t_ns), dict(extra))
        self.events.append(ev)
        return ev

    def __iter__(self) -> Iterator[TraceEvent]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)

    def first(self, event: str) -> TraceEvent | None:
        return next((e for e in self.events if e.event == event), None)

    def last(self, event: str) -> TraceEvent | None:
        return next((e for e in reversed(self.events) if e.event == event), None)

    def times(self, event: str) -> list[int]:
        """All timestamps (ns) of one event kind, in recording order."""
        return [e.t_ns for e in self.events if e.event == event]

    def to_records(self) -> list[dict[str, Any]]:
        """Plain rows (one per event) for JSON or ``pandas.DataFrame``."""
        return [{"request_id": self.request_id, **e.as_dict()} for e in self.events]

    def to_json(self) -> str:
        return json.dumps({"request_id": self.request_id, "events": [e.as_dict() for e in self.events]})

    @classmethod
    def from_records(cls, request_id: str, rows: list[dict[str, Any]]) -> "Trace":
        tr = cls(request_id)
        for r in rows:
            extra = {k: v for k, v in r.items() if k not in ("event", "t_ns", "request_id")}
            tr.events.append(TraceEvent(r["event"], int(r["t_ns"]), extra))
        return tr
