"""Statistics over many requests' metrics (chapter 10.2 and 10.6): distributions and their
percentiles, SLOs and goodput, the steady-state window, the run's summary with input and output
throughput apart, and which TTFT stage dominates at a percentile.

The per-request metrics come from :mod:`minillm.metrics.definitions`; everything here is a pure
function of them. Percentiles use numpy's default (linear) interpolation, like vLLM.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from minillm.metrics.definitions import PERCENTILES, STAGES, RequestMetrics, ns_to_s


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
        return ", ".join(f"{k[:-2].upper()} ≤ {v * 1e3:g} ms"
                         for k, v in asdict(self).items() if v is not None)



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
    duration = ns_to_s(last - first)
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
        win = ns_to_s(t1 - t0)
        inside = lambda t: t0 <= t <= t1  # noqa: E731
        s.steady_window_s = win
        s.steady_output_tok_s = _rate(sum(n for m in ok for t, n in m.deliveries if inside(t)), win)
        s.steady_input_tok_s = _rate(sum(m.prompt_tokens for m in ok
                                         if m.t_first_token_ns is not None and inside(m.t_first_token_ns)),
                                     win)
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


def metric_values(metrics: Sequence[RequestMetrics]) -> dict[str, list[float]]:
    """The samples of each metric over the successful requests (seconds); ITL is pooled ICL."""
    ok = [m for m in metrics if m.ok]
    return {"ttft": [m.ttft_s for m in ok if m.ttft_s is not None],
            "tpot": [m.tpot_s for m in ok if m.tpot_s is not None],
            "itl": [g for m in ok for g in m.itl_s],
            "e2el": [m.e2e_s for m in ok if m.e2e_s is not None]}



def percentile_table(metrics: Sequence[RequestMetrics], which: Sequence[str],
                     qs: Sequence[float]) -> dict[str, dict[str, float | None]]:
    vals = metric_values(metrics)
    out: dict[str, dict[str, float | None]] = {}
    for k in which:
        xs = np.asarray(vals[k], dtype=float) * 1e3
        row: dict[str, float | None] = {"mean": float(xs.mean()) if xs.size else None,
                                        "median": float(np.median(xs)) if xs.size else None}
        for q in qs:
            row[f"p{q:g}"] = float(np.percentile(xs, q)) if xs.size else None
        out[k] = row
    return out


_STAGE_PHRASE = {"gateway": "in the gateway", "body": "reading the request body",
                 "tokenize": "tokenizing the prompt", "queue": "in the queue", "prefill": "in prefill",
                 "first_token": "sampling the first token (and decoding until a token carries text)"}
