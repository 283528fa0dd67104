"""The chapter 10.2 figures, drawn from recorded traces only (nothing here times anything).

* ``10-2-itl-distribution``: every inter-token gap of a run, as a histogram and a CDF, with the
  mean and p99 marked. Gaps that contain another request's prefill (10.4's stall) are coloured
  apart, so the reader sees *why* the tail is where it is: the mean hides it, p99 finds it.
* ``10-2-ttft-breakdown``: TTFT of the p50 and the p99 request, stacked by stage
  (gateway / tokenize / queue / prefill / first token), from ``metrics.breakdown_at_percentile``.
"""
from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Sequence

import numpy as np

from minillm.core.trace import Trace
from minillm.metrics.definitions import STAGES, RequestMetrics, metrics_from_traces
from minillm.metrics.stutter import token_gaps
from minillm.metrics.summary import breakdown_at_percentile, distribution

STAGE_COLORS = {"gateway": "tab:purple", "body": "tab:brown", "tokenize": "tab:olive", "queue": "tab:red",
                "prefill": "tab:blue", "first_token": "tab:gray"}
STAGE_LABELS = {"gateway": "gateway", "body": "request body", "tokenize": "tokenize", "queue": "queue",
                "prefill": "prefill", "first_token": "first token (sample + copy)"}


def stamp_for(llm, what: str = "") -> str:
    """'measured <date> on <hardware>; model <name> <dtype> (shape twin...); torch <v>; <what>'."""
    import torch

    from minillm.core.device import dtype_name
    from minillm.hardware.machine import describe_hardware
    twin = " (shape twin: random weights, real speed)" if getattr(llm, "is_shape_twin", False) else ""
    date = _dt.date.today().isoformat()
    return (f"measured {date} on {describe_hardware(llm.device).summary()}; model {llm.model_name} "
            f"{dtype_name(llm.dtype)}{twin}; torch {torch.__version__}" + (f"; {what}" if what else ""))


def _ms(x: float) -> float:
    return x * 1e3


