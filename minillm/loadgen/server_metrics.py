"""The server's own view of a run, from its Prometheus ``GET /metrics`` (10.2, 10.6): a scrape before
and one after, the histograms' deltas (count, sum, buckets), and from them a mean and bucket quantiles
per stage, with each engine's names mapped onto the chapter's stages.

Any OpenAI-compatible server may be on the other end, and each names its metrics its own way:

* **vLLM** (``vllm/v1/metrics/loggers.py`` in vllm-project/vllm): histograms
  ``vllm:request_queue_time_seconds`` (WAITING), ``vllm:request_prefill_time_seconds``,
  ``vllm:request_decode_time_seconds``, ``vllm:time_to_first_token_seconds``,
  ``vllm:inter_token_latency_seconds`` (before 0.11 ``vllm:time_per_output_token_seconds``),
  ``vllm:request_time_per_output_token_seconds``, ``vllm:e2e_request_latency_seconds``; gauges
  ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``. ``minillm serve`` exports the same
  names and buckets (``minillm/serving/prom.py``), with ``minillm:rejected_requests_total`` beside them.
* **SGLang** (``python/sglang/srt/metrics/collector.py`` in sgl-project/sglang): histograms
  ``sglang:queue_time_seconds``, ``sglang:time_to_first_token_seconds``,
  ``sglang:inter_token_latency_seconds``, ``sglang:e2e_request_latency_seconds``; no prefill histogram
  of its own, so "prefill" is not available from it (TTFT − queue is shown instead, labelled so).
* **llama.cpp** ``llama-server --metrics`` (``tools/server/server-context.cpp``, formerly
  ``tools/server/server.cpp``, in ggml-org/llama.cpp): no histograms at all, only counters
  ``llamacpp:prompt_tokens_total``, ``llamacpp:prompt_seconds_total``,
  ``llamacpp:tokens_predicted_total``, ``llamacpp:tokens_predicted_seconds_total``,
  ``llamacpp:n_decode_total`` and gauges ``llamacpp:requests_processing``,
  ``llamacpp:requests_deferred``. Prefill and decode *throughput* can be had from the counters'
  deltas; a per-request queue time, TTFT or ITL cannot: they are "not available from this server".

A quantile from buckets is an estimate (Prometheus' ``histogram_quantile``: linear inside the bucket
it falls in), only as fine as the buckets; the mean (sum / count) is exact.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from minillm.metrics.diagnose import ServerStage

NOT_AVAILABLE = "not available from this server"
STAGE_NAMES = ("queue", "prefill", "decode", "ttft", "itl", "tpot", "e2e")


# ---------------------------------------------------------------------------------------------
# The text format
@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


def parse_sample(line: str) -> Sample | None:
    """One sample line (``name{labels} value [timestamp]``), or None for a line that is not one.
    The line is read by ``prometheus_client``'s parser (labels with their escapes, "+Inf", exponents);
    a line it refuses is skipped, so one odd line never loses the rest of a scrape."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    try:
        for fam in text_string_to_metric_families(line + "\n"):
            for s in fam.samples:
                return Sample(s.name, tuple(s.labels.items()), float(s.value))
    except ValueError:
        return None
    return None


class PromTextParser:
    """An incremental parser of Prometheus' text format: :meth:`feed` takes pieces (a network read
    may end mid-line), :meth:`close` returns the :class:`Scrape`."""

    def __init__(self) -> None:
        self._buf = ""
        self.samples: list[Sample] = []
        self.types: dict[str, str] = {}

    def feed(self, text: str) -> None:
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self._line(line)

    def _line(self, line: str) -> None:
        line = line.rstrip("\r")
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4:
                self.types[parts[2]] = parts[3]
            return
        s = parse_sample(line)
        if s is not None:
            self.samples.append(s)

    def close(self, t_s: float | None = None) -> "Scrape":
        if self._buf:
            self._line(self._buf)
            self._buf = ""
        return Scrape(self.samples, self.types, time.time() if t_s is None else t_s)


