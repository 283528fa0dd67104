"""Performance metrics of inference requests, computed from recorded data only (design.md §2).

Everything here is a pure function over plain data: an engine :class:`~minillm.core.trace.Trace`
(engine side) or a :class:`ClientRecord` (what an HTTP client saw). Nothing is timed here, so
every number a notebook prints can be traced back to recorded timestamps (chapter 10.2).

The names mean what they mean in ``vllm bench serve``:

* **TTFT**  first output token delivered − request received.
* **E2E**   last output token delivered − request received.
* **TPOT**  per request, (E2E − TTFT) / (N_out − 1), only for N_out ≥ 2. Its statistics are
  *request-weighted*: one value per request, a 2-token request weighs as much as a 500-token one.
* **ITL**   every gap between consecutive output tokens, pooled over all requests, so its
  statistics are *token-weighted*: long requests dominate. For one request, mean ITL = TPOT;
  over many requests, mean ITL ≠ mean TPOT (see tests/test_metrics.py for a worked example).
* **ICL**   inter-*chunk* latency: the gaps a client sees between streamed chunks. When a server
  packs several tokens into one chunk the client cannot see the gaps inside it. vLLM's
  client-side "ITL" is really ICL; guidellm and AIPerf call our TPOT "ITL". Compare tools
  only after checking which of the three a number is (chapter 10.6).
* **Throughput** input and output tokens/s *separately* (a prefill-heavy and a decode-heavy
  workload differ by orders of magnitude in tok/s), over the window first arrival → last
  completion, as vLLM does; optionally a steady-state window beside it (:class:`SteadyWindow`).
* **Goodput** requests/s that met every given SLO (:class:`SLO`), as vLLM's ``--goodput``.

Percentiles use numpy's default (linear) interpolation, like vLLM.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from minillm.core.trace import Trace

# ---------------------------------------------------------------------------------------------
# Stages of TTFT (chapter 10.2): the stage each milestone event *closes*. The time from one
# milestone to the next is charged to the stage of the later one, so the stages telescope:
# they add up to TTFT exactly, whatever subset of events a trace happens to hold.
STAGES = ("gateway", "body", "tokenize", "queue", "prefill", "first_token")
STAGE_OF_EVENT = {
    "received": "gateway",        # only a second `received` (the first one starts the clock)
    "authenticated": "gateway",
    "admitted": "gateway",
    "rejected": "gateway",
    "body_read": "body",          # the request body received and parsed as JSON (server side)
    "tokenized": "tokenize",
    "enqueued": "queue",
    "scheduled": "queue",
    "preempted": "queue",
    "prefill_start": "prefill",   # scheduled → prefill_start: assembling the batch's input
    "prefill_end": "prefill",     # the forward pass over the prompt
    "first_token": "prefill",
}
# Events that mark the end of the forward pass: after them, the gap to the first `token`
# is sampling + copying the token id to the host ("first_token"); without them, it is prefill.
_PREFILL_DONE = ("prefill_end", "first_token")

FAILED_REASONS = ("error",)
PERCENTILES = (50, 90, 95, 99)


def _s(ns: int | float) -> float:
    return ns / 1e9


# ---------------------------------------------------------------------------------------------
# One request
@dataclass
class RequestMetrics:
    """The metrics of one request. Times in seconds; ``None`` where undefined.

    ``itl_s`` holds the token gaps on the engine side and the chunk gaps (ICL) on the client
    side; ``side`` says which. ``breakdown`` splits TTFT into :data:`STAGES` (engine side only;
    empty for a client, which cannot see inside the server). ``deliveries`` lists
    ``(t_ns, n_tokens)`` for every delivery of output tokens, used by the steady-state window.
    """
    request_id: str
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    e2e_s: float | None
    tpot_s: float | None
    itl_s: list[float]
    breakdown: dict[str, float]
    t_start_ns: int
    t_end_ns: int
    ok: bool
    finish_reason: str | None
    side: str = "engine"
    error: str | None = None
    deliveries: list[tuple[int, int]] = field(default_factory=list, repr=False)

    @property
    def t_first_token_ns(self) -> int | None:
        return self.deliveries[0][0] if self.deliveries else None


def _tpot(ttft_s: float | None, e2e_s: float | None, n_out: int) -> float | None:
    # With a single token there is no decode step to average over (vLLM skips it too).
    if ttft_s is None or e2e_s is None or n_out < 2:
        return None
    return (e2e_s - ttft_s) / (n_out - 1)


def ttft_breakdown(trace: Trace) -> dict[str, float]:
    """Split TTFT into :data:`STAGES` (seconds) so that the values sum to TTFT exactly.

    Milestones are the events in :data:`STAGE_OF_EVENT` recorded before the first ``token``,
    taken in time order; each gap between consecutive milestones goes to the stage of the
    event that closes it. The engine tokenizes before it enqueues, but any order, and any
    missing event, works: with no gateway events ``gateway`` is 0; with no ``prefill_end``
    the whole scheduled → first-token gap is ``prefill``. The last gap (→ first token) is
    ``first_token`` (sampling, host copy) after ``prefill_end``. If the engine stamps
    ``prefill_end`` without synchronising the device, the device wait lands in
    ``first_token`` instead of ``prefill`` (design.md §1). Empty dict if no token was produced.
    """
    events = list(trace)
    i_first = next((i for i, e in enumerate(events) if e.event == "token"), None)
    if i_first is None:
        return {}
    t_first = events[i_first].t_ns
    t0 = _start_ns(trace)
    out = {stage: 0 for stage in STAGES}
    milestones = sorted((e for e in events[:i_first] if e.event in STAGE_OF_EVENT),
                        key=lambda e: e.t_ns)          # stable: ties keep recording order
    t_prev, last = t0, None
    for e in milestones:
        t = min(max(e.t_ns, t0), t_first)              # clamp: stages never go negative
        out[STAGE_OF_EVENT[e.event]] += t - t_prev
        t_prev, last = t, e.event
    out["first_token" if last in _PREFILL_DONE else "prefill"] += t_first - t_prev
    return {stage: _s(ns) for stage, ns in out.items()}


def _start_ns(trace: Trace) -> int:
    rec = trace.first("received")
    return rec.t_ns if rec is not None else min(e.t_ns for e in trace)


def request_metrics(trace: Trace) -> RequestMetrics:
    """Engine-side metrics of one request from its trace (``token`` events = delivery times).

    Start = ``received`` (else the earliest event); end = ``finished`` (else the last event).
    Prompt tokens = ``tokenized.n_tokens`` (else ``admitted.prompt_tokens``, else 0).
    A request is failed if it was ``rejected``, finished with reason ``"error"``, or produced
    no output token (as in vLLM: without a first token there is no TTFT).
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"request_metrics needs a Trace, got {type(trace).__name__}")
    if len(trace) == 0:
        raise ValueError(f"trace of request {trace.request_id!r} is empty")
    t0 = _start_ns(trace)
    times = trace.times("token")
    if any(b < a for a, b in zip(times, times[1:])):
        raise ValueError(f"token timestamps of request {trace.request_id!r} go backwards")
    if times and times[0] < t0:
        raise ValueError(f"request {trace.request_id!r}: first token precedes `received`")

    fin = trace.last("finished")
    reason = fin.extra.get("reason") if fin is not None else None
    rejected = trace.first("rejected")
    error = None
    if rejected is not None:
        error = "rejected" + "".join(f" {k}={v}" for k, v in rejected.extra.items())
    elif reason in FAILED_REASONS:
        error = str(fin.extra.get("error", "finished with reason 'error'"))
    elif not times:
        error = "no output token"

    tok, adm = trace.first("tokenized"), trace.first("admitted")
    if tok is not None and "n_tokens" in tok.extra:
        prompt_tokens = int(tok.extra["n_tokens"])
    elif adm is not None and "prompt_tokens" in adm.extra:
        prompt_tokens = int(adm.extra["prompt_tokens"])
    else:
        prompt_tokens = 0

    ttft = _s(_first_text_token_ns(trace, times) - t0) if times else None
    e2e = _s(times[-1] - t0) if times else None
    return RequestMetrics(
        request_id=trace.request_id, prompt_tokens=prompt_tokens, output_tokens=len(times),
        ttft_s=ttft, e2e_s=e2e, tpot_s=_tpot(ttft, e2e, len(times)),
        itl_s=[_s(b - a) for a, b in zip(times, times[1:])],
        breakdown=ttft_breakdown(trace),
        t_start_ns=t0, t_end_ns=fin.t_ns if fin is not None else max(e.t_ns for e in trace),
        ok=error is None, finish_reason=reason, side="engine", error=error,
        deliveries=[(t, 1) for t in times])


