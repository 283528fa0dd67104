"""What does HTTP + SSE cost? (chapter 10.1: the first and last stages of a request's path)

The same requests, on the same model and settings, two ways:

* **in process** — ``LLM.stream(prompt)`` in this Python process: the caller sees each text
  delta the moment the engine produces it;
* **through the server** — ``POST /v1/completions`` with ``stream: true`` to ``minillm serve`` on
  loopback, read by a streaming HTTP client (``httpx``): the gateway, JSON, SSE framing, the
  socket and the client's parsing are added.

Both sides are timed the same way — a :class:`~minillm.metrics.definitions.ClientRecord` (the time the
request was issued, the time of every non-empty chunk), turned into TTFT and inter-chunk gaps by
:func:`~minillm.metrics.definitions.client_request_metrics` — so the difference is the HTTP path and nothing
else. Requests run one at a time (concurrency 1: the overhead, not queueing) and alternate
between the two sides, so slow drift of the machine (turbo, other load) hits both equally.

The server's own traces split the HTTP TTFT further, all on one clock (``perf_counter_ns`` is
CLOCK_MONOTONIC, shared by processes on one Linux machine)::

    client sends ─► server `received` ─► first `token` ─► its chunk `sent` ─► client reads it
       "inbound"         "server"           "outbound (server)"   "outbound (socket+client)"

The target the chapter sets for a loopback server: **≤ 3 ms added to TTFT at p50**.

The client helpers here (:func:`stream_completion`, :func:`astream_completion`,
:func:`run_concurrent`) are also what the notebooks use to talk to the server.
"""
from __future__ import annotations

import asyncio
import os
import platform
import random
import shlex
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from minillm.core.trace import Trace, now_ns
from minillm.loadgen.serve_process import ServeProcess
from minillm.loadgen.server_api import fetch_traces
from minillm.loadgen.sse import StreamCollector
from minillm.metrics.definitions import ClientRecord, client_request_metrics

TARGET_P50_MS = 3.0


# ---------------------------------------------------------------------------------------------
# A streaming client
# ---------------------------------------------------------------------------------------------

@dataclass
class StreamResult:
    """What a streaming client saw of one request (``record`` is on the trace clock)."""
    request_id: str | None
    record: ClientRecord
    text: str
    finish_reason: str | None
    usage: dict[str, int] | None
    done: bool                         # the stream ended with ``data: [DONE]``
    status: int
    error: str | None = None
    disconnected: bool = False         # we hung up on purpose (see ``stop_after``)
    n_events: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None and not self.disconnected


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _endpoint(base_url: str, chat: bool) -> str:
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + ("/chat/completions" if chat else "/completions")


class _Collector:
    """SSE lines → a :class:`StreamResult` (shared by the sync and async clients). Each ``data:``
    payload goes to the one stream collector of the project (:class:`~minillm.loadgen.sse.StreamCollector`,
    also ``bench-serve``'s); this adds the line framing, the event count and the HTTP status."""

    def __init__(self, t_sent_ns: int, chat: bool, prompt_tokens: int = 0) -> None:
        self.events = StreamCollector("?", t_sent_ns, chat)
        self.prompt_tokens = prompt_tokens
        self.n_events = 0

    @property
    def done(self) -> bool:
        return self.events.done

    def line(self, line: str, t_ns: int) -> None:
        if not line.startswith("data:"):
            return                                   # blank separators, comments, keep-alives
        self.n_events += 1
        self.events.event(line[5:].strip(), t_ns)

    def result(self, status: int, t_done_ns: int, error: str | None = None, disconnected: bool = False,
               request_id: str | None = None) -> StreamResult:
        ev = self.events
        err = error or ev.error
        if status == 200 and not ev.done and err is None and not disconnected:
            err = "the stream ended without [DONE]"
        rid = ev.server_id or request_id or "?"
        usage = ev.usage
        rec = ClientRecord(request_id=rid, t_sent_ns=ev.t_sent_ns, chunks=ev.chunks, t_done_ns=t_done_ns,
                           prompt_tokens=(usage or {}).get("prompt_tokens", self.prompt_tokens),
                           ok=err is None and not disconnected and status == 200, error=err,
                           completion_tokens=(usage or {}).get("completion_tokens"))
        return StreamResult(rid if rid != "?" else None, rec, "".join(ev.text), ev.finish_reason, usage,
                            ev.done, status, err, disconnected, self.n_events)


