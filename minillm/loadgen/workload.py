"""Drive the engine in-process with a realistic workload (chapter 10.2 and 10.6).

A benchmark that sends one fixed prompt, all at once, measures a workload nobody serves. Here:

* prompt and output lengths are **drawn from a distribution** (:class:`LengthDist`), never one
  fixed length (10.6);
* prompts are **unique** token-id lists: no two share even their first token, so no prefix is
  shared and a prefix cache (if an engine had one) could not flatter the result;
* arrivals are **open loop** (:func:`poisson_arrivals`, :func:`gamma_arrivals`): a request
  arrives at its time whether or not the engine has finished the earlier ones, as real users do.
  A closed loop (send the next one when one finishes) slows its own arrivals when the server
  slows, and so hides queueing ("coordinated omission");
* time is **real** (``time.perf_counter_ns``, the clock of every trace). Nothing is simulated.

:func:`run_workload` plays the part of a server's front end: a feeder thread wakes at each
arrival time, stamps ``received`` and tokenizes (as vLLM's API server does, concurrently with the
engine), and puts the request in an inbox; the engine loop steps and, between steps, moves what
has arrived into the scheduler. A request that arrives during a forward pass therefore waits
for that step to end, and that wait is charged to the **queue** stage of its TTFT (10.2).

:func:`stall_scenario` is chapter 10.4's stall on purpose: a few short requests are decoding
when one long prompt arrives; with the prefill-first scheduler the next step is that whole
prefill, so every short request sees one long inter-token gap. :func:`token_gaps` finds such
gaps from trace timestamps alone.
"""
from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from minillm.core.trace import Trace, now_ns
from minillm.engine.sampling import SamplingParams
from minillm.metrics.definitions import RequestMetrics, metrics_from_traces
from minillm.metrics.stutter import TokenGap, token_gaps
from minillm.metrics.summary import SLO, SteadyWindow, Summary, summarize
from minillm.model.config import DEFAULT_VOCAB

# Ids 0..5 are the special tokens of the shipped tokenizer (<|endoftext|>, <|im_start|>, ...):
# a workload prompt made of random ids should not be full of end-of-text markers.
FIRST_ORDINARY_ID = 6


# ---------------------------------------------------------------------------------------------
# Lengths
@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts, always within ``[low, high]`` (both inclusive).

    ``kind`` is ``"fixed"`` (always ``low``), ``"uniform"`` (every integer in the bounds equally
    likely) or ``"lognormal"`` (``exp(N(ln median, sigma))``, rounded, then clipped to the bounds:
    the long right tail real prompt lengths have, 10.6). Build with the class methods.
    """
    kind: str
    low: int
    high: int
    median: float | None = None
    sigma: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"unknown length distribution {self.kind!r}: fixed, uniform or lognormal")
        if not (isinstance(self.low, int) and isinstance(self.high, int) and 1 <= self.low <= self.high):
            raise ValueError("length bounds must be integers with 1 ≤ low ≤ high, got "
                             f"{self.low}..{self.high}")
        if self.kind == "lognormal" and not (self.median and self.median > 0 and self.sigma >= 0):
            raise ValueError("a lognormal length needs median > 0 and sigma ≥ 0")

    @classmethod
    def fixed(cls, n: int) -> "LengthDist":
        return cls("fixed", n, n)

    @classmethod
    def uniform(cls, low: int, high: int) -> "LengthDist":
        return cls("uniform", low, high)

    @classmethod
    def lognormal(cls, median: float, sigma: float, low: int, high: int) -> "LengthDist":
        return cls("lognormal", low, high, float(median), float(sigma))

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` lengths, shape [n], dtype int64."""
        if self.kind == "fixed":
            return np.full(n, self.low, dtype=np.int64)                            # [n]
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)   # [n]
        x = np.exp(rng.normal(math.log(self.median), self.sigma, size=n))          # [n] float
        return np.clip(np.rint(x), self.low, self.high).astype(np.int64)           # [n]

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed {self.low}"
        if self.kind == "uniform":
            return f"uniform [{self.low}, {self.high}]"
        return (f"lognormal (median {self.median:g}, sigma {self.sigma:g}) "
                f"clipped to [{self.low}, {self.high}]")