def _first_text_token_ns(trace: Trace, times: list[int]) -> int:
    """TTFT ends at the first *non-empty* token delivered (design.md §2): a token that is half
    a UTF-8 character, or text held back by a stop string, delivers nothing yet. The engine
    records ``detokenized`` right after the step whose token released the text, so the first
    non-empty token is the last ``token`` at or before the first ``detokenized``. A trace with
    no ``detokenized`` event (no text at all, or hand-made) uses the first token."""
    det = trace.first("detokenized")
    if det is None:
        return times[0]
    before = [t for t in times if t <= det.t_ns]
    return before[-1] if before else times[0]


def metrics_from_traces(traces: Iterable[Trace]) -> list[RequestMetrics]:
    return [request_metrics(t) for t in traces]


# ---------------------------------------------------------------------------------------------
# The client's view
@dataclass
class ClientRecord:
    """What an HTTP client recorded for one streamed request, on its own clock.

    ``chunks`` is ``[(t_ns, n_tokens, text), ...]`` in arrival order. ``n_tokens`` may be
    ``None`` when the stream does not say: such a chunk counts as **one token if its text is
    non-empty** and zero otherwise, which undercounts when the server packs several tokens per
    chunk. ``completion_tokens`` (e.g. the server's ``usage`` block) overrides the total.
    """
    request_id: str
    t_sent_ns: int
    chunks: list[tuple[int, int | None, str]]
    t_done_ns: int
    prompt_tokens: int
    ok: bool = True
    error: str | None = None
    completion_tokens: int | None = None


