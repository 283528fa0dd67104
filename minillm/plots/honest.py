"""The chapter 10.6 figures, drawn from ``bench-serve`` results only (nothing here sends a request).

* ``10-6-latency-vs-rate``: TTFT p50 and p99 against the arrival rate each open-loop run really
  drew (its Poisson schedule, below the offered rate by chance), the offered rates on the top axis,
  up to and past the measured service rate, with the closed-loop point drawn at the rate *it*
  achieved: it sits low because it never let a queue form.
* ``10-6-<pair>``: a self-deception beside its honest twin — the TTFT distributions (CDFs) of both
  runs, or, for cold vs warm, TTFT in the order the requests were sent.
* ``10-6-report``: the complete report on one page — the header fields (model, precision,
  hardware, parallel, lengths, load, warm-up, prefix caching), the TTFT/TPOT/ITL/E2E
  distributions with p50/p95/p99 marked, and input and output throughput apart.

Every figure is drawn from a plain dict (``*_from_data``), the one its data file holds, so a saved
figure can be redrawn from ``figures/data/NAME.json`` alone; :data:`REDRAW` names them.
"""
from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np

from minillm.metrics.definitions import client_request_metrics
from minillm.metrics.summary import metric_values

DECEPTIVE, HONEST = "tab:red", "tab:blue"


def _cdf(ax, values_s, color: str, label: str) -> None:
    """The empirical CDF of ``values_s`` (seconds) in ms, p50 (dotted) and p99 (dashed) as vertical
    lines; their values go into the series' legend label, not beside the lines, where two runs'
    labels would collide."""
    xs = np.sort(np.asarray(values_s, dtype=float) * 1e3)              # [n] ms
    if xs.size == 0:
        return
    ys = np.arange(1, xs.size + 1) / xs.size
    p50, p99 = (float(np.percentile(xs, q)) for q in (50, 99))
    ax.step(xs, ys, where="post", color=color, label=f"{label}: p50 {p50:.0f}, p99 {p99:.0f} ms")
    ax.axvline(p50, color=color, ls=":", lw=0.9)
    ax.axvline(p99, color=color, ls="--", lw=0.9)


def _ttfts_in_order(res) -> list[float | None]:
    """TTFT (s) of each request of a run, in the order sent (None: no first token)."""
    recs = sorted(res.records, key=lambda r: r.record.t_sent_ns)
    return [client_request_metrics(r.record).ttft_s for r in recs]


def pair_data(pair) -> dict:
    """``pair.to_dict()`` and what the pair figures draw, per request: each run's metric values
    (seconds, as :func:`minillm.metrics.summary.metric_values`) and its TTFTs in the order sent,
    so that :func:`plot_pair_from_data` and :func:`plot_cold_warm_from_data` redraw from it alone."""
    d = pair.to_dict()
    d["values"] = {side: {**metric_values([client_request_metrics(r.record) for r in res.records]),
                          "ttft_in_order": _ttfts_in_order(res)}
                   for side, res in (("deceptive", pair.deceptive), ("honest", pair.honest))}
    return d


def plot_pair_from_data(d: dict, metric: str = "ttft", title: str | None = None, caption: str | None = None):
    """CDFs of ``metric`` (ttft, tpot, itl, e2el) for both variants, from :func:`pair_data`'s dict."""
    import matplotlib.pyplot as plt
    if "values" not in d:
        raise ValueError("this pair's data holds no per-request values (saved before pair_data): "
                         "rerun the notebook to redraw it")
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    for side, color in (("deceptive", DECEPTIVE), ("honest", HONEST)):
        _cdf(ax, d["values"][side][metric], color, f"{side}: {d[f'{side}_label']} ({d[side]['n_ok']} ok)")
    ax.set_xlabel(f"{metric.upper()} (ms); dotted: p50, dashed: p99")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)   # below the data
    ax.set_title(title or d.get("title") or d["name"], fontsize=10)
    text = d["lesson"] if caption is None else caption
    if text:
        ax.text(0.0, -0.36, "\n".join(textwrap.wrap(text, 110)), transform=ax.transAxes, fontsize=8, va="top")
    fig.tight_layout()
    return fig


def plot_pair(pair, metric: str = "ttft", title: str | None = None, caption: str | None = None):
    """CDFs of ``metric`` (ttft, tpot, itl, e2el) for both variants of a DeceptionPair. ``caption``
    (default: the pair's lesson) is printed under the plot; pass one computed from the numbers when
    this run's numbers say something else, or "" for none."""
    return plot_pair_from_data(pair_data(pair), metric, title, caption)


