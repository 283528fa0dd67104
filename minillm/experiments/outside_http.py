"""What HTTP, JSON and SSE cost (chapter 10.5), per request and per token, as shares of TTFT
and ITL. The measurement is ``bench-http`` (:func:`minillm.loadgen.http_overhead.run_http_overhead`:
the same requests in process and through ``minillm serve``, alternating); this module only reads
its report, and adds one in-process micro-measurement: building and framing one SSE chunk.

- **per request**: HTTP TTFT − in-process TTFT (p50), what the first token pays for the
  request's JSON body, the gateway, the socket and the first chunk; share = that ÷ HTTP TTFT;
- **per token**: HTTP ITL − in-process ITL (p50), what every further token pays for its own
  chunk (one JSON object + ``data: …\\n\\n``) and the socket; share = that ÷ HTTP ITL;
- **JSON + SSE framing**: the host time to build one completion chunk and serialize it, as the
  server does (``serving.responses.sse_line``): part of the per-token cost.

ITL here is the gap between text chunks on both sides (ICL, design.md §2): with one token per
chunk, as minillm streams, the two are the same.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass


def chunk_body(request_id: str, delta: str, chat: bool = False, model: str = "tiny") -> dict:
    """One streamed chunk, in the shape ``serving.responses.Job.chunk`` sends (no logprobs)."""
    if chat:
        choice = {"index": 0, "delta": {"content": delta}, "logprobs": None, "finish_reason": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": None}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": 1767225600, "model": model, "choices": [choice]}


def sse_chunk_us(n: int = 2000, repeats: int = 5, delta: str = " token", chat: bool = False) -> list[float]:
    """µs to build one chunk, serialize it as an SSE event and encode it to bytes; ``repeats``
    samples, each the mean over ``n`` chunks."""
    from minillm.serving.responses import sse_line

    rid = "cmpl-" + "0" * 24
    out = []
    for _ in range(repeats + 1):                      # the first pass warms up
        t0 = time.perf_counter()
        for _ in range(n):
            sse_line(chunk_body(rid, delta, chat)).encode("utf-8")
        out.append((time.perf_counter() - t0) * 1e6 / n)
    return out[1:]


@dataclass
class HttpCost:
    model: str
    hardware: str
    mode: str                          # bench-http's: server in a "subprocess" or a "thread"
    n_requests: int
    max_tokens: int
    ttft_inproc_ms: float              # p50
    ttft_http_ms: float
    itl_inproc_ms: float
    itl_http_ms: float
    per_request_ms: float              # TTFT overhead, p50
    per_token_ms: float                # ITL overhead, p50
    per_request_p99_ms: float
    per_token_p99_ms: float
    sse_json_us: float | None = None   # one chunk built + serialized (median)

    @property
    def share_of_ttft(self) -> float:
        return self.per_request_ms / self.ttft_http_ms

    @property
    def share_of_itl(self) -> float:
        return self.per_token_ms / self.itl_http_ms

    @property
    def sse_json_share_of_itl(self) -> float | None:
        return None if self.sse_json_us is None else self.sse_json_us / 1e3 / self.itl_http_ms

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(share_of_ttft=self.share_of_ttft, share_of_itl=self.share_of_itl,
                 sse_json_share_of_itl=self.sse_json_share_of_itl)
        return d

    def table(self) -> str:
        lines = [f"HTTP + JSON + SSE — {self.model} on {self.hardware} (bench-http, server in a {self.mode}, "
                 f"{self.n_requests} requests per side, {self.max_tokens} tokens each)",
                 f"{'':<34}{'in process':>12}{'over HTTP':>12}{'added p50':>12}{'added p99':>12}{'share':>9}",
                 f"{'per request: TTFT (ms)':<34}{self.ttft_inproc_ms:>12.3f}{self.ttft_http_ms:>12.3f}"
                 f"{self.per_request_ms:>12.3f}{self.per_request_p99_ms:>12.3f}"
                 f"{100 * self.share_of_ttft:>8.1f}%",
                 f"{'per token: ITL (ms)':<34}{self.itl_inproc_ms:>12.3f}{self.itl_http_ms:>12.3f}"
                 f"{self.per_token_ms:>12.3f}{self.per_token_p99_ms:>12.3f}{100 * self.share_of_itl:>8.1f}%"]
        if self.sse_json_us is not None:
            lines.append(f"{'  of which: chunk + JSON + SSE':<34}{'':>24}{self.sse_json_us / 1e3:>12.4f}"
                         f"{'':>12}{100 * self.sse_json_share_of_itl:>8.2f}%")
        lines.append("share = added p50 ÷ the HTTP value (of TTFT per request, of ITL per token)")
        return "\n".join(lines)

    def summary(self) -> str:
        """The table, then what it says in one sentence."""
        chunk = (f", of which building + serializing the chunk is {self.sse_json_us:.1f} µs"
                 if self.sse_json_us is not None else "")
        return (f"{self.table()}\n\nper request the HTTP path adds {self.per_request_ms:.3f} ms "
                f"({100 * self.share_of_ttft:.1f} % of TTFT); per token {self.per_token_ms:.3f} ms "
                f"({100 * self.share_of_itl:.1f} % of ITL){chunk}")


def http_costs(report, sse_us: float | list[float] | None = None) -> HttpCost:
    """``report``: an ``OverheadReport`` from ``run_http_overhead`` or its JSON (``bench-http
    --json``). ``sse_us``: one chunk's build + serialize time, or the samples of ``sse_chunk_us``."""
    d = report.to_dict() if hasattr(report, "to_dict") else report
    t, i = d["ttft"], d["itl"]
    return HttpCost(model=d["model"], hardware=d["hardware"], mode=d.get("mode", "?"),
                    n_requests=d["n_requests"],
                    max_tokens=d["max_tokens"], ttft_inproc_ms=t["inproc_p50_ms"],
                    ttft_http_ms=t["http_p50_ms"],
                    itl_inproc_ms=i["inproc_p50_ms"], itl_http_ms=i["http_p50_ms"],
                    per_request_ms=t["http_p50_ms"] - t["inproc_p50_ms"],
                    per_token_ms=i["http_p50_ms"] - i["inproc_p50_ms"],
                    per_request_p99_ms=t["http_p99_ms"] - t["inproc_p99_ms"],
                    per_token_p99_ms=i["http_p99_ms"] - i["inproc_p99_ms"],
                    sse_json_us=None if sse_us is None else float(
                        sse_us if isinstance(sse_us, (int, float)) else statistics.median(sse_us)))
