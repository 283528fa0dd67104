"""The chapter 10.5 figures, drawn from measured data only (nothing here times anything).

* ``10-5-step-phases``: one bar per case (model, batch), 100 % tall, stacked by the StepRecord
  phases. The phases outside the forward (schedule, prepare, sample, output) sit at the bottom,
  so the chapter's "about 30 %" line shows at a glance which case reaches it.
* ``10-5-sampling-cost``: ms per step against batch, one panel per vocabulary size, one line
  per method for the engine's batched sampler (solid) and for the per-row loop it replaced
  (dashed). Horizontal dotted lines mark a decode step's time, when given, labelled outside the
  plot on the right: sampling matters where its line comes near them. Colour names the method
  (legend of the first panel), line style the implementation (legend of the last).

Both are drawn from the data files' dicts as well (``*_from_data``, :data:`REDRAW`).
"""
from __future__ import annotations

from pathlib import Path

from minillm.core.step_record import OUTSIDE_PHASES, PHASE_LABELS, PHASES
from minillm.hardware.quiet import NOISY_SPREAD, spread
from minillm.metrics.findings import CHAPTER_OUTSIDE_SHARE

# bottom to top: outside the forward first, then the forward
STACK = (*OUTSIDE_PHASES, *[p for p in PHASES if p not in OUTSIDE_PHASES])
PHASE_COLORS = {"schedule": "tab:purple", "prepare": "tab:olive", "sample": "tab:red", "output": "tab:orange",
                "forward_issue": "tab:blue", "device": "tab:cyan"}
METHOD_COLORS = {"greedy": "tab:gray", "temperature": "tab:green", "top-k": "tab:blue", "top-p": "tab:red",
                 "top-k+top-p": "tab:purple"}


def plot_step_phases(cases, references=None, reference_label: str = "reference", title: str | None = None,
                     line: float = CHAPTER_OUTSIDE_SHARE):
    """``cases`` (and ``references``, e.g. a GPU run's): PhaseCase results
    (experiments/outside_steps.py); a saved run's dicts go through ``PhaseCase.from_dict`` first."""
    import matplotlib.pyplot as plt

    bars = [(c, "") for c in cases] + [(c, f"\n({reference_label})") for c in references or []]
    fig, ax = plt.subplots(figsize=(1.6 * len(bars) + 3.2, 4.8))
    xs = range(len(bars))
    bottoms = [0.0] * len(bars)
    for p in STACK:
        vals = [c.shares[p] for c, _ in bars]
        ax.bar(xs, vals, bottom=bottoms, color=PHASE_COLORS[p], width=0.62, label=PHASE_LABELS[p],
               edgecolor="white", linewidth=0.5)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for x, (c, _) in zip(xs, bars):
        o = c.outside_share
        ax.annotate(f"{100 * o:.0f} %", (x, o), xytext=(0, 3), textcoords="offset points", ha="center",
                    va="bottom", fontsize=8, color="white" if o < 0.9 else "black", fontweight="bold")
        ax.text(x, 1.01, f"{c.mean_wall_ms:.3g} ms/step", ha="center", va="bottom", fontsize=8)
        if c.noisy:        # the step times spread widely: something else ran (minillm.hardware.quiet)
            ax.bar([x], [1.0], width=0.62, fill=False, edgecolor="red", linewidth=1.6, hatch="//")
            ax.text(x, 0.5, f"noisy\n×{c.spread:.1f}", ha="center", va="center", fontsize=8, color="red",
                    fontweight="bold",
                    bbox={"facecolor": "white", "edgecolor": "red", "alpha": 0.85, "pad": 1})
    ax.axhline(line, color="black", ls="--", lw=1.2)
    ax.text(-0.45, line + 0.005, f"chapter: about {100 * line:.0f} % outside the forward", va="bottom",
            ha="left", fontsize=8, bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})
    ax.set_xticks(list(xs), [f"{c.label}\n{c.device.split(':')[0]} {c.dtype}{suffix}" for c, suffix in bars],
                  fontsize=8)
    ax.set_ylim(0, 1.08)
    ax.set_ylabel("share of the step's wall time")
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{100 * v:.0f} %"))
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8,
              title="phase (top to bottom)", title_fontsize=8)
    ax.set_title(title or "Where a decode step's time goes (engine StepRecords, mean over steps)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def plot_sampling_cost(bench, step_ms: dict[str, float] | None = None, title: str | None = None,
                       methods: list[str] | None = None):
    """``bench``: a SamplingBench (experiments/outside_sampling.py; a saved one through its
    ``from_dict``). ``step_ms``: {label: ms} of decode steps to mark."""
    import matplotlib.pyplot as plt

    b = bench
    methods = methods or b.method_names
    vocabs = b.vocabs
    noisy_any = False
    fig, axes = plt.subplots(1, len(vocabs), figsize=(5.2 * len(vocabs), 4.4), sharey=True, squeeze=False)
    for ax, V in zip(axes[0], vocabs):
        for m in methods:
            for impl, ls, lw, alpha in (("batched", "-", 1.8, 1.0), ("per-row", "--", 1.1, 0.75)):
                if impl == "per-row" and m == "greedy":
                    continue                  # the old code's greedy rows were a batched argmax too
                pts = [(B, r.ms_median) for B in b.batches if (r := b.get(m, B, V, impl)) is not None]
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, lw=lw, alpha=alpha, marker="o", ms=3,
                        color=METHOD_COLORS.get(m))
                bad = [(B, r.ms_median) for B in b.batches if (r := b.get(m, B, V, impl)) is not None
                       and (sp := spread(r.ms)) is not None and sp > NOISY_SPREAD]
                if bad:          # repeats that spread widely: ringed in red (minillm.hardware.quiet)
                    ax.scatter([q[0] for q in bad], [q[1] for q in bad], s=90, facecolors="none",
                               edgecolors="red",
                               linewidths=1.3, zorder=5)
                    noisy_any = True
        for lab, ms in (step_ms or {}).items():
            ax.axhline(ms, color="black", ls=":", lw=1)
            if ax is axes[0][-1]:        # labelled once, outside the plot: never over a line
                ax.annotate(lab, (1.0, ms), xycoords=("axes fraction", "data"), xytext=(4, 0),
                            textcoords="offset points", va="center", ha="left", fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(b.batches, [str(x) for x in b.batches])
        ax.set_xlabel("batch (rows sampled per step)")
        ax.set_title(f"vocabulary {V:,}", fontsize=10)
        ax.grid(True, which="both", alpha=0.25)
    axes[0][0].set_ylabel("ms per step (median), logits → ids on the host")
    from matplotlib.lines import Line2D
    # two small legends below the panels, ≤ 6 entries each: colour = method, line style = implementation
    below = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.16), "fontsize": 8, "frameon": False}
    method_handles = [Line2D([], [], color=METHOD_COLORS.get(m), lw=1.8, marker="o", ms=3, label=m)
                      for m in methods]
    axes[0][0].legend(handles=method_handles, ncol=3, title="method (colour)", title_fontsize=8, **below)
    style_handles = [Line2D([], [], color="0.3", lw=1.8, marker="o", ms=3, label="batched sampler (engine)"),
                     Line2D([], [], color="0.3", lw=1.1, ls="--", alpha=0.75, marker="o", ms=3,
                            label="per-row loop (before; greedy was batched)")]
    if noisy_any:
        style_handles.append(Line2D([], [], ls="", marker="o", mfc="none", mec="red", ms=9,
                                    label=f"noisy: repeats spread > ×{NOISY_SPREAD:g} (p90/p10)"))
    axes[0][-1].legend(handles=style_handles, ncol=1, title="implementation (line style)", title_fontsize=8,
                       **below)
    fig.suptitle(title or "Sampling cost per step: batched sampler (solid) vs the per-row loop before it "
                          f"(dashed), by method, vocabulary and batch; {b.logits_dtype} logits on {b.device}",
                 fontsize=10)
    fig.tight_layout()
    return fig


