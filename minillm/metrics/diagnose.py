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

From a terminal (``python -m minillm diagnose``)::

    python -m minillm diagnose --base-url http://127.0.0.1:8000 --api-key $MINILLM_API_KEY
    python -m minillm diagnose --traces traces.json --json

A traces file is JSON in any of these forms: what ``GET /v1/traces`` returns (``{"data": [...]}``),
a list of its items (``{"request_id", "events": [{"event", "t_ns", ...}]}``), a list of
``Trace.to_records()`` lists, or ``{"traces": <one of those>, "steps": <GET /v1/steps's body or
its "data" list>}``, which is what ``--save`` writes.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

from minillm.core.records import as_steps, as_traces
from minillm.core.step_record import PHASES, StepRecord
from minillm.core.trace import Trace
from minillm.metrics.definitions import STAGES, RequestMetrics, request_metrics
from minillm.metrics.findings import (
    FRONT_STAGES,
    HEALTHY,
    NO_DATA,
    OUTSIDE,
    STAGE_HINT,
    START_LATE,
    STUTTERS,
    WAIT_STAGES,
    Finding,
    Thresholds,
    fmt_pct,
    fmt_time,
    json_safe,
    ratio_or_inf,
)
from minillm.metrics.stutter import check_stutter
from minillm.metrics.summary import Summary, breakdown_at_percentile, summarize


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
        lines += ["", f"requests: {self.n_completed} completed, {self.n_failed} failed, {self.n_aborted} "
                      f"aborted ({self.n_traces} traces"
                      + (f", {self.n_skipped} unreadable" if self.n_skipped else "")
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
        return json_safe(asdict(self))


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
    pre = sorted(m.breakdown.get("prefill", 0.0) + m.breakdown.get("first_token", 0.0)
                 for m in done if m.breakdown)
    return pre[len(pre) // 2] if pre else 0.0


def _tail_breakdown(done: Sequence[RequestMetrics], ttft_floor: float) -> dict[str, float]:
    """Mean stages of the requests at or above the p99 request's TTFT (the tail, 10.2)."""
    tail = [m for m in done if m.breakdown and m.ttft_s is not None and m.ttft_s >= ttft_floor]
    return {st: sum(m.breakdown[st] for m in tail) / len(tail) for st in STAGES}


def _stage_line(label: str, rid: str, ttft_s: float, bd: dict[str, float]) -> str:
    parts = ", ".join(f"{st} {fmt_time(v)}" for st, v in bd.items() if v > 0) or "no stage recorded"
    return f"{label} ({rid}, TTFT {fmt_time(ttft_s)}): {parts}"


def _queue_evidence(done: Sequence[RequestMetrics], by_id: dict[str, Trace],
                    steps: Sequence[StepRecord]) -> list[str]:
    depths = [int(e.extra["queue_depth"]) for m in done for e in by_id[m.request_id]
              if e.event == "enqueued" and "queue_depth" in e.extra]
    starts = sorted(m.t_start_ns for m in done)
    lines = [f"{len(done)} requests arrived within {fmt_time((starts[-1] - starts[0]) / 1e9)} of each other"]
    if depths:
        lines.append(f"up to {max(depths)} requests were waiting at once (queue depth at `enqueued`)")
    if steps:
        lines.append(f"the engine ran at most {max(s.num_rows for s in steps)} requests in one step")
    return lines


def _prefill_evidence(done: Sequence[RequestMetrics], by_id: dict[str, Trace],
                      tail_ids: list[str]) -> list[str]:
    prompts = sorted(m.prompt_tokens for m in done)
    by_rid = {m.request_id: m for m in done}
    tail = [by_rid[rid] for rid in tail_ids]
    lines = [f"prompt tokens of the slowest requests: {', '.join(str(m.prompt_tokens) for m in tail[:5])} "
             f"(median over all requests {prompts[len(prompts) // 2]})"]
    for m in tail[:3]:
        ps = by_id[m.request_id].first("prefill_start")
        chunks = [e for e in by_id[m.request_id] if e.event == "prefill_chunk"]
        if ps is not None and "n_tokens" in ps.extra and int(ps.extra["n_tokens"]) > m.prompt_tokens:
            lines.append(f"{m.request_id} shared its first prefill step: {ps.extra['n_tokens']} prompt "
                         f"tokens in it, {m.prompt_tokens} of them its own")
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
    ratio = ratio_or_inf(s.ttft.p99, s.ttft.p50)
    wait = sum(tail[st] for st in WAIT_STAGES)
    scale = _step_scale(s, done)
    by_tail = ratio >= th.tail_ratio
    by_wait = total > 0 and wait / total >= th.wait_share and wait >= th.wait_steps * scale
    lost = sum(max(0.0, m.ttft_s - s.ttft.p50) for m in with_bd)
    evidence = [f"TTFT p50 {fmt_time(s.ttft.p50)}, p99 {fmt_time(s.ttft.p99)} ({ratio:.1f}× p50), max "
                f"{fmt_time(s.ttft.max)} over {s.ttft.count} requests",
                _stage_line("p50 request", rid50, ttft_of[rid50], bd50),
                _stage_line("p99 request", rid99, ttft_of[rid99], bd99)]
    if 1 < len(tail_ids) < len(with_bd):
        evidence.append(f"the {len(tail_ids)} requests at or above p99: {fmt_pct(share)} of their TTFT in "
                        f"{stage}")
    if by_wait and not by_tail:
        evidence.append(f"every request waits: the tail queued {fmt_time(wait)} ({fmt_pct(wait / total)} of "
                        f"its TTFT), {ratio_or_inf(wait, scale):.0f} decode steps of {fmt_time(scale)}")
    if by_tail or by_wait:
        evidence.append(f"{stage}: {STAGE_HINT[stage]}")
        if stage == "queue":
            evidence += _queue_evidence(done, by_id, steps)
        elif stage == "prefill":
            evidence += _prefill_evidence(done, by_id, tail_ids)
    return Finding(START_LATE, by_tail or by_wait, stage,
                   f"{START_LATE}: {stage} (p99 TTFT {fmt_time(s.ttft.p99)}, {fmt_pct(share)} of it {stage})",
                   lost, evidence,
                   {"ttft_p50_s": s.ttft.p50, "ttft_p99_s": s.ttft.p99, "ttft_ratio": ratio,
                    "p50_request": rid50, "p99_request": rid99, "breakdown_p50_s": bd50,
                    "breakdown_p99_s": bd99,
                    "tail_requests": tail_ids, "tail_breakdown_s": tail, "dominant_stage": stage,
                    "dominant_share": share, "queue_steps": ratio_or_inf(wait, scale)})


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
    return {"wall_ms": wall, "device_ms": device, "host_ms": host,
            "host_share": host / wall if wall > 0 else 0.0,
            "gc_ms": gc_ms,
            "device_from": "CUDA events" if events else "forward phases (no device timer)",
            "phase_share": {p: (v / wall if wall > 0 else 0.0) for p, v in phases.items()}}


def _server_time_split(done: Sequence[RequestMetrics]) -> dict[str, float]:
    """Σ over requests of their time at the server (received → last event), and of the parts
    outside the engine: the stages before it (gateway, body, tokenize) and the return after the
    last token (detokenizing, streaming, closing). Seconds."""
    served = sum((m.t_end_ns - m.t_start_ns) / 1e9 for m in done)
    front = {st: sum(m.breakdown.get(st, 0.0) for m in done) for st in FRONT_STAGES}
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
    evidence = [f"requests: {fmt_pct(trace_share)} of their time at the server was outside the engine"
                + (" (" + ", ".join(f"{k} {fmt_pct(v / srv['served_s'])}" for k, v in
                                    sorted(parts.items(), key=lambda kv: -kv[1])) + ")" if parts else "")]
    numbers: dict[str, Any] = {"trace_outside_share": trace_share, **srv}
    step_share = None
    if steps:
        split = host_device_split(steps)
        step_share = split["host_share"]
        shares = split["phase_share"]
        by_share = sorted(OUTSIDE_PHASES, key=lambda p: -shares[p])
        host_phases = ", ".join(f"{p} {fmt_pct(shares[p])}" for p in by_share)
        evidence.append(f"steps: {fmt_pct(step_share)} of {len(steps)} steps' time on the host "
                        f"({host_phases}); device {split['device_ms']:.1f} ms of {split['wall_ms']:.1f} ms, "
                        f"from {split['device_from']}")
        if split["gc_ms"] > 0:
            evidence.append(f"garbage collection: {split['gc_ms']:.1f} ms inside the steps "
                            f"({fmt_pct(split['gc_ms'] / split['wall_ms'] if split['wall_ms'] > 0 else 0.0)} "
                            "of their time, counted in whichever phase it interrupted)")
        numbers.update({f"steps_{k}": v for k, v in split.items()})
    else:
        evidence.append("no step records: the host/device split of the engine's steps is not known "
                        "(GET /v1/steps, or engine.step_history)")
    by_steps = step_share is not None and step_share >= th.outside_share
    by_trace = trace_share >= th.outside_share
    if by_steps and (not by_trace or step_share >= trace_share):
        top = max(OUTSIDE_PHASES, key=lambda p: numbers["steps_phase_share"][p])
        headline = (f"{OUTSIDE}: host phases ({fmt_pct(step_share)} of step time on the host, most in {top}; "
                    f"chapter line {fmt_pct(th.outside_share)})")
        cause = "host phases"
    else:
        top = max(parts, key=parts.get) if parts else "-"
        headline = (f"{OUTSIDE}: outside the engine ({fmt_pct(trace_share)} of the requests' time at the "
                    f"server; most in {top})")
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
        notes.append(f"{no_start} trace(s) have no `received` event: their TTFT and E2E start at their first "
                     "event")
    if len(done) < 100:
        notes.append(f"{len(done)} completed requests: p99 is (close to) the maximum; read it as 'the "
                     "slowest'")
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
        parts = [f"TTFT p99 {fmt_time(s.ttft.p99)} = {start.numbers.get('ttft_ratio', 1.0):.1f}× p50"]
        if "itl_ratio" in stutter.numbers:
            parts.append(f"ITL p99 {fmt_time(s.itl.p99)} = {stutter.numbers['itl_ratio']:.1f}× p50")
        if "steps_host_share" in outside.numbers:
            parts.append(f"{fmt_pct(outside.numbers['steps_host_share'])} of step time on the host")
        return f"{HEALTHY}: no tail stands out ({'; '.join(parts)})", HEALTHY, None
    return main.headline, main.check, main.cause


# ---------------------------------------------------------------------------------------------
# From a server's Prometheus histograms, when it keeps no traces (vLLM, SGLang, llama.cpp)
@dataclass(frozen=True)
class ServerStage:
    """One stage's histogram over a window: the count, the exact mean (sum / count) and quantiles
    estimated from the buckets (None: no request in the window)."""
    count: int
    mean_s: float | None
    p50_s: float | None
    p99_s: float | None


SERVER_NOT_AVAILABLE = "not available from this server"


def _stage_text(name: str, st: ServerStage | None, ttft_mean: float | None) -> str:
    if st is None:
        return f"{name}: {SERVER_NOT_AVAILABLE}"
    if st.mean_s is None:
        return f"{name}: no request recorded in the window"
    share = f" ({fmt_pct(st.mean_s / ttft_mean)} of mean TTFT)" if ttft_mean else ""
    return (f"{name}: mean {fmt_time(st.mean_s)}{share}, p50 ≈ {fmt_time(st.p50_s or 0.0)}, "
            f"p99 ≈ {fmt_time(st.p99_s or 0.0)}")


def _server_start_finding(stages: dict[str, ServerStage | None], th: Thresholds) -> Finding:
    """Starts late, from histograms: the mean TTFT split into queue and prefill (vLLM's own
    stages: WAITING, then scheduled → first token), TTFT p99 against p50 from the buckets."""
    ttft, queue, prefill = stages.get("ttft"), stages.get("queue"), stages.get("prefill")
    t_mean = ttft.mean_s if ttft else None
    parts = {k: v.mean_s for k, v in (("queue", queue), ("prefill", prefill)) if v and v.mean_s is not None}
    if t_mean and "prefill" not in parts and "queue" in parts:
        parts["prefill and the rest"] = max(0.0, t_mean - parts["queue"])   # SGLang: no prefill histogram
    evidence = [_stage_text("TTFT", ttft, None), _stage_text("queue", queue, t_mean),
                _stage_text("prefill", prefill, t_mean)]
    if not parts or not t_mean:
        return Finding(START_LATE, False, None, f"{START_LATE}: the server's histograms cannot split TTFT",
                       evidence=evidence)
    stage = max(parts, key=parts.get)
    share = parts[stage] / t_mean
    ratio = ratio_or_inf(ttft.p99_s or 0.0, ttft.p50_s or 0.0)
    q_share = parts.get("queue", 0.0) / t_mean
    fired = ratio >= th.tail_ratio or q_share >= th.wait_share
    if fired and stage == "queue":
        evidence.append(f"queue: {STAGE_HINT['queue']}")
    elif fired and stage == "prefill":
        evidence.append(f"prefill: {STAGE_HINT['prefill']}")
    return Finding(START_LATE, fired, stage.split()[0],
                   f"{START_LATE}: {stage} (mean TTFT {fmt_time(t_mean)}, {fmt_pct(share)} of it {stage})",
                   (t_mean - (ttft.p50_s or 0.0)) * ttft.count if ttft.count else 0.0, evidence,
                   {"ttft_mean_s": t_mean, "ttft_p50_s": ttft.p50_s, "ttft_p99_s": ttft.p99_s,
                    "ttft_ratio": ratio, "stage_means_s": parts, "dominant_stage": stage,
                    "dominant_share": share})


def _server_stutter_finding(stages: dict[str, ServerStage | None], th: Thresholds) -> Finding:
    itl = stages.get("itl")
    if itl is None or itl.mean_s is None:
        return Finding(STUTTERS, False, None, f"{STUTTERS}: no inter-token histogram",
                       evidence=[_stage_text("ITL", itl, None)])
    ratio = ratio_or_inf(itl.p99_s or 0.0, itl.p50_s or 0.0)
    fired = ratio >= th.tail_ratio
    evidence = [_stage_text("ITL", itl, None),
                "which gaps held another request's prefill: not available from /metrics (it needs "
                "per-request traces)"]
    return Finding(STUTTERS, fired, None,
                   f"{STUTTERS}: ITL p99 ≈ {fmt_time(itl.p99_s or 0.0)} = {ratio:.1f}× p50 (from buckets)",
                   0.0, evidence, {"itl_p50_s": itl.p50_s, "itl_p99_s": itl.p99_s, "itl_ratio": ratio})


def diagnose_server_histograms(stages: dict[str, ServerStage | None], source: str, window: str,
                               thresholds: Thresholds | None = None,
                               notes: Sequence[str] = ()) -> Diagnosis:
    """The diagnosis a server's Prometheus histograms allow (``source`` names them, e.g. "the
    server's /metrics (vLLM names)"): starts late split into queue and prefill by their means, stutters
    from ITL p99/p50 in the buckets; time outside the device is not available from histograms."""
    th = thresholds or Thresholds()
    ttft = stages.get("ttft")
    e2e = stages.get("e2e")
    n = (e2e or ttft).count if (e2e or ttft) else 0
    base = dict(n_completed=n, notes=[f"source: {source}, {window}",
                                      "quantiles are estimated from the histogram buckets; means are exact",
                                      f"outside the device: {SERVER_NOT_AVAILABLE} (/metrics has no step "
                                      "records)"] + list(notes))
    if ttft is None and stages.get("queue") is None:
        return Diagnosis(f"{NO_DATA}: TTFT and queue time are {SERVER_NOT_AVAILABLE} ({source})", NO_DATA,
                         None, **base)
    if not n:
        return Diagnosis(f"{NO_DATA}: no request finished in the window ({source})", NO_DATA, None, **base)
    findings = [_server_start_finding(stages, th), _server_stutter_finding(stages, th)]
    fired = [f for f in findings if f.fired]
    if fired:
        main = fired[0]
        verdict = f"{main.headline}; from {source}"
        return Diagnosis(verdict, main.check, main.cause, **base, findings=findings)
    return Diagnosis(f"{HEALTHY}: no tail stands out in {source}", HEALTHY, None, **base, findings=findings)