# ---------------------------------------------------------------------------------------------
def plot_itl_distribution(traces: Sequence[Trace], title: str | None = None):
    """Histogram (log-spaced bins) and empirical CDF of every ITL gap, in ms, with mean and p99.

    The marked statistics are ``metrics.distribution`` of the pooled gaps (token-weighted, the
    same numbers ``summarize(...).itl`` reports)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    gaps = token_gaps(traces)
    if not gaps:
        raise ValueError("no inter-token gaps: every request produced fewer than 2 tokens")
    ms_all = [m for mt in metrics_from_traces(traces) for m in mt.itl_s]      # pooled, seconds
    d = distribution(ms_all)
    normal = np.array([_ms(g.gap_s) for g in gaps if not g.stalled])          # [n_normal]
    stalled = np.array([_ms(g.gap_s) for g in gaps if g.stalled])             # [n_stalled]
    values = np.array([_ms(x) for x in ms_all])                               # [n_gaps]

    fig, (ax_h, ax_c) = plt.subplots(1, 2, figsize=(11, 4.2))
    lo, hi = max(values.min(), 1e-3), values.max()
    bins = np.geomspace(lo * 0.9, hi * 1.1, 50) if hi > lo else 20
    ax_h.hist([normal, stalled], bins=bins, stacked=True, color=["tab:blue", "tab:red"],
              label=[f"gap without another prefill ({normal.size})",
                     f"gap containing another request's prefill ({stalled.size})"])
    ax_h.set_xscale("log")
    ax_h.set_yscale("log")
    ax_h.set_ylim(bottom=0.7)          # a single stalled gap (count 1) must stay visible
    ax_h.set_xlabel("inter-token latency (ms, log scale)")
    ax_h.set_ylabel("number of gaps (log scale)")

    xs = np.sort(values)                                                       # [n_gaps]
    ys = np.arange(1, xs.size + 1) / xs.size                                   # [n_gaps]
    ax_c.step(xs, ys, where="post", color="black", lw=1.2, label="empirical CDF of ITL")
    ax_c.axhline(0.99, color="0.6", lw=0.8, ls=":")
    ax_c.set_xscale("log")
    ax_c.set_xlabel("inter-token latency (ms, log scale)")
    ax_c.set_ylabel("fraction of gaps ≤ x")
    ax_c.set_ylim(0, 1.02)

    for ax in (ax_h, ax_c):
        ax.axvline(_ms(d.p50), color="tab:green", lw=1.2, ls="-", label=f"p50 = {_ms(d.p50):.2f} ms")
        ax.axvline(_ms(d.mean), color="tab:orange", lw=1.6, ls="--", label=f"mean = {_ms(d.mean):.2f} ms")
        ax.axvline(_ms(d.p99), color="tab:red", lw=1.6, ls=":", label=f"p99 = {_ms(d.p99):.2f} ms")
        ax.grid(True, which="both", alpha=0.2)
        # label 1-2-5 steps: a log axis spanning less than a decade would otherwise show one label
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=30))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        # below the axes: inside, the legend would sit on the tail (the p99 line, the stalled gaps)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=2, frameon=False)
    fig.suptitle(title or f"ITL distribution: {d.count} gaps pooled over {len(traces)} requests "
                          f"(max {_ms(d.max):.1f} ms)", fontsize=10)
    fig.tight_layout()
    return fig


def plot_ttft_breakdown(metrics: Sequence[RequestMetrics], percentiles: Sequence[float] = (50, 99),
                        title: str | None = None):
    """One stacked bar per percentile: the TTFT stages (ms) of *the* request at that percentile
    (nearest rank, ``breakdown_at_percentile``), with its id, prompt length and total TTFT."""
    import matplotlib.pyplot as plt

    by_id = {m.request_id: m for m in metrics}
    picked = [(q, *breakdown_at_percentile(metrics, q)) for q in percentiles]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    x = np.arange(len(picked))
    bottom = np.zeros(len(picked))                                             # [n_bars]
    for st in STAGES:
        h = np.array([_ms(bd.get(st, 0.0)) for _, _, bd in picked])            # [n_bars]
        ax.bar(x, h, bottom=bottom, color=STAGE_COLORS[st], label=STAGE_LABELS[st], width=0.55)
        bottom += h
    for i, (q, rid, bd) in enumerate(picked):
        ax.annotate(f"{bottom[i]:.1f} ms", (x[i], bottom[i]), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x, [f"p{q:g} TTFT\n{rid}, prompt {by_id[rid].prompt_tokens} tok" for q, rid, _ in picked],
                  fontsize=8)
    ax.set_ylabel("time to first token (ms)")
    ax.set_ylim(0, bottom.max() * 1.12 if bottom.max() > 0 else 1)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title or f"Where TTFT went: the p50 and the p99 request of {len(metrics)}", fontsize=10)
    ax.grid(True, axis="y", alpha=0.25)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
def _save(fig, name: str, stamp: str, out_dir: str | Path | None, data,
          title: str | None = None) -> list[Path]:
    """Save ``fig`` with ``data``; the stamp (and a caller's title) go into the data too, so a redraw
    from the data file (:data:`REDRAW`) carries the same footnote and title."""
    import matplotlib.pyplot as plt

    from minillm.plots.figures import save_figure
    data = {**data, "stamp": stamp, **({"title": title} if title else {})}
    paths = save_figure(fig, name, stamp, out_dir, data=data)
    plt.close(fig)
    return paths


def save_itl_distribution(traces: Sequence[Trace], stamp: str, out_dir: str | Path | None = None,
                          name: str = "10-2-itl-distribution", title: str | None = None) -> list[Path]:
    data = {"traces": [t.to_records() for t in traces]}          # every event the figure was drawn from
    return _save(plot_itl_distribution(traces, title), name, stamp, out_dir, data, title)


def save_ttft_breakdown(metrics: Sequence[RequestMetrics], stamp: str, out_dir: str | Path | None = None,
                        name: str = "10-2-ttft-breakdown", title: str | None = None) -> list[Path]:
    from dataclasses import asdict
    data = {"requests": [asdict(m) for m in metrics]}
    return _save(plot_ttft_breakdown(metrics, title=title), name, stamp, out_dir, data, title)


# ---------------------------------------------------------------------------------------------
# From the data files' dicts alone (figures/data/NAME.json)
def itl_distribution_from_data(d: dict):
    traces = [Trace.from_records(rows[0].get("request_id", "?") if rows else "?", rows)
              for rows in d["traces"]]
    return plot_itl_distribution(traces, d.get("title"))


def ttft_breakdown_from_data(d: dict):
    return plot_ttft_breakdown([RequestMetrics(**r) for r in d["requests"]], title=d.get("title"))


# figure name → the function that draws it from its data file's dict (tests/test_figures_clean.py)
REDRAW = {"10-2-itl-distribution": itl_distribution_from_data,
          "10-2-ttft-breakdown": ttft_breakdown_from_data}
