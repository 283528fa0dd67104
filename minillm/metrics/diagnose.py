"""Where did the slow requests lose their time? A diagnosis from traces (and step records).

The chapter's third core question (10.7): a user says "it is slow"; which metric do you read
first? This module reads them in the chapter's order and answers with numbers:

1. **Starts late** (10.1, 10.2): TTFT p50 against p99, and the p99 requests' TTFT split into the
   stages of :mod:`minillm.metrics.definitions` (gateway, body, tokenize, queue, prefill,
   first_token; they add up to TTFT exactly). The dominant stage of the tail is the cause: a
   queue (a burst, too little capacity) or a prefill (a long prompt).
2. **Stutters** (10.2, 10.4): ITL p99 against p50, and the long gaps: which of them hold another
   request's prefill, found from the other requests' ``prefill_chunk`` (or ``prefill_start`` …
   ``prefill_end``) events overlapping the gap, and from step records with prefill tokens inside it.
3. **Outside the device** (10.5): from step records, the host phases (schedule, prepare, sample,
   output) against the forward; from traces, the part of a request's time at the server spent
   outside the engine (gateway, body, tokenize, and the return after the last token).

Every definition comes from :mod:`minillm.metrics.definitions` (``request_metrics``, ``summarize``,
``breakdown_at_percentile``): this module only reads them. The thresholds are ratios, never
absolute milliseconds, so the same rules hold on a laptop CPU and on an H200 (:class:`Thresholds`).

The verdict is one line, then the evidence::

    d = diagnose(traces, steps)          # Trace objects, /v1/traces JSON, StepRecords or /v1/steps JSON
    print(d.text())                      # "verdict: starts late: queue (p99 TTFT 1.84 s, 91 % of it queue)"
    d.to_dict()                          # the same, as JSON-safe data

From a terminal (``python -m minillm diagnose``, see :func:`add_diagnose_parser`)::

    python -m minillm diagnose --base-url http://127.0.0.1:8000 --api-key $MINILLM_API_KEY
    python -m minillm diagnose --traces traces.json --json

A traces file is JSON in any of these forms: what ``GET /v1/traces`` returns (``{"data": [...]}``),
a list of its items (``{"request_id", "events": [{"event", "t_ns", ...}]}``), a list of
``Trace.to_records()`` lists, or ``{"traces": <one of those>, "steps": <GET /v1/steps's body or
its "data" list>}``, which is what ``--save`` writes.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

from minillm.core.records import as_steps, as_traces
from minillm.core.step_record import PHASES, StepRecord
from minillm.core.trace import Trace
from minillm.metrics.definitions import (
    STAGES,
    RequestMetrics,
    Summary,
    breakdown_at_percentile,
    request_metrics,
    summarize,
)

# Import light on purpose: the CLI builds this command's parser for every command (`doctor` too), so
# nothing here may import torch at module level; 10.5's phase names are the step record's.
CHAPTER_OUTSIDE_SHARE = 0.30   # = minillm.experiments.outside_steps.CHAPTER_OUTSIDE_SHARE (a test keeps them equal)

START_LATE, STUTTERS, OUTSIDE = "starts late", "stutters", "outside the device"
HEALTHY, NO_DATA = "healthy", "no data"
PREFILL_CAUSE = "another request's prefill"
NO_PREFILL_CAUSE = "pauses without a prefill inside"
GC_CAUSE = "Python's garbage collector"
# Stages in which the request waits rather than being worked on (10.1): what a burst inflates.
_WAIT_STAGES = ("queue",)
# Stages before the engine sees the request and after it is done with it: the server's own time.
_FRONT_STAGES = ("gateway", "body", "tokenize")
_STAGE_HINT = {
    "queue": "it waited for a place in the running batch: a burst, or too little capacity "
             "(max_batch_size, replicas); admission control or chunked prefill shorten the wait (10.1, 10.4)",
    "prefill": "its own prompt's forward pass: a long prompt, or a prefill step shared with long prompts; "
               "prefix caching helps repeated prefixes, chunked prefill protects the others, not this one (10.4)",
    "gateway": "the server's front end before the engine: auth, rate limits, admission (10.1)",
    "body": "receiving and parsing the request body (10.1, 10.5)",
    "tokenize": "tokenizing the prompt on the host (10.5)",
    "first_token": "sampling the first token and copying it to the host after the prefill (10.5)",
}


@dataclass(frozen=True)
class Thresholds:
    """The rules, as ratios. Why these values:

    * ``tail_ratio`` 3: a p99 three times the p50 is a tail, not noise around the median; the same
      ratio for TTFT and ITL (10.2: read p99 against p50, never the mean alone).
    * ``wait_share`` 0.5 and ``wait_steps`` 5: a burst delays *every* request, so TTFT p99/p50 can
      stay below 3 while the queue is the whole story. The tail also starts late when at least half
      its TTFT was queueing and that wait is at least 5 decode steps (ITL p50) long: a request that
      arrives during a step waits for that one step, not for five (10.1).
    * ``long_gap_ratio`` 3: a gap three times the typical one is a stall a reader notices (10.4).
    * ``prefill_share`` 0.5: when most long gaps hold another request's prefill, that is their cause.
    * ``gc_share`` 0.5: when garbage collection fills at least half of the long gaps' excess over
      the p50 gap, the collector is their cause.
    * ``outside_share`` 0.30: the chapter's line for time outside the forward (10.5).
    """
    tail_ratio: float = 3.0
    wait_share: float = 0.5
    wait_steps: float = 5.0
    long_gap_ratio: float = 3.0
    prefill_share: float = 0.5
    gc_share: float = 0.5
    outside_share: float = CHAPTER_OUTSIDE_SHARE


@dataclass
class Finding:
    """One of the three checks. ``lost_s`` is the time the requests lost to it beyond the typical
    (Σ of excess over the p50), the common currency that ranks the two symptoms."""
    check: str                     # START_LATE | STUTTERS | OUTSIDE
    fired: bool
    cause: str | None              # a stage, PREFILL_CAUSE, "host phases", ... (None: nothing to name)
    headline: str                  # the verdict line, if this finding wins
    lost_s: float = 0.0
    evidence: list[str] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)


@dataclass
class Diagnosis:
    verdict: str                   # one line: what the slow requests suffer, with numbers
    cause: str                     # START_LATE | STUTTERS | OUTSIDE | HEALTHY | NO_DATA
    stage: str | None              # the named cause inside it (e.g. "queue"), None if none
    n_traces: int = 0
    n_completed: int = 0
    n_failed: int = 0
    n_aborted: int = 0
    n_skipped: int = 0             # traces that could not be read (empty, tokens going backwards)
    n_steps: int = 0               # step records inside the traces' window
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def finding(self, check: str) -> Finding | None:
        return next((f for f in self.findings if f.check == check), None)

    def text(self) -> str:
        lines = [f"verdict: {self.verdict}"]
        lines += [f"also: {f.headline}" for f in self.findings if f.fired and f.check != self.cause]
        lines += ["", f"requests: {self.n_completed} completed, {self.n_failed} failed, {self.n_aborted} aborted "
                      f"({self.n_traces} traces" + (f", {self.n_skipped} unreadable" if self.n_skipped else "")
                      + (f"; {self.n_steps} step records" if self.n_steps else "") + ")"]
        for f in self.findings:
            lines.append(f"{f.check}? {'YES' if f.fired else 'no'}")
            lines += [f"  {e}" for e in f.evidence]
        if self.notes:
            lines += ["notes:"] + [f"  - {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe data (NaN and infinities become None)."""
        return _clean(asdict(self))