def stream_completion(client, base_url: str, body: dict[str, Any], api_key: str | None = None,
                      chat: bool = False) -> StreamResult:
    """POST one streaming request with a sync ``httpx.Client``; time every chunk on arrival."""
    body = {**body, "stream": True}
    t_sent = now_ns()
    col = _Collector(t_sent, chat)
    with client.stream("POST", _endpoint(base_url, chat), json=body, headers=_headers(api_key)) as r:
        if r.status_code != 200:
            r.read()
            return col.result(r.status_code, now_ns(), error=r.text[:500],
                              request_id=r.headers.get("x-request-id"))
        for line in r.iter_lines():
            col.line(line, now_ns())
        return col.result(200, now_ns(), request_id=r.headers.get("x-request-id"))


async def astream_completion(client, base_url: str, body: dict[str, Any], api_key: str | None = None,
                             chat: bool = False, stop_after: int | None = None) -> StreamResult:
    """The same with an ``httpx.AsyncClient``. ``stop_after=k`` hangs up after k events
    (0: as soon as the response headers arrive) — a client that goes away mid-stream."""
    body = {**body, "stream": True}
    t_sent = now_ns()
    col = _Collector(t_sent, chat)
    async with client.stream("POST", _endpoint(base_url, chat), json=body, headers=_headers(api_key)) as r:
        rid = r.headers.get("x-request-id")
        if r.status_code != 200:
            await r.aread()
            return col.result(r.status_code, now_ns(), error=r.text[:500], request_id=rid)
        if stop_after == 0:
            return col.result(200, now_ns(), disconnected=True, request_id=rid)
        async for line in r.aiter_lines():
            col.line(line, now_ns())
            if stop_after is not None and col.n_events >= stop_after and not col.done:
                return col.result(200, now_ns(), disconnected=True, request_id=rid)   # closing = hanging up
        return col.result(200, now_ns(), request_id=rid)


async def arun_concurrent(base_url: str, bodies: list[dict[str, Any]], api_key: str | None = None,
                          chat: bool = False, stop_after: list[int | None] | None = None,
                          timeout_s: float = 300.0) -> list[StreamResult]:
    """Send every body at once (one connection each) and collect the streams."""
    import httpx
    limits = httpx.Limits(max_connections=len(bodies) + 8, max_keepalive_connections=len(bodies) + 8)
    stops = stop_after or [None] * len(bodies)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as client:
        return list(await asyncio.gather(*(astream_completion(client, base_url, b, api_key, chat, s)
                                           for b, s in zip(bodies, stops))))


def run_concurrent(base_url: str, bodies: list[dict[str, Any]], api_key: str | None = None,
                   chat: bool = False, stop_after: list[int | None] | None = None,
                   timeout_s: float = 300.0) -> list[StreamResult]:
    """:func:`arun_concurrent` from synchronous code — also inside Jupyter, whose own event loop
    is already running (the client gets a fresh loop in a helper thread)."""
    return run_in_fresh_loop(lambda: arun_concurrent(base_url, bodies, api_key, chat, stop_after, timeout_s),
                             "minillm-client")


def run_in_fresh_loop(make_coroutine, name: str):
    """Run ``make_coroutine()`` to completion on a fresh event loop in a helper thread and return
    its result (or raise its exception here). Works where a loop already runs, e.g. Jupyter."""
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(asyncio.run(make_coroutine()))
        except BaseException as e:      # re-raised in the caller's thread
            out.append(e)

    t = threading.Thread(target=target, name=name)
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------