def plot_cold_warm_from_data(d: dict, title: str | None = None):
    """TTFT of each request in the order it was sent, cold run and warm run, from :func:`pair_data`'s dict."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, ScalarFormatter
    if "values" not in d:
        raise ValueError("this pair's data holds no per-request values (saved before pair_data): "
                         "rerun the notebook to redraw it")
    fig, ax = plt.subplots(figsize=(7.2, 4.0))
    for side, color in (("deceptive", DECEPTIVE), ("honest", HONEST)):
        ys = d["values"][side]["ttft_in_order"]
        xs = [i for i, y in enumerate(ys) if y is not None]
        ax.plot(xs, [ys[i] * 1e3 for i in xs], "o-", color=color, ms=4, label=d[f"{side}_label"])
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("request, in the order sent")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    ax.set_title(title or d.get("title") or d["name"], fontsize=10)
    fig.tight_layout()
    return fig


def plot_cold_warm(pair, title: str | None = None):
    """TTFT of each request in the order it was sent, cold run and warm run side by side."""
    return plot_cold_warm_from_data(pair_data(pair), title)


def _rate(p: dict) -> float:
    """The arrival rate an open-loop point really drew (its schedule: N − 1 gaps between the first
    and the last send), else the offered one (older data)."""
    return p.get("drawn_rate") or p["offered_rate"]


def plot_latency_vs_rate(sweep, title: str | None = None, slo_ms: float | None = None):
    """``sweep``: a deceptions.RateSweep (or its dict, e.g. the data file's, with an optional
    ``slo_ms``). x: the rate each open-loop run drew (its random Poisson schedule falls short of
    or beyond the offered rate by chance); the offered rates are the top axis's ticks."""
    import matplotlib.pyplot as plt
    d = sweep if isinstance(sweep, dict) else sweep.to_dict()
    slo_ms = slo_ms if slo_ms is not None else d.get("slo_ms")
    pts = [p for p in d["points"] if p.get("ttft_p50_ms") is not None]
    fig, ax = plt.subplots(figsize=(7.2, 4.8))
    xs = [_rate(p) for p in pts]
    drawn = all(p.get("drawn_rate") for p in pts)
    ax.plot(xs, [p["ttft_p50_ms"] for p in pts], "o-", color=HONEST, label="open loop: TTFT p50")
    ax.plot(xs, [p["ttft_p99_ms"] for p in pts], "s-", color="tab:purple", label="open loop: TTFT p99")
    for p in pts:                   # an overloaded point shows: completions fell behind the arrivals
        drawn_r, done = p.get("drawn_rate"), p.get("completion_rate")
        if drawn_r and done and done < 0.9 * drawn_r:
            ax.annotate(f"fell behind: {done:.2f}/s completed", (_rate(p), p["ttft_p99_ms"]),
                        fontsize=7, xytext=(-8, -4), textcoords="offset points", ha="right", va="top")
    c = d["closed"]
    if c.get("ttft_p99_ms") is not None:
        ax.plot([c["achieved_rate"]], [c["ttft_p99_ms"]], "*", ms=16, color=DECEPTIVE, ls="",
                label=f"closed loop ({c['max_concurrency']} in flight): TTFT p99 at the rate it achieved")
    ax.axvline(d["service_rate"], color="0.5", ls="--", lw=1)
    # left of its line, at the top: clear of the points, which past the line climb to the top right
    ax.text(d["service_rate"], 0.98, "measured service rate ", transform=ax.get_xaxis_transform(), fontsize=7,
            color="0.4", va="top", ha="right")
    if slo_ms:
        ax.axhline(slo_ms, color="black", ls=":", lw=1, label=f"SLO: TTFT p99 ≤ {slo_ms:.0f} ms")
    ax.set_yscale("log")
    ax.set_xlabel("arrival rate drawn by each run (requests/s, Poisson)" if drawn else
                  "offered arrival rate (requests/s, Poisson)")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.legend(fontsize=8, loc="upper left")
    if drawn:                       # both rates, labelled: the offered one above each point
        top = ax.secondary_xaxis("top")
        top.set_xticks(xs, [f"{p['offered_rate']:.2f}" for p in pts], fontsize=7)
        top.set_xlabel("offered rate of each point (requests/s)", fontsize=8)
    ax.set_title(title or "Latency against arrival rate: the closed loop hides the queue", fontsize=10)
    fig.tight_layout()
    return fig


def latency_vs_rate_from_data(d: dict):
    """Figure 10-6-latency-vs-rate from its data file alone (``slo_ms`` where it holds one)."""
    return plot_latency_vs_rate(d, title=d.get("title"))


REPORT_WIDTH = 100          # characters per header line of the report figure