def make_prompts(n: int, length_dist: LengthDist, seed: int = 0, vocab_size: int = DEFAULT_VOCAB,
                 first_id: int = FIRST_ORDINARY_ID) -> list[list[int]]:
    """``n`` token-id prompts with lengths drawn from ``length_dist``; ids in ``[first_id, vocab_size)``.

    Every prompt starts with a different token (drawn without replacement), so no two prompts
    share a prefix of any length (10.6: unique prompts unless the experiment is about prefix
    caching). The rest of each prompt is uniform random ids. Deterministic for a given seed.
    """
    if n < 0:
        raise ValueError(f"n must be ≥ 0, got {n}")
    n_ids = vocab_size - first_id
    if n > n_ids:
        raise ValueError(f"{n} unique prompts need {n} distinct first tokens, but only {n_ids} ids "
                         f"lie in [{first_id}, {vocab_size})")
    rng = np.random.default_rng(seed)
    lengths = length_dist.sample(n, rng)                                  # [n]
    firsts = rng.choice(n_ids, size=n, replace=False) + first_id          # [n] distinct
    prompts = []
    for length, first in zip(lengths, firsts):
        rest = rng.integers(first_id, vocab_size, size=int(length) - 1)    # [length - 1]
        prompts.append([int(first), *map(int, rest)])
    return prompts


# ---------------------------------------------------------------------------------------------
# Arrivals
def poisson_arrivals(rate: float, n: int, seed: int = 0) -> list[float]:
    """Arrival times (seconds from the start) of ``n`` requests at ``rate`` requests/s.

    Open loop, Poisson: the gaps are independent exponentials with mean 1/rate. The first
    request arrives at 0 (the measurement window starts at the first arrival, design.md §2).
    """
    return gamma_arrivals(rate, n, burstiness=1.0, seed=seed)


def gamma_arrivals(rate: float, n: int, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Like :func:`poisson_arrivals` with Gamma-distributed gaps (vLLM's ``--burstiness``):
    mean gap 1/rate always; burstiness 1 is Poisson, < 1 burstier, > 1 more regular."""
    if not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"rate must be a positive number of requests/s, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if n < 0:
        raise ValueError(f"n must be ≥ 0, got {n}")
    if n == 0:
        return []
    rng = np.random.default_rng(seed)
    if burstiness == 1.0:
        gaps = rng.exponential(1.0 / rate, size=n - 1)                                # [n-1]
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)  # [n-1]
    return [0.0, *np.cumsum(gaps).tolist()]


# ---------------------------------------------------------------------------------------------
# Requests
@dataclass
class WorkloadRequest:
    prompt: list[int] | str
    params: SamplingParams
    request_id: str
    arrival_s: float = 0.0        # seconds after the start of the run


def make_requests(n: int, prompt_len: LengthDist, output_len: LengthDist, seed: int = 0,
                  vocab_size: int = DEFAULT_VOCAB, arrivals: Sequence[float] | None = None,
                  temperature: float = 0.0, prefix: str = "wl") -> list[WorkloadRequest]:
    """``n`` unique prompts and output lengths drawn from the two distributions.

    ``ignore_eos=True`` with ``max_tokens`` = the drawn output length, so every request produces
    exactly its drawn number of tokens (10.6: otherwise a random-weight model's early EOS decides
    the output length distribution, not the experiment).
    """
    prompts = make_prompts(n, prompt_len, seed, vocab_size)
    outs = output_len.sample(n, np.random.default_rng(seed + 1))          # [n]
    if arrivals is not None and len(arrivals) != n:
        raise ValueError(f"{n} requests but {len(arrivals)} arrival times")
    arr = list(arrivals) if arrivals is not None else [0.0] * n
    return [WorkloadRequest(p, SamplingParams(max_tokens=int(o), ignore_eos=True, temperature=temperature,
                                              seed=seed + i), f"{prefix}-{i:04d}", float(a))
            for i, (p, o, a) in enumerate(zip(prompts, outs, arr))]


# ---------------------------------------------------------------------------------------------
# Running
class _FinishedOutputs:
    """Traces and metrics of a run's ``outputs`` (RequestOutputs), computed from the traces."""
    outputs: list[Any]

    @property
    def traces(self) -> list[Trace]:
        return [o.trace for o in self.outputs]

    @property
    def metrics(self) -> list[RequestMetrics]:
        return metrics_from_traces(self.traces)


@dataclass
class WorkloadResult(_FinishedOutputs):
    """What a run produced: the finished outputs (in request order) with their traces.

    ``t0_ns`` is the start of the run on the trace clock; request *i* was due at
    ``t0_ns + arrivals_s[i]``. ``arrival_lag_s[i]`` is how late the feeder thread actually woke
    for it (GIL, OS scheduling); its ``received`` stamp is the due time regardless, as an
    open-loop client sends on schedule, so that lateness is inside its TTFT, not hidden.
    """
    outputs: list[Any]              # minillm.engine.engine.RequestOutput
    arrivals_s: list[float]
    t0_ns: int
    arrival_lag_s: list[float]
    info: dict[str, Any] = field(default_factory=dict)

    def summary(self, slo: SLO | None = None, steady: SteadyWindow | None = None) -> Summary:
        return summarize(self.metrics, slo=slo, steady=steady)


def warm_up(llm, prompt_len: int = 64, max_tokens: int = 4, batch: int = 2) -> None:
    """Run a few throwaway requests first (10.6): the first forward passes pay for memory
    allocation and kernel selection, which no later request pays again."""
    vocab = llm.engine.config.vocab_size
    prompts = make_prompts(batch,
                           LengthDist.fixed(min(prompt_len, llm.engine.max_model_len - max_tokens - 1)),
                           seed=12345, vocab_size=vocab)
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))


