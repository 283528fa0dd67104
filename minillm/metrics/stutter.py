"""The second check of a diagnosis (10.2, 10.4): stutters. The long inter-token gaps against the
p50 gap, and what lies inside each: another request's prefill (from its trace events, or a step
record with prefill tokens), or the garbage collector (from the step records' ``gc_ms``)."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Iterable, Sequence

from minillm.core.step_record import PHASES, StepRecord
from minillm.core.trace import Trace
from minillm.metrics.definitions import RequestMetrics
from minillm.metrics.findings import (
    GC_CAUSE,
    NO_PREFILL_CAUSE,
    PREFILL_CAUSE,
    STUTTERS,
    Finding,
    Thresholds,
    fmt_pct,
    fmt_time,
    ratio_or_inf,
)
from minillm.metrics.summary import Summary


# ---------------------------------------------------------------------------------------------
# 2. Stutters (10.2, 10.4)
@dataclass(frozen=True)
class Gap:
    """One inter-token gap of one request, with what ran inside it."""
    request_id: str
    index: int                     # the gap before token `index`
    t0_ns: int
    t1_ns: int
    prefills: tuple[str, ...] = ()  # other requests whose prefill (a chunk of it) overlaps the gap
    prefill_steps: int = 0          # step records with prefill tokens inside the gap
    prefill_tokens: int = 0         # their prefill tokens
    gc_ms: float = 0.0              # garbage collection in the step records inside the gap

    @property
    def gap_s(self) -> float:
        return (self.t1_ns - self.t0_ns) / 1e9

    @property
    def holds_prefill(self) -> bool:
        return bool(self.prefills) or self.prefill_steps > 0


@dataclass(frozen=True)
class _Interval:
    start: int
    end: int
    owner: str
    tokens: int
    gc_ms: float = 0.0


def prefill_intervals(traces: Iterable[Trace]) -> list[_Interval]:
    """Where each request's prefill ran: its ``prefill_chunk`` events ([t_start_ns, t_ns], one per
    chunk, so chunked prefill gives several short ones), else ``prefill_start`` … ``prefill_end``."""
    out = []
    for tr in traces:
        chunks = [e for e in tr if e.event == "prefill_chunk" and "t_start_ns" in e.extra]
        if chunks:
            out += [_Interval(int(e.extra["t_start_ns"]), e.t_ns, tr.request_id,
                              int(e.extra.get("tokens", 0)))
                    for e in chunks]
            continue
        ps, pe = tr.first("prefill_start"), tr.last("prefill_end")
        if ps is not None and pe is not None:
            out.append(_Interval(ps.t_ns, pe.t_ns, tr.request_id, int(ps.extra.get("n_tokens", 0))))
    return sorted(out, key=lambda iv: iv.start)


def _step_window(rec: StepRecord) -> tuple[int, int]:
    """The part of a step that produces its tokens: scheduled → sampled (a token's timestamp is its
    step's "sampled" mark), so the step that produced a gap's first token does not overlap the gap."""
    marks = rec.t_ns
    start = marks[0] if marks else rec.t_start_ns
    i = PHASES.index("sample")
    end = marks[i] if len(marks) > i else (marks[-1] if marks else rec.t_start_ns)
    return start, end


def _gc_windows(rec: StepRecord) -> list[_Interval]:
    """A step's garbage collection, where it delays tokens: up to the sampled mark it delays this
    step's tokens (the gap that ends there), after it (``gc_output_ms``, the output phase) the
    next ones (the gap that starts there)."""
    start, sampled = _step_window(rec)
    end = rec.t_ns[-1] if rec.t_ns else sampled
    before = rec.gc_ms - rec.gc_output_ms
    out = [_Interval(start, sampled, f"step {rec.step}", 0, before)] if before > 0 else []
    if rec.gc_output_ms > 0:
        out.append(_Interval(sampled, max(end, sampled + 1), f"step {rec.step}", 0, rec.gc_output_ms))
    return out


def _overlapping(ivs: Sequence[_Interval], starts: list[int], longest: int, t0: int,
                 t1: int) -> list[_Interval]:
    """Intervals with start < t1 and end > t0 (strict: touching at an end is not overlapping)."""
    lo = bisect_left(starts, t0 - longest)
    hi = bisect_left(starts, t1)
    return [iv for iv in ivs[lo:hi] if iv.end > t0]


def gaps_with_prefills(done: Sequence[RequestMetrics], traces: Sequence[Trace], steps: Sequence[StepRecord],
                       min_gap_s: float = 0.0) -> list[Gap]:
    """The gaps of ``done`` (the ITL sample, from each request's deliveries) of at least
    ``min_gap_s``, each marked with the other requests' prefills, the prefill steps and the
    garbage collection (steps' ``gc_ms``) inside it."""
    ivs = prefill_intervals(traces)
    steps_iv = sorted((_Interval(*_step_window(r), f"step {r.step}", r.num_prefill_tokens)
                       for r in steps if r.num_prefill_tokens > 0), key=lambda iv: iv.start)
    gc_iv = sorted((iv for r in steps if r.gc_ms > 0 for iv in _gc_windows(r)), key=lambda iv: iv.start)
    idx = [(v, [iv.start for iv in v], max((iv.end - iv.start for iv in v), default=0))
           for v in (ivs, steps_iv, gc_iv)]
    out = []
    for m in done:
        times = [t for t, _ in m.deliveries]
        for k, (a, b) in enumerate(zip(times, times[1:]), start=1):
            if (b - a) / 1e9 < min_gap_s:
                continue
            pre = [iv for iv in _overlapping(*idx[0], a, b) if iv.owner != m.request_id]
            st = _overlapping(*idx[1], a, b)
            gc_inside = sum(iv.gc_ms for iv in _overlapping(*idx[2], a, b))
            out.append(Gap(m.request_id, k, a, b, tuple(sorted({iv.owner for iv in pre})),
                           len(st), sum(iv.tokens for iv in st), gc_inside))
    return out


def check_stutter(done: Sequence[RequestMetrics], s: Summary, traces: Sequence[Trace],
                  steps: Sequence[StepRecord], th: Thresholds) -> Finding:
    itl = s.itl
    if itl.count == 0:
        return Finding(STUTTERS, False, None, f"{STUTTERS}: no decode gaps",
                       evidence=["no request produced two tokens: there is no ITL to read"])
    threshold = th.long_gap_ratio * itl.p50
    long = gaps_with_prefills(done, traces, steps, min_gap_s=threshold) if threshold > 0 else []
    ratio = ratio_or_inf(itl.p99, itl.p50)
    fired = ratio >= th.tail_ratio and bool(long)
    n_pre = sum(g.holds_prefill for g in long)
    knows_prefills = bool(steps) or any(tr.first("prefill_start") is not None for tr in traces)
    lost = sum(g.gap_s - itl.p50 for g in long)
    gc_s = sum(g.gc_ms for g in long) / 1e3
    cause = (PREFILL_CAUSE if long and n_pre >= th.prefill_share * len(long)
             else GC_CAUSE if long and gc_s >= th.gc_share * lost
             else NO_PREFILL_CAUSE if knows_prefills else "long gaps")
    evidence = [f"ITL p50 {fmt_time(itl.p50)}, p99 {fmt_time(itl.p99)} ({ratio:.1f}× p50), max "
                f"{fmt_time(itl.max)} over {itl.count} gaps",
                f"{len(long)} long gaps (≥ {th.long_gap_ratio:g}× p50 = {fmt_time(threshold)}) in "
                f"{len({g.request_id for g in long})} of {len(done)} requests"]
    if long:
        evidence.append(f"{n_pre} of the {len(long)} long gaps hold another request's prefill"
                        + (" (from the traces' prefill events and the step records)" if steps
                           else " (from the traces' prefill events)"))
        worst = max(long, key=lambda g: g.gap_s)
        evidence.append(f"longest: {fmt_time(worst.gap_s)} in {worst.request_id} before token {worst.index}"
                        + (f", holding the prefill of {', '.join(worst.prefills[:3])}"
                           if worst.prefills else "")
                        + (f"; {worst.prefill_steps} step(s) with {worst.prefill_tokens} prefill tokens "
                           "inside"
                           if worst.prefill_steps else ""))
    if gc_s > 0:
        evidence.append(f"the garbage collector held the GIL for {fmt_time(gc_s)} of the long gaps' "
                        f"{fmt_time(lost)} beyond p50 ({fmt_pct(ratio_or_inf(gc_s, lost))}; summed gap by "
                        "gap, from the step records' gc_ms: an upper bound, since an operator already "
                        "running in C++ goes on)")
    if not knows_prefills:
        evidence.append("the traces have no prefill events and no step records were given: "
                        "what ran inside the gaps is unknown")
    elif cause == PREFILL_CAUSE:
        evidence.append("a prefill step makes every decoding request wait for it; chunked prefill splits it "
                        "into budget-sized chunks that share steps with the decodes (10.4)")
    elif cause == GC_CAUSE:
        evidence.append("a full garbage collection holds the GIL: the engine thread's Python stops mid-step; "
                        "freezing the start-up heap (gc.freeze(), as `minillm serve` does) keeps it short "
                        "(10.5)")
    elif long:
        evidence.append("the long gaps hold no prefill: look at the host (sampling, detokenizing, the "
                        "server's event loop, the garbage collector, other processes on the machine; 10.5)")
    headline = (f"{STUTTERS}: {cause} (ITL p99 {fmt_time(itl.p99)} = {ratio:.1f}× p50 {fmt_time(itl.p50)}; "
                + (f"garbage collection in {fmt_pct(ratio_or_inf(gc_s, lost))} of the long gaps' excess)"
                   if cause == GC_CAUSE
                   else f"{n_pre} of {len(long)} long gaps hold another request's prefill)"))
    return Finding(STUTTERS, fired, cause if long else None, headline, lost, evidence,
                   {"itl_p50_s": itl.p50, "itl_p99_s": itl.p99, "itl_max_s": itl.max, "itl_ratio": ratio,
                    "n_gaps": itl.count, "long_gap_s": threshold, "n_long_gaps": len(long),
                    "n_long_with_prefill": n_pre,
                    "long_gaps": [{"request_id": g.request_id, "index": g.index, "gap_s": g.gap_s,
                                   "prefills": list(g.prefills), "prefill_steps": g.prefill_steps,
                                   "prefill_tokens": g.prefill_tokens, "gc_ms": g.gc_ms}
                                  for g in sorted(long, key=lambda g: -g.gap_s)[:20]]})


# ---------------------------------------------------------------------------------------------
# Inter-token gaps and what happened inside them
@dataclass(frozen=True)
class TokenGap:
    """One inter-token gap of one request: from token ``index - 1`` to token ``index``.
    ``prefills`` names the *other* requests whose whole prefill ran inside this gap."""
    request_id: str
    index: int
    t0_ns: int
    t1_ns: int
    prefills: tuple[str, ...] = ()

    @property
    def gap_s(self) -> float:
        return (self.t1_ns - self.t0_ns) / 1e9

    @property
    def stalled(self) -> bool:
        return bool(self.prefills)


def token_gaps(traces: Sequence[Trace]) -> list[TokenGap]:
    """Every inter-token gap of every request (the ITL sample, token-weighted), each marked
    with the prefills of other requests that ran between its two tokens (by timestamps:
    ``t0 ≤ prefill_start`` and ``prefill_end ≤ t1``). A gap that holds one is a stall (10.4)."""
    prefills = []
    for tr in traces:
        ps, pe = tr.first("prefill_start"), tr.first("prefill_end")
        if ps is not None and pe is not None:
            prefills.append((tr.request_id, ps.t_ns, pe.t_ns))
    gaps = []
    for tr in traces:
        ts = tr.times("token")
        for k, (a, b) in enumerate(zip(ts, ts[1:]), start=1):
            inside = tuple(rid for rid, s, e in prefills if rid != tr.request_id and a <= s and e <= b)
            gaps.append(TokenGap(tr.request_id, k, a, b, inside))
    return gaps