_LIFECYCLE_WORDS = ("the request enters the gateway then waits in the queue until the scheduler gives it a "
                    "slot prefill reads the whole prompt once and writes the cache decode then produces one "
                    "token per step for every running request while the server streams each piece of text "
                    "back").split()


def make_text_prompts(tokenizer, n: int, prompt_tokens: int, seed: int = 0) -> list[str]:
    """``n`` different prompts of about ``prompt_tokens`` tokens (unique, as 10.6 asks)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [f"#{i}"] + [rng.choice(_LIFECYCLE_WORDS) for _ in range(prompt_tokens * 2)]
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[:prompt_tokens]
        out.append(tokenizer.decode(ids))
    return out


def inprocess_stream(llm, prompt: str, params) -> ClientRecord:
    """Time ``LLM.stream`` exactly as the HTTP client is timed: issue → every non-empty delta."""
    t_sent = now_ns()
    chunks = [(now_ns(), None, d) for d in llm.stream(prompt, params)]
    out = llm.last_output
    return ClientRecord(out.request_id, t_sent, chunks, now_ns(), len(out.prompt_token_ids),
                        completion_tokens=len(out.token_ids))


def _q(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


@dataclass
class Compared:
    """One latency, in process vs through HTTP, in milliseconds."""
    name: str
    inproc_p50_ms: float
    inproc_p99_ms: float
    http_p50_ms: float
    http_p99_ms: float
    n_inproc: int
    n_http: int

    @property
    def overhead_p50_ms(self) -> float:
        return self.http_p50_ms - self.inproc_p50_ms

    @property
    def overhead_p99_ms(self) -> float:
        return self.http_p99_ms - self.inproc_p99_ms

    @property
    def ratio_p50(self) -> float:
        return self.http_p50_ms / self.inproc_p50_ms if self.inproc_p50_ms > 0 else float("nan")

    @property
    def ratio_p99(self) -> float:
        return self.http_p99_ms / self.inproc_p99_ms if self.inproc_p99_ms > 0 else float("nan")

    @classmethod
    def of(cls, name: str, inproc_s: list[float], http_s: list[float]) -> "Compared":
        ms = lambda xs, q: _q([x * 1e3 for x in xs], q)  # noqa: E731
        return cls(name, ms(inproc_s, 50), ms(inproc_s, 99), ms(http_s, 50), ms(http_s, 99),
                   len(inproc_s), len(http_s))


@dataclass
class OverheadReport:
    model: str
    dtype: str
    device: str
    hardware: str
    mode: str                          # "subprocess" (server in its own process) or "thread"
    torch_threads: int
    n_requests: int
    warmup: int
    prompt_tokens_mean: float
    max_tokens: int
    ttft: Compared
    itl: Compared
    ttft_split_ms: dict[str, dict[str, float]]   # the HTTP TTFT by segment, p50/p99 (server traces)
    samples: dict[str, list[float]] = field(repr=False)   # every sample, seconds
    target_p50_ms: float = TARGET_P50_MS
    started: str = ""
    command: str = ""
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def meets_target(self) -> bool:
        return self.ttft.overhead_p50_ms <= self.target_p50_ms

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("ttft", "itl"):
            c: Compared = getattr(self, k)
            d[k].update(overhead_p50_ms=c.overhead_p50_ms, overhead_p99_ms=c.overhead_p99_ms,
                        ratio_p50=c.ratio_p50, ratio_p99=c.ratio_p99)
        d["meets_target"] = self.meets_target
        return d

    def table(self) -> str:
        lines = [f"HTTP + SSE overhead — {self.model} {self.dtype} on {self.hardware}",
                 f"{self.n_requests} requests per side (after {self.warmup} warm-up), one at a time, "
                 f"alternating; prompt ≈ {self.prompt_tokens_mean:.0f} tokens, {self.max_tokens} output "
                 f"tokens; server in a {self.mode}; {self.torch_threads} torch thread(s) per side",
                 "",
                 f"{'':<8}{'in-process':>22}{'HTTP + SSE':>22}{'overhead':>22}{'HTTP / in-process':>22}",
                 f"{'(ms)':<8}" + f"{'p50':>11}{'p99':>11}" * 3 + f"{'p50':>11}{'p99':>11}"]
        for c in (self.ttft, self.itl):
            lines.append(f"{c.name:<8}{c.inproc_p50_ms:>11.3f}{c.inproc_p99_ms:>11.3f}{c.http_p50_ms:>11.3f}"
                         f"{c.http_p99_ms:>11.3f}{c.overhead_p50_ms:>11.3f}{c.overhead_p99_ms:>11.3f}"
                         f"{c.ratio_p50:>10.2f}×{c.ratio_p99:>10.2f}×")
        lines.append("")
        verdict = "meets" if self.meets_target else "MISSES"
        lines.append(f"target: TTFT overhead ≤ {self.target_p50_ms:g} ms at p50 on loopback → measured "
                     f"{self.ttft.overhead_p50_ms:.3f} ms "
                     f"({self.ttft.overhead_p50_ms / self.target_p50_ms:.2f} × the target): {verdict} it")
        if self.ttft_split_ms:
            lines.append("")
            lines.append("HTTP TTFT by segment (server traces, one clock)        p50 ms     p99 ms")
            for k, v in self.ttft_split_ms.items():
                lines.append(f"  {k:<52}{v['p50']:>7.3f}{v['p99']:>11.3f}")
        lines.append("(ITL here is the gap between non-empty text chunks on both sides — ICL, design.md §2)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def ttft_split(records: list[ClientRecord], traces: dict[str, Trace]) -> dict[str, dict[str, float]]:
    """The client-side TTFT of each streamed request cut at the server's trace events (one clock):
    p50/p99 in ms of each segment, over the requests that have a trace."""
    parts: dict[str, list[float]] = {"inbound: client sends → server received": [],
                                     "server: received → first token (gateway, queue, prefill)": [],
                                     "outbound: first token → its chunk sent": [],
                                     "socket + client: chunk sent → client has it": []}
    keys = list(parts)
    for rec in records:
        tr = traces.get(rec.request_id)
        visible = [t for t, _, text in rec.chunks if text]
        if tr is None or not visible:
            continue
        rcv, tok = tr.first("received"), tr.first("token")
        sent = next((e for e in tr.events if e.event == "sent" and e.extra.get("n_chars", 0) > 0), None)
        if rcv is None or tok is None or sent is None:
            continue
        for k, (a, b) in zip(keys, ((rec.t_sent_ns, rcv.t_ns), (rcv.t_ns, tok.t_ns), (tok.t_ns, sent.t_ns),
                                    (sent.t_ns, visible[0]))):
            parts[k].append((b - a) / 1e6)
    return {k: {"p50": _q(v, 50), "p99": _q(v, 99), "n": len(v)} for k, v in parts.items() if v}


def run_http_overhead(model: str = "tiny", device: str | None = "cpu", dtype: str | None = "fp32",
                      n_requests: int = 50, prompt_tokens: int = 32, max_tokens: int = 32, warmup: int = 5,
                      mode: str = "subprocess", max_batch_size: int = 8, max_model_len: int = 512,
                      seed: int = 0, torch_threads: int | None = None, command: str = "") -> OverheadReport:
    """Measure the HTTP + SSE overhead on TTFT and ITL (see the module docstring).

    ``torch_threads`` sets torch's intra-op threads on both sides. On a machine with few cores it
    matters: the HTTP path needs a core of its own while a step runs, and torch's threads, by
    default one per core, compete with it (and spin-wait on each other) — the in-process side never
    has that competition, so the difference would charge torch's oversubscription to HTTP."""
    import httpx
    import torch

    from minillm.core.device import dtype_name
    from minillm.engine.llm import LLM
    from minillm.engine.sampling import SamplingParams
    from minillm.hardware.machine import describe_hardware
    from minillm.serving.server import ServerConfig, ServerThread

    if mode not in ("subprocess", "thread"):
        raise ValueError(f"mode must be 'subprocess' or 'thread', got {mode!r}")
    if torch_threads:
        torch.set_num_threads(torch_threads)
    if n_requests < 2 or max_tokens < 2 or warmup < 0:
        raise ValueError("need n_requests ≥ 2, max_tokens ≥ 2 (an ITL needs two tokens) and warmup ≥ 0")
    llm = LLM(model=model, device=device, dtype=dtype, seed=seed, max_batch_size=max_batch_size,
              max_model_len=max_model_len)
    dev = str(llm.device)
    key = "bench-" + os.urandom(8).hex()
    srv: Any
    if mode == "thread":
        srv = ServerThread(ServerConfig(model=model, device=dev, dtype=dtype_name(llm.dtype), seed=seed,
                                        port=0,
                                        api_keys=[key], max_batch_size=max_batch_size,
                                        max_model_len=max_model_len, max_queue_depth=16)).start()
    else:
        srv = ServeProcess(["--model", model, "--device", dev, "--dtype", dtype_name(llm.dtype),
                            "--max-batch-size", str(max_batch_size), "--max-model-len", str(max_model_len),
                            "--max-queue-depth", "16"], key, torch_threads=torch_threads).launch()
    prompts = make_text_prompts(llm.tokenizer, warmup + n_requests, prompt_tokens, seed)
    # ignore_eos: both sides produce exactly max_tokens tokens, so the gaps are comparable
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    inproc: list[ClientRecord] = []
    http: list[ClientRecord] = []
    t_start = time.time()
    try:
        if mode == "subprocess":
            srv.wait_ready()
        with httpx.Client(timeout=120) as client:
            for i, prompt in enumerate(prompts):
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True}
                # alternate which side goes first, so neither always runs on a "warmer" machine
                order = ("in", "http") if i % 2 == 0 else ("http", "in")
                for side in order:
                    if side == "in":
                        rec = inprocess_stream(llm, prompt, params)
                        if i >= warmup:
                            inproc.append(rec)
                    else:
                        res = stream_completion(client, srv.url, body, key)
                        if not res.ok:
                            raise RuntimeError(f"HTTP request failed: {res.status} {res.error}")
                        if i >= warmup:
                            http.append(res.record)
            traces = {t.request_id: t for t in fetch_traces(srv.url, [r.request_id for r in http], key,
                                                            client)}
    finally:
        srv.stop()

    mi = [client_request_metrics(r) for r in inproc]
    mh = [client_request_metrics(r) for r in http]
    samples = {"ttft_inproc_s": [m.ttft_s for m in mi], "ttft_http_s": [m.ttft_s for m in mh],
               "itl_inproc_s": [g for m in mi for g in m.itl_s],
               "itl_http_s": [g for m in mh for g in m.itl_s]}
    cmd = command or "python -m minillm bench-http " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    import fastapi
    import uvicorn
    return OverheadReport(
        model=model, dtype=dtype_name(llm.dtype), device=dev,
        hardware=describe_hardware(llm.device).summary(),
        mode=mode, torch_threads=torch.get_num_threads(), n_requests=n_requests, warmup=warmup,
        prompt_tokens_mean=float(np.mean([r.prompt_tokens for r in inproc])), max_tokens=max_tokens,
        ttft=Compared.of("TTFT", samples["ttft_inproc_s"], samples["ttft_http_s"]),
        itl=Compared.of("ITL", samples["itl_inproc_s"], samples["itl_http_s"]),
        ttft_split_ms=ttft_split(http, traces), samples=samples,
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t_start)), command=cmd,
        versions={"python": platform.python_version(), "torch": torch.__version__,
                  "fastapi": fastapi.__version__,
                  "uvicorn": uvicorn.__version__, "httpx": httpx.__version__})