def run_workload(llm, requests: Sequence[WorkloadRequest], arrivals: Sequence[float] | None = None,
                 timeout_s: float | None = None) -> WorkloadResult:
    """Feed ``requests`` to ``llm.engine`` at their arrival times, in real time, and step the
    engine until every one has finished. ``arrivals`` (seconds from the start) overrides each
    request's ``arrival_s``. Returns the outputs in the order of ``requests``.

    The engine must be idle. Every prompt is checked before the clock starts, so a bad request
    fails here and not halfway through a measurement. String prompts are tokenized up front too
    (the token ids are what is sent), so their ``tokenize`` stage is ~0 here; notebook 01
    measures tokenization on the server path. ``timeout_s`` aborts a run that takes too long.
    """
    engine = llm.engine
    if engine.has_unfinished():
        raise RuntimeError("run_workload needs an idle engine: it still has unfinished requests")
    reqs = list(requests)
    times = [r.arrival_s for r in reqs] if arrivals is None else [float(a) for a in arrivals]
    if len(times) != len(reqs):
        raise ValueError(f"{len(reqs)} requests but {len(times)} arrival times")
    if any(not (t >= 0 and math.isfinite(t)) for t in times):
        raise ValueError("arrival times must be finite and ≥ 0 (seconds after the start)")
    ids = [r.request_id for r in reqs]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")

    # Validate (and tokenize strings) before the clock starts.
    prompts: list[list[int]] = []
    for r in reqs:
        ids_ = list(r.prompt) if not isinstance(r.prompt, str) else \
            engine.prepare(r.prompt, r.params, request_id=r.request_id).prompt_ids
        engine.prepare(ids_, r.params, request_id=r.request_id)       # raises RequestError if bad
        prompts.append(ids_)

    order = sorted(range(len(reqs)), key=lambda i: times[i])
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    lag = [0.0] * len(reqs)
    stop = threading.Event()
    t0 = now_ns()

    def feeder() -> None:
        # The front end: wake at each arrival time, stamp it, tokenize/validate, hand over.
        try:
            for i in order:
                due = t0 + round(times[i] * 1e9)
                while (wait := due - now_ns()) > 0:
                    if stop.wait(wait / 1e9):
                        return
                lag[i] = (now_ns() - due) / 1e9
                tr = Trace(reqs[i].request_id)
                tr.record("received", t_ns=due)
                inbox.put(engine.prepare(prompts[i], reqs[i].params, reqs[i].request_id, tr))
        except BaseException as e:          # surfaces in the engine loop below
            inbox.put(e)

    thread = threading.Thread(target=feeder, name="minillm-workload-feeder", daemon=True)
    thread.start()
    done: dict[str, Any] = {}
    deadline = None if timeout_s is None else t0 + round(timeout_s * 1e9)
    try:
        while len(done) < len(reqs):
            if deadline is not None and now_ns() > deadline:
                raise TimeoutError(f"workload did not finish within {timeout_s} s "
                                   f"({len(done)}/{len(reqs)} requests done)")
            # Between steps: everything that has arrived joins the scheduler's queue.
            # Idle engine: block until the next arrival instead of spinning.
            block = not engine.has_unfinished()
            while True:
                try:
                    item = inbox.get(timeout=0.05) if block else inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, BaseException):
                    raise item
                engine.enqueue(item)
                block = False
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = engine.output_of(engine.pop_finished(out.request_id))
    finally:
        stop.set()
        thread.join()
        _abort_unfinished(engine, ids, done)     # on error: leave the engine idle and reusable
        while True:                          # requests the feeder handed over after the error
            try:
                item = inbox.get_nowait()
            except queue.Empty:
                break
    info = {"n_requests": len(reqs), "prompt_tokens": [len(p) for p in prompts],
            "max_tokens": [r.params.max_tokens for r in reqs],
            "last_arrival_s": max(times, default=0.0)}
    return WorkloadResult([done[rid] for rid in ids], times, t0, lag, info)


