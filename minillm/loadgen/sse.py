"""Server-sent events as an OpenAI-compatible server streams them: a line parser, the text of one
event, and the collector that turns a stream into a :class:`~minillm.metrics.definitions.ClientRecord`
on the trace clock (the client side of 10.2's TTFT and ITL)."""
from __future__ import annotations

import json
from typing import Any

from minillm.metrics.definitions import (
    ClientRecord,
)


# ---------------------------------------------------------------------------------------------
# Server-sent events
class SSEParser:
    """An incremental parser of a ``text/event-stream`` (the WHATWG rules that matter here).

    :meth:`feed` takes text in arbitrary pieces (a network read may end mid-line) and returns the
    ``data`` payloads of the events it completed. Lines end with LF, CRLF or CR; an event ends
    at a blank line; several ``data:`` lines of one event are joined with ``\\n``; lines starting
    with ``:`` are comments (keep-alives) and ignored, as are ``event:``/``id:``/``retry:``
    fields. :meth:`close` flushes an event the stream ended without a blank line after.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []
        self.n_comments = 0

    def feed(self, text: str) -> list[str]:
        self._buf += text
        out: list[str] = []
        while True:
            i_n, i_r = self._buf.find("\n"), self._buf.find("\r")
            cands = [i for i in (i_n, i_r) if i >= 0]
            if not cands:
                break
            i = min(cands)
            if self._buf[i] == "\r" and i + 1 == len(self._buf):
                break                   # a CR at the end: wait, it may be the first half of CRLF
            line = self._buf[:i]
            step = 2 if self._buf[i] == "\r" and self._buf[i + 1] == "\n" else 1
            self._buf = self._buf[i + step:]
            self._line(line, out)
        return out

    def _line(self, line: str, out: list[str]) -> None:
        if line == "":
            if self._data:
                out.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):
            self.n_comments += 1
            return
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)

    def close(self) -> list[str]:
        out: list[str] = []
        if self._buf:
            line, self._buf = self._buf.rstrip("\r"), ""
            self._line(line, out)
        self._line("", out)
        return out


def delta_text(event: dict, chat: bool) -> tuple[bool, str]:
    """``(has_choices, text)`` of one streamed JSON event (completions or chat)."""
    choices = event.get("choices") or []
    if not choices:
        return False, ""
    text = ""
    for c in choices:                     # n=1 in practice; join just in case
        if chat:
            text += (c.get("delta") or {}).get("content") or ""
        else:
            text += c.get("text") or ""
    return True, text


class StreamCollector:
    """Turns a stream's SSE payloads into a :class:`ClientRecord` (on the trace clock)."""

    def __init__(self, request_id: str, t_sent_ns: int, chat: bool) -> None:
        self.request_id, self.t_sent_ns, self.chat = request_id, t_sent_ns, chat
        self.chunks: list[tuple[int, int | None, str]] = []
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.error: str | None = None
        self.server_id: str | None = None
        self.finish_reason: str | None = None
        self.text: list[str] = []

    def event(self, data: str, t_ns: int) -> None:
        if self.done or self.error:
            return
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            ev = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"bad JSON in the stream: {data[:200]!r}"
            return
        if not isinstance(ev, dict):
            self.error = f"unexpected event in the stream: {data[:200]!r}"
            return
        if ev.get("error") is not None:
            err = ev["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            self.error = f"server error event mid-stream: {msg}"
            return
        self.server_id = self.server_id or ev.get("id")
        if ev.get("usage"):
            self.usage = ev["usage"]
        has, text = delta_text(ev, self.chat)
        if has:
            for c in ev["choices"]:
                self.finish_reason = c.get("finish_reason") or self.finish_reason
            self.chunks.append((t_ns, None, text))
            self.text.append(text)

    def record(self, t_done_ns: int, error: str | None = None, prompt_tokens_hint: int = 0) -> ClientRecord:
        err = error or self.error
        if err is None and not self.done:
            err = "connection closed before [DONE]"
        u = self.usage or {}
        return ClientRecord(request_id=self.request_id, t_sent_ns=self.t_sent_ns, chunks=list(self.chunks),
                            t_done_ns=max(t_done_ns, self.t_sent_ns),
                            prompt_tokens=int(u.get("prompt_tokens", prompt_tokens_hint) or 0),
                            ok=err is None, error=err, completion_tokens=u.get("completion_tokens"))


