"""10.4's stall, step by step: decoders running, a long prompt arrives; prefill-first runs it in one
step and every decoder waits, chunked cuts it to a token budget. ``run_stall`` measures one policy
and budget through the engine's traces and step records; ``chunk_tradeoff`` sweeps the budgets."""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from minillm.core.result import Result
from minillm.hardware.quiet import NOISY_SPREAD, median_p10_p90, too_wide
from minillm.perf.prefill import chunk_sizes

# ----------------------------------------------------------------------------- the stall, step by step

@dataclass(frozen=True)
class StepGap:
    """One inter-token gap of one request, in engine steps: token ``index - 1`` came out of step
    ``step_from``, token ``index`` out of ``step_to``. The gap spans steps step_from + 1 … step_to
    (the token of step_to appears only when that step's whole forward is done)."""
    request_id: str
    index: int
    step_from: int
    step_to: int
    chunk_steps: tuple[int, ...]       # steps of the long prefill's chunks inside this gap
    whole_prefill: bool                # every chunk of the long prefill is inside


def gaps_by_steps(token_steps: dict[str, list[int]], chunk_steps: Sequence[int]) -> list[StepGap]:
    """Every gap of every request in ``token_steps`` (request → the step of each of its tokens),
    with the long prefill's chunk steps that fall inside it. Pure bookkeeping, no clocks."""
    chunks = sorted(chunk_steps)
    out = []
    for rid, steps in token_steps.items():
        for k, (a, b) in enumerate(zip(steps, steps[1:]), start=1):
            inside = tuple(c for c in chunks if a < c <= b)
            out.append(StepGap(rid, k, a, b, inside, bool(chunks) and len(inside) == len(chunks)))
    return out


def token_steps_of(trace, records) -> list[int]:
    """The step that produced each ``token`` of ``trace``: a token is stamped with its step's
    "sampled" mark (StepRecord.t_ns after the sample phase), so the two are matched exactly."""
    from minillm.core.step_record import PHASES
    i = PHASES.index("sample")
    by_t = {r.t_ns[i]: r.step for r in records if len(r.t_ns) > i}
    try:
        return [by_t[t] for t in trace.times("token")]
    except KeyError as e:
        raise ValueError(f"request {trace.request_id}: a token stamped {e} matches no step record "
                         f"(the step history is too short?)") from None


@dataclass
class StallRun(Result):
    """One run of the stall scenario, as plain data: times in ms from the long request's arrival."""
    policy: str
    budget: int
    setup: dict
    short_ids: list[str]
    long_id: str
    tokens_ms: dict[str, list[float]]       # request → its token times
    token_steps: dict[str, list[int]]       # request → the step of each token
    # the long prefill's chunks: step, t_start_ms, t_end_ms, tokens, decode_rows
    chunks: list[dict]
    steps: list[dict]                       # the scenario's StepRecords, abridged
    stalled: list[dict]                     # short requests' gaps holding the whole long prefill
    itl_max_ms: float
    itl_p99_ms: float
    itl_p50_ms: float
    output_tok_s: float                     # all output tokens / (first arrival → last token)
    long_ttft_ms: float
    long_prefill_ms: float                  # prefill_start → prefill_end of the long request
    max_chunk_gap_ms: float                 # the longest decoder gap that holds any chunk of it

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    def gaps(self) -> list[StepGap]:
        return gaps_by_steps({r: self.token_steps[r] for r in self.short_ids},
                             [c["step"] for c in self.chunks])

    def summary(self, sweep_prefill_ms: float | None = None) -> str:
        """What happened to the long prompt, read from step numbers: the step(s) its prefill ran in,
        with how many decode rows; the decoders' gaps that hold the whole prefill, one line each; and
        the long prefill's time in this run's trace (beside ``sweep_prefill_ms``, a prefill sweep's
        forward time for the same prompt length, when given)."""
        c = self.chunks
        whole = [g for g in self.gaps() if g.whole_prefill]
        if len(c) == 1:
            head = (f"the long prompt ran as step {c[0]['step']}: {c[0]['tokens']} prefill tokens, "
                    f"{c[0]['decode_rows']} decode rows")
        else:
            head = (f"{len(c)} chunks ({', '.join(str(x['tokens']) for x in c)} tokens), each in a step with "
                    f"{sorted({x['decode_rows'] for x in c})} decode rows")
        out = [f"{self.policy}, budget {self.budget}: {head}; gaps holding the whole prefill: {len(whole)}"]
        out += [f"  {g['request_id']}: token {g['index'] - 1} from step {g['step_from']}, token {g['index']} "
                f"from step {g['step_to']}: the gap holds the whole prefill, {g['gap_ms']:.1f} ms"
                for g in self.stalled]
        sweep = f"; {sweep_prefill_ms:.1f} ms (forward) in the prefill sweep" if sweep_prefill_ms else ""
        out.append(f"  the long prefill: {self.long_prefill_ms:.1f} ms in this run's trace"
                   + (" (first chunk to last)" if len(c) > 1 else "") + sweep)
        return "\n".join(out)


