"""``python -m minillm bench-serve``: an honest load generator for any OpenAI-compatible server
(chapter 10.6, design.md §2 and §4).

Flags carry the names of ``vllm bench serve`` (``--request-rate``, ``--burstiness``,
``--max-concurrency``, ``--goodput``, ``--percentile-metrics`` ...). What it does:

* **open loop**: request *i* is due at ``schedule[i]`` seconds after the start, a schedule
  computed up front from the seed (:func:`arrival_schedule`: Poisson, or Gamma gaps with shape
  ``--burstiness``; ``--request-rate inf`` sends everything at once). A slow server does not slow
  the arrivals (no coordinated omission). ``--max-concurrency`` caps requests in flight; a request
  then waits for a slot *after* its due time, and, as in vLLM, its clock starts when it is sent.
* **unique prompts** by default (a random prefix per request, so no prefix cache flatters the
  result); ``--same-prompt`` sends one prompt repeated, the deliberate deception for showing
  prefix caching.
* **streaming** with ``stream: true`` and ``stream_options: {include_usage: true}``: token counts
  come from the server's ``usage``, not from counting chunks (a chunk may hold several tokens).
* **every request accounted for**: ok, or failed with a reason (``HTTP 429``, ``connection
  closed``, ``server error event``, ``timeout``, ...). A failure never crashes the run.

Metrics are **not** computed here: every chunk's arrival time goes into a
:class:`~minillm.metrics.definitions.ClientRecord`, and
:func:`~minillm.metrics.definitions.client_request_metrics` + :func:`~minillm.metrics.summary.summarize` (+
:class:`~minillm.metrics.summary.SLO` for goodput) turn them into the numbers, exactly as everywhere else in
minillm.

Where these numbers match vLLM's client and where they differ (read against
``vllm/benchmarks/lib/endpoint_request_func.py``, ``async_request_openai_completions`` and
``async_request_openai_chat_completions``; check again when vLLM changes):

* **TTFT**: minillm stops the clock at the first chunk with *non-empty* text (design.md §2).
  vLLM's clients (completions and chat alike) stop it at the first chunk that has ``choices`` at
  all, even an empty one — the role-only ``{"delta": {"role": "assistant"}}`` chunk a chat server
  sends first, or a special token that decodes to no text — so vLLM's TTFT can be shorter than
  ours for the same stream, by up to a whole prefill when the role chunk is sent before it.
* **"ITL"**: vLLM's client-side ITL is the gap between *chunks*: when a server packs several
  tokens into one chunk the gaps inside it are invisible. minillm calls that **ICL** and says so
  in the table; it is the quantity vLLM reports as ITL (pooled over requests, chunk-weighted),
  except that vLLM counts a gap at every chunk with ``choices`` (empty ones too) and we count
  gaps between non-empty chunks only.
* **Success**: vLLM counts a 200 stream as successful once one chunk with ``choices`` arrived; we
  need one non-empty chunk (else there is no TTFT), a ``[DONE]``, and no ``error`` event. vLLM
  ignores an error event that arrives mid-stream (it has no ``choices``) and counts the request as
  ok; we count it as failed. A stream cut before ``[DONE]`` fails here; in vLLM only if the
  transport raises.
* **TPOT** = (E2E − TTFT) / (N_out − 1) per request, with N_out from the server's ``usage`` — the
  same as vLLM (which tokenizes the text itself only when the server sends no usage; without usage
  we count one token per non-empty chunk, an undercount when chunks hold several tokens).
  **E2E** here ends at the last non-empty chunk; vLLM's at the last chunk with ``choices``.
* **Throughput** window: first send → last completion; tokens and requests/s count successful
  requests only, as vLLM. **Goodput** = requests/s meeting every SLO given, as vLLM.
* **Request body**: vLLM's completions client sends no temperature (the server's default) and its
  chat client sends ``max_completion_tokens``; we send ``temperature: 0`` and ``max_tokens`` to both
  endpoints (``max_tokens`` is what minillm and most servers accept).
* **Prompt lengths**: vLLM's random dataset decodes random token ids with the model's tokenizer;
  this client knows no tokenizer, so ``--random-input-len`` is a *target* in words, and the input
  tokens reported are the server's ``usage.prompt_tokens`` (what was really processed).
* **Clock**: a request's clock starts when it is sent (after waiting for a ``--max-concurrency``
  slot), as in vLLM; ``send_lag_s`` in the saved records says how late that was after its due time
  in the open-loop schedule, so a client that could not keep up is visible, not hidden.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minillm.core.trace import now_ns
from minillm.engine.gc_pauses import GC_CLOCK
from minillm.loadgen.datasets import (
    BenchRequest,
    arrival_schedule,
    count_tokens,
    load_count_tokenizer,
    sample_requests,
)
from minillm.loadgen.sse import SSEParser, StreamCollector
from minillm.metrics.definitions import ClientRecord, client_request_metrics
from minillm.metrics.summary import SLO, Summary, percentile_table, summarize

METRICS = ("ttft", "tpot", "itl", "e2el")
POOL = 8                 # connections per httpx client (see arun_bench)


# ---------------------------------------------------------------------------------------------
# Sending
@dataclass
class BenchConfig:
    base_url: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    model: str | None = None
    num_prompts: int = 100
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    dataset_name: str = "random"
    dataset_path: str | None = None
    random_input_len: int = 128
    random_output_len: int = 64
    random_range_ratio: float = 0.0
    lognormal_sigma: float = 0.5
    same_prompt: bool = False
    warmup: int = 0
    timeout_s: float = 600.0
    temperature: float = 0.0
    goodput: dict[str, float] = field(default_factory=dict)      # metric → ms
    percentile_metrics: tuple[str, ...] = METRICS
    metric_percentiles: tuple[float, ...] = (50, 90, 99)
    tokenizer: str | None = None                # counts tokens (see load_count_tokenizer)
    sharegpt_output_len: int | None = None
    progress: bool = False                      # a progress bar on stderr (the CLI turns it on)
    prompt_nonce: int | None = None             # None: a fresh one per run (see sample_requests)

    @property
    def chat(self) -> bool:
        return "chat" in self.endpoint

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")

    def slo(self) -> SLO | None:
        if not self.goodput:
            return None
        g = self.goodput
        return SLO(ttft_s=g["ttft"] / 1e3 if "ttft" in g else None,
                   tpot_s=g["tpot"] / 1e3 if "tpot" in g else None,
                   e2e_s=g["e2el"] / 1e3 if "e2el" in g else None)


@dataclass
class RequestRecord:
    """One request, whatever became of it. ``status`` is the HTTP status (None: no response)."""
    index: int
    scheduled_s: float             # due time after the start (the open-loop schedule)
    record: ClientRecord
    status: int | None
    input_len: int                 # the dataset's target
    output_len: int                # max_tokens asked for
    usage: dict[str, Any] | None = None
    server_id: str | None = None
    finish_reason: str | None = None
    output_text: str = ""
    send_lag_s: float | None = None   # sent this long after its due time (slot wait, event loop)

    @property
    def ok(self) -> bool:
        """As the metrics see it: a stream that delivered no text at all has no TTFT and fails
        (vLLM's rule too), even with HTTP 200 and [DONE]."""
        return client_request_metrics(self.record).ok

    @property
    def error(self) -> str | None:
        return client_request_metrics(self.record).error


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def request_body(cfg: BenchConfig, model: str, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.output_len, "temperature": cfg.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


async def send_one(client, cfg: BenchConfig, model: str, req: BenchRequest, request_id: str,
                   index: int = 0, scheduled_s: float = 0.0) -> RequestRecord:
    """POST one streaming request and record it. Never raises (except cancellation)."""
    import httpx
    t_sent = now_ns()
    col = StreamCollector(request_id, t_sent, cfg.chat)
    status: int | None = None
    error: str | None = None
    headers = {**_headers(cfg.api_key), "x-request-id": request_id}

    async def stream() -> str | None:
        nonlocal status
        async with client.stream("POST", cfg.url, json=request_body(cfg, model, req), headers=headers) as r:
            status = r.status_code
            if status != 200:
                body = (await r.aread()).decode("utf-8", "replace")
                return f"HTTP {status}: {body[:300]}"
            parser = SSEParser()
            async for piece in r.aiter_text():
                t = now_ns()
                for data in parser.feed(piece):
                    col.event(data, t)
            for data in parser.close():
                col.event(data, now_ns())
        return None

    try:
        # httpx's timeout bounds each wait (connect, each read); this bounds the whole request,
        # so a server that trickles keep-alives forever still ends as a timeout
        error = await asyncio.wait_for(stream(), cfg.timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException) as e:
        error = f"timeout: no complete response within {cfg.timeout_s:g} s ({type(e).__name__})"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        error = f"connection closed: {type(e).__name__}: {e}"
    except httpx.ConnectError as e:
        error = f"connection failed: {e}"
    except asyncio.CancelledError:
        raise
    except Exception as e:              # anything else: a failed request, not a crashed benchmark
        error = f"{type(e).__name__}: {e}"
    rec = col.record(now_ns(), error, prompt_tokens_hint=0)
    return RequestRecord(index, scheduled_s, rec, status, req.input_len, req.output_len, col.usage,
                         col.server_id, col.finish_reason, "".join(col.text))


async def first_model(client, base_url: str, api_key: str | None) -> str:
    """The id of the first model of ``GET /v1/models`` (vLLM's default for ``--model``)."""
    import httpx
    try:
        r = await client.get(base_url.rstrip("/") + "/v1/models", headers=_headers(api_key))
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {base_url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise ValueError(f"GET /v1/models answered {r.status_code}: {r.text[:200]} (give --model)")
    data = r.json().get("data") or []
    if not data:
        raise ValueError("GET /v1/models lists no model (give --model)")
    return str(data[0]["id"])


@dataclass
class BenchResult:
    config: BenchConfig
    model: str
    records: list[RequestRecord]
    warmup_records: list[RequestRecord]
    summary: Summary
    percentiles: dict[str, dict[str, float]]     # metric → {"p50": ms, ...} (successful requests)
    started: str = ""
    client_gc_ms: float = 0.0                # garbage collection in the client's process during the timed run
    client_gc_collections: int = 0
    # the server's own view of the timed run, from its Prometheus /metrics (server_metrics.py): the
    # histograms' deltas between a scrape before and one after, with the source named
    server_view: dict[str, Any] | None = None
    server_view_lines: list[str] = field(default_factory=list)

    @property
    def n_ok(self) -> int:
        return self.summary.n_ok

    @property
    def n_failed(self) -> int:
        return self.summary.n_failed

    @property
    def max_send_lag_ms(self) -> float | None:
        lags = [r.send_lag_s for r in self.records if r.send_lag_s is not None]
        return max(lags) * 1e3 if lags else None

    def failures(self) -> dict[str, int]:
        """Failure reasons, by kind (``HTTP 429``, ``connection closed`` ...), with counts."""
        out: dict[str, int] = {}
        for r in self.records:
            if not r.ok:
                kind = (r.error or "failed").split(":")[0]
                out[kind] = out.get(kind, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        def rec(r: RequestRecord) -> dict[str, Any]:
            m = client_request_metrics(r.record)
            return {"index": r.index, "request_id": r.record.request_id, "server_id": r.server_id,
                    "scheduled_s": r.scheduled_s, "send_lag_s": r.send_lag_s, "status": r.status, "ok": m.ok,
                    "error": m.error,
                    "input_len_target": r.input_len, "max_tokens": r.output_len, "usage": r.usage,
                    "prompt_tokens": m.prompt_tokens, "output_tokens": m.output_tokens,
                    "finish_reason": r.finish_reason, "ttft_s": m.ttft_s, "tpot_s": m.tpot_s,
                    "e2e_s": m.e2e_s,
                    "icl_s": m.itl_s, "t_sent_ns": r.record.t_sent_ns, "t_done_ns": r.record.t_done_ns,
                    "chunks": [[t, n, text] for t, n, text in r.record.chunks]}
        cfg = asdict(self.config)
        cfg["api_key"] = "***" if cfg.get("api_key") else None        # never write a key to disk
        cfg["request_rate"] = (str(cfg["request_rate"]) if math.isinf(cfg["request_rate"])
                               else cfg["request_rate"])
        import platform
        import sys

        import httpx
        return {"tool": "minillm bench-serve", "started": self.started, "model": self.model, "config": cfg,
                "command": " ".join(sys.argv), "versions": {"python": platform.python_version(),
                                                            "httpx": httpx.__version__,
                                                            "numpy": np.__version__},
                "send_lag_max_ms": self.max_send_lag_ms,
                "client_gc_ms": self.client_gc_ms, "client_gc_collections": self.client_gc_collections,
                "summary": self.summary.to_dict(), "percentiles_ms": self.percentiles,
                "failures": self.failures(), "server_view": self.server_view,
                "requests": [rec(r) for r in self.records],
                "warmup_requests": [rec(r) for r in self.warmup_records]}

    def server_diagnosis(self):
        """``diagnose`` from the server's own histograms over the timed run (scraped after the
        warm-up and after the last request), for a server without ``/v1/traces``; None when its
        ``/metrics`` could not be read (``server_view_lines`` says why)."""
        from minillm.metrics.diagnose import ServerStage, diagnose_server_histograms
        v = self.server_view
        if v is None:
            return None
        stages = {k: ServerStage(**st) if st is not None else None for k, st in v["stages"].items()}
        return diagnose_server_histograms(stages, v["source"], v["window"])

    def table(self) -> str:
        s = self.summary
        w = 34
        def fmt(x):
            return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"
        lines = ["=" * 20 + " Serving Benchmark Result " + "=" * 20,
                 f"{'Model:':<{w}}{self.model}",
                 f"{'Successful requests:':<{w}}{s.n_ok}",
                 f"{'Failed requests:':<{w}}{s.n_failed}"]
        for kind, n in sorted(self.failures().items()):
            lines.append(f"  {n} × {kind}")
        rate = self.config.request_rate
        lines += [f"{'Request rate (req/s):':<{w}}{rate}"
                  + (f" (burstiness {self.config.burstiness:g})" if not math.isinf(rate) else ""),
                  f"{'Max concurrency:':<{w}}{self.config.max_concurrency or '-'}",
                  f"{'Warm-up requests (excluded):':<{w}}{len(self.warmup_records)}",
                  f"{'Max send lag (ms):':<{w}}{fmt(self.max_send_lag_ms)}  (sent after its due time)",
                  f"{'Client-process GC (ms):':<{w}}{self.client_gc_ms:.2f}  ({self.client_gc_collections} "
                  "collections in the client's process, a server sharing it included: they delay its "
                  "timestamps)",
                  f"{'Benchmark duration (s):':<{w}}{s.duration_s:.2f}",
                  f"{'Total input tokens:':<{w}}{s.input_tokens}",
                  f"{'Total generated tokens:':<{w}}{s.output_tokens}",
                  f"{'Request throughput (req/s):':<{w}}{fmt(s.requests_s)}",
                  f"{'Input token throughput (tok/s):':<{w}}{fmt(s.input_tok_s)}",
                  f"{'Output token throughput (tok/s):':<{w}}{fmt(s.output_tok_s)}"]
        if s.slo is not None:
            lines.append(f"{'Request goodput (req/s):':<{w}}{fmt(s.goodput_rps)}  "
                         f"({s.n_good}/{s.n_ok} met {s.slo.describe()})")
        names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-chunk Latency (ICL; vLLM's 'ITL')", "e2el": "End-to-end Latency"}
        for k in self.config.percentile_metrics:
            lines.append("-" * 20 + f" {names[k]} " + "-" * 10)
            for stat, v in self.percentiles[k].items():
                # one replacement field padded as a whole: an f-string cannot break inside it
                lines.append(f"{(stat.replace('p', 'P', 1) if stat.startswith('p') else stat.title()) + ' ' + k.upper() + ' (ms):':<{w}}{fmt(v)}")  # noqa: E501
        if self.server_view_lines:
            lines.append("-" * 20 + " The server's own view " + "-" * 10)
            lines += self.server_view_lines
        lines.append("=" * 66)
        return "\n".join(lines)

    def save(self, result_dir: str | Path = ".", filename: str | None = None) -> Path:
        d = Path(result_dir)
        d.mkdir(parents=True, exist_ok=True)
        name = filename or f"bench-serve-{self.model.replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        p = d / name
        p.write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False, default=_json_default),
                     encoding="utf-8")
        return p


def _json_default(x: Any) -> Any:
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return str(x)


async def arun_bench(cfg: BenchConfig, transport=None,
                     schedule: Sequence[float] | None = None) -> BenchResult:
    """Run the benchmark (see the module docstring). ``transport``: an httpx transport (tests)."""
    import httpx
    if cfg.endpoint.rstrip("/") not in ("/v1/completions", "/v1/chat/completions"):
        raise ValueError(f"--endpoint must be /v1/completions or /v1/chat/completions, got {cfg.endpoint!r}")
    if cfg.max_concurrency is not None and cfg.max_concurrency < 1:
        raise ValueError("--max-concurrency must be ≥ 1")
    if cfg.warmup < 0:
        raise ValueError("--warmup must be ≥ 0")
    unknown = set(cfg.percentile_metrics) - set(METRICS)
    if unknown:
        raise ValueError(f"--percentile-metrics takes {', '.join(METRICS)}, got {sorted(unknown)}")
    slo = cfg.slo()
    tok = load_count_tokenizer(cfg.tokenizer)
    reqs = sample_requests(cfg.num_prompts + cfg.warmup, cfg.dataset_name, cfg.random_input_len,
                           cfg.random_output_len, cfg.random_range_ratio, cfg.lognormal_sigma,
                           cfg.dataset_path,
                           cfg.same_prompt, cfg.seed, tok, cfg.sharegpt_output_len, cfg.prompt_nonce)
    warm, reqs = reqs[:cfg.warmup], reqs[cfg.warmup:]
    sched = list(schedule) if schedule is not None else \
        arrival_schedule(len(reqs), cfg.request_rate, cfg.burstiness, cfg.seed)
    if len(sched) != len(reqs):
        raise ValueError(f"{len(reqs)} requests but {len(sched)} send times")
    n_conn = (cfg.max_concurrency or len(reqs) + len(warm) or 1) + 8
    # Several small clients, request i on client i mod K: httpcore's pool scans every waiting
    # request against every connection each time one is assigned (quadratic in its size); pools
    # of POOL connections keep that scan short, which took the client from ~130 to the rates
    # `bench-client` reports (measured there against a stub server).
    n_clients = math.ceil(n_conn / POOL)
    limits = httpx.Limits(max_connections=POOL, max_keepalive_connections=POOL)
    kw: dict[str, Any] = {"transport": transport} if transport is not None else {}
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if transport is None:            # one TLS context for all of them (building one reads the CA file)
        import ssl

        import certifi
        kw["verify"] = ssl.create_default_context(cafile=certifi.where())
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(
            httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(cfg.timeout_s),
                              **kw)) for _ in range(n_clients)]
        model = cfg.model or await first_model(clients[0], cfg.base_url, cfg.api_key)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        tag = os.urandom(3).hex()
        bar = _progress_bar(len(reqs) + len(warm)) if cfg.progress else None

        async def limited(i: int, req: BenchRequest, rid: str, sched_s: float) -> RequestRecord:
            client = clients[i % n_clients]
            if sem is None:
                rec = await send_one(client, cfg, model, req, rid, i, sched_s)
            else:
                async with sem:
                    rec = await send_one(client, cfg, model, req, rid, i, sched_s)
            if bar is not None:
                bar.update(1)
            return rec

        warm_recs = list(await asyncio.gather(*(limited(i, r, f"warmup-{tag}-{i}", 0.0)
                                                 for i, r in enumerate(warm))))
        # The client is a Python process too: a collection of its heap pauses its event loop, and
        # every timestamp it takes meanwhile is late (10.5, 10.6). Start the timed run with a clean
        # heap and report what the collector took during it.
        before = await _scrape_quietly(clients[0], cfg.base_url)
        gc.collect()
        gc_ns, gc_n = GC_CLOCK.spent_ns(), GC_CLOCK.collections
        t0 = time.perf_counter()
        t0_ns = now_ns()
        tasks = []
        for i, (req, due) in enumerate(zip(reqs, sched)):
            delay = t0 + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(i, req, f"bench-{tag}-{i:05d}", due)))
        records = list(await asyncio.gather(*tasks))
        gc_ns, gc_n = GC_CLOCK.spent_ns() - gc_ns, GC_CLOCK.collections - gc_n
        view, view_lines = _server_view(before, await _scrape_quietly(clients[0], cfg.base_url))
    if bar is not None:
        bar.close()
    for r in records:
        r.send_lag_s = (r.record.t_sent_ns - t0_ns) / 1e9 - r.scheduled_s
    if tok is not None:
        _count_without_usage(records, reqs, tok)
    summary = summarize([client_request_metrics(r.record) for r in records], slo=slo)
    pct = percentile_table([client_request_metrics(r.record) for r in records], cfg.percentile_metrics,
                           cfg.metric_percentiles)
    return BenchResult(cfg, model, records, warm_recs, summary, pct, started,
                       client_gc_ms=gc_ns / 1e6, client_gc_collections=gc_n, server_view=view,
                       server_view_lines=view_lines)


