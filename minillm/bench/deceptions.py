"""The four ways a benchmark fools its author (chapter 10.6), each measured beside its honest twin.

Every function takes one :class:`~minillm.loadgen.bench_serve.BenchConfig` (the server, the key,
the lengths, the number of requests), runs the deceptive and the honest variant through
``bench-serve`` against that one server, **one after the other, never at once** (they would share
the server), and returns a :class:`DeceptionPair` with both results and the numbers that differ:

* :func:`fixed_vs_lognormal` — every prompt the same length, against a lognormal of the **same
  mean**: the long tail of real prompts is what makes p99 TTFT and E2E, and a fixed length has none.
* :func:`closed_vs_open` — closed loop (C requests in flight; the next is sent when one finishes)
  never lets a queue form, because the client slows down with the server. An open loop at the
  *same mean rate* (Poisson arrivals) does: bursts queue. :func:`latency_vs_rate` sweeps the open
  loop up to and past saturation, the data of figure ``10-6-latency-vs-rate``.
* :func:`cold_vs_warm` — the first requests after a server starts pay for allocation, lazy
  initialisation and (on a GPU) compilation and CUDA-graph capture. Call it on a freshly started
  server; it checks that with the server's own counter where the server has one.
* :func:`unique_vs_repeated` — one prompt repeated, with prefix caching on: every request after
  the first skips its prefill, so TTFT looks far better than real users (different prompts) see.
  The server's own cache-hit counter (``vllm:prefix_cache_hits`` on ``/metrics``, minillm's and
  vLLM's name) says how much was skipped.

Which variant is which is fixed by the function; what the numbers are is measured, every time.
A pair (and a sweep) formats itself: ``summary()`` — also what Jupyter shows for it — gives the
table, the load each run offered against what it achieved, what this run found, and how long it took.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from minillm.loadgen.bench_serve import BenchConfig, BenchResult, run_bench
from minillm.loadgen.rate_sweep import load_table, offered_load, sweep_row, sweep_table
from minillm.loadgen.serve_process import ServeProcess


@dataclass(eq=False)
class DeceptionPair:
    """One self-deception and its honest twin, measured against the same server.

    ``numbers``: metric name → ``(deceptive, honest)``, in the unit its name says (``_ms``,
    ``_rps``). ``lesson``: one sentence, what the deceptive number hid. ``finding``: what *this*
    run's numbers show (they may not show the deception: one run is one sample). ``elapsed_s``:
    how long both runs took.
    """
    name: str
    deceptive_label: str
    honest_label: str
    deceptive: BenchResult
    honest: BenchResult
    numbers: dict[str, tuple[float | None, float | None]]
    lesson: str
    extra: dict[str, Any] = field(default_factory=dict)
    finding: str = ""
    elapsed_s: float | None = None

    def ratio(self, metric: str) -> float | None:
        """honest ÷ deceptive: how much better the deceptive number looks (> 1: flattering)."""
        d, h = self.numbers[metric]
        return h / d if d and h is not None and d > 0 else None

    def table(self) -> str:
        w = max(len(k) for k in self.numbers) + 2
        lines = [f"{self.name}: {self.deceptive_label} (deceptive) vs {self.honest_label} (honest)",
                 f"{'':<{w}}{'deceptive':>12}{'honest':>12}{'honest/deceptive':>18}"]
        for k, (d, h) in self.numbers.items():
            r = self.ratio(k)
            lines.append(f"{k:<{w}}{_fmt(d):>12}{_fmt(h):>12}{(f'{r:.2f}×' if r else '-'):>18}")
        for k, v in self.extra.items():
            if not isinstance(v, (list, dict)):
                lines.append(f"  {k}: {v:.3g}" if isinstance(v, float) else f"  {k}: {v}")
        lines.append(f"  → {self.lesson}")
        return "\n".join(lines)

    def workload(self) -> str:
        """What was sent, in one line (a figure's provenance stamp): the number of requests per run,
        the input/output lengths asked for (the deceptive run's; the mean, for a distribution), and
        the load each run offered."""
        d = self.deceptive.config
        ld, lh = offered_load(d), offered_load(self.honest.config)
        return (f"{len(self.deceptive.records)} requests per run, input/output {d.random_input_len}/"
                f"{d.random_output_len} tokens, " + (ld if ld == lh else f"{ld} vs {lh}"))

    def load_table(self) -> str:
        """Offered against achieved, for both runs (:func:`~minillm.loadgen.rate_sweep.load_table`)."""
        return load_table([self.deceptive, self.honest], ["deceptive run", "honest run"])

    def summary(self) -> str:
        """The table, the load offered against achieved, what this run found, and how long it took."""
        parts = [self.table(), "load, offered against achieved:", self.load_table()]
        if self.finding:
            parts.append(self.finding)
        if self.elapsed_s is not None:
            parts.append(f"({self.elapsed_s:.1f} s)")
        return "\n".join(parts)

    def __str__(self) -> str:
        return self.summary()

    def _repr_pretty_(self, p, cycle) -> None:        # what Jupyter shows for a pair at the end of a cell
        p.text(self.summary())

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "deceptive_label": self.deceptive_label, "honest_label": self.honest_label,
                "numbers": {k: list(v) for k, v in self.numbers.items()}, "lesson": self.lesson,
                "extra": self.extra, "deceptive": sweep_row(self.deceptive), "honest": sweep_row(self.honest)}


def _fmt(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.1f}"


def _ms(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x * 1e3


def _pctl(res: BenchResult, metric: str, p: str) -> float | None:
    return _ms(getattr(getattr(res.summary, metric), p))


def _lengths(res: BenchResult) -> dict[str, float]:
    """The lengths the server reports it processed (usage), over the successful requests."""
    ok = [r for r in res.records if r.ok and r.usage]
    ins = [r.usage.get("prompt_tokens", 0) for r in ok]
    outs = [r.usage.get("completion_tokens", 0) for r in ok]
    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")
    return {"mean_in": mean(ins), "max_in": max(ins, default=0), "mean_out": mean(outs),
            "max_out": max(outs, default=0)}


def describe_lengths(res: BenchResult, which: str) -> str:
    """A length distribution, for a report: what ``which`` ("input" or "output") was drawn from, and
    what the server says it processed (its usage: mean, p99, max over the successful requests)."""
    import numpy as np
    c = res.config
    key = "prompt_tokens" if which == "input" else "completion_tokens"
    xs = np.array([r.usage[key] for r in res.records if r.ok and r.usage and key in r.usage], dtype=float)
    target = c.random_input_len if which == "input" else c.random_output_len
    unit = "tokens" if (c.tokenizer or which == "output") else "words"
    drawn = (f"lognormal σ={c.lognormal_sigma:g} median {target} {unit}" if c.dataset_name == "lognormal"
             else f"fixed {target} {unit}" if c.dataset_name == "random" and not c.random_range_ratio
             else f"{c.dataset_name} ({target} {unit})")
    if not xs.size:
        return drawn + " (the server sent no usage)"
    return f"{drawn} (served: mean {xs.mean():.0f}, p99 {np.percentile(xs, 99):.0f}, max {xs.max():.0f})"


def _finish(pair: DeceptionPair, t0: float, finding: Callable[[DeceptionPair], str]) -> DeceptionPair:
    """Set what this run found (from its own numbers) and how long the pair took since ``t0``."""
    pair.finding = finding(pair)
    pair.elapsed_s = time.perf_counter() - t0
    return pair


def _num(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


_NO_TTFT = "What went wrong: no TTFT on one side (failed requests, see above): nothing to compare"


# ---------------------------------------------------------------------------------------------
# 1. Fixed lengths vs a distribution
def fixed_vs_lognormal(cfg: BenchConfig, sigma: float = 1.0) -> DeceptionPair:
    """``cfg.random_input_len``/``random_output_len`` as the *mean*: the deceptive run sends
    exactly that; the honest one a lognormal with that mean (median = mean·e^(−σ²/2); clipped at
    8× the median, so its realised mean is a little lower — both realised means are reported)."""
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    t0 = time.perf_counter()
    shrink = math.exp(-sigma ** 2 / 2)
    fixed = replace(cfg, dataset_name="random", random_range_ratio=0.0, same_prompt=False)
    dist = replace(cfg, dataset_name="lognormal", lognormal_sigma=sigma, same_prompt=False,
                   random_input_len=max(1, round(cfg.random_input_len * shrink)),
                   random_output_len=max(1, round(cfg.random_output_len * shrink)))
    d, h = run_bench(fixed), run_bench(dist)
    ld, lh = _lengths(d), _lengths(h)
    return _finish(DeceptionPair(
        "fixed length vs lognormal", f"fixed {cfg.random_input_len}/{cfg.random_output_len}",
        f"lognormal σ={sigma:g}, same mean", d, h,
        {"ttft_p50_ms": (_pctl(d, "ttft", "p50"), _pctl(h, "ttft", "p50")),
         "ttft_p99_ms": (_pctl(d, "ttft", "p99"), _pctl(h, "ttft", "p99")),
         "e2e_p99_ms": (_pctl(d, "e2e", "p99"), _pctl(h, "e2e", "p99"))},
        "a fixed length has no long prompts, so nothing ever waits behind one: p99 comes from the tail it "
        "left out",
        {"realised_mean_in": (ld["mean_in"], lh["mean_in"]), "longest_prompt": (ld["max_in"], lh["max_in"]),
         "realised_mean_out": (ld["mean_out"], lh["mean_out"])}), t0, _fixed_finding)


def _fixed_finding(pair: DeceptionPair) -> str:
    (d99, h99), (de2e, he2e) = pair.numbers["ttft_p99_ms"], pair.numbers["e2e_p99_ms"]
    longest = pair.extra["longest_prompt"]
    if d99 is None or h99 is None:
        return _NO_TTFT
    if h99 > d99:
        return ("What went wrong: at the same mean length and the same rate, the fixed-length run reported "
                f"p99 TTFT {d99:.1f} ms and the lognormal {h99:.1f} ms (×{h99 / d99:.2f}; p99 E2E "
                f"{_num(de2e, '.0f')} against {_num(he2e, '.0f')} ms). Its longest prompt was {longest[0]} "
                f"tokens against {longest[1]}: nobody ever waited behind a long prompt, so its p99 described "
                "a workload no user sends.")
    return (f"On this run the fixed length did not look better: p99 TTFT {d99:.1f} ms (fixed) against "
            f"{h99:.1f} ms (lognormal), longest prompt {longest[0]} against {longest[1]} tokens. With "
            f"{len(pair.honest.records)} requests the draw may hold few long prompts, or the load was too "
            "light for anyone to wait behind one; with more requests (the notebook's full mode) the tail has "
            "room to show. One run is one sample.")


# ---------------------------------------------------------------------------------------------
# 2. Closed loop vs open loop
def closed_vs_open(cfg: BenchConfig, concurrency: int = 1, burstiness: float = 1.0) -> DeceptionPair:
    """Closed loop at ``concurrency`` (rate inf, at most C in flight), then an open loop (Poisson
    by default) at the rate the closed loop *achieved*: the same mean load, with the queue let in.

    The default C = 1 is the chapter's "send one, wait, send the next". At larger C the closed
    loop keeps C requests in the server all the time, so its own TTFT includes their contention
    and its p50 can be the worse one; its tails (p99, E2E) are still the ones that flatter
    (measured with `bench-deceptions --concurrency`, see the README)."""
    t0 = time.perf_counter()
    closed = run_bench(replace(cfg, request_rate=math.inf, max_concurrency=concurrency))
    rate = closed.summary.requests_s
    if not rate or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"the closed-loop run completed no request ({closed.n_failed} failed), so it has no "
                         "rate to match")
    opened = run_bench(replace(cfg, request_rate=rate, burstiness=burstiness, max_concurrency=None))
    return _finish(DeceptionPair(
        "closed loop vs open loop", f"closed loop, {concurrency} in flight",
        f"open loop (Poisson) at {rate:.2f} req/s",
        closed, opened,
        {"ttft_p50_ms": (_pctl(closed, "ttft", "p50"), _pctl(opened, "ttft", "p50")),
         "ttft_p99_ms": (_pctl(closed, "ttft", "p99"), _pctl(opened, "ttft", "p99")),
         "e2e_p99_ms": (_pctl(closed, "e2e", "p99"), _pctl(opened, "e2e", "p99")),
         "achieved_rps": (closed.summary.requests_s, opened.summary.requests_s)},
        "the closed loop slows its sending whenever the server slows, so no queue ever forms; "
        "real users do not wait for each other, and their bursts queue",
        {"matched_rate_rps": rate, "concurrency": concurrency}), t0, _closed_open_finding)


def _closed_open_finding(pair: DeceptionPair) -> str:
    d99, h99 = pair.numbers["ttft_p99_ms"]
    rate = pair.extra["matched_rate_rps"]
    if d99 is None or h99 is None:
        return _NO_TTFT
    if h99 > d99:
        return (f"What went wrong: at the same mean rate ({rate:.2f}/s) the closed loop reported p99 TTFT "
                f"{d99:.1f} ms and the open loop {h99:.1f} ms (×{h99 / d99:.2f}): the closed loop waited for "
                "the server before sending, so the bursts that make users queue never happened.")
    return (f"On this run the closed loop did not look better: p99 TTFT {d99:.1f} ms (closed) against "
            f"{h99:.1f} ms (open) at {rate:.2f}/s. Well below saturation a Poisson stream rarely queues; a "
            "sweep of rates (latency_vs_rate) shows where it starts to.")


def measure_server_service_rate(cfg: BenchConfig, concurrency: int = 8) -> float:
    """Completed requests/s of a closed loop with ``concurrency`` in flight: roughly the most this
    server sustains for this workload. Rates for a sweep are offered as fractions of it, so the
    sweep fits the machine instead of a number typed in for another one."""
    res = run_bench(replace(cfg, request_rate=math.inf, max_concurrency=concurrency))
    if not res.summary.requests_s or res.n_ok == 0:
        raise ValueError(f"no request completed ({res.n_failed} failed: {res.failures()}): no service rate")
    return float(res.summary.requests_s)


@dataclass(eq=False)
class RateSweep:
    """Open-loop points (offered rate → latency) and the closed-loop point, for the figure."""
    service_rate: float
    points: list[dict[str, Any]]          # sweep_row of each open-loop run, in rate order
    closed: dict[str, Any]                # sweep_row of the closed-loop run
    results: list[BenchResult] = field(default_factory=list, repr=False)
    elapsed_s: float | None = None

    def crossing(self, metric: str = "ttft_p99_ms", limit_ms: float = 1000.0) -> float | None:
        """The offered rate at which ``metric`` first exceeds ``limit_ms`` (linear between points);
        None when no measured point does."""
        prev = None
        for p in self.points:
            v = p.get(metric)
            if v is not None and v > limit_ms:
                if prev is None:
                    return p["offered_rate"]
                (r0, v0), r1 = prev, p["offered_rate"]
                return r0 + (r1 - r0) * (limit_ms - v0) / (v - v0)
            if v is not None:
                prev = (p["offered_rate"], v)
        return None

    def open_loop_at(self, rate: float, metric: str = "ttft_p99_ms") -> tuple[float, bool] | None:
        """``metric`` of an open loop at ``rate``, interpolated linearly between the measured points
        (the nearest end outside them), and whether ``rate`` lies inside their range; None with
        fewer than two measured points."""
        import numpy as np
        pts = [p for p in self.points if p.get(metric) is not None]
        if len(pts) < 2:
            return None
        xs = [p["offered_rate"] for p in pts]
        return float(np.interp(rate, xs, [p[metric] for p in pts])), xs[0] <= rate <= xs[-1]

    def first_behind(self, tolerance: float = 0.9) -> dict[str, Any] | None:
        """The first open-loop point whose completions came at less than ``tolerance`` of the
        drawn arrival rate (past saturation), or None when the server kept up at every one."""
        return next((p for p in self.points if p.get("ttft_p99_ms") is not None and p["drawn_rate"]
                     and p["completion_rate"] and p["completion_rate"] < tolerance * p["drawn_rate"]), None)

    def workload(self) -> str:
        """What was sent, in one line (a figure's provenance stamp)."""
        cfg = self.results[0].config if self.results else None
        sent = (f"{len(self.results[0].records)} requests per point, {cfg.random_input_len}/"
                f"{cfg.random_output_len} tokens, " if cfg else "")
        rates = ", ".join(f"{p['fraction']:g}" for p in self.points if "fraction" in p)
        return (f"{sent}rates {rates}× the measured {self.service_rate:.2f}/s; closed loop at "
                f"{self.closed['max_concurrency']}")

    def table(self) -> str:
        """Offered rate → latencies, the closed loop last (rates to 2 decimals)."""
        rows = self.points + [self.closed]
        return sweep_table([{**r, "offered_rate": round(r["offered_rate"], 2)} for r in rows])

    def finding(self) -> str:
        """Whether the server kept up, and what the closed loop hid, from this sweep's numbers."""
        behind, c = self.first_behind(), self.closed
        lines = ["the server kept up with every offered rate (completions ≥ 90 % of the drawn arrival rate)"
                 if behind is None else
                 f"from {behind['offered_rate']:.2f}/s offered ({behind['fraction']:g}× the service rate; "
                 f"drawn {behind['drawn_rate']:.2f}/s) completions came at only "
                 f"{behind['completion_rate']:.2f}/s: past saturation"]
        at = self.open_loop_at(c["achieved_rate"]) if c.get("ttft_p99_ms") is not None else None
        if at is None:
            lines.append("What went wrong: too few measured points to compare the closed loop with")
            return "\n".join(lines)
        (open_p99, inside), p99 = at, c["ttft_p99_ms"]
        where = "inside" if inside else "outside (the nearest end is used)"
        if open_p99 > p99:
            lines.append(f"What went wrong: the closed loop ({c['max_concurrency']} in flight) achieved "
                         f"{c['achieved_rate']:.2f}/s and reported p99 TTFT {p99:.1f} ms; Poisson arrivals "
                         f"at that rate give about {open_p99:.1f} ms (×{open_p99 / p99:.2f}, interpolated "
                         f"between the measured points, {where} their range): the closed loop hides the "
                         "queue.")
        else:
            lines.append(f"On this run the closed loop did not look better: p99 TTFT {p99:.1f} ms at "
                         f"{c['achieved_rate']:.2f}/s, against about {open_p99:.1f} ms for the open loop at "
                         f"that rate (interpolated, {where} the measured range). At a light load there is "
                         "little queue to hide.")
        return "\n".join(lines)

    def summary(self) -> str:
        """The service rate, the table, the load offered against achieved, and what the sweep found."""
        took = f" ({self.elapsed_s:.1f} s)" if self.elapsed_s is not None else ""
        labels = [f"{p['fraction']:g}× service rate" if "fraction" in p else "open loop" for p in self.points]
        parts = [f"service rate {self.service_rate:.2f}/s; {len(self.points)} open-loop points and the "
                 f"closed loop{took}", "", self.table(), ""]
        if len(self.results) == len(self.points) + 1:
            parts += ["load, offered against achieved:", load_table(self.results, labels + ["closed loop"])]
        return "\n".join(parts + [self.finding()])

    def __str__(self) -> str:
        return self.summary()

    def _repr_pretty_(self, p, cycle) -> None:        # what Jupyter shows for a sweep at the end of a cell
        p.text(self.summary())

    def to_dict(self) -> dict[str, Any]:
        return {"service_rate": self.service_rate, "points": self.points, "closed": self.closed}


def latency_vs_rate(cfg: BenchConfig, fractions: Sequence[float] = (0.25, 0.5, 0.75, 0.9, 1.0, 1.2),
                    concurrency: int = 4, service_rate: float | None = None) -> RateSweep:
    """TTFT against offered rate, open loop, at ``fractions`` of the measured service rate (up to
    and past saturation), and the closed loop at ``concurrency`` — which reports a low TTFT at its
    own achieved rate because it never lets the queue form."""
    if not fractions or any(not f > 0 for f in fractions):
        raise ValueError(f"fractions must be > 0, got {list(fractions)}")
    t0 = time.perf_counter()
    mu = service_rate or measure_server_service_rate(cfg, concurrency=max(concurrency, 8))
    results = [run_bench(replace(cfg, request_rate=f * mu, max_concurrency=None)) for f in sorted(fractions)]
    closed = run_bench(replace(cfg, request_rate=math.inf, max_concurrency=concurrency))
    rows = [sweep_row(r) for r in results]
    for f, row in zip(sorted(fractions), rows):
        row["fraction"] = f
    return RateSweep(mu, rows, sweep_row(closed), results + [closed], time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# 3. Cold vs warm
def scrape_counter(cfg: BenchConfig, name: str) -> float | None:
    """The sum of a counter family on the server's ``/metrics`` (all its label sets), or None when
    the server has no such page or series. ``name`` without ``_total``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    try:
        r = httpx.get(cfg.base_url.rstrip("/") + "/metrics", headers=headers, timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    for fam in text_string_to_metric_families(r.text):
        if fam.name == name:
            return float(sum(s.value for s in fam.samples if s.name.endswith("_total")))
    return None


def cold_vs_warm(cfg: BenchConfig, n_cold: int | None = None) -> DeceptionPair:
    """The first ``n_cold`` requests a server ever serves (no warm-up), then the same workload
    again on the now-warm server (a different seed, so no prompt repeats and no prefix cache
    helps). Call it right after starting the server: ``extra['server_was_fresh']`` says whether
    the server's ``vllm:request_success`` counter was 0 (None: the server does not say)."""
    t0 = time.perf_counter()
    served = scrape_counter(cfg, "vllm:request_success")
    n = n_cold or cfg.num_prompts
    cold = run_bench(replace(cfg, num_prompts=n, warmup=0))
    warm = run_bench(replace(cfg, num_prompts=n, warmup=0, seed=cfg.seed + 1))
    first = cold.records[0] if cold.records else None
    from minillm.metrics.definitions import client_request_metrics
    first_ttft = _ms(client_request_metrics(first.record).ttft_s) if first else None
    return _finish(DeceptionPair(
        "cold vs warm", "cold: the first requests after start", "warm: the same workload again", cold, warm,
        {"ttft_p50_ms": (_pctl(cold, "ttft", "p50"), _pctl(warm, "ttft", "p50")),
         "ttft_max_ms": (_pctl(cold, "ttft", "max"), _pctl(warm, "ttft", "max")),
         "e2e_p50_ms": (_pctl(cold, "e2e", "p50"), _pctl(warm, "e2e", "p50"))},
        "the first requests pay one-off costs (allocation, lazy set-up, compilation, graph capture) "
        "that a long-running server never pays again: warm up, then measure",
        {"server_was_fresh": None if served is None else served == 0, "first_request_ttft_ms": first_ttft}),
        t0, _cold_finding)


def _cold_finding(pair: DeceptionPair) -> str:
    fresh = {True: "the server's own counter says it had served no request before the cold run: it was fresh",
             False: "the server had already served requests before this run: the 'cold' run was not cold "
                    "(restart the server and measure cold against warm first)",
             None: "the server does not say whether it was fresh (no vllm:request_success counter on "
                   "/metrics)"}
    first = pair.extra["first_request_ttft_ms"]
    warm_p50, warm_max = pair.numbers["ttft_p50_ms"][1], pair.numbers["ttft_max_ms"][1]
    if first is None or warm_p50 is None or warm_max is None:
        what = _NO_TTFT
    elif first > warm_max:
        what = (f"What went wrong: the very first request waited {first:.1f} ms for its first token, "
                f"{first / warm_p50:.1f}× the warm median ({warm_p50:.1f} ms) and slower than any warm "
                f"request (max {warm_max:.1f} ms); counted without a warm-up, that one-off cost looks like a "
                "cost every user pays.")
    else:
        what = (f"On this run the cold start cost little: the first request's TTFT was {first:.1f} ms "
                f"against a warm median of {warm_p50:.1f} ms and a warm max of {warm_max:.1f} ms. A small "
                "model on a CPU has little to set up; on a GPU (compilation, CUDA-graph capture) the first "
                "requests are where it shows. Warm up anyway: you cannot know in advance that it does not "
                "matter.")
    return fresh[pair.extra["server_was_fresh"]] + "\n" + what


# ---------------------------------------------------------------------------------------------
# 4. Unique prompts vs one repeated prompt (prefix caching on)
def _cached_tokens(res: BenchResult) -> int:
    """Prompt tokens the server says it took from its prefix cache (``usage.prompt_tokens_details``)."""
    total = 0
    for r in res.records:
        details = (r.usage or {}).get("prompt_tokens_details") or {}
        total += int(details.get("cached_tokens") or 0)
    return total


def unique_vs_repeated(cfg: BenchConfig) -> DeceptionPair:
    """One prompt sent ``num_prompts`` times, then as many unique prompts (a random prefix each),
    same lengths, same load. Prefix caching must be on at the server for the deception to show
    (minillm: on by default). Hits come from the server: its usage's ``cached_tokens`` and the
    ``vllm:prefix_cache_hits`` counter on ``/metrics`` (before/after each run)."""
    def run(c: BenchConfig) -> tuple[BenchResult, float | None]:
        before = scrape_counter(c, "vllm:prefix_cache_hits")
        res = run_bench(c)
        after = scrape_counter(c, "vllm:prefix_cache_hits")
        return res, (after - before if before is not None and after is not None else None)

    t0 = time.perf_counter()
    rep, rep_hits = run(replace(cfg, same_prompt=True))
    uni, uni_hits = run(replace(cfg, same_prompt=False, seed=cfg.seed + 1))
    return _finish(DeceptionPair(
        "repeated prompt vs unique prompts", "one prompt repeated", "unique prompts", rep, uni,
        {"ttft_p50_ms": (_pctl(rep, "ttft", "p50"), _pctl(uni, "ttft", "p50")),
         "ttft_p99_ms": (_pctl(rep, "ttft", "p99"), _pctl(uni, "ttft", "p99")),
         "cached_prompt_tokens": (float(_cached_tokens(rep)), float(_cached_tokens(uni)))},
        "the repeated prompt is prefilled once and then served from the prefix cache: the TTFT measured "
        "is the cache's, not the prefill real (different) prompts need",
        {"prefix_cache_hits_metric": (rep_hits, uni_hits),
         "prompt_tokens": (rep.summary.input_tokens, uni.summary.input_tokens)}), t0, _repeated_finding)


def _repeated_finding(pair: DeceptionPair) -> str:
    d50, h50 = pair.numbers["ttft_p50_ms"]
    cached_rep, cached_uni = pair.numbers["cached_prompt_tokens"]
    tokens_rep = pair.extra["prompt_tokens"][0]
    if not cached_rep:
        return ("The server reported no prefix-cache hits for the repeated prompt: prefix caching is off "
                "there (vLLM: --enable-prefix-caching) or it does not report them, so the repeated prompt "
                "could not flatter it.")
    if d50 is None or h50 is None:
        return _NO_TTFT
    if h50 > d50:
        return (f"What went wrong: {cached_rep:.0f} of the repeated run's {tokens_rep} prompt tokens came "
                f"from the prefix cache (unique prompts: {cached_uni:.0f}), so its median TTFT was {d50:.1f} "
                f"ms against {h50:.1f} ms for unique prompts (×{h50 / d50:.2f}): it measured the cache, not "
                "the prefill.")
    return (f"On this run the repeated prompt did not look better: median TTFT {d50:.1f} ms against "
            f"{h50:.1f} ms, although {cached_rep:.0f} of its {tokens_rep} prompt tokens were cache hits. "
            "With prompts this short the prefill it skipped is a small part of TTFT; longer prompts "
            "(random_input_len: INPUT_LEN in notebook 06) make the skipped part larger.")


def run_all(cfg: BenchConfig, concurrency: int = 4) -> list[DeceptionPair]:
    """The three pairs that need no restart (cold vs warm needs a fresh server: run it first)."""
    return [fixed_vs_lognormal(cfg), closed_vs_open(cfg, concurrency), unique_vs_repeated(cfg)]


# ---------------------------------------------------------------------------------------------
# The benchmark: all four pairs against a fresh `minillm serve` (its own process)
def run_benchmark(model: str = "cpu-small", num_prompts: int = 40, input_len: int = 256, output_len: int = 32,
                  concurrency: int = 1, rate_fraction: float = 0.7, base_url: str | None = None,
                  api_key: str | None = None, tokenizer: str | None = "default") -> dict[str, Any]:
    """All four pairs, deceptive beside honest. Cold vs warm runs first on a fresh server (started
    here unless ``base_url`` points at one); the other three follow on the now-warm server, at
    ``rate_fraction`` of its measured service rate (open-loop runs) so the load fits the machine."""
    import contextlib
    server = ServeProcess(["--model", model, "--log-level", "warning"]) if base_url is None else None
    with server or contextlib.nullcontext():
        url, key = (server.url, server.key) if server else (base_url, api_key)
        cfg = BenchConfig(base_url=url, api_key=key, num_prompts=num_prompts, random_input_len=input_len,
                          random_output_len=output_len, ignore_eos=True, tokenizer=tokenizer, timeout_s=600)
        cold = cold_vs_warm(replace(cfg, max_concurrency=1), n_cold=min(num_prompts, 8))
        mu = measure_server_service_rate(cfg, concurrency=max(8, concurrency))
        open_cfg = replace(cfg, request_rate=rate_fraction * mu, warmup=2)
        pairs = [cold, fixed_vs_lognormal(open_cfg), closed_vs_open(replace(cfg, warmup=2), concurrency),
                 unique_vs_repeated(replace(cfg, max_concurrency=1, warmup=2))]
        from minillm.bench.report import fetch_server_info
        info = fetch_server_info(cfg)
    return {"model": model, "server": {k: info.get(k) for k in ("hardware", "dtype", "device", "engine")},
            "service_rate_rps": mu, "open_loop_rate_rps": rate_fraction * mu,
            "settings": {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
                         "concurrency": concurrency, "rate_fraction": rate_fraction},
            "pairs": pairs}
