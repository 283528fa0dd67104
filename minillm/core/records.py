"""Reading the records back: traces and step records from JSON, in every form the project writes.

Traces: ``Trace`` objects, one page of ``GET /v1/traces`` (``{"data": [...]}``), a list of its items
(``{"request_id", "events"}``), flat event rows of many requests, or a file saved by
``minillm diagnose --save`` (``{"traces", "steps"}``). Step records: ``StepRecord`` objects or
``GET /v1/steps``'s JSON. One reader for all of them, so a notebook, ``diagnose`` and the benchmarks
read the same files the same way.
"""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from minillm.core.step_record import StepRecord
from minillm.core.trace import Trace


def as_traces(data: Any) -> list[Trace]:
    """Traces from any of the accepted forms (see the module docstring). Raises ``ValueError``
    naming what it could not read."""
    if data is None:
        return []
    if isinstance(data, Trace):
        return [data]
    if isinstance(data, dict):
        if "traces" in data:
            return as_traces(data["traces"])
        if "data" in data:                                  # one page of GET /v1/traces
            return as_traces(data["data"])
        if "events" in data:
            return [_trace_from_item(data)]
        raise ValueError("a traces object needs 'data' (GET /v1/traces), 'traces' or 'events'")
    if not isinstance(data, (list, tuple)):
        raise ValueError(f"cannot read traces from a {type(data).__name__}")
    if data and all(isinstance(r, dict) and "event" in r for r in data):   # flat rows of many requests
        return _traces_from_rows(data)
    out: list[Trace] = []
    for item in data:
        if isinstance(item, Trace):
            out.append(item)
        elif isinstance(item, dict):
            out.append(_trace_from_item(item))
        elif isinstance(item, list):                         # one Trace.to_records() list
            out.extend(_traces_from_rows(item))
        else:
            raise ValueError(f"cannot read a trace from a {type(item).__name__}")
    return out


def _trace_from_item(item: dict) -> Trace:
    if "events" not in item:
        raise ValueError("a trace item needs 'events' (and 'request_id'), as GET /v1/traces returns them")
    rows = item["events"]
    if not all(isinstance(r, dict) and "event" in r and "t_ns" in r for r in rows):
        raise ValueError(f"trace {item.get('request_id')!r}: every event needs 'event' and 't_ns'")
    return Trace.from_records(str(item.get("request_id", "?")), rows)


def _traces_from_rows(rows: list[dict]) -> list[Trace]:
    by_id: dict[str, list[dict]] = {}
    for r in rows:
        if "event" not in r or "t_ns" not in r:
            raise ValueError("a trace row needs 'event' and 't_ns'")
        by_id.setdefault(str(r.get("request_id", "?")), []).append(r)
    return [Trace.from_records(rid, rs) for rid, rs in by_id.items()]


_STEP_FIELDS = {f.name for f in fields(StepRecord)}


def as_steps(data: Any) -> list[StepRecord]:
    """StepRecords from StepRecord objects, their ``to_dict()`` or ``GET /v1/steps``'s body."""
    if data is None:
        return []
    if isinstance(data, dict):
        if "data" in data:
            return as_steps(data["data"])
        data = [data]
    out = []
    for d in data:
        if isinstance(d, StepRecord):
            out.append(d)
        elif isinstance(d, dict) and "t_start_ns" in d:
            kw = {k: v for k, v in d.items() if k in _STEP_FIELDS}
            kw["t_ns"] = [int(t) for t in kw.get("t_ns", [])]
            if kw.get("bucket") is not None:
                kw["bucket"] = tuple(kw["bucket"])
            out.append(StepRecord(**kw))
        else:
            raise ValueError("a step record needs 't_start_ns' and 't_ns' (StepRecord.to_dict(), GET "
                             "/v1/steps)")
    return out


def load_input(path: str | Path) -> tuple[list[Trace], list[StepRecord]]:
    """Traces (and steps, when the file has them) from a JSON file (see the module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such traces file: {p}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not JSON: {e}") from None
    steps = as_steps(data.get("steps")) if isinstance(data, dict) else []
    return as_traces(data), steps
