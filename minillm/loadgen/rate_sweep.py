"""Several load points in one command: one bench run per request rate (or concurrency), each with
the rate it drew and the rate the server completed, so a server that did not keep up is named."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from minillm.core.result import Col, text_table
from minillm.loadgen.bench_serve import BenchConfig, BenchResult, run_bench


# ---------------------------------------------------------------------------------------------
# Sweeps: several load points in one command
def sweep_configs(cfg: BenchConfig, rates: Sequence[float] | None = None,
                  concurrencies: Sequence[int] | None = None) -> list[BenchConfig]:
    """One config per point: ``rates`` (open loop, each with the base ``--max-concurrency``) or
    ``concurrencies`` (closed loop: rate inf, at most C in flight)."""
    from dataclasses import replace
    if bool(rates) == bool(concurrencies):
        raise ValueError("give one of --sweep-rate or --sweep-concurrency")
    if rates:
        bad = [r for r in rates if not r > 0]
        if bad:
            raise ValueError(f"--sweep-rate takes rates > 0 (or inf), got {bad}")
        return [replace(cfg, request_rate=float(r)) for r in rates]
    bad = [c for c in concurrencies if c < 1]
    if bad:
        raise ValueError(f"--sweep-concurrency takes concurrencies ≥ 1, got {bad}")
    return [replace(cfg, request_rate=math.inf, max_concurrency=int(c)) for c in concurrencies]


def _span_rate(times_s: Sequence[float]) -> float | None:
    ts = sorted(times_s)
    return (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 and ts[-1] > ts[0] else None


def drawn_rate(res: BenchResult) -> float | None:
    """The rate of the schedule this run drew: N − 1 gaps between its first and last due time
    (a seeded Poisson draw of 50 gaps can be 10 % off the rate asked for). None: closed loop."""
    if math.isinf(res.config.request_rate):
        return None
    return _span_rate([r.scheduled_s for r in res.records])


def served_completion_rate(res: BenchResult) -> float | None:
    """Completions/s between the first and the last successful completion. Beside the drawn
    rate it says whether the server kept up: equal when it did, lower when its queue grew
    through the run. (Achieved req/s, N over first send → last completion, differs from both on
    a short run even when the server keeps up: N requests but N − 1 gaps, plus the last E2E.)"""
    return _span_rate([r.record.t_done_ns / 1e9 for r in res.records if r.ok])


def kept_up(res: BenchResult, tolerance: float = 0.9) -> bool | None:
    """Open loop: did completions keep pace with the drawn arrivals (≥ ``tolerance`` of them)?"""
    d, c = drawn_rate(res), served_completion_rate(res)
    return None if d is None or c is None else c >= tolerance * d


def sweep_row(res: BenchResult) -> dict[str, Any]:
    """One point of a sweep: the offered load beside what was achieved (so an overloaded server
    or client is seen), then the percentiles that matter."""
    s, c = res.summary, res.config
    def ms(x):
        return None if x is None or (isinstance(x, float) and math.isnan(x)) else x * 1e3
    return {"offered_rate": c.request_rate, "max_concurrency": c.max_concurrency,
            "drawn_rate": drawn_rate(res), "completion_rate": served_completion_rate(res),
            "achieved_rate": s.requests_s, "n_ok": s.n_ok, "n_failed": s.n_failed,
            "input_tok_s": s.input_tok_s, "output_tok_s": s.output_tok_s,
            "ttft_p50_ms": ms(s.ttft.p50), "ttft_p99_ms": ms(s.ttft.p99), "tpot_p50_ms": ms(s.tpot.p50),
            "itl_p99_ms": ms(s.itl.p99), "e2e_p99_ms": ms(s.e2e.p99), "send_lag_max_ms": res.max_send_lag_ms}


def sweep_table(rows: Sequence[dict[str, Any]]) -> str:
    cols = [("offered_rate", "offered/s", "{:.2f}"), ("max_concurrency", "conc", "{}"),
            ("achieved_rate", "achieved/s", "{:.2f}"),
            ("n_ok", "ok", "{}"), ("n_failed", "failed", "{}"), ("output_tok_s", "out tok/s", "{:.1f}"),
            ("ttft_p50_ms", "TTFT p50", "{:.1f}"), ("ttft_p99_ms", "TTFT p99", "{:.1f}"),
            ("tpot_p50_ms", "TPOT p50", "{:.1f}"), ("itl_p99_ms", "ICL p99", "{:.1f}"),
            ("e2e_p99_ms", "E2E p99", "{:.1f}")]

    def cell(v, f):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        return "inf" if isinstance(v, float) and math.isinf(v) else f.format(v)
    lines = ["".join(f"{h:>11}" for _, h, _ in cols) + "   (latencies in ms)"]
    lines += ["".join(f"{cell(r[k], f):>11}" for k, _, f in cols) for r in rows]
    return "\n".join(lines)


def run_rate_sweep(cfg: BenchConfig, rates: Sequence[float] | None = None,
              concurrencies: Sequence[int] | None = None) -> list[BenchResult]:
    """Each point in turn, against the same server (never two at once: they would share it)."""
    return [run_bench(c) for c in sweep_configs(cfg, rates, concurrencies)]


# ---------------------------------------------------------------------------------------------
# Offered against achieved, for any set of runs (notebook 06 shows it under every pair and sweep)
def offered_load(cfg: BenchConfig) -> str:
    """The load a run offered, in words: an open-loop rate and its arrival process, or a closed loop."""
    if math.isinf(cfg.request_rate):
        return f"closed loop, {cfg.max_concurrency} in flight" if cfg.max_concurrency else "all at once"
    return f"{cfg.request_rate:.2f}/s " + ("Poisson" if cfg.burstiness == 1 else f"Gamma {cfg.burstiness:g}")


def load_table(results: Sequence[BenchResult], labels: Sequence[str]) -> str:
    """Offered against achieved, one line per run, and a note under any run the server fell behind
    in or that had failures. Open loop: ``drawn`` is the rate of the random schedule the run drew
    (N − 1 gaps between its first and last send time; a Poisson schedule of a few requests can come
    out faster or slower than asked), ``completed`` the rate of completions between the first and
    the last one (equal to ``drawn`` when the server kept up, lower when its queue grew through the
    run), ``achieved`` N requests over first send → last completion. ``send lag``: how late the
    client sent a request after its due time (a client that cannot keep up shows there)."""
    w = max([len(label) for label in labels] + [3]) + 2
    cols = [Col("run", w, left=True), Col("offered", 26, left=True), Col("drawn/s", 9, ".2f"),
            Col("completed/s", 13, ".2f"), Col("achieved/s", 12, ".2f"), Col("ok", 5), Col("failed", 8),
            Col("max send lag", 14, ".0f", " ms")]
    rows, notes = [], []
    for res, label in zip(results, labels):
        d, done = drawn_rate(res), served_completion_rate(res)
        rows.append([label, offered_load(res.config), d, done, res.summary.requests_s, res.n_ok, res.n_failed,
                     (res.max_send_lag_ms or 0.0) if d is not None else None])
        if kept_up(res) is False:
            notes.append(f"  ← {label}: completions came at {done / d:.0%} of the drawn arrival rate: the "
                         "server fell behind, and this run's latencies include a growing queue")
        if res.n_failed:
            notes.append(f"  ← {label}: failures {res.failures()}")
    lines = text_table(cols, rows)
    lines.append(f"{'':<{w}}(drawn: the schedule's rate; completed: first → last completion; "
                 "achieved: first send → last completion)")
    return "\n".join(lines + notes)