async def _scrape_quietly(client, base_url: str):
    """The server's /metrics, or (None, why): a server without one never fails a benchmark."""
    from minillm.loadgen.server_metrics import ascrape
    try:
        return await ascrape(base_url, client)
    except Exception as e:             # a test transport or an odd server: the view is optional
        return None, f"GET /metrics failed: {type(e).__name__}: {e}"


def _server_view(before, after) -> tuple[dict[str, Any] | None, list[str]]:
    """The histograms' deltas over the timed run, as data and as report lines naming the source."""
    from minillm.loadgen.server_metrics import NOT_AVAILABLE, server_view
    (b, _), (a, why) = before, after
    if a is None:
        return None, [f"queue, prefill and the other server-side stages: {NOT_AVAILABLE} ({why})"]
    view = server_view(a, b)
    return view.to_dict(), view.lines()


def _progress_bar(total: int):
    """tqdm on stderr (as vLLM's client), or None when tqdm is not installed."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="requests", unit="req", leave=False)


def _count_without_usage(records: Sequence[RequestRecord], reqs: Sequence[BenchRequest], tok) -> None:
    """A server that sends no ``usage``: count with the user's tokenizer (vLLM's fallback too).
    For chat the server's template adds tokens the client cannot see; the count is the content's."""
    for r, q in zip(records, reqs):
        if r.usage is None and r.record.ok:
            r.record.completion_tokens = count_tokens(tok, r.output_text)
            r.record.prompt_tokens = count_tokens(tok, q.prompt)


def run_bench(cfg: BenchConfig, transport=None, schedule: Sequence[float] | None = None) -> BenchResult:
    """:func:`arun_bench` from synchronous code (a fresh event loop in a helper thread, so it
    works inside Jupyter too)."""
    from minillm.loadgen.http_overhead import run_in_fresh_loop
    return run_in_fresh_loop(lambda: arun_bench(cfg, transport, schedule), "minillm-bench-serve")


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` → ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds, vLLM's form)."""
    out: dict[str, float] = {}
    for it in items or []:
        k, sep, v = it.partition(":")
        if not sep or k not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {it!r}")
        try:
            ms = float(v)
        except ValueError:
            raise ValueError(f"--goodput {it!r}: {v!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput {it!r}: the limit must be > 0 ms")
        out[k] = ms
    return out


