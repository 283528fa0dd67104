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
  workload differ by orders of magnitude in tok/s), over the window first arrival → last completion, as vLLM
  does; optionally a steady-state window beside it (:class:`~minillm.metrics.summary.SteadyWindow`).
* **Goodput** requests/s that met every given SLO (:class:`~minillm.metrics.summary.SLO`), as vLLM's
  ``--goodput``.

Statistics over many requests (distributions, percentiles, summaries, goodput) are in
:mod:`minillm.metrics.summary`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

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


def ns_to_s(ns: int | float) -> float:
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
    ``first_token`` instead of ``prefill`` (design.md §1). TTFT ends at the first token that
    carries text (:func:`_first_text_token_ns`): when the first token is half a UTF-8 character,
    the decode steps until one completes it go to ``first_token`` too, so the stages still add
    up to TTFT. Empty dict if no token was produced.
    """
    events = list(trace)
    i_first = next((i for i, e in enumerate(events) if e.event == "token"), None)
    if i_first is None:
        return {}
    t_first = events[i_first].t_ns
    t_text = _first_text_token_ns(trace, [e.t_ns for e in events if e.event == "token"])
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
    out["first_token"] += max(t_text - t_first, 0)     # until a token carries text (TTFT's end)
    return {stage: ns_to_s(ns) for stage, ns in out.items()}


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

    ttft = ns_to_s(_first_text_token_ns(trace, times) - t0) if times else None
    e2e = ns_to_s(times[-1] - t0) if times else None
    return RequestMetrics(
        request_id=trace.request_id, prompt_tokens=prompt_tokens, output_tokens=len(times),
        ttft_s=ttft, e2e_s=e2e, tpot_s=_tpot(ttft, e2e, len(times)),
        itl_s=[ns_to_s(b - a) for a, b in zip(times, times[1:])],
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
    ttft = ns_to_s(visible[0] - rec.t_sent_ns) if visible else None
    e2e = ns_to_s(visible[-1] - rec.t_sent_ns) if visible else None
    return RequestMetrics(
        request_id=rec.request_id, prompt_tokens=int(rec.prompt_tokens), output_tokens=n_out,
        ttft_s=ttft, e2e_s=e2e, tpot_s=_tpot(ttft, e2e, n_out),
        itl_s=[ns_to_s(b - a) for a, b in zip(visible, visible[1:])],
        breakdown={}, t_start_ns=int(rec.t_sent_ns), t_end_ns=int(rec.t_done_ns),
        ok=ok, finish_reason=None if ok else "error", side="client",
        error=None if ok else (error or "failed"),
        deliveries=[d for d in deliveries if d[1] > 0])


