"""Figure 10-1, the timeline of a request, drawn from traces (plain data) only.

(a) one request: one horizontal bar per stage — gateway, tokenize, queue, prefill, decode — with
    its output tokens as ticks on the decode bar and the SSE chunks the server sent as ticks on a
    row of their own;
(b) a zoom of (a) on received → first token, where the short stages live;
(c) a few concurrent requests, one row each, on one clock, in the order the server had their whole
    request (``body_read``): with more requests than batch slots, the queue segments grow row after
    row — queueing, visible. The request at p99 TTFT (nearest rank, as in figure 10-2) is marked.

The stages telescope like :func:`minillm.metrics.definitions.ttft_breakdown` (each event closes a stage), so
the bars of one request tile its life without gaps or overlaps::

  received ─gateway─► admitted ─tokenize─► tokenized ─queue─► scheduled ─prefill─► first token
           ─decode─► last token ─return─► response complete (server `finished`)

Input: :class:`~minillm.core.trace.Trace` objects, or the JSON of ``GET /v1/traces``
(``{"request_id", "events": [{"event", "t_ns", ...}]}``), or a list of such event rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from minillm.core.trace import Trace
from minillm.metrics.definitions import metrics_from_traces
from minillm.metrics.summary import breakdown_at_percentile

STAGE_ORDER = ("gateway", "body", "tokenize", "queue", "prefill", "decode", "return")
STAGE_COLORS = {"gateway": "tab:purple", "body": "tab:brown", "tokenize": "tab:olive", "queue": "tab:red",
                "prefill": "tab:orange", "decode": "tab:blue", "return": "tab:green"}
STAGE_HELP = {"gateway": "auth, request rate (and, after tokenize, the token quota and admission)",
              "body": "the request body arrives and is parsed as JSON",
              "tokenize": "text → token ids",
              "queue": "waiting for the engine and a batch slot",
              "prefill": "the whole prompt in one forward pass → first token",
              "decode": "one token per step, shared with the batch",
              "return": "last chunks, usage, [DONE]"}


def as_trace(obj: Any) -> Trace:
    """A :class:`Trace` from a Trace, a ``/v1/traces`` item, or a list of event rows."""
    if isinstance(obj, Trace):
        return obj
    if isinstance(obj, dict) and "events" in obj:
        return Trace.from_records(obj.get("request_id", "?"), obj["events"])
    if isinstance(obj, list):
        rid = obj[0].get("request_id", "?") if obj else "?"
        return Trace.from_records(rid, obj)
    raise TypeError(f"cannot read a trace from {type(obj).__name__}")


@dataclass(frozen=True)
class StageSpan:
    stage: str
    t0_ns: int
    t1_ns: int

    @property
    def duration_ms(self) -> float:
        return (self.t1_ns - self.t0_ns) / 1e6


def _first(tr: Trace, name: str) -> int | None:
    e = tr.first(name)
    return e.t_ns if e is not None else None


def _end_of_response(tr: Trace) -> int | None:
    server_end = [e.t_ns for e in tr.events if e.event == "finished" and e.extra.get("where") == "server"]
    sent = tr.times("sent")
    if server_end:
        return server_end[-1]
    return max(sent) if sent else None


def stage_spans(trace: Any) -> list[StageSpan]:
    """The stages of one request, in order; a stage whose events are missing is left out
    (an in-process request has no gateway; a rejected one has nothing after the gateway)."""
    tr = as_trace(trace)
    tokens = tr.times("token")
    marks = [("gateway", _first(tr, "received"), _first(tr, "authenticated") or _first(tr, "rejected")),
             ("body", None, _first(tr, "body_read")),
             ("tokenize", None, _first(tr, "tokenized")),
             ("queue", None, _first(tr, "scheduled")),
             ("prefill", None, tokens[0] if tokens else None),
             ("decode", None, tokens[-1] if tokens else None),
             ("return", None, _end_of_response(tr))]
    spans: list[StageSpan] = []
    t_prev = _first(tr, "received")
    if t_prev is None:
        t_prev = min(e.t_ns for e in tr.events)
    for stage, t_start, t_end in marks:
        t0 = t_start if t_start is not None else t_prev
        if t_end is None or t_end < t0:
            continue
        spans.append(StageSpan(stage, t0, t_end))
        t_prev = t_end
    return spans


def stage_table(trace: Any) -> list[dict[str, Any]]:
    """One row per stage (ms since ``received``) for ``pandas.DataFrame``."""
    tr = as_trace(trace)
    spans = stage_spans(tr)
    t0 = spans[0].t0_ns if spans else 0
    return [{"stage": s.stage, "start_ms": (s.t0_ns - t0) / 1e6, "end_ms": (s.t1_ns - t0) / 1e6,
             "duration_ms": s.duration_ms, "what happens": STAGE_HELP[s.stage]} for s in spans]


def event_table(trace: Any, max_tokens_shown: int | None = 3) -> list[dict[str, Any]]:
    """One row per trace event, in time order: ms since ``received`` and since the previous event.
    With ``max_tokens_shown``, only the first few token/detokenized/sent events are kept
    (a note row says how many were folded), so that one request fits on a screen."""
    tr = as_trace(trace)
    events = sorted(tr.events, key=lambda e: e.t_ns)
    t0 = _first(tr, "received") or (events[0].t_ns if events else 0)
    rows: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    folded: dict[str, int] = {}
    last = {e.event: i for i, e in enumerate(events)}
    t_prev = t0
    for i, e in enumerate(events):
        n = seen[e.event] = seen.get(e.event, 0) + 1
        if max_tokens_shown is not None and e.event in ("token", "detokenized", "sent") \
                and n > max_tokens_shown and i != last[e.event]:     # the last one of each stays
            folded[e.event] = folded.get(e.event, 0) + 1
            continue
        extra = ", ".join(f"{k}={v}" for k, v in e.extra.items())
        rows.append({"event": e.event, "t_ms": (e.t_ns - t0) / 1e6,
                     "since_previous_ms": (e.t_ns - t_prev) / 1e6,
                     "details": extra})
        t_prev = e.t_ns
    if folded:
        rows.append({"event": "…", "t_ms": None, "since_previous_ms": None,
                     "details": "not shown: " + ", ".join(f"{n} more {k}" for k, n in folded.items())})
    return rows


# ---------------------------------------------------------------------------------------------
# Drawing
def _bar(ax, y: float, span: StageSpan, t0_ns: int, height: float, label: bool) -> None:
    ax.barh(y, span.duration_ms, left=(span.t0_ns - t0_ns) / 1e6, height=height,
            color=STAGE_COLORS[span.stage], edgecolor="none", label=span.stage if label else None)


def plot_request_timeline(trace: Any, ax=None, window_ms: tuple[float, float] | None = None,
                          annotate: bool = True):
    """Panels (a) and (b): one row per stage, token ticks on the decode row, SSE chunks on their own row."""
    import matplotlib.pyplot as plt
    tr = as_trace(trace)
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    spans = stage_spans(tr)
    if not spans:
        raise ValueError(f"trace {tr.request_id!r} has no stage to draw")
    t0 = spans[0].t0_ns
    rows = [s.stage for s in spans]
    has_sent = bool(tr.times("sent"))
    labels = rows + (["SSE chunks sent"] if has_sent else [])
    ypos = {name: len(labels) - 1 - i for i, name in enumerate(labels)}
    x_lo, x_hi = window_ms or (0.0, (spans[-1].t1_ns - t0) / 1e6)
    for s in spans:
        _bar(ax, ypos[s.stage], s, t0, 0.6, label=False)
        if annotate:
            x_end = min((s.t1_ns - t0) / 1e6, x_hi)
            ax.annotate(f"{s.duration_ms:.2f} ms", (max(x_end, x_lo), ypos[s.stage]), xytext=(4, 0),
                        textcoords="offset points", va="center", fontsize=7, color="0.25", clip_on=True)
    tok = [(t - t0) / 1e6 for t in tr.times("token")]
    if "decode" in ypos or "prefill" in ypos:
        y = ypos.get("decode", ypos.get("prefill"))
        ax.vlines(tok, y - 0.38, y + 0.38, color="k", lw=0.7, label="output token")
    if has_sent:
        sent = [(t - t0) / 1e6 for t in tr.times("sent")]
        ax.vlines(sent, ypos["SSE chunks sent"] - 0.3, ypos["SSE chunks sent"] + 0.3,
                  color=STAGE_COLORS["return"],
                  lw=0.7, label="SSE chunk sent")
    ax.set_yticks([ypos[n] for n in labels], labels)
    ax.set_xlim(x_lo, x_hi * 1.2 if window_ms is None else x_hi)
    ax.set_xlabel("ms since the request was received")
    ax.grid(axis="x", alpha=0.3)
    return ax


def arrival_ns(trace: Any) -> int:
    """When the server had the whole request: its ``body_read`` stamp (over HTTP), else its
    ``received`` one (in process), else its first event. ``received`` is stamped when the headers
    arrive; a client that opens many connections at once can send a body much later, and the
    request only joins the queue once its body is in. Ordering rows by ``received`` would show
    that client-side delay as the server serving late arrivals first."""
    tr = as_trace(trace)
    for name in ("body_read", "received"):
        t = _first(tr, name)
        if t is not None:
            return t
    return min(e.t_ns for e in tr.events)


def arrival_order(traces: Iterable[Any]) -> list[Trace]:
    """The traces that have a stage to draw, in the order their bodies were received."""
    trs = [as_trace(t) for t in traces]
    return sorted((t for t in trs if stage_spans(t)), key=arrival_ns)


def p99_ttft_request(traces: Iterable[Any]) -> tuple[str, float] | None:
    """``(request_id, ttft_ms)`` of the request at p99 TTFT among ``traces`` (nearest rank, the same
    request :func:`minillm.metrics.summary.breakdown_at_percentile` picks for figure 10-2), or None
    when no request has a first token."""
    metrics = metrics_from_traces([as_trace(t) for t in traces])
    try:
        rid, bd = breakdown_at_percentile(metrics, 99)
    except ValueError:
        return None
    m = next(m for m in metrics if m.request_id == rid)
    return rid, m.ttft_s * 1e3


def plot_concurrent_timeline(traces: Iterable[Any], ax=None, max_rows: int = 32, mark_p99: bool = True):
    """Panel (c): one row per request, in the order its body was received (:func:`arrival_ns`),
    stages as coloured segments, token ticks; with ``mark_p99``, the p99-TTFT request's row is
    outlined and starred at its first token, and a legend says so."""
    import matplotlib.pyplot as plt
    all_trs = arrival_order(traces)
    if not all_trs:
        raise ValueError("no trace with a stage to draw")
    trs = all_trs[:max_rows]
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.25 * len(trs) + 1))
    t0 = min(stage_spans(t)[0].t0_ns for t in trs)
    labelled: set[str] = set()
    for i, tr in enumerate(trs):
        y = len(trs) - 1 - i
        for s in stage_spans(tr):
            _bar(ax, y, s, t0, 0.7, label=s.stage not in labelled)
            labelled.add(s.stage)
        # rasterized: a thousand tick lines would make the SVG heavy for no visible gain
        ax.vlines([(t - t0) / 1e6 for t in tr.times("token")], y - 0.3, y + 0.3, color="k", lw=0.3, alpha=0.6,
                  rasterized=True)
    ax.set_yticks(range(len(trs)), [f"#{len(trs) - k}" for k in range(len(trs))], fontsize=6)
    p99 = p99_ttft_request(all_trs) if mark_p99 else None
    row = next((i for i, tr in enumerate(trs) if p99 and tr.request_id == p99[0]), None)
    if row is not None:
        from matplotlib.patches import Rectangle
        y = len(trs) - 1 - row
        spans = stage_spans(trs[row])
        x0, x1 = (spans[0].t0_ns - t0) / 1e6, (spans[-1].t1_ns - t0) / 1e6
        ax.add_patch(Rectangle((x0, y - 0.5), x1 - x0, 1.0, fill=False, edgecolor="black", lw=1.4, zorder=4))
        t_first = trs[row].times("token")[0]
        star, = ax.plot([(t_first - t0) / 1e6], [y], marker="*", ms=11, color="gold", mec="black", mew=0.8,
                        ls="", zorder=5,
                        label=f"p99-TTFT request: #{row + 1}, outlined, TTFT {p99[1]:.0f} ms (★ first token)")
        ax.get_yticklabels()[y].set_fontweight("bold")
        from matplotlib.transforms import offset_copy
        # below the axis, right-aligned beside its label: never over a row of data
        ax.legend(handles=[star], loc="upper right", fontsize=8, frameon=False, bbox_to_anchor=(1.0, 0.0),
                  bbox_transform=offset_copy(ax.transAxes, fig=ax.figure, y=-30, units="points"))
    elif p99 is not None:
        ax.annotate(f"p99-TTFT request {p99[0]} ({p99[1]:.0f} ms): not among the {len(trs)} rows shown",
                    (1.0, 0.0), xycoords="axes fraction", xytext=(0, -30), textcoords="offset points",
                    fontsize=8, ha="right", va="top")
    ax.set_ylabel("request (by body received)")
    ax.set_xlabel("ms since the first request arrived")
    ax.grid(axis="x", alpha=0.3)
    return ax


def request_timeline_figure(single: Any, concurrent: Iterable[Any], title: str | None = None):
    """The whole figure: (a) one request, (b) its zoom on TTFT, (c) concurrent requests."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    tr = as_trace(single)
    conc = [as_trace(t) for t in concurrent]
    n_rows = max(1, min(32, len(conc)))
    fig = plt.figure(figsize=(11, 4.0 + 0.17 * n_rows))
    gs = fig.add_gridspec(2, 2, height_ratios=[2.2, 0.5 + 0.14 * n_rows], width_ratios=[1.5, 1], hspace=0.45,
                          wspace=0.35)
    ax_a = fig.add_subplot(gs[0, 0])
    ax_z = fig.add_subplot(gs[0, 1])
    ax_b = fig.add_subplot(gs[1, :])
    plot_request_timeline(tr, ax_a)
    ax_a.set_title("(a) one request through the HTTP server, stage by stage", fontsize=10, loc="left")
    spans = stage_spans(tr)
    t_first_tok = next((s.t1_ns for s in spans if s.stage == "prefill"), spans[-1].t1_ns)
    zoom_hi = (t_first_tok - spans[0].t0_ns) / 1e6 * 1.25
    plot_request_timeline(tr, ax_z, window_ms=(0.0, zoom_hi))
    ax_z.set_title("(b) zoom on (a): received → first token (TTFT)", fontsize=10, loc="left")
    ax_z.axvline((t_first_tok - spans[0].t0_ns) / 1e6, color="k", ls=":", lw=0.8)
    if conc:
        plot_concurrent_timeline(conc, ax_b, max_rows=32)
        shown = f" (the first {n_rows})" if n_rows < len(conc) else ""
        ax_b.set_title(f"(c) {len(conc)} concurrent requests{shown}, one row each, in the order their bodies "
                       "were received: waiting in the queue shows as red", fontsize=10, loc="left")
    else:
        ax_b.set_visible(False)
    handles = [Patch(color=STAGE_COLORS[s], label=s) for s in STAGE_ORDER]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1.0))
    if title:
        fig.suptitle(title, y=1.04, fontsize=11)
    return fig