def _abort_unfinished(engine, ids: Sequence[str], done: dict) -> None:
    """Abort and drop every request of ``ids`` not in ``done``: after an error the engine is left
    idle and reusable."""
    for rid in ids:
        if rid not in done:
            try:
                engine.abort(rid)
                engine.pop_finished(rid)
            except KeyError:
                pass


# ---------------------------------------------------------------------------------------------
# How fast can this machine serve a workload? (calibrating an open-loop rate)
def _prepare_all(engine, reqs: Sequence[WorkloadRequest]) -> list[list[int]]:
    prompts = []
    for r in reqs:
        ids_ = list(r.prompt) if not isinstance(r.prompt, str) else \
            engine.prepare(r.prompt, r.params, request_id=r.request_id).prompt_ids
        engine.prepare(ids_, r.params, request_id=r.request_id)       # raises RequestError if bad
        prompts.append(ids_)
    return prompts


def run_closed_loop(llm, requests: Sequence[WorkloadRequest], concurrency: int,
                    timeout_s: float | None = None) -> WorkloadResult:
    """A closed loop: keep ``concurrency`` requests in flight; each completion sends the next one
    at once (its ``received`` is that moment). It measures what the engine can serve, never how it
    behaves under a given load: it slows its own arrivals when the engine slows (10.6). The
    requests' own ``arrival_s`` are ignored; the result's ``arrivals_s`` are when each was sent."""
    engine = llm.engine
    if engine.has_unfinished():
        raise RuntimeError("run_closed_loop needs an idle engine: it still has unfinished requests")
    if concurrency < 1:
        raise ValueError("concurrency must be ≥ 1")
    reqs = list(requests)
    ids = [r.request_id for r in reqs]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")
    prompts = _prepare_all(engine, reqs)
    sent = [0.0] * len(reqs)
    t0 = now_ns()
    nxt = 0

    def send() -> None:
        nonlocal nxt
        i, nxt = nxt, nxt + 1
        t = now_ns()
        tr = Trace(reqs[i].request_id)
        tr.record("received", t_ns=t)
        sent[i] = (t - t0) / 1e9
        engine.enqueue(engine.prepare(prompts[i], reqs[i].params, reqs[i].request_id, tr))

    done: dict[str, Any] = {}
    deadline = None if timeout_s is None else t0 + round(timeout_s * 1e9)
    try:
        while nxt < min(concurrency, len(reqs)):
            send()
        while len(done) < len(reqs):
            if deadline is not None and now_ns() > deadline:
                raise TimeoutError(f"closed loop did not finish within {timeout_s} s "
                                   f"({len(done)}/{len(reqs)} done)")
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = engine.output_of(engine.pop_finished(out.request_id))
                    if nxt < len(reqs):
                        send()
    finally:
        _abort_unfinished(engine, ids, done)
    info = {"n_requests": len(reqs), "closed_loop_concurrency": concurrency,
            "prompt_tokens": [len(p) for p in prompts], "max_tokens": [r.params.max_tokens for r in reqs]}
    return WorkloadResult([done[rid] for rid in ids], sent, t0, [0.0] * len(reqs), info)


