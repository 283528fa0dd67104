"""Did the engine keep up? (chapter 10.6) The service rate of a workload, measured with a closed loop
that never leaves the engine short of work, and the check that an open-loop run was offered less
than that: an overloaded run measures its own queue, not the engine.

:func:`measure_service_rate` gives the rate at which the engine completes requests of a workload;
an open-loop rate is then offered as a fraction of it. :func:`rate_check` compares one run's
arrivals with its completions and the growth of its TTFT over the run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from minillm.loadgen.workload import LengthDist, WorkloadResult, make_requests, run_closed_loop
from minillm.metrics.definitions import RequestMetrics
from minillm.metrics.summary import summarize


def completion_rate(metrics: Sequence[RequestMetrics]) -> float | None:
    """Completed requests/s while completions were coming: (N − 1) / (last − first completion).
    Unlike requests/s over first arrival → last completion, it does not depend on how long the
    first request took or how long the arrivals lasted: it is the pace at which the engine
    finished requests. None for fewer than two completions."""
    ends = sorted(m.t_end_ns for m in metrics if m.ok)
    if len(ends) < 2 or ends[-1] == ends[0]:
        return None
    return (len(ends) - 1) / ((ends[-1] - ends[0]) / 1e9)


@dataclass
class ServiceRate:
    """What a closed-loop burst completed, per repeat: the engine's service rate for a workload."""
    samples_rps: list[float]           # completion_rate of each repeat
    output_tok_s: list[float]          # output tok/s of each repeat (window: first arrival → last completion)
    concurrency: int
    n_requests: int

    @property
    def rps(self) -> float:
        return float(np.median(self.samples_rps))

    @property
    def spread(self) -> float | None:
        from minillm.hardware.quiet import spread
        return spread(self.samples_rps)

    def line(self) -> str:
        xs = ", ".join(f"{x:.2f}" for x in self.samples_rps)
        return (f"service rate (closed loop, {self.concurrency} in flight, {self.n_requests} requests, "
                f"{len(self.samples_rps)} repeats): {xs} req/s → median {self.rps:.2f} req/s")


def measure_service_rate(llm, prompt_len: LengthDist, output_len: LengthDist, concurrency: int,
                         n_requests: int | None = None, repeats: int = 2, seed: int = 0,
                         timeout_s: float | None = None) -> ServiceRate:
    """The requests/s this engine completes for this workload when it is never short of work:
    a closed loop at ``concurrency`` (default 2 × concurrency requests), ``repeats`` times, each
    with fresh unique prompts. Offer an open-loop rate as a fraction of it (10.6): at 0.5× the
    engine keeps up with room to spare, near 1× the queue grows."""
    n = n_requests or 2 * concurrency
    rps, tok = [], []
    for r in range(repeats):
        reqs = make_requests(n, prompt_len, output_len, seed=seed + 7919 * (r + 1),
                             vocab_size=llm.engine.config.vocab_size, prefix=f"svc{r}")
        res = run_closed_loop(llm, reqs, concurrency, timeout_s=timeout_s)
        m = res.metrics
        rate = completion_rate(m)
        if rate is not None:
            rps.append(rate)
        tok.append(summarize(m).output_tok_s)
    if not rps:
        raise RuntimeError("the closed loop completed fewer than two requests: no rate to measure")
    return ServiceRate(rps, tok, concurrency, n)


@dataclass(frozen=True)
class RateCheck:
    """Offered against achieved rate of one open-loop run: did the engine keep up?"""
    offered_rps: float          # the rate asked for
    arrived_rps: float | None   # what the draw actually offered: (N − 1) / (last − first arrival)
    achieved_rps: float | None  # completion_rate: the pace of completions
    ttft_growth: float | None   # median TTFT of the last third of arrivals / of the first third
    tolerance: float = 0.9

    @property
    def ratio(self) -> float | None:
        if not self.arrived_rps or self.achieved_rps is None:
            return None
        return self.achieved_rps / self.arrived_rps

    @property
    def kept_up(self) -> bool:
        """Completions came as fast as arrivals (within ``tolerance``)."""
        return self.ratio is not None and self.ratio >= self.tolerance

    def line(self) -> str:
        if self.ratio is None:
            return f"offered {self.offered_rps:.2f} req/s: too few requests to compare with what was achieved"
        growth = (f"; median TTFT of the last third of arrivals ×{self.ttft_growth:.1f} "
                  "that of the first third"
                  if self.ttft_growth else "")
        verdict = ("the engine kept up" if self.kept_up else
                   "the engine did NOT keep up: requests arrived faster than it finished them, the queue "
                   "grew through the run, and every latency of this run includes that backlog")
        return (f"offered {self.offered_rps:.2f} req/s (this draw: {self.arrived_rps:.2f}), achieved "
                f"{self.achieved_rps:.2f} req/s completed ({100 * self.ratio:.0f} %){growth}: {verdict}")


def rate_check(result: WorkloadResult, offered_rps: float, tolerance: float = 0.9) -> RateCheck:
    """Compare the rate a run offered with the rate at which it completed requests. An engine that
    keeps up finishes requests as fast as they arrive; an overloaded one finishes them at its own
    service rate, and its TTFT climbs with arrival order."""
    arr = sorted(result.arrivals_s)
    arrived = (len(arr) - 1) / (arr[-1] - arr[0]) if len(arr) >= 2 and arr[-1] > arr[0] else None
    ms = result.metrics
    by_arrival = [m for _, m in sorted(zip(result.arrivals_s, ms),
                                       key=lambda x: x[0]) if m.ok and m.ttft_s is not None]
    third = len(by_arrival) // 3
    growth = None
    if third >= 1:
        first = float(np.median([m.ttft_s for m in by_arrival[:third]]))
        last = float(np.median([m.ttft_s for m in by_arrival[-third:]]))
        growth = last / first if first > 0 else None
    return RateCheck(float(offered_rps), arrived, completion_rate(ms), growth, tolerance)