def report_header_lines(text: str, width: int = REPORT_WIDTH) -> list[str]:
    """The report's text, each line wrapped at ``width`` characters (continuations indented), so
    that one long field does not make the saved figure (``bbox_inches="tight"``) twice as wide."""
    out: list[str] = []
    for line in text.splitlines():
        out.extend(textwrap.wrap(line, width, subsequent_indent="    ", break_on_hyphens=False) or [""])
    return out


def report_data(result, report, title: str | None = None) -> dict:
    """What the report figure draws, as plain data: the report's fields and rendered text, the
    result without its request list, and the per-request values its histograms draw (seconds:
    ``ttft``, ``tpot``, ``e2el`` per request, ``itl`` every gap pooled), so that
    :func:`plot_report_from_data` redraws it from this dict alone."""
    d = {"report": report.to_dict(),
         "result": {k: v for k, v in result.to_dict().items() if k != "requests"},
         "text": report.render(),
         "values": metric_values([client_request_metrics(r.record) for r in result.records])}
    if title:
        d["title"] = title
    return d


def plot_report_from_data(d: dict, title: str | None = None):
    """The complete report on one page from :func:`report_data`'s dict alone."""
    import matplotlib.pyplot as plt
    missing = [k for k in ("text", "values") if k not in d]
    if missing:
        raise ValueError(f"this report's data holds no {' and no '.join(missing)} (saved before report_data "
                         "stored them): rerun the benchmark to redraw it")
    vals = d["values"]
    lines = report_header_lines(d["text"])
    fig = plt.figure(figsize=(10, 6.2 + 0.13 * len(lines)))
    gs = fig.add_gridspec(3, 3, height_ratios=[0.3 + 0.1 * len(lines), 1.4, 1.4], hspace=0.55, wspace=0.35)
    head = fig.add_subplot(gs[0, :])
    head.axis("off")
    head.text(0, 1, "\n".join(lines), family="monospace", fontsize=7.5, va="top")
    names = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ICL (client ITL)"), ("e2el", "E2E"))
    for (k, label), cell in zip(names, [gs[1, 0], gs[1, 1], gs[2, 0], gs[2, 1]]):
        ax = fig.add_subplot(cell)
        xs = np.asarray([v for v in vals.get(k, []) if v is not None], dtype=float) * 1e3     # [n] ms
        if xs.size:
            ax.hist(xs, bins=min(40, max(5, xs.size // 3)), color="0.7")
            for q, ls in ((50, ":"), (95, "-."), (99, "--")):
                v = float(np.percentile(xs, q))
                ax.axvline(v, color="black", ls=ls, lw=1, label=f"p{q} {v:.1f}")
            ax.legend(fontsize=7, loc="upper right")
        ax.set_title(f"{label} (ms), n={xs.size}", fontsize=9)
        ax.tick_params(labelsize=7)
    ax = fig.add_subplot(gs[1:, 2])
    s = d["result"]["summary"]
    bars = [("input", s.get("input_tok_s")), ("output", s.get("output_tok_s"))]
    heights = [v if isinstance(v, (int, float)) and math.isfinite(v) else 0.0 for _, v in bars]
    ax.bar([b[0] for b in bars], heights, color=["tab:green", "tab:orange"])
    for i, v in enumerate(heights):
        ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_title("throughput (tokens/s),\ninput and output apart", fontsize=9)
    ax.tick_params(labelsize=7)
    fig.suptitle(title or d.get("title") or "Benchmark report", fontsize=11)
    return fig


def plot_report(result, report, title: str | None = None):
    """The complete report on one page. ``result``: a bench-serve result (its ``records`` and
    ``summary``); the plot draws it and sends nothing. Renders only a complete report
    (``report.render()`` raises MissingReportFields first, naming what is missing)."""
    return plot_report_from_data(report_data(result, report), title)


def save(fig, name: str, stamp: str, data: dict, out_dir: str | Path | None = None) -> list[Path]:
    """Save ``fig`` with ``data`` beside it; the stamp goes into the data too (``"stamp"``), so a
    redraw from the data file carries the same footnote."""
    import matplotlib.pyplot as plt

    from minillm.plots.figures import save_figure
    data = {**data, "stamp": data.get("stamp", stamp)}
    try:
        return save_figure(fig, name, stamp, out_dir, data=data)
    finally:
        plt.close(fig)


# figure name → the function that draws it from its data file's dict (tests/test_figures_clean.py);
# the pairs and the report need the per-request values that pair_data and report_data store
REDRAW = {"10-6-latency-vs-rate": latency_vs_rate_from_data,
          "10-6-cold-vs-warm": plot_cold_warm_from_data,
          "10-6-fixed-vs-lognormal": plot_pair_from_data,
          "10-6-repeated-prompt": plot_pair_from_data,
          "10-6-report": plot_report_from_data}