# ---------------------------------------------------------------------------------------------
# Chapter 10.4's stall, on purpose
@dataclass
class StallResult(_FinishedOutputs):
    outputs: list[Any]              # RequestOutput: the short requests, then the long one
    short_ids: list[str]
    long_id: str
    info: dict[str, Any] = field(default_factory=dict)

    def gaps(self) -> list[TokenGap]:
        return token_gaps(self.traces)

    def stalled_gaps(self) -> list[TokenGap]:
        """Gaps of the short requests that contain the long request's prefill."""
        return [g for g in self.gaps() if g.request_id in self.short_ids and self.long_id in g.prefills]

    def describe(self) -> str:
        """The scenario in one line (a figure's stamp): how many short requests, how long the prompt
        that arrives, and when."""
        i = self.info
        return (f"stall scenario: {i['n_short']} short requests x {i['short_output']} tokens, long prompt "
                f"{i['long_prompt_len']} tokens arriving after {i['arrive_after_tokens']} tokens")

    def summary(self) -> str:
        """What the stall did, read from the traces, in six lines: how many gaps hold the long prompt's
        prefill (and how long that prefill took), the median of the gaps that hold no prefill, every
        stalled gap, the ITL distribution (p50, mean, p99, max, pooled over every gap), the share of
        gaps that stalled, and whether p99 falls on the stalled gaps."""
        gaps, stalled = self.gaps(), self.stalled_gaps()
        normal_ms = np.array([g.gap_s for g in gaps if not g.stalled]) * 1e3
        long_m = next(m for m in self.metrics if m.request_id == self.long_id)
        d = summarize(self.metrics).itl
        out = [f"{len(gaps)} gaps; {len(stalled)} of them contain the {self.info['long_prompt_len']}-token "
               f"prefill (the long request's prefill took {long_m.breakdown['prefill'] * 1e3:.1f} ms)",
               f"gaps without a prefill: median {np.median(normal_ms):.2f} ms" if normal_ms.size
               else "no gap without a prefill",
               f"stalled gaps:           {', '.join(f'{g.gap_s * 1e3:.1f}' for g in stalled) or '-'} ms",
               f"ITL: p50 {d.p50 * 1e3:.2f} ms | mean {d.mean * 1e3:.2f} ms | p99 {d.p99 * 1e3:.2f} ms | "
               f"max {d.max * 1e3:.2f} ms",
               f"share of gaps that stalled: {len(stalled) / max(len(gaps), 1):.1%}"]
        if not stalled:
            out.append("no gap held the long prefill: it did not arrive while the short requests decoded")
        elif d.p99 >= min(g.gap_s for g in stalled):
            out.append("p99 falls on the stalled gaps")
        else:
            out.append("p99 lies below the stalled gaps (they are under 1% of the gaps here)")
        return "\n".join(out)


def stall_scenario(llm, n_short: int = 4, short_prompt_len: int = 16, short_output: int = 48,
                   long_prompt_len: int = 1024, long_output: int = 4, arrive_after_tokens: int = 16,
                   seed: int = 0) -> StallResult:
    """``n_short`` short requests start together and decode; after each has produced
    ``arrive_after_tokens`` tokens, one request with a ``long_prompt_len``-token prompt arrives.

    The arrival is triggered by progress, not by a clock value, so on any machine it lands
    mid-decode (everything is still real time). The prefill-first policy then runs the long
    prefill as one step, and every short request waits for it: one long gap each. The chunked
    policy (the default) splits it into budget-sized chunks that share steps with the decodes:
    several shorter gaps (10.4's fix).
    """
    engine = llm.engine
    if engine.has_unfinished():
        raise RuntimeError("stall_scenario needs an idle engine")
    if not 1 <= arrive_after_tokens < short_output:
        raise ValueError("arrive_after_tokens must be ≥ 1 and < short_output, so the short requests "
                         "are still decoding when the long prompt arrives")
    if n_short + 1 > engine.scheduler.max_batch_size or n_short + 1 > engine.allocator.num_free:
        raise ValueError(f"{n_short} short requests + 1 long need {n_short + 1} batch slots")
    if long_prompt_len + long_output > engine.max_model_len:
        raise ValueError(f"long prompt ({long_prompt_len}) + output ({long_output}) exceed the engine's "
                         f"max_model_len ({engine.max_model_len})")
    vocab = engine.config.vocab_size
    prompts = make_prompts(n_short + 1, LengthDist.fixed(short_prompt_len), seed, vocab)
    prompts[-1] = make_prompts(1, LengthDist.fixed(long_prompt_len), seed + 1, vocab)[0]
    if prompts[-1][0] in {p[0] for p in prompts[:-1]}:        # keep every prompt unique
        prompts[-1][0] = next(t for t in range(FIRST_ORDINARY_ID, vocab) if t not in {p[0] for p in prompts})
    short_ids = [f"short-{i}" for i in range(n_short)]
    long_id = "long"
    short_params = SamplingParams(max_tokens=short_output, ignore_eos=True, temperature=0)
    for rid, p in zip(short_ids, prompts):
        engine.add_request(p, short_params, rid)
    long_added = False
    done: dict[str, Any] = {}
    while len(done) < n_short + 1:
        if not long_added and all(len(engine.get(r).output_ids) >= arrive_after_tokens for r in short_ids):
            engine.add_request(prompts[-1], SamplingParams(max_tokens=long_output, ignore_eos=True,
                                                           temperature=0), long_id)
            long_added = True
        for out in engine.step():
            if out.finished:
                done[out.request_id] = engine.output_of(engine.pop_finished(out.request_id))
    info = {"n_short": n_short, "short_prompt_len": short_prompt_len, "short_output": short_output,
            "long_prompt_len": long_prompt_len, "long_output": long_output,
            "arrive_after_tokens": arrive_after_tokens, "policy": engine.scheduler.policy,
            "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens}
    return StallResult([done[r] for r in short_ids] + [done[long_id]], short_ids, long_id, info)