def parse_metrics(text: str, t_s: float | None = None) -> "Scrape":
    p = PromTextParser()
    p.feed(text)
    return p.close(t_s)


# ---------------------------------------------------------------------------------------------
# Histograms
@dataclass
class Histogram:
    """One histogram family summed over its label sets (engines, models): cumulative buckets."""
    buckets: list[tuple[float, float]]      # (le, cumulative count), sorted, +Inf last
    count: float
    sum: float

    def minus(self, before: "Histogram | None") -> "Histogram":
        """The delta since ``before`` (a histogram only grows; a server restart makes it shrink)."""
        if before is None:
            return self
        prev = dict(before.buckets)
        return Histogram([(le, c - prev.get(le, 0.0)) for le, c in self.buckets],
                         self.count - before.count, self.sum - before.sum)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """Prometheus' ``histogram_quantile``: the rank q·count, linear inside its bucket (from 0
        for the first bucket); in the +Inf bucket, the largest finite bound."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_le, lower_c = 0.0, 0.0
        for le, c in self.buckets:
            if c >= rank:
                if math.isinf(le):
                    return lower_le
                if c == lower_c:
                    return le
                return lower_le + (le - lower_le) * (rank - lower_c) / (c - lower_c)
            lower_le, lower_c = le, c
        return lower_le

    def stage(self) -> ServerStage:
        """Count, exact mean, and p50/p99 from the buckets, each at most what the mean allows: no more
        than a fraction 1 − q of non-negative values can exceed mean ÷ (1 − q) (Markov's inequality).
        Interpolating inside a wide first bucket otherwise says where the bucket ends: vLLM's
        queue-time buckets start at 0.3 s, and a window of 3 ms queues (exact mean) read as p50 150 ms."""
        mean = self.mean

        def bounded(q: float) -> float | None:
            est = self.quantile(q)
            return est if est is None or mean is None else min(est, mean / (1 - q))
        return ServerStage(count=int(round(self.count)), mean_s=mean, p50_s=bounded(0.5), p99_s=bounded(0.99))


@dataclass
class Scrape:
    samples: list[Sample]
    types: dict[str, str]
    t_s: float                                 # when it was read (wall clock, seconds)

    def families(self) -> set[str]:
        names = set(self.types)
        for s in self.samples:
            names.add(s.name)
            for suffix in ("_bucket", "_count", "_sum", "_total"):
                if s.name.endswith(suffix):
                    names.add(s.name[:-len(suffix)])
        return names

    def value(self, name: str) -> float | None:
        """A counter's or gauge's value summed over its label sets; None when the server has none."""
        vals = [s.value for s in self.samples if s.name == name]
        return sum(vals) if vals else None

    def histogram(self, family: str) -> Histogram | None:
        """``family``'s ``_bucket``/``_count``/``_sum`` summed over every label set but ``le``."""
        buckets: dict[float, float] = {}
        for s in self.samples:
            if s.name == family + "_bucket":
                le = s.label("le")
                if le is not None:
                    key = float(le)
                    buckets[key] = buckets.get(key, 0.0) + s.value
        count, total = self.value(family + "_count"), self.value(family + "_sum")
        if count is None or total is None:
            return None
        return Histogram(sorted(buckets.items()), count, total)


# ---------------------------------------------------------------------------------------------
# Each engine's names
@dataclass(frozen=True)
class EngineNames:
    engine: str                                     # "vLLM", "SGLang", "llama.cpp"
    marker: str                                     # a family only this engine exports
    histograms: dict[str, tuple[str, ...]]          # stage → family names, newest first
    counters: dict[str, str] = field(default_factory=dict)
    gauges: dict[str, str] = field(default_factory=dict)


VLLM = EngineNames(
    "vLLM", "vllm:num_requests_running",
    {"queue": ("vllm:request_queue_time_seconds",), "prefill": ("vllm:request_prefill_time_seconds",),
     "decode": ("vllm:request_decode_time_seconds",), "ttft": ("vllm:time_to_first_token_seconds",),
     "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
     "tpot": ("vllm:request_time_per_output_token_seconds",),
     "e2e": ("vllm:e2e_request_latency_seconds",)},
    {"prompt_tokens": "vllm:prompt_tokens_total", "generation_tokens": "vllm:generation_tokens_total"},
    {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting"})
SGLANG = EngineNames(
    "SGLang", "sglang:num_running_reqs",
    {"queue": ("sglang:queue_time_seconds",), "ttft": ("sglang:time_to_first_token_seconds",),
     "itl": ("sglang:inter_token_latency_seconds",), "e2e": ("sglang:e2e_request_latency_seconds",)},
    {},
    {"running": "sglang:num_running_reqs", "waiting": "sglang:num_queue_reqs"})
LLAMACPP = EngineNames(
    "llama.cpp", "llamacpp:n_decode_total", {},
    {"prompt_tokens": "llamacpp:prompt_tokens_total", "prompt_seconds": "llamacpp:prompt_seconds_total",
     "generation_tokens": "llamacpp:tokens_predicted_total",
     "generation_seconds": "llamacpp:tokens_predicted_seconds_total",
     "decode_calls": "llamacpp:n_decode_total"},
    {"running": "llamacpp:requests_processing", "waiting": "llamacpp:requests_deferred"})
ENGINES = (VLLM, SGLANG, LLAMACPP)


def detect_engine(scrape: Scrape) -> EngineNames | None:
    """Which engine's names this /metrics uses (None: none that minillm knows)."""
    fams = scrape.families()
    for e in ENGINES:
        if e.marker in fams or any(n in fams for names in e.histograms.values() for n in names) \
                or any(n in fams for n in e.counters.values()):
            return e
    return None


def source_label(scrape: Scrape, engine: EngineNames | None) -> str:
    if engine is None:
        return "the server's /metrics (no names minillm knows)"
    if engine is VLLM and any(f.startswith("minillm:") for f in scrape.families()):
        return "the server's /metrics (vLLM names, as minillm serve exports them)"
    return f"the server's /metrics ({engine.engine} names)"


# ---------------------------------------------------------------------------------------------
# The view of one run
@dataclass
class ServerView:
    """What the server's /metrics says of the requests between two scrapes (or since it started)."""
    engine: str | None
    source: str                                  # "the server's /metrics (vLLM names)"
    window: str                                  # "between two scrapes 12.3 s apart", "since it started"
    stages: dict[str, ServerStage | None]        # STAGE_NAMES → stats, None: not available
    counters: dict[str, float | None]            # deltas
    gauges: dict[str, float | None]              # at the last scrape
    families: dict[str, str | None] = field(default_factory=dict)   # stage → the family read

    def missing(self) -> list[str]:
        return [s for s, v in self.stages.items() if v is None]

    def lines(self) -> list[str]:
        """The view as text, a stage a line; what the server lacks is said, never shown as 0."""
        out = [f"from {self.source}, {self.window}:"]
        for st in STAGE_NAMES:
            v = self.stages.get(st)
            if v is None:
                out.append(f"  {st:8s} {NOT_AVAILABLE}")
            elif v.count == 0 or v.mean_s is None:
                out.append(f"  {st:8s} no requests recorded ({self.families.get(st)})")
            else:
                out.append(f"  {st:8s} mean {_ms(v.mean_s)}, p50 ≈ {_ms(v.p50_s)}, p99 ≈ {_ms(v.p99_s)} "
                           f"over {v.count} (quantiles from buckets; {self.families.get(st)})")
        if self.stages.get("prefill") is None and self.stages.get("queue") and self.stages.get("ttft"):
            q, t = self.stages["queue"], self.stages["ttft"]
            if q.mean_s is not None and t.mean_s is not None:
                out.append(f"  TTFT − queue (prefill and whatever else precedes the first token): mean "
                           f"{_ms(max(0.0, t.mean_s - q.mean_s))}")
        rates = throughput_from_counters(self.counters)
        out += [f"  {k}: {v:.1f} tok/s of the server's own busy time" for k, v in rates.items()]
        for g, v in self.gauges.items():
            out.append(f"  {g} now: " + (NOT_AVAILABLE if v is None else f"{v:g}"))
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["not_available"] = self.missing()
        return d


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


def throughput_from_counters(counters: dict[str, float | None]) -> dict[str, float]:
    """llama.cpp's pairs of token and seconds counters → prefill and decode tok/s (its busy time)."""
    out = {}
    for label, tok, sec in (("prefill", "prompt_tokens", "prompt_seconds"),
                            ("decode", "generation_tokens", "generation_seconds")):
        t, s = counters.get(tok), counters.get(sec)
        if t is not None and s:
            out[label] = t / s
    return out


def server_view(after: Scrape, before: Scrape | None = None) -> ServerView:
    """The histograms' deltas between ``before`` and ``after`` (``before`` None: since the server
    started), mapped onto the chapter's stages with the engine's own names."""
    engine = detect_engine(after)
    window = (f"between two scrapes {after.t_s - before.t_s:.1f} s apart" if before is not None
              else "since the server started (cumulative)")
    stages: dict[str, ServerStage | None] = {}
    fams: dict[str, str | None] = {}
    for st in STAGE_NAMES:
        stages[st], fams[st] = None, None
        for fam in (engine.histograms.get(st, ()) if engine else ()):
            h = after.histogram(fam)
            if h is not None:
                stages[st] = h.minus(before.histogram(fam) if before is not None else None).stage()
                fams[st] = fam
                break
    counters: dict[str, float | None] = {}
    for key, name in (engine.counters.items() if engine else ()):
        a = after.value(name)
        b = before.value(name) if before is not None else None
        counters[key] = None if a is None else a - (b or 0.0)
    gauges = {key: after.value(name) for key, name in (engine.gauges.items() if engine else ())}
    return ServerView(engine.engine if engine else None, source_label(after, engine), window, stages,
                      counters, gauges, fams)


# ---------------------------------------------------------------------------------------------
# Over HTTP
def scrape(base_url: str, client=None, timeout_s: float = 10.0) -> tuple[Scrape | None, str | None]:
    """``GET /metrics`` → (Scrape, None), or (None, why) when the server has none or refuses."""
    import httpx
    root = base_url.rstrip("/")
    root = root[:-3] if root.endswith("/v1") else root
    own = client is None
    client = client or httpx.Client(timeout=timeout_s)
    try:
        r = client.get(root + "/metrics")
    except httpx.HTTPError as e:
        return None, f"GET /metrics failed: {type(e).__name__}: {e}"
    finally:
        if own:
            client.close()
    if r.status_code != 200:
        return None, f"GET /metrics answered {r.status_code} (llama-server needs --metrics)"
    p = PromTextParser()
    for piece in r.iter_text():
        p.feed(piece)
    return p.close(), None


async def ascrape(base_url: str, client) -> tuple[Scrape | None, str | None]:
    """:func:`scrape` with an ``httpx.AsyncClient`` (bench-serve's own); never raises."""
    import httpx
    root = base_url.rstrip("/")
    root = root[:-3] if root.endswith("/v1") else root
    try:
        r = await client.get(root + "/metrics")
    except (httpx.HTTPError, OSError) as e:
        return None, f"GET /metrics failed: {type(e).__name__}: {e}"
    if r.status_code != 200:
        return None, f"GET /metrics answered {r.status_code}"
    return parse_metrics(r.text), None