def _save(fig, name: str, stamp: str, data: dict, out_dir: str | Path | None) -> list[Path]:
    import matplotlib.pyplot as plt

    from minillm.plots.figures import save_figure
    data = {**data, "stamp": data.get("stamp", stamp)}       # a redraw from the data file keeps the footnote
    paths = save_figure(fig, name, stamp, out_dir, data=data)
    plt.close(fig)
    return paths


def save_step_phases(cases, stamp: str, references=None, reference_label: str = "reference",
                     out_dir: str | Path | None = None, name: str = "10-5-step-phases") -> list[Path]:
    fig = plot_step_phases(cases, references, reference_label)
    data = {"cases": [c.to_dict() for c in cases], "references": [c.to_dict() for c in references or []],
            "reference_label": reference_label}
    return _save(fig, name, stamp, data, out_dir)


def save_sampling_cost(bench, stamp: str, step_ms: dict[str, float] | None = None,
                       out_dir: str | Path | None = None, name: str = "10-5-sampling-cost") -> list[Path]:
    fig = plot_sampling_cost(bench, step_ms)
    data = bench.to_dict()
    return _save(fig, name, stamp, {"sampling": data, "step_ms": step_ms or {}}, out_dir)


# ---------------------------------------------------------------------------------------------
# From the data files' dicts alone: what the plots read of a PhaseCase and a SamplingBench, rebuilt
# here (a plot never imports an experiment)
class _CaseData:
    """A saved PhaseCase dict, read as the plot reads a PhaseCase."""

    def __init__(self, d: dict):
        self.label, self.device, self.dtype = d["label"], d["device"], d["dtype"]
        self.shares, self.outside_share = d["shares"], d["outside_share"]
        self.mean_wall_ms, self.spread = d["mean_wall_ms"], d["spread"]
        self.noisy = self.spread > NOISY_SPREAD


class _BenchData:
    """A saved SamplingBench dict, read as the plot reads a SamplingBench."""

    def __init__(self, d: dict):
        from types import SimpleNamespace
        self.device, self.logits_dtype = d["device"], d["logits_dtype"]
        self.rows = [SimpleNamespace(**r) for r in d["rows"]]
        self.vocabs = sorted({r.vocab for r in self.rows})
        self.batches = sorted({r.batch for r in self.rows})
        self.method_names = list(dict.fromkeys(r.method for r in self.rows))

    def get(self, method: str, batch: int, vocab: int, impl: str = "batched"):
        key = (impl, method, batch, vocab)
        return next((r for r in self.rows if (r.impl, r.method, r.batch, r.vocab) == key), None)


def step_phases_from_data(d: dict):
    return plot_step_phases([_CaseData(c) for c in d["cases"]],
                            [_CaseData(c) for c in d.get("references", [])],
                            d.get("reference_label", "reference"))


def sampling_cost_from_data(d: dict):
    return plot_sampling_cost(_BenchData(d["sampling"]), d.get("step_ms") or None)


# figure name → the function that draws it from its data file's dict (tests/test_figures_clean.py)
REDRAW = {"10-5-step-phases": step_phases_from_data, "10-5-sampling-cost": sampling_cost_from_data}