def timeline_stamp(hardware: str, model: str, dtype: str, detail: str = "") -> str:
    import time
    return (f"measured {time.strftime('%Y-%m-%d')} on {hardware}; model {model} {dtype}; "
            f"minillm serve over HTTP on loopback{'; ' + detail if detail else ''}")


def save_request_timeline(single: Any, concurrent: Iterable[Any], stamp: str,
                          out_dir: str | Path | None = None,
                          name: str = "10-1-request-timeline") -> list[Path]:
    """Draw and save figure 10-1 (PNG + SVG) through :func:`minillm.plots.figures.save_figure`."""
    import matplotlib.pyplot as plt  # any backend saves a file; the caller's backend is left alone

    from minillm.plots.figures import save_figure
    concurrent = list(concurrent)
    fig = request_timeline_figure(single, concurrent)
    data = {"single": as_trace(single).to_records(),
            "concurrent": [as_trace(t).to_records() for t in concurrent], "stamp": stamp}
    try:
        return save_figure(fig, name, stamp, out_dir, data=data)
    finally:
        plt.close(fig)


def request_timeline_from_data(data: dict):
    """Figure 10-1 from its data file (``figures/data/10-1-request-timeline.json``) alone."""
    return request_timeline_figure(data["single"], data["concurrent"])


# figure name → the function that draws it from its data file's dict (tests/test_figures_clean.py)
REDRAW = {"10-1-request-timeline": request_timeline_from_data}