def _chunk_tokens(n: int | None, text: str) -> int:
    return (1 if text else 0) if n is None else int(n)


def client_request_metrics(rec: ClientRecord) -> RequestMetrics:
    """Client-side metrics of one request (``side="client"``; ``itl_s`` holds **ICL**).

    Empty chunks (role headers, keep-alives, a token that decoded to no text yet) are ignored
    for timing: TTFT = first non-empty chunk − sent; ICL = gaps between consecutive non-empty
    chunks; E2E = last non-empty chunk − sent. ``t_end_ns`` = ``t_done_ns`` (stream closed).
    Output tokens = Σ chunk tokens, or ``completion_tokens`` if given; TPOT uses that count.
    """
    if not isinstance(rec, ClientRecord):
        raise TypeError(f"client_request_metrics needs a ClientRecord, got {type(rec).__name__}")
    times = [int(c[0]) for c in rec.chunks]
    if any(b < a for a, b in zip(times, times[1:])):
        raise ValueError(f"chunk timestamps of request {rec.request_id!r} go backwards")
    if times and times[0] < rec.t_sent_ns:
        raise ValueError(f"request {rec.request_id!r}: a chunk arrived before the request was sent")
    if rec.t_done_ns < rec.t_sent_ns:
        raise ValueError(f"request {rec.request_id!r}: t_done_ns precedes t_sent_ns")
    if any(n is not None and n < 0 for _, n, _ in rec.chunks):
        raise ValueError(f"request {rec.request_id!r}: negative n_tokens in a chunk")

    deliveries = [(int(t), _chunk_tokens(n, text)) for t, n, text in rec.chunks]
    visible = [int(t) for t, _, text in rec.chunks if text]
    n_out = sum(n for _, n in deliveries) if rec.completion_tokens is None else int(rec.completion_tokens)
    error = rec.error
    if rec.ok and not visible:
        # design.md §2: no text, no TTFT, so not a success (vLLM's client is laxer: any chunk with
        # `choices`, even an empty one, counts; see minillm/loadgen/bench_serve.py)
        error = "never received a non-empty chunk"
    ok = rec.ok and bool(visible)
    ttft = _s(visible[0] - rec.t_sent_ns) if visible else None
    e2e = _s(visible[-1] - rec.t_sent_ns) if visible else None
    return RequestMetrics(
        request_id=rec.request_id, prompt_tokens=int(rec.prompt_tokens), output_tokens=n_out,
        ttft_s=ttft, e2e_s=e2e, tpot_s=_tpot(ttft, e2e, n_out),
        itl_s=[_s(b - a) for a, b in zip(visible, visible[1:])],
        breakdown={}, t_start_ns=int(rec.t_sent_ns), t_end_ns=int(rec.t_done_ns),
        ok=ok, finish_reason=None if ok else "error", side="client",
        error=None if ok else (error or "failed"),
        deliveries=[d for d in deliveries if d[1] > 0])