def stall_setup(n_short: int = 8, long_prompt_len: int = 2048, min_budget: int = 64,
                arrive_after_tokens: int = 16,
                short_prompt_len: int = 16, long_output: int = 1, tail: int = 16) -> dict:
    """``stall_scenario``'s keywords, with the decoders' output long enough that they are still
    decoding when the long prompt's last chunk runs at the smallest budget (so every budget of a
    trade-off sweep is measured against the same, still-running decoders).

    ``long_output`` = 1: the long request stops at its first token (its TTFT is what 10.4 asks
    about), so the decoders' gaps show the prefill alone. Were it to decode beside them, every
    such step would read its long context for every row (rows of different lengths are gathered
    to the longest, ``engine/attention.py``; chapter 11's paged attention removes that): a real
    cost, but a different one, and it would set the decoders' max ITL at every budget alike."""
    n_chunks = len(chunk_sizes(long_prompt_len, min_budget, n_short))
    return dict(n_short=n_short, short_prompt_len=short_prompt_len,
                short_output=arrive_after_tokens + n_chunks + tail, long_prompt_len=long_prompt_len,
                long_output=long_output, arrive_after_tokens=arrive_after_tokens)


def run_stall(llm, policy: str, budget: int, setup: dict, seed: int = 0) -> StallRun:
    """``workload.stall_scenario`` under ``policy`` with step budget ``budget`` (restored after),
    kept as a timeline: every token's time and step, the long prefill's chunks, the step records."""
    from minillm.loadgen.workload import stall_scenario
    from minillm.metrics.definitions import request_metrics
    eng = llm.engine
    sch = eng.scheduler
    saved = sch.policy, sch.max_num_batched_tokens
    sch.policy, sch.max_num_batched_tokens = policy, budget
    eng.allocator.forget()
    last = eng.step_history[-1].step if eng.step_history else -1
    try:
        res = stall_scenario(llm, seed=seed, **setup)
    finally:
        sch.policy, sch.max_num_batched_tokens = saved
    recs = [r for r in eng.step_history if r.step > last]
    if not recs or recs[0].step != last + 1:
        raise RuntimeError("the step history lost some of this run's steps: raise EngineConfig.step_history")
    traces = {o.request_id: o.trace for o in res.outputs}
    long_tr = traces[res.long_id]
    t0 = long_tr.first("received").t_ns
    ms = lambda t: (t - t0) / 1e6          # noqa: E731
    tokens_ms = {rid: [ms(t) for t in tr.times("token")] for rid, tr in traces.items()}
    token_steps = {rid: token_steps_of(tr, recs) for rid, tr in traces.items()}
    chunks = [{"step": e.extra["step"], "t_start_ms": ms(e.extra["t_start_ns"]), "t_end_ms": ms(e.t_ns),
               "tokens": e.extra["tokens"], "decode_rows": e.extra["decode_rows"]}
              for e in long_tr if e.event == "prefill_chunk"]
    steps = [{"step": r.step, "t_start_ms": ms(r.t_start_ns), "t_end_ms": ms(r.t_ns[-1]) if r.t_ns else None,
              "prefill_tokens": r.num_prefill_tokens, "decode_rows": r.num_decode_rows} for r in recs]
    gaps = gaps_by_steps({r: token_steps[r] for r in res.short_ids}, [c["step"] for c in chunks])
    gap_ms = lambda g: tokens_ms[g.request_id][g.index] - tokens_ms[g.request_id][g.index - 1]   # noqa: E731
    stalled = [{"request_id": g.request_id, "index": g.index, "step_from": g.step_from, "step_to": g.step_to,
                "gap_ms": gap_ms(g)} for g in gaps if g.whole_prefill]
    with_chunk = [gap_ms(g) for g in gaps if g.chunk_steps]

    mets = [request_metrics(o.trace) for o in res.outputs]
    itl = np.array([g for m in mets if m.request_id in res.short_ids for g in m.itl_s]) * 1e3
    start = min(m.t_start_ns for m in mets)
    end = max(m.t_end_ns for m in mets)
    long_m = next(m for m in mets if m.request_id == res.long_id)
    return StallRun(policy, budget, dict(setup), list(res.short_ids), res.long_id, tokens_ms, token_steps,
                    chunks, steps, stalled, float(itl.max()), float(np.percentile(itl, 99)),
                    float(np.percentile(itl, 50)), sum(m.output_tokens for m in mets) / ((end - start) / 1e9),
                    long_m.ttft_s * 1e3,
                    (long_tr.first("prefill_end").t_ns - long_tr.first("prefill_start").t_ns) / 1e6,
                    max(with_chunk, default=0.0))


