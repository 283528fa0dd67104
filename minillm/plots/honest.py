"""The chapter 10.6 figures, drawn from ``bench-serve`` results only (nothing here sends a request).

* ``10-6-latency-vs-rate``: TTFT p50 and p99 against the offered arrival rate (open loop, up to
  and past the measured service rate), with the closed-loop point drawn at the rate *it* achieved:
  it sits low because it never let a queue form.
* ``10-6-<pair>``: a self-deception beside its honest twin — the TTFT distributions (CDFs) of both
  runs, or, for cold vs warm, TTFT in the order the requests were sent.
* ``10-6-report``: the complete report on one page — the header fields (model, precision,
  hardware, parallel, lengths, load, warm-up, prefix caching), the TTFT/TPOT/ITL/E2E
  distributions with p50/p95/p99 marked, and input and output throughput apart.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from minillm.metrics.definitions import client_request_metrics
from minillm.metrics.summary import metric_values

DECEPTIVE, HONEST = "tab:red", "tab:blue"


def _cdf(ax, values_s, color: str, label: str) -> None:
    xs = np.sort(np.asarray(values_s, dtype=float) * 1e3)              # [n] ms
    if xs.size == 0:
        return
    ys = np.arange(1, xs.size + 1) / xs.size
    ax.step(xs, ys, where="post", color=color, label=label)
    for q, ls in ((50, ":"), (99, "--")):
        v = float(np.percentile(xs, q))
        ax.axvline(v, color=color, ls=ls, lw=0.9)
        ax.annotate(f"p{q} {v:.0f}", (v, 0.02 if q == 50 else 0.1), rotation=90, fontsize=7, color=color,
                    xytext=(2, 0), textcoords="offset points", va="bottom")


def plot_pair(pair, metric: str = "ttft", title: str | None = None, caption: str | None = None):
    """CDFs of ``metric`` (ttft, tpot, itl, e2el) for both variants of a DeceptionPair. ``caption``
    (default: the pair's lesson) is printed under the plot; pass one computed from the numbers when
    this run's numbers say something else, or "" for none."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    for res, color, label in ((pair.deceptive, DECEPTIVE, f"deceptive: {pair.deceptive_label}"),
                              (pair.honest, HONEST, f"honest: {pair.honest_label}")):
        _cdf(ax, metric_values([client_request_metrics(r.record) for r in res.records])[metric], color,
             f"{label} ({res.n_ok} ok)")
    ax.set_xlabel(f"{metric.upper()} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title or pair.name, fontsize=10)
    text = pair.lesson if caption is None else caption
    if text:
        ax.text(0.0, -0.2, text, transform=ax.transAxes, fontsize=8, wrap=True, va="top")
    fig.tight_layout()
    return fig


def plot_cold_warm(pair, title: str | None = None):
    """TTFT of each request in the order it was sent, cold run and warm run side by side."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.2, 4.0))
    for res, color, label in ((pair.deceptive, DECEPTIVE, pair.deceptive_label),
                              (pair.honest, HONEST, pair.honest_label)):
        recs = sorted(res.records, key=lambda r: r.record.t_sent_ns)
        ys = [client_request_metrics(r.record).ttft_s for r in recs]
        xs = [i for i, y in enumerate(ys) if y is not None]
        ax.plot(xs, [ys[i] * 1e3 for i in xs], "o-", color=color, ms=4, label=label)
    from matplotlib.ticker import MaxNLocator, ScalarFormatter
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("request, in the order sent")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.legend(fontsize=8)
    ax.set_title(title or pair.name, fontsize=10)
    fig.tight_layout()
    return fig


def plot_latency_vs_rate(sweep, title: str | None = None, slo_ms: float | None = None):
    """``sweep``: a deceptions.RateSweep (or its dict)."""
    import matplotlib.pyplot as plt
    d = sweep if isinstance(sweep, dict) else sweep.to_dict()
    pts = [p for p in d["points"] if p.get("ttft_p50_ms") is not None]
    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    xs = [p["offered_rate"] for p in pts]
    ax.plot(xs, [p["ttft_p50_ms"] for p in pts], "o-", color=HONEST, label="open loop: TTFT p50")
    ax.plot(xs, [p["ttft_p99_ms"] for p in pts], "s-", color="tab:purple", label="open loop: TTFT p99")
    for p in pts:                   # an overloaded point shows: completions fell behind the arrivals
        drawn, done = p.get("drawn_rate"), p.get("completion_rate")
        if drawn and done and done < 0.9 * drawn:
            ax.annotate(f"fell behind: {done:.2f}/s completed", (p["offered_rate"], p["ttft_p99_ms"]),
                        fontsize=7, xytext=(-60, 6), textcoords="offset points")
    c = d["closed"]
    if c.get("ttft_p99_ms") is not None:
        ax.plot([c["achieved_rate"]], [c["ttft_p99_ms"]], "*", ms=16, color=DECEPTIVE,
                label=f"closed loop ({c['max_concurrency']} in flight): TTFT p99 at the rate it achieved")
    ax.axvline(d["service_rate"], color="0.5", ls="--", lw=1)
    ax.text(d["service_rate"], 0.98, " measured service rate", transform=ax.get_xaxis_transform(), fontsize=7,
            color="0.4", va="top")
    if slo_ms:
        ax.axhline(slo_ms, color="black", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("offered arrival rate (requests/s, Poisson)")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(title or "Latency against arrival rate: the closed loop hides the queue", fontsize=10)
    fig.tight_layout()
    return fig


def plot_report(result, report, title: str | None = None):
    """The complete report on one page. ``result``: a bench-serve result (its ``records`` and
    ``summary``); the plot draws it and sends nothing. Renders only a complete report
    (``report.render()`` raises MissingReportFields first, naming what is missing)."""
    import matplotlib.pyplot as plt
    text = report.render()
    vals = metric_values([client_request_metrics(r.record) for r in result.records])
    fig = plt.figure(figsize=(10, 7.6))
    gs = fig.add_gridspec(3, 3, height_ratios=[1.0, 1.4, 1.4], hspace=0.55, wspace=0.35)
    head = fig.add_subplot(gs[0, :])
    head.axis("off")
    head.text(0, 1, text, family="monospace", fontsize=7.5, va="top")
    names = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ICL (client ITL)"), ("e2el", "E2E"))
    for (k, label), cell in zip(names, [gs[1, 0], gs[1, 1], gs[2, 0], gs[2, 1]]):
        ax = fig.add_subplot(cell)
        xs = np.asarray(vals[k], dtype=float) * 1e3                      # [n] ms
        if xs.size:
            ax.hist(xs, bins=min(40, max(5, xs.size // 3)), color="0.7")
            for q, ls in ((50, ":"), (95, "-."), (99, "--")):
                v = float(np.percentile(xs, q))
                ax.axvline(v, color="black", ls=ls, lw=1, label=f"p{q} {v:.1f}")
            ax.legend(fontsize=7)
        ax.set_title(f"{label} (ms), n={xs.size}", fontsize=9)
        ax.tick_params(labelsize=7)
    ax = fig.add_subplot(gs[1:, 2])
    s = result.summary
    bars = [("input", s.input_tok_s), ("output", s.output_tok_s)]
    ax.bar([b[0] for b in bars], [b[1] or 0 for b in bars], color=["tab:green", "tab:orange"])
    for i, (_, v) in enumerate(bars):
        ax.text(i, v or 0, f"{(v or 0):.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_title("throughput (tokens/s),\ninput and output apart", fontsize=9)
    ax.tick_params(labelsize=7)
    fig.suptitle(title or "Benchmark report", fontsize=11)
    return fig


def report_data(result, report) -> dict:
    return {"report": report.to_dict(),
            "result": {k: v for k, v in result.to_dict().items() if k != "requests"}}


def save(fig, name: str, stamp: str, data: dict, out_dir: str | Path | None = None) -> list[Path]:
    import matplotlib.pyplot as plt

    from minillm.plots.figures import save_figure
    try:
        return save_figure(fig, name, stamp, out_dir, data=data)
    finally:
        plt.close(fig)