# ---------------------------------------------------------------------------------------------
# Formatting
def _t(seconds: float | None) -> str:
    """A duration the way a person reads it: 812.3 ms, 1.84 s."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    return f"{seconds:.2f} s" if abs(seconds) >= 1 else f"{seconds * 1e3:.1f} ms"


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (math.inf if a > 0 else 1.0)


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


# ---------------------------------------------------------------------------------------------
# The requests
def _read_metrics(traces: Sequence[Trace]) -> tuple[list[RequestMetrics], list[str]]:
    """Per-request metrics (metrics.request_metrics); a trace it refuses is skipped with a note."""
    out, notes = [], []
    for tr in traces:
        try:
            out.append(request_metrics(tr))
        except (ValueError, TypeError) as e:
            notes.append(f"skipped trace {tr.request_id!r}: {e}")
    return out, notes


def _completed(metrics: Iterable[RequestMetrics]) -> list[RequestMetrics]:
    # the same rule as metrics.summarize: completed = ok and not aborted by the client
    return [m for m in metrics if m.ok and m.finish_reason != "abort"]


def _failure_note(metrics: Sequence[RequestMetrics]) -> str | None:
    failed = Counter((m.error or "failed")[:80] for m in metrics if not m.ok)
    if not failed:
        return None
    return "failed: " + ", ".join(f"{err} ×{n}" for err, n in failed.most_common(5))


# ---------------------------------------------------------------------------------------------
# 1. Starts late (10.1, 10.2)
def _step_scale(s: Summary, done: Sequence[RequestMetrics]) -> float:
    """One decode step's time (ITL p50); with no decode gaps, the median prefill instead."""
    if s.itl.count:
        return s.itl.p50
    pre = sorted(m.breakdown.get("prefill", 0.0) + m.breakdown.get("first_token", 0.0) for m in done if m.breakdown)
    return pre[len(pre) // 2] if pre else 0.0


def _tail_breakdown(done: Sequence[RequestMetrics], ttft_floor: float) -> dict[str, float]:
    """Mean stages of the requests at or above the p99 request's TTFT (the tail, 10.2)."""
    tail = [m for m in done if m.breakdown and m.ttft_s is not None and m.ttft_s >= ttft_floor]
    return {st: sum(m.breakdown[st] for m in tail) / len(tail) for st in STAGES}


def _stage_line(label: str, rid: str, ttft_s: float, bd: dict[str, float]) -> str:
    parts = ", ".join(f"{st} {_t(v)}" for st, v in bd.items() if v > 0) or "no stage recorded"
    return f"{label} ({rid}, TTFT {_t(ttft_s)}): {parts}"


def _queue_evidence(done: Sequence[RequestMetrics], by_id: dict[str, Trace],
                    steps: Sequence[StepRecord]) -> list[str]:
    depths = [int(e.extra["queue_depth"]) for m in done for e in by_id[m.request_id]
              if e.event == "enqueued" and "queue_depth" in e.extra]
    starts = sorted(m.t_start_ns for m in done)
    lines = [f"{len(done)} requests arrived within {_t((starts[-1] - starts[0]) / 1e9)} of each other"]
    if depths:
        lines.append(f"up to {max(depths)} requests were waiting at once (queue depth at `enqueued`)")
    if steps:
        lines.append(f"the engine ran at most {max(s.num_rows for s in steps)} requests in one step")
    return lines


def _prefill_evidence(done: Sequence[RequestMetrics], by_id: dict[str, Trace], tail_ids: list[str]) -> list[str]:
    prompts = sorted(m.prompt_tokens for m in done)
    by_rid = {m.request_id: m for m in done}
    tail = [by_rid[rid] for rid in tail_ids]
    lines = [f"prompt tokens of the slowest requests: {', '.join(str(m.prompt_tokens) for m in tail[:5])} "
             f"(median over all requests {prompts[len(prompts) // 2]})"]
    for m in tail[:3]:
        ps = by_id[m.request_id].first("prefill_start")
        chunks = [e for e in by_id[m.request_id] if e.event == "prefill_chunk"]
        if ps is not None and "n_tokens" in ps.extra and int(ps.extra["n_tokens"]) > m.prompt_tokens:
            lines.append(f"{m.request_id} shared its first prefill step: {ps.extra['n_tokens']} prompt tokens "
                         f"in it, {m.prompt_tokens} of them its own")
        if len(chunks) > 1:
            lines.append(f"{m.request_id}'s prompt ran in {len(chunks)} chunks (chunked prefill)")
    return lines


def check_start(done: Sequence[RequestMetrics], s: Summary, by_id: dict[str, Trace],
                steps: Sequence[StepRecord], th: Thresholds) -> Finding:
    with_bd = [m for m in done if m.breakdown]
    if not with_bd:
        return Finding(START_LATE, False, None, f"{START_LATE}: no TTFT breakdown",
                       evidence=["no completed request has a TTFT breakdown (no `token` event)"])
    rid50, bd50 = breakdown_at_percentile(with_bd, 50)
    rid99, bd99 = breakdown_at_percentile(with_bd, 99)
    ttft_of = {m.request_id: m.ttft_s for m in with_bd}
    tail_ids = [m.request_id for m in sorted(with_bd, key=lambda m: -m.ttft_s) if m.ttft_s >= ttft_of[rid99]]
    tail = _tail_breakdown(with_bd, ttft_of[rid99])
    total = sum(tail.values())
    stage = max(STAGES, key=lambda st: tail[st])
    share = tail[stage] / total if total > 0 else 0.0
    ratio = _ratio(s.ttft.p99, s.ttft.p50)
    wait = sum(tail[st] for st in _WAIT_STAGES)
    scale = _step_scale(s, done)
    by_tail = ratio >= th.tail_ratio
    by_wait = total > 0 and wait / total >= th.wait_share and wait >= th.wait_steps * scale
    lost = sum(max(0.0, m.ttft_s - s.ttft.p50) for m in with_bd)
    evidence = [f"TTFT p50 {_t(s.ttft.p50)}, p99 {_t(s.ttft.p99)} ({ratio:.1f}× p50), max {_t(s.ttft.max)} "
                f"over {s.ttft.count} requests",
                _stage_line("p50 request", rid50, ttft_of[rid50], bd50),
                _stage_line("p99 request", rid99, ttft_of[rid99], bd99)]
    if 1 < len(tail_ids) < len(with_bd):
        evidence.append(f"the {len(tail_ids)} requests at or above p99: {_pct(share)} of their TTFT in {stage}")
    if by_wait and not by_tail:
        evidence.append(f"every request waits: the tail queued {_t(wait)} ({_pct(wait / total)} of its TTFT), "
                        f"{_ratio(wait, scale):.0f} decode steps of {_t(scale)}")
    if by_tail or by_wait:
        evidence.append(f"{stage}: {_STAGE_HINT[stage]}")
        if stage == "queue":
            evidence += _queue_evidence(done, by_id, steps)
        elif stage == "prefill":
            evidence += _prefill_evidence(done, by_id, tail_ids)
    return Finding(START_LATE, by_tail or by_wait, stage,
                   f"{START_LATE}: {stage} (p99 TTFT {_t(s.ttft.p99)}, {_pct(share)} of it {stage})",
                   lost, evidence,
                   {"ttft_p50_s": s.ttft.p50, "ttft_p99_s": s.ttft.p99, "ttft_ratio": ratio,
                    "p50_request": rid50, "p99_request": rid99, "breakdown_p50_s": bd50, "breakdown_p99_s": bd99,
                    "tail_requests": tail_ids, "tail_breakdown_s": tail, "dominant_stage": stage,
                    "dominant_share": share, "queue_steps": _ratio(wait, scale)})


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
            out += [_Interval(int(e.extra["t_start_ns"]), e.t_ns, tr.request_id, int(e.extra.get("tokens", 0)))
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


def _overlapping(ivs: Sequence[_Interval], starts: list[int], longest: int, t0: int, t1: int) -> list[_Interval]:
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
    ratio = _ratio(itl.p99, itl.p50)
    fired = ratio >= th.tail_ratio and bool(long)
    n_pre = sum(g.holds_prefill for g in long)
    knows_prefills = bool(steps) or any(tr.first("prefill_start") is not None for tr in traces)
    lost = sum(g.gap_s - itl.p50 for g in long)
    gc_s = sum(g.gc_ms for g in long) / 1e3
    cause = (PREFILL_CAUSE if long and n_pre >= th.prefill_share * len(long)
             else GC_CAUSE if long and gc_s >= th.gc_share * lost
             else NO_PREFILL_CAUSE if knows_prefills else "long gaps")
    evidence = [f"ITL p50 {_t(itl.p50)}, p99 {_t(itl.p99)} ({ratio:.1f}× p50), max {_t(itl.max)} "
                f"over {itl.count} gaps",
                f"{len(long)} long gaps (≥ {th.long_gap_ratio:g}× p50 = {_t(threshold)}) in "
                f"{len({g.request_id for g in long})} of {len(done)} requests"]
    if long:
        evidence.append(f"{n_pre} of the {len(long)} long gaps hold another request's prefill"
                        + (" (from the traces' prefill events and the step records)" if steps
                           else " (from the traces' prefill events)"))
        worst = max(long, key=lambda g: g.gap_s)
        evidence.append(f"longest: {_t(worst.gap_s)} in {worst.request_id} before token {worst.index}"
                        + (f", holding the prefill of {', '.join(worst.prefills[:3])}" if worst.prefills else "")
                        + (f"; {worst.prefill_steps} step(s) with {worst.prefill_tokens} prefill tokens inside"
                           if worst.prefill_steps else ""))
    if gc_s > 0:
        evidence.append(f"the garbage collector held the GIL for {_t(gc_s)} of the long gaps' {_t(lost)} beyond "
                        f"p50 ({_pct(_ratio(gc_s, lost))}; summed gap by gap, from the step records' gc_ms: "
                        "an upper bound, since an operator already running in C++ goes on)")
    if not knows_prefills:
        evidence.append("the traces have no prefill events and no step records were given: "
                        "what ran inside the gaps is unknown")
    elif cause == PREFILL_CAUSE:
        evidence.append("a prefill step makes every decoding request wait for it; chunked prefill splits it "
                        "into budget-sized chunks that share steps with the decodes (10.4)")
    elif cause == GC_CAUSE:
        evidence.append("a full garbage collection holds the GIL: the engine thread's Python stops mid-step; "
                        "freezing the start-up heap (gc.freeze(), as `minillm serve` does) keeps it short (10.5)")
    elif long:
        evidence.append("the long gaps hold no prefill: look at the host (sampling, detokenizing, the "
                        "server's event loop, the garbage collector, other processes on the machine; 10.5)")
    headline = (f"{STUTTERS}: {cause} (ITL p99 {_t(itl.p99)} = {ratio:.1f}× p50 {_t(itl.p50)}; "
                + (f"garbage collection in {_pct(_ratio(gc_s, lost))} of the long gaps' excess)" if cause == GC_CAUSE
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
# 3. Outside the device (10.5)
def steps_in_window(steps: Sequence[StepRecord], done: Sequence[RequestMetrics]) -> list[StepRecord]:
    """The step records that ran while these requests were at the server (a server's step history
    also holds earlier work: warm-ups, other runs)."""
    if not done:
        return []
    t0, t1 = min(m.t_start_ns for m in done), max(m.t_end_ns for m in done)
    return [r for r in steps if r.t_ns and t0 <= r.t_start_ns <= t1]


def host_device_split(steps: Sequence[StepRecord]) -> dict[str, Any]:
    """Host and device time of the steps (ms). With CUDA events on every step, device = their
    time and host = wall − device (the host's launch time overlaps the device's work otherwise
    hidden in it). Without them (a CPU), the forward's phases count as device time: the kernels run
    as they are issued, so the host's share is a lower bound there."""
    from minillm.core.step_record import FORWARD_PHASES
    wall = sum(r.wall_ms for r in steps)
    events = all(r.device_ms is not None for r in steps)
    phases = {p: sum(r.phase_ms.get(p, 0.0) for r in steps) for p in PHASES}
    device = sum(r.device_ms for r in steps) if events else sum(phases[p] for p in FORWARD_PHASES)
    host = max(0.0, wall - device)
    gc_ms = sum(r.gc_ms for r in steps)     # inside whichever phase it interrupted (a forward's, often)
    return {"wall_ms": wall, "device_ms": device, "host_ms": host, "host_share": host / wall if wall > 0 else 0.0,
            "gc_ms": gc_ms,
            "device_from": "CUDA events" if events else "forward phases (no device timer)",
            "phase_share": {p: (v / wall if wall > 0 else 0.0) for p, v in phases.items()}}


def _server_time_split(done: Sequence[RequestMetrics]) -> dict[str, float]:
    """Σ over requests of their time at the server (received → last event), and of the parts
    outside the engine: the stages before it (gateway, body, tokenize) and the return after the
    last token (detokenizing, streaming, closing). Seconds."""
    served = sum((m.t_end_ns - m.t_start_ns) / 1e9 for m in done)
    front = {st: sum(m.breakdown.get(st, 0.0) for m in done) for st in _FRONT_STAGES}
    after = sum(max(0, m.t_end_ns - m.deliveries[-1][0]) / 1e9 for m in done if m.deliveries)
    return {"served_s": served, **{f"{k}_s": v for k, v in front.items()}, "return_s": after}


_PART_LABEL = {"return": "the return after the last token"}


def check_outside(done: Sequence[RequestMetrics], steps: Sequence[StepRecord], th: Thresholds) -> Finding:
    from minillm.core.step_record import OUTSIDE_PHASES
    srv = _server_time_split(done)
    outside_s = sum(v for k, v in srv.items() if k != "served_s")
    trace_share = outside_s / srv["served_s"] if srv["served_s"] > 0 else 0.0
    parts = {_PART_LABEL.get(k[:-2], k[:-2]): v for k, v in srv.items()
             if k != "served_s" and srv["served_s"] > 0 and v / srv["served_s"] >= 0.005}
    evidence = [f"requests: {_pct(trace_share)} of their time at the server was outside the engine"
                + (" (" + ", ".join(f"{k} {_pct(v / srv['served_s'])}" for k, v in
                                    sorted(parts.items(), key=lambda kv: -kv[1])) + ")" if parts else "")]
    numbers: dict[str, Any] = {"trace_outside_share": trace_share, **srv}
    step_share = None
    if steps:
        split = host_device_split(steps)
        step_share = split["host_share"]
        shares = split["phase_share"]
        host_phases = ", ".join(f"{p} {_pct(shares[p])}" for p in sorted(OUTSIDE_PHASES, key=lambda p: -shares[p]))
        evidence.append(f"steps: {_pct(step_share)} of {len(steps)} steps' time on the host ({host_phases}); "
                        f"device {split['device_ms']:.1f} ms of {split['wall_ms']:.1f} ms, from {split['device_from']}")
        if split["gc_ms"] > 0:
            evidence.append(f"garbage collection: {split['gc_ms']:.1f} ms inside the steps "
                            f"({_pct(split['gc_ms'] / split['wall_ms'] if split['wall_ms'] > 0 else 0.0)} of their time, "
                            "counted in whichever phase it interrupted)")
        numbers.update({f"steps_{k}": v for k, v in split.items()})
    else:
        evidence.append("no step records: the host/device split of the engine's steps is not known "
                        "(GET /v1/steps, or engine.step_history)")
    by_steps = step_share is not None and step_share >= th.outside_share
    by_trace = trace_share >= th.outside_share
    if by_steps and (not by_trace or step_share >= trace_share):
        top = max(OUTSIDE_PHASES, key=lambda p: numbers["steps_phase_share"][p])
        headline = (f"{OUTSIDE}: host phases ({_pct(step_share)} of step time on the host, most in {top}; "
                    f"chapter line {_pct(th.outside_share)})")
        cause = "host phases"
    else:
        top = max(parts, key=parts.get) if parts else "-"
        headline = (f"{OUTSIDE}: outside the engine ({_pct(trace_share)} of the requests' time at the server; "
                    f"most in {top})")
        cause = "outside the engine"
    if by_steps or by_trace:
        evidence.append("time outside the forward slows every request alike (10.5): fewer, fatter steps, "
                        "CUDA graphs, batched sampling, moving work off the engine thread")
    lost = max(step_share or 0.0, trace_share) * sum(m.e2e_s or 0.0 for m in done)
    return Finding(OUTSIDE, by_steps or by_trace, cause if (by_steps or by_trace) else None, headline, lost,
                   evidence, numbers)


# ---------------------------------------------------------------------------------------------
# The diagnosis
def diagnose(traces: Any, steps: Any = None, thresholds: Thresholds | None = None) -> Diagnosis:
    """Where the slow requests lost their time: starts late, stutters, or outside the device.

    ``traces``: Trace objects or the server's JSON (see :func:`as_traces`); ``steps``: StepRecords
    or ``GET /v1/steps``'s JSON, optional. The verdict is the symptom (starts late, stutters)
    that cost the requests the most time beyond the typical one; time outside the device slows
    every request alike, so it is the verdict only when no symptom stands out.
    """
    th = thresholds or Thresholds()
    traces = as_traces(traces)
    steps = as_steps(steps)
    if not traces:
        return Diagnosis(f"{NO_DATA}: no traces given", NO_DATA, None,
                         notes=["record some requests first (GET /v1/traces, or LLM outputs' .trace)"])
    metrics, notes = _read_metrics(traces)
    s = summarize(metrics)
    done = _completed(metrics)
    base = dict(n_traces=len(traces), n_completed=s.n_ok, n_failed=s.n_failed, n_aborted=s.n_aborted,
                n_skipped=len(traces) - len(metrics))
    failure = _failure_note(metrics)
    if failure:
        notes.append(f"{s.n_failed} request(s) failed and are left out of the statistics; {failure}")
    if s.n_aborted:
        notes.append(f"{s.n_aborted} request(s) were aborted by their client and are left out")
    if not done:
        return Diagnosis(f"{NO_DATA}: none of the {len(traces)} requests completed", NO_DATA, None,
                         **base, notes=notes)
    if steps:
        window = steps_in_window(steps, done)
        if not window:
            notes.append(f"none of the {len(steps)} step records falls inside the requests' time window: "
                         "host/device split skipped")
        steps = window
    no_start = sum(tr.first("received") is None for tr in traces)
    if no_start:
        notes.append(f"{no_start} trace(s) have no `received` event: their TTFT and E2E start at their first event")
    if len(done) < 100:
        notes.append(f"{len(done)} completed requests: p99 is (close to) the maximum; read it as 'the slowest'")
    by_id = {tr.request_id: tr for tr in traces}
    findings = [check_start(done, s, by_id, steps, th), check_stutter(done, s, traces, steps, th),
                check_outside(done, steps, th)]
    return Diagnosis(*_verdict(findings, s), **base, n_steps=len(steps), findings=findings, notes=notes)


def _verdict(findings: list[Finding], s: Summary) -> tuple[str, str, str | None]:
    symptoms = [f for f in findings if f.fired and f.check in (START_LATE, STUTTERS)]
    outside = next(f for f in findings if f.check == OUTSIDE)
    if symptoms:
        main = max(symptoms, key=lambda f: f.lost_s)
    elif outside.fired:
        main = outside
    else:
        start = next(f for f in findings if f.check == START_LATE)
        stutter = next(f for f in findings if f.check == STUTTERS)
        parts = [f"TTFT p99 {_t(s.ttft.p99)} = {start.numbers.get('ttft_ratio', 1.0):.1f}× p50"]
        if "itl_ratio" in stutter.numbers:
            parts.append(f"ITL p99 {_t(s.itl.p99)} = {stutter.numbers['itl_ratio']:.1f}× p50")
        if "steps_host_share" in outside.numbers:
            parts.append(f"{_pct(outside.numbers['steps_host_share'])} of step time on the host")
        return f"{HEALTHY}: no tail stands out ({'; '.join(parts)})", HEALTHY, None
    return main.headline, main.check, main.cause
