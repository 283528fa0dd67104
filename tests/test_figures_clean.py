"""The chapter's figures stay slide-clean and redrawable: every committed figure has its data file,
each plots module's redraw function draws its figure from that file alone with at most six legend
entries per axes and distinct axes titles, and the report figure's header lines stay short."""
import json
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from minillm.plots import honest, lifecycle, metrics, outside, prefill_decode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "figures"
REDRAW = {**lifecycle.REDRAW, **metrics.REDRAW, **prefill_decode.REDRAW, **outside.REDRAW, **honest.REDRAW}
# committed data saved before the per-request values were stored: a full notebook run redraws them


def _data(name: str) -> dict:
    return json.loads((FIGURES / "data" / f"{name}.json").read_text())


def _check_clean(fig) -> None:
    titles = []
    for ax in fig.axes:
        leg = ax.get_legend()
        if leg is not None:
            assert len(leg.get_texts()) <= 6, f"{len(leg.get_texts())} legend entries on {ax.get_title()!r}"
        titles += [t for t in (ax.get_title(loc=w) for w in ("left", "center", "right")) if t]
    assert len(titles) == len(set(titles)), f"repeated axes titles: {titles}"
    panels = [t.split(")")[0] + ")" for t in titles if t.startswith("(") and ")" in t]
    assert len(panels) == len(set(panels)), f"two panels share a label: {titles}"


def test_every_committed_figure_has_its_data_file():
    pngs = sorted(FIGURES.glob("*.png"))
    assert pngs
    missing = [p.name for p in pngs if not (FIGURES / "data" / f"{p.stem}.json").is_file()]
    assert not missing, f"figures without figures/data/<name>.json: {missing}"


@pytest.mark.parametrize("name", sorted(REDRAW))
def test_each_redraw_runs_on_its_committed_data_and_is_clean(name):
    d = _data(name)
    fig = REDRAW[name](d)
    try:
        _check_clean(fig)
        assert d.get("stamp") or name == "10-4-roofline-prefill-decode", "no stamp to redraw the footnote"
    finally:
        plt.close(fig)


@pytest.mark.parametrize("name", ["10-6-cold-vs-warm", "10-6-fixed-vs-lognormal", "10-6-repeated-prompt",
                                  "10-6-report"])
def test_data_without_per_request_values_is_refused_not_drawn_half(name):
    old = {k: v for k, v in _data(name).items() if k != "values"}       # as saved before they were kept
    with pytest.raises(ValueError, match="rerun"):
        REDRAW[name](old)


def test_the_latency_figure_plots_the_drawn_rate_with_the_offered_one_on_top():
    d = _data("10-6-latency-vs-rate")
    fig = honest.latency_vs_rate_from_data(d)
    try:
        ax = fig.axes[0]
        p50 = next(line for line in ax.get_lines() if line.get_label() == "open loop: TTFT p50")
        assert list(p50.get_xdata()) == [p["drawn_rate"] for p in d["points"]]
        assert "drawn" in ax.get_xlabel()
        assert any("offered" in a.get_xlabel() for a in fig.axes[1:] + ax.child_axes)
    finally:
        plt.close(fig)


def test_the_chunk_tradeoff_linear_axes_start_at_zero():
    fig = prefill_decode.chunk_tradeoff_from_data(_data("10-4-chunk-tradeoff"))
    try:
        assert [ax.get_ylim()[0] for ax in fig.axes[1:]] == [0, 0]
    finally:
        plt.close(fig)


def test_the_timeline_marks_the_p99_ttft_request():
    d = _data("10-1-request-timeline")
    fig = lifecycle.request_timeline_from_data(d)
    try:
        legends = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        assert any(t.startswith("p99-TTFT request") for t in legends)
    finally:
        plt.close(fig)


def _values(n: int, scale: float) -> list[float]:
    return [scale * (1 + (i * 37 % 11) / 5) for i in range(n)]


def test_the_report_header_lines_are_short_and_it_draws_from_its_data_alone():
    long = "input lengths " + "lognormal σ=1 median 78 tokens (served: mean 132, p99 514, max 554); " * 4
    d = {"text": "model m (bf16) on a card, parallel tp=1\n" + long + "\n(ms)  p50  p95  p99",
         "values": {"ttft": _values(20, 0.2), "tpot": _values(20, 0.04), "itl": _values(200, 0.04),
                    "e2el": _values(20, 1.5)},
         "result": {"summary": {"input_tok_s": 134.3, "output_tok_s": 33.0}}}
    fig = honest.plot_report_from_data(d, title="report")
    try:
        _check_clean(fig)
        header = next(t.get_text() for ax in fig.axes for t in ax.texts if t.get_text().startswith("model m"))
        lines = header.splitlines()
        assert len(lines) > 3 and max(len(line) for line in lines) <= 110
        assert "".join(lines).replace(" ", "") == d["text"].replace("\n", "").replace(" ", "")  # all kept
        assert fig.get_size_inches()[0] == 10
    finally:
        plt.close(fig)


def test_the_pair_figures_draw_from_their_data_alone():
    d = {"name": "a vs b", "deceptive_label": "fixed", "honest_label": "lognormal", "lesson": "a lesson",
         "deceptive": {"n_ok": 12}, "honest": {"n_ok": 12},
         "values": {side: {"ttft": _values(12, s), "ttft_in_order": _values(12, s)}
                    for side, s in (("deceptive", 0.2), ("honest", 0.3))}}
    for draw in (honest.plot_pair_from_data, honest.plot_cold_warm_from_data):
        fig = draw(d)
        try:
            _check_clean(fig)
            assert fig.axes[0].get_legend() is not None
        finally:
            plt.close(fig)