# ---------------------------------------------------------------------------------------------
# Distributions
@dataclass
class Distribution:
    """Summary statistics of one metric (seconds). ``std`` is the population std (numpy's
    default, as vLLM). With no values: ``count`` 0 and every statistic NaN."""
    count: int
    mean: float
    std: float
    min: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float

    def percentile(self, q: int) -> float:
        return getattr(self, f"p{q}")


def distribution(values: Iterable[float]) -> Distribution:
    """Statistics of ``values``; percentiles with numpy's default linear interpolation."""
    xs = np.asarray(list(values), dtype=float)
    if xs.ndim != 1:
        raise ValueError("distribution() needs a flat sequence of numbers")
    if np.isnan(xs).any():
        raise ValueError("distribution() got NaN/None values; filter undefined metrics first")
    if xs.size == 0:
        nan = float("nan")
        return Distribution(0, nan, nan, nan, nan, nan, nan, nan, nan)
    p50, p90, p95, p99 = (float(p) for p in np.percentile(xs, PERCENTILES))
    return Distribution(int(xs.size), float(xs.mean()), float(xs.std()), float(xs.min()),
                        p50, p90, p95, p99, float(xs.max()))


# ---------------------------------------------------------------------------------------------
# Service levels and windows
@dataclass(frozen=True)
class SLO:
    """Service-level objectives in seconds; ``None`` = not constrained. A request meets the SLO
    if every given limit holds (``value ≤ limit``); a request without a TPOT (one output
    token) passes the TPOT limit, as in vLLM."""
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        limits = {k: v for k, v in asdict(self).items() if v is not None}
        if not limits:
            raise ValueError("an SLO needs at least one of ttft_s, tpot_s, e2e_s")
        bad = [f"{k}={v}" for k, v in limits.items() if not v > 0]
        if bad:
            raise ValueError(f"SLO limits must be positive seconds: {', '.join(bad)}")

    def met_by(self, m: RequestMetrics) -> bool:
        if not m.ok:
            return False
        checks = [(self.ttft_s, m.ttft_s), (self.tpot_s, m.tpot_s), (self.e2e_s, m.e2e_s)]
        return all(limit is None or value is None or value <= limit for limit, value in checks)

    def describe(self) -> str:
        return ", ".join(f"{k[:-2].upper()} ≤ {v * 1e3:g} ms" for k, v in asdict(self).items() if v is not None)