@dataclass
class Tradeoff(Result):
    """The chunk-budget sweep: the prefill-first run (one whole-prompt step) and a chunked run
    per budget, all on the same scenario."""
    setup: dict
    prefill_first: StallRun
    chunked: list[StallRun]

    def table(self) -> str:
        s = self.setup
        out = [f"{s['n_short']} requests decoding, a {s['long_prompt_len']}-token prompt arrives after "
               f"{s['arrive_after_tokens']} tokens",
               f"{'policy':<14}{'budget':>7}{'chunks':>7}{'ITL max ms':>11}{'ITL p99 ms':>11}"
               f"{'ITL p50 ms':>11}{'long TTFT ms':>13}{'out tok/s':>10}"]
        for r in [self.prefill_first, *self.chunked]:
            out.append(f"{r.policy:<14}{r.budget:>7}{r.n_chunks:>7}{r.itl_max_ms:>11.1f}{r.itl_p99_ms:>11.1f}"
                       f"{r.itl_p50_ms:>11.1f}{r.long_ttft_ms:>13.1f}{r.output_tok_s:>10.1f}")
        out += ["WARNING: " + w for w in stall_warnings([self.prefill_first, *self.chunked])]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, p, cycle: bool) -> None:      # IPython/Jupyter show the table
        p.text(self.table())


def stall_warnings(runs: Sequence[StallRun | dict], spike: float = 3.0) -> list[str]:
    """Signs of a busy machine in stall runs, read from their step records:
    - a run whose decode steps before the long prompt arrived (the same requests, the same work
      in every run) spread more than NOISY_SPREAD (p90/p10), or whose median is that far off
      the other runs';
    - a step with no prefill in it that took more than ``spike`` × the median of the run's
      decode-only steps with as many rows: the scheduler put nothing extra in it, so the machine
      did (another process, the OS)."""
    med, out = {}, []
    for r in runs:
        d = r.to_dict() if isinstance(r, StallRun) else r
        tag = f"{d['policy']} {d['budget']}"
        decode = [s for s in d["steps"] if s["prefill_tokens"] == 0 and s["t_end_ms"] is not None]
        wall = lambda s: s["t_end_ms"] - s["t_start_ms"]          # noqa: E731
        before = [wall(s) for s in decode if s["t_start_ms"] < 0]
        if len(before) >= 3:
            m, p10, p90 = median_p10_p90(before)
            med[tag] = m
            if too_wide(p10, p90):
                out.append(f"{tag}: decode steps before the arrival spread ×{p90 / p10:.1f} (p90/p10)")
        spikes = []
        for rows in {s["decode_rows"] for s in decode}:
            same = [wall(s) for s in decode if s["decode_rows"] == rows]
            m = statistics.median(same)
            spikes += [(w, m) for w in same if w > spike * m]
        if spikes:
            w, m = max(spikes)
            out.append(f"{tag}: {len(spikes)} decode-only step(s) took over {spike:g}× the median of their "
                       f"batch (up to {w:.1f} ms against {m:.1f} ms) with no prefill in them")
    if med:
        mid = statistics.median(med.values())
        out += [f"{tag}: decode steps before the arrival took {m:.1f} ms against {mid:.1f} ms in the other "
                "runs"
                for tag, m in med.items() if max(m / mid, mid / m) > NOISY_SPREAD]
    if out:
        out.append("something else was using the machine: rerun before trusting these runs' max ITL")
    return out


def illustrative_slo_ms(tradeoff: Tradeoff | dict) -> float:
    """An ITL SLO for machines where no real one (e.g. 50 ms p99 for chat) is within reach, as
    on a CPU: the geometric mean of the smallest budget's p99 ITL and prefill-first's, so that the
    crossing falls inside the measured range. It illustrates the reading, it is no requirement."""
    d = tradeoff.to_dict() if isinstance(tradeoff, Tradeoff) else tradeoff
    small = min(d["chunked"], key=lambda r: r["budget"])["itl_p99_ms"]
    return math.sqrt(small * d["prefill_first"]["itl_p99_ms"])


def warm_up_stall(llm, setup: dict) -> None:
    """One untimed run of the scenario: allocations, kernel choice and (on CUDA) the decode
    graphs of every bucket it will meet are paid here, not inside a measured gap."""
    run_stall(llm, "prefill-first", max(2048, setup["long_prompt_len"]), setup, seed=991)


def chunk_tradeoff(llm, budgets: Sequence[int], setup: dict, warmup: bool = True, seed: int = 0) -> Tradeoff:
    """The scenario once under prefill-first and once per chunk budget (chunked policy)."""
    if warmup:
        warm_up_stall(llm, setup)
    first = run_stall(llm, "prefill-first", max(2048, setup["long_prompt_len"]), setup, seed)
    runs = [run_stall(llm, "chunked", int(b), setup, seed) for b in sorted(budgets)]
    return Tradeoff(dict(setup), first, runs)


def largest_budget_within(runs: Sequence[StallRun | dict], slo_ms: float,
                          key: str = "itl_p99_ms") -> int | None:
    """The largest measured budget whose ``key`` stays ≤ slo_ms (the largest chunk keeps the
    long request's TTFT and the throughput best), or None."""
    ok = [(r["budget"] if isinstance(r, dict) else r.budget) for r in runs
          if (r[key] if isinstance(r, dict) else getattr(r, key)) <= slo_ms]
    return max(ok, default=None)