@dataclass(frozen=True)
class SteadyWindow:
    """A steady-state window inside the full run (chapter 10.6: skip warmup and drain).

    Either fractions of the full window (first arrival → last completion) cut from the start
    (``warmup``) and the end (``drain``), or absolute ``t0_ns``/``t1_ns`` on the trace clock.
    Inside [t0, t1] we count: output tokens *delivered* in it (each token at its own
    timestamp, so a request straddling t0 contributes only its later tokens); input tokens of
    requests whose *first token* falls in it (that is when their prefill completed); requests
    that *completed* (``t_end_ns``) in it. Each is divided by t1 − t0.
    """
    warmup: float = 0.1
    drain: float = 0.1
    t0_ns: int | None = None
    t1_ns: int | None = None

    def __post_init__(self) -> None:
        if (self.t0_ns is None) != (self.t1_ns is None):
            raise ValueError("give both t0_ns and t1_ns, or neither")
        if self.t0_ns is not None and not self.t1_ns > self.t0_ns:
            raise ValueError(f"steady window needs t1_ns > t0_ns, got {self.t0_ns}..{self.t1_ns}")
        if not (0 <= self.warmup < 1 and 0 <= self.drain < 1 and self.warmup + self.drain < 1):
            raise ValueError(f"warmup and drain are fractions with warmup + drain < 1, "
                             f"got {self.warmup} and {self.drain}")

    def resolve(self, first_ns: int, last_ns: int) -> tuple[int, int]:
        if self.t0_ns is not None:
            return int(self.t0_ns), int(self.t1_ns)
        span = last_ns - first_ns
        return first_ns + round(self.warmup * span), last_ns - round(self.drain * span)


# ---------------------------------------------------------------------------------------------
# Many requests
@dataclass
class Summary:
    """A benchmark's results. Latency statistics cover successful requests only; the window
    (``duration_s``) spans every request, failed ones included, from first arrival to last
    completion. Token counts and requests/s count successful requests (as vLLM)."""
    side: str
    n_ok: int                      # completed (finished by stop or length)
    n_failed: int                  # rejected, errored, or no output token
    duration_s: float
    input_tokens: int
    output_tokens: int
    input_tok_s: float
    output_tok_s: float
    requests_s: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution          # ICL when side == "client"
    e2e: Distribution
    breakdown_mean: dict[str, float]   # mean of each stage: sums to mean TTFT exactly
    breakdown_p50: dict[str, float]    # stages of *the* request at p50 TTFT (nearest rank)
    breakdown_p99: dict[str, float]    # stages of the request at p99 TTFT (nearest rank)
    slo: SLO | None = None
    n_good: int | None = None
    goodput_rps: float | None = None
    steady_window_s: float | None = None
    steady_input_tok_s: float | None = None
    steady_output_tok_s: float | None = None
    steady_requests_s: float | None = None
    n_aborted: int = 0             # aborted by the client: neither completed nor failed

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-safe data (NaN becomes None)."""
        def clean(x: Any) -> Any:
            if isinstance(x, float) and math.isnan(x):
                return None
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            return x
        return clean(asdict(self))

    def table(self) -> str:
        """An aligned text table, times in ms."""
        def ms(x: float | None) -> str:
            return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:.2f}"

        def rate(x: float | None) -> str:
            return "-" if x is None or math.isnan(x) else f"{x:.2f}"

        w = 22
        lines = [f"{'requests':<{w}}{self.n_ok} ok / {self.n_failed} failed"
                 + (f" / {self.n_aborted} aborted" if self.n_aborted else "") + f"  ({self.side} side)",
                 f"{'window':<{w}}{self.duration_s:.3f} s  (first arrival → last completion)",
                 f"{'input tok/s':<{w}}{rate(self.input_tok_s)}  ({self.input_tokens} tokens)",
                 f"{'output tok/s':<{w}}{rate(self.output_tok_s)}  ({self.output_tokens} tokens)",
                 f"{'requests/s':<{w}}{rate(self.requests_s)}"]
        if self.slo is not None:
            lines.append(f"{'goodput req/s':<{w}}{rate(self.goodput_rps)}  "
                         f"({self.n_good}/{self.n_ok} met {self.slo.describe()})")
        if self.steady_window_s is not None:
            lines.append(f"{'steady window':<{w}}{self.steady_window_s:.3f} s: input "
                         f"{rate(self.steady_input_tok_s)} tok/s, output {rate(self.steady_output_tok_s)} "
                         f"tok/s, {rate(self.steady_requests_s)} req/s")
        cols = ("count", "mean", "std", "min", "p50", "p90", "p95", "p99", "max")
        lines.append("")
        lines.append(f"{'latency (ms)':<{w}}" + "".join(f"{c:>9}" for c in cols))
        gap_name = "ICL" if self.side == "client" else "ITL"
        for name, d in (("TTFT", self.ttft), ("TPOT", self.tpot), (gap_name, self.itl), ("E2E", self.e2e)):
            lines.append(f"{name:<{w}}{d.count:>9}" + "".join(f"{ms(getattr(d, c)):>9}" for c in cols[1:]))
        if self.breakdown_mean:
            lines.append("")
            lines.append(f"{'TTFT stages (ms)':<{w}}{'mean':>9}{'p50 req':>9}{'p99 req':>9}")
            for st in STAGES:
                lines.append(f"{st:<{w}}{ms(self.breakdown_mean.get(st)):>9}"
                             f"{ms(self.breakdown_p50.get(st)):>9}{ms(self.breakdown_p99.get(st)):>9}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _side_of(metrics: Sequence[RequestMetrics]) -> str:
    sides = {m.side for m in metrics}
    if len(sides) > 1:
        raise ValueError("cannot summarise engine-side and client-side metrics together: "
                         "their ITL means different things (token gaps vs chunk gaps)")
    return sides.pop() if sides else "engine"


def _rate(n: float, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("nan")


def summarize(metrics: Sequence[RequestMetrics], slo: SLO | None = None,
              steady: SteadyWindow | None = None) -> Summary:
    """Aggregate per-request metrics into a :class:`Summary` (vLLM's definitions, design.md §2)."""
    metrics = list(metrics)
    if not all(isinstance(m, RequestMetrics) for m in metrics):
        raise TypeError("summarize() needs a list of RequestMetrics (see request_metrics / "
                        "client_request_metrics)")
    if slo is not None and not isinstance(slo, SLO):
        raise TypeError(f"slo must be an SLO, got {type(slo).__name__}")
    side = _side_of(metrics)
    aborted = [m for m in metrics if m.ok and m.finish_reason == "abort"]
    ok = [m for m in metrics if m.ok and m.finish_reason != "abort"]    # completed requests only
    first = min((m.t_start_ns for m in metrics), default=0)
    last = max((m.t_end_ns for m in metrics), default=0)
    duration = _s(last - first)
    n_in, n_out = sum(m.prompt_tokens for m in ok), sum(m.output_tokens for m in ok)

    with_bd = [m for m in ok if m.breakdown]
    s = Summary(
        side=side, n_ok=len(ok), n_failed=len(metrics) - len(ok) - len(aborted), n_aborted=len(aborted),
        duration_s=duration,
        input_tokens=n_in, output_tokens=n_out,
        input_tok_s=_rate(n_in, duration), output_tok_s=_rate(n_out, duration),
        requests_s=_rate(len(ok), duration),
        ttft=distribution(m.ttft_s for m in ok),
        tpot=distribution(m.tpot_s for m in ok if m.tpot_s is not None),
        itl=distribution(g for m in ok for g in m.itl_s),          # pooled: token-weighted
        e2e=distribution(m.e2e_s for m in ok),
        breakdown_mean={st: float(np.mean([m.breakdown[st] for m in with_bd])) for st in STAGES}
        if with_bd else {},
        breakdown_p50=breakdown_at_percentile(with_bd, 50)[1] if with_bd else {},
        breakdown_p99=breakdown_at_percentile(with_bd, 99)[1] if with_bd else {},
    )
    if slo is not None:
        s.slo = slo
        s.n_good = sum(slo.met_by(m) for m in ok)
        s.goodput_rps = _rate(s.n_good, duration)
    if steady is not None:
        if not isinstance(steady, SteadyWindow):
            raise TypeError(f"steady must be a SteadyWindow, got {type(steady).__name__}")
        t0, t1 = steady.resolve(first, last)
        win = _s(t1 - t0)
        inside = lambda t: t0 <= t <= t1  # noqa: E731
        s.steady_window_s = win
        s.steady_output_tok_s = _rate(sum(n for m in ok for t, n in m.deliveries if inside(t)), win)
        s.steady_input_tok_s = _rate(sum(m.prompt_tokens for m in ok
                                         if m.t_first_token_ns is not None and inside(m.t_first_token_ns)), win)
        s.steady_requests_s = _rate(sum(inside(m.t_end_ns) for m in ok), win)
    return s


# ---------------------------------------------------------------------------------------------
# Tables and explanations for the notebooks
def to_rows(metrics: Iterable[RequestMetrics]) -> list[dict[str, Any]]:
    """One flat row per request (``pandas.DataFrame(to_rows(ms))``). Breakdown stages become
    ``ttft_<stage>_s`` columns; ITL/ICL gaps are summarised by count and mean."""
    rows = []
    for m in metrics:
        row = {"request_id": m.request_id, "side": m.side, "ok": m.ok, "finish_reason": m.finish_reason,
               "error": m.error, "prompt_tokens": m.prompt_tokens, "output_tokens": m.output_tokens,
               "ttft_s": m.ttft_s, "tpot_s": m.tpot_s, "e2e_s": m.e2e_s, "n_gaps": len(m.itl_s),
               "mean_gap_s": float(np.mean(m.itl_s)) if m.itl_s else None,
               "t_start_ns": m.t_start_ns, "t_end_ns": m.t_end_ns}
        row.update({f"ttft_{st}_s": m.breakdown.get(st) for st in STAGES})
        rows.append(row)
    return rows


def breakdown_at_percentile(metrics: Sequence[RequestMetrics], q: float) -> tuple[str, dict[str, float]]:
    """``(request_id, breakdown)`` of the request whose TTFT sits at percentile ``q``.

    A breakdown belongs to one real request, so this uses the **nearest-rank** percentile on
    the sorted TTFTs (rank ⌈q/100 · n⌉, at least 1), not numpy's interpolation: its TTFT can
    differ slightly from ``Summary.ttft.p99``. Only successful engine-side requests count.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    pool = [m for m in metrics if m.ok and m.ttft_s is not None and m.breakdown]
    if not pool:
        raise ValueError("no successful request with a TTFT breakdown (client-side metrics have none: "
                         "the client cannot see inside the server)")
    pool.sort(key=lambda m: m.ttft_s)
    m = pool[max(1, math.ceil(q / 100 * len(pool))) - 1]
    return m.request_id, dict(m.breakdown)


_STAGE_PHRASE = {"gateway": "in the gateway", "tokenize": "tokenizing the prompt",
                 "queue": "in the queue", "prefill": "in prefill",
                 "first_token": "sampling the first token"}


def explain_ttft(metrics: Sequence[RequestMetrics], q: float = 99) -> str:
    """One sentence from data, e.g. "At p99 TTFT (request r7, 412.0 ms), 300.0 ms (73%) was
    spent in the queue; then prefill 80.0 ms, ...". Names the largest stage first."""
    rid, bd = breakdown_at_percentile(metrics, q)
    total = sum(bd.values())
    stages = sorted(bd.items(), key=lambda kv: kv[1], reverse=True)
    (top, top_s), rest = stages[0], [(k, v) for k, v in stages[1:] if v > 0]
    share = f" ({100 * top_s / total:.0f}%)" if total > 0 else ""
    text = (f"At p{q:g} TTFT (request {rid}, {total * 1e3:.1f} ms), {top_s * 1e3:.1f} ms{share} "
            f"was spent {_STAGE_PHRASE[top]}")
    if rest:
        text += "; then " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in rest)
    return text + "."
