"""The chapter 10.4 figures, drawn from data (the dicts of ``minillm.experiments.prefill_decode``),
so a reference run and a learner's live run go on the same axes:

- ``10-4-roofline-prefill-decode``: attainable FLOP/s against arithmetic intensity (log-log) with
  the measured bandwidth slope and compute roof, decode and prefill points, the ridge point I*;
  beside it, time per token of prefill and decode;
- ``10-4-prefill-stall``: the decoders' token rasters with the long prefill marked, one run per
  panel (prefill-first above, chunked below);
- ``10-4-chunk-tradeoff``: max / p99 ITL, the long request's TTFT and output tok/s against the
  chunk budget, with an ITL SLO line and where it is crossed.
"""
from __future__ import annotations

import math
from pathlib import Path

from minillm.hardware.quiet import NOISY_SPREAD, too_wide
from minillm.metrics.findings import slo_crossing
from minillm.perf.prefill import cost_ratio

PREFILL_C, DECODE_C, REF_C = "tab:orange", "tab:blue", "tab:purple"


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["status"] == "ok"]


def _roofline_of(d: dict) -> dict:
    """A reference file holds {"roofline": ..., "tradeoff": ...}; a live result is the roofline."""
    return d.get("roofline", d)


def _label(res: dict) -> str:
    hw = res.get("hardware", {})
    return f"{res['model']} {res['dtype']} on {hw.get('name') or res.get('device')}"


def _bw_kind(res: dict) -> str:
    """Which bandwidth the roof uses: the read ceiling, or (older runs) the copy's read + write."""
    return "(read)" if res["ceilings"].get("bandwidth_kind") == "read" else "(copy, read + write)"


def _roof(ax, bw: float, peak: float, x0: float, x1: float, **kw) -> None:
    import numpy as np
    xs = np.logspace(math.log10(x0), math.log10(x1), 200)
    ax.plot(xs, np.minimum(peak, xs * bw), **kw)


def plot_roofline_prefill_decode(result: dict, references: list[dict] | None = None):
    """Left: the classic roofline. Right: ms per token against tokens per forward pass."""
    import matplotlib.pyplot as plt
    res = _roofline_of(result)
    refs = [_roofline_of(r) for r in references or []]
    bw, peak = res["ceilings"]["bandwidth"], res["ceilings"]["peak_flops"]
    i_star = res["ridge_point"]
    pre, dec = _ok(res["prefill"]), _ok(res["decode"])
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 6.2))

    xs = [r["intensity"] for r in pre + dec] + [i_star]
    for ref in refs:
        xs += [r["intensity"] for r in _ok(ref["prefill"]) + _ok(ref["decode"])] + [ref["ridge_point"]]
    x0, x1 = min(xs) / 3, max(xs) * 3
    for ref in refs:
        rb, rp = ref["ceilings"]["bandwidth"], ref["ceilings"]["peak_flops"]
        _roof(ax, rb, rp, x0, x1, color=REF_C, lw=1, ls="--", alpha=0.6,
              label=f"reference roof: {_label(ref)} ({rb / 1e12:.2f} TB/s, {rp / 1e12:.0f} TFLOP/s)")
        for rows, mk in ((_ok(ref["decode"]), "o"), (_ok(ref["prefill"]), "s")):
            ax.plot([r["intensity"] for r in rows], [r["achieved_flops"] for r in rows], mk, color=REF_C,
                    mfc="none", ms=5, alpha=0.7)
        ax.plot([], [], "s", color=REF_C, mfc="none", label="reference points (○ decode, □ prefill)")
    _roof(ax, bw, peak, x0, x1, color="k", lw=1.6,
          label=f"roofline: min(peak, I × BW); BW {bw / 1e9:.1f} GB/s {_bw_kind(res)}, "
                f"peak {peak / 1e9:.0f} GFLOP/s (matmul)")
    ax.axvline(i_star, color="tab:red", ls=":", lw=1,
               label=f"ridge point I* = peak / BW = {i_star:.1f} FLOP/byte")
    ax.annotate(f"I* = {i_star:.1f}", (i_star, peak), xytext=(4, 6), textcoords="offset points", fontsize=8,
                color="tab:red")
    ax.plot([r["intensity"] for r in dec], [r["achieved_flops"] for r in dec], "o-", color=DECODE_C,
            label=f"decode steps, batch {dec[0]['batch']}–{dec[-1]['batch']} (context "
                  f"{res['decode_context']})"
            if dec else "decode")
    ax.plot([r["intensity"] for r in pre], [r["achieved_flops"] for r in pre], "s-", color=PREFILL_C,
            label=f"prefill, prompt {pre[0]['tokens']}–{pre[-1]['tokens']} tokens" if pre else "prefill")
    for rows, key, pre_ in ((dec, "batch", "B="), (pre, "tokens", "T=")):
        for i, r in enumerate(rows):
            if i in (0, len(rows) - 1) or len(rows) <= 5:
                ax.annotate(f"{pre_}{r[key]}", (r["intensity"], r["achieved_flops"]), fontsize=7,
                            xytext=(4, -10 if pre_ == "B=" else 4), textcoords="offset points")
    noisy = [r for r in pre + dec if too_wide(r.get("time_ms_p10"), r.get("time_ms_p90"))]
    if noisy:        # samples that spread widely: something else ran (minillm.hardware.quiet)
        ax.scatter([r["intensity"] for r in noisy], [r["achieved_flops"] for r in noisy], s=150,
                   facecolors="none",
                   edgecolors="red", linewidths=1.4, zorder=5,
                   label=f"noisy: samples spread > ×{NOISY_SPREAD:g} (p90/p10): rerun")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(x0, x1)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title(f"Prefill and decode on one roofline\n{_label(res)}", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13))   # below: never hides a point

    # right: time per token
    cfg = res["config"]
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    ax2.plot([r["tokens"] for r in pre], [r["ms_per_token"] for r in pre], "s-", color=PREFILL_C,
             label="prefill: forward time / T (T = prompt length)")
    ax2.plot([r["tokens"] for r in dec], [r["ms_per_token"] for r in dec], "o-", color=DECODE_C,
             label="decode: step time / B (B = batch)")
    for ref in refs:
        ax2.plot([r["tokens"] for r in _ok(ref["prefill"])],
                 [r["ms_per_token"] for r in _ok(ref["prefill"])], "s--",
                 color=REF_C, mfc="none", alpha=0.6, ms=4, label=f"reference prefill ({ref['model']})")
        ax2.plot([r["tokens"] for r in _ok(ref["decode"])], [r["ms_per_token"] for r in _ok(ref["decode"])],
                 "o--",
                 color=REF_C, mfc="none", alpha=0.6, ms=4, label=f"reference decode ({ref['model']})")
    if noisy:
        ax2.scatter([r["tokens"] for r in noisy], [r["ms_per_token"] for r in noisy], s=150,
                    facecolors="none",
                    edgecolors="red", linewidths=1.4, zorder=5, label="noisy (as on the left)")
    if pre or dec:
        from minillm.model.config import ModelConfig
        body = ModelConfig(**cfg).matmul_params - v * h          # P without the LM head
        ax2.axhline(2 * body / peak * 1e3, color="tab:red", ls="-.", lw=1, alpha=0.7,
                    label="compute floor per token: 2·P_body / peak")
    ratio = cost_ratio(res)
    sub = (f"\none batch-1 decode token costs as much time as {ratio['decode_b1_over_prefill']:.0f} prefill "
           f"tokens (T={ratio['prefill_tokens']});\nat batch {ratio['batch']}: "
           f"{ratio['decode_bmax_over_prefill']:.1f} prefill tokens"
           if ratio else "")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("tokens in one forward pass (prefill: T, decode: B)")
    ax2.set_ylabel("ms per token")
    ax2.set_title("Time per token: prefill against decode" + sub, fontsize=10)
    ax2.grid(True, which="both", alpha=0.25)
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    fig.tight_layout()
    return fig


def plot_stall_rasters(runs: list[dict], measured_prefill_ms: float | None = None):
    """One raster per run (a StallRun dict), stacked, on one time axis (ms from the long
    prompt's arrival): a tick per token of each decoding request, the long prefill's chunks
    shaded, the gap that holds the whole prefill marked with its length."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 2.4 + 1.9 * len(runs)), sharex=True, squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        s = run["setup"]
        rows = run["short_ids"] + [run["long_id"]]
        ax.eventplot([run["tokens_ms"][r] for r in rows], lineoffsets=list(range(len(rows))), linelengths=0.7,
                     colors=[DECODE_C] * len(run["short_ids"]) + [PREFILL_C], linewidths=1)
        for c in run["chunks"]:
            ax.axvspan(c["t_start_ms"], c["t_end_ms"], color=PREFILL_C, alpha=0.18, lw=0)
            ax.broken_barh([(c["t_start_ms"], c["t_end_ms"] - c["t_start_ms"])], (len(rows) - 1.35, 0.7),
                           color=PREFILL_C, alpha=0.6)
        ax.axvline(0, color="k", lw=0.8, ls=":")
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([r.replace("short-", "decode ") for r in run["short_ids"]]
                           + [f"long ({s['long_prompt_len']} tok)"], fontsize=7)
        ax.invert_yaxis()
        if run["stalled"]:
            g = max(run["stalled"], key=lambda g: g["gap_ms"])
            i = run["short_ids"].index(g["request_id"])
            t = run["tokens_ms"][g["request_id"]]
            a, b = t[g["index"] - 1], t[g["index"]]
            ax.annotate("", (a, i - 0.45), (b, i - 0.45),
                        arrowprops=dict(arrowstyle="<->", color="tab:red", lw=1))
            msg = (f"gap {g['gap_ms']:.0f} ms (the longest of {len(run['stalled'])} gaps that hold the whole "
                   f"prefill);\nthe prefill itself: {run['long_prefill_ms']:.0f} ms in the trace")
            if measured_prefill_ms:
                msg += f", {measured_prefill_ms:.0f} ms forward in the prefill sweep"
            ax.text(0.99, 0.02, msg, transform=ax.transAxes, fontsize=7, ha="right", va="bottom",
                    color="tab:red",
                    bbox=dict(facecolor="white", edgecolor="none", alpha=0.85))
        else:
            ax.text(0.99, 0.02, f"{len(run['chunks'])} chunks; no decoder gap holds the whole prefill;\n"
                    f"the longest gap holding a chunk: {run['max_chunk_gap_ms']:.0f} ms",
                    transform=ax.transAxes, fontsize=7, ha="right", va="bottom", color="tab:red",
                    bbox=dict(facecolor="white", edgecolor="none", alpha=0.85))
        title = run["policy"] + (f", budget {run['budget']} tokens/step" if run["policy"] == "chunked" else
                                 " (a step is all prefill or all decode)")
        ax.set_title(f"{title}: ITL max {run['itl_max_ms']:.0f} ms, p99 {run['itl_p99_ms']:.0f} ms; "
                     f"long request's TTFT {run['long_ttft_ms']:.0f} ms", fontsize=9)
        ax.grid(True, axis="x", alpha=0.25)
    s = runs[0]["setup"]
    axes[-1, 0].set_xlabel(f"time since the {s['long_prompt_len']}-token prompt arrived (ms); "
                           f"{s['n_short']} requests decoding, each tick = one token")
    fig.tight_layout()
    return fig


def plot_chunk_tradeoff(tradeoff: dict, slo_ms: float | None = None):
    """Three panels against the chunk budget (log2): the decoders' max and p99 ITL with the SLO,
    the long request's TTFT, aggregate output tok/s; the prefill-first run as dashed lines."""
    import matplotlib.pyplot as plt
    runs, pf = tradeoff["chunked"], tradeoff["prefill_first"]
    b = [r["budget"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), sharex=True)
    ax = axes[0]
    ax.plot(b, [r["itl_p99_ms"] for r in runs], "s-", color=DECODE_C, label="ITL p99 (decoders)")
    ax.plot(b, [r["itl_max_ms"] for r in runs], "o--", color="tab:red", mfc="none", ms=8,
            label="ITL max (decoders)")
    ax.axhline(pf["itl_max_ms"], color="tab:red", ls="--", lw=1, alpha=0.6, label="prefill-first: ITL max")
    ax.axhline(pf["itl_p99_ms"], color=DECODE_C, ls="--", lw=1, alpha=0.6, label="prefill-first: ITL p99")
    if slo_ms:
        # where p99 crosses the SLO goes into the SLO's legend entry: a text in the panel would sit on
        # the dashed prefill-first lines at the top
        x = slo_crossing(b, [r["itl_p99_ms"] for r in runs], slo_ms)
        where = (f"p99 crosses it at a budget ≈ {x:.0f}" if x else
                 "p99 within it at every budget" if all(r["itl_p99_ms"] <= slo_ms for r in runs) else
                 "p99 over it at every budget")
        ax.axhline(slo_ms, color="k", lw=1.2, label=f"SLO: ITL p99 ≤ {slo_ms:.0f} ms;\n{where}")
        if x:
            ax.axvline(x, color="k", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.set_title("Decoders' inter-token latency", fontsize=10)
    ax = axes[1]
    ax.plot(b, [r["long_ttft_ms"] for r in runs], "o-", color=PREFILL_C, label="chunked")
    ax.axhline(pf["long_ttft_ms"], color=PREFILL_C, ls="--", lw=1, alpha=0.6, label="prefill-first")
    ax.set_ylabel("ms")
    ax.set_title(f"The long request's TTFT ({tradeoff['setup']['long_prompt_len']} tokens)", fontsize=10)
    ax = axes[2]
    ax.plot(b, [r["output_tok_s"] for r in runs], "o-", color="tab:green", label="chunked")
    ax.axhline(pf["output_tok_s"], color="tab:green", ls="--", lw=1, alpha=0.6, label="prefill-first")
    ax.set_ylabel("output tokens / s (all requests)")
    ax.set_title("Aggregate output throughput", fontsize=10)
    tps = [r["output_tok_s"] for r in runs] + [pf["output_tok_s"]]
    mid = (max(tps) + min(tps)) / 2
    ax.text(0.98, 0.04, f"one run per budget; all within ±{100 * (max(tps) - min(tps)) / 2 / mid:.0f} % "
            f"of {mid:.1f} tok/s", transform=ax.transAxes, fontsize=7, ha="right", va="bottom",
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1})
    for ax in axes:
        ax.margins(y=0.08)                      # keep the dashed prefill-first lines off the frame
        ax.set_xscale("log", base=2)
        ax.set_xlabel("chunk budget (tokens per step)")
        ax.grid(True, which="both", alpha=0.25)
    axes[0].legend(fontsize=7, loc="lower right")
    # linear axes start at 0: a few % of run-to-run noise must not look like a trend
    for ax in axes[1:]:
        ax.set_ylim(0, max(max(line.get_ydata()) for line in ax.get_lines()) * 1.15)
        ax.legend(fontsize=7, loc="upper right", ncol=2)
    fig.tight_layout()
    return fig


def stamp_of(result: dict) -> str:
    res = _roofline_of(result)
    hw = res.get("hardware", {})
    return (f"measured {res.get('started', '')} on {hw.get('summary') or hw.get('name') or res['device']}; "
            f"model {res['model']} {res['dtype']}; torch {res['torch_version']}; {res.get('command', '')}")


def _save(fig, name: str, stamp: str, data: dict, out_dir) -> list[Path]:
    import matplotlib.pyplot as plt

    from minillm.plots.figures import save_figure
    paths = save_figure(fig, name, stamp, out_dir, data=data)
    plt.close(fig)
    return paths


def _save_stamped(fig, name: str, stamp: str, data: dict, out_dir) -> list[Path]:
    """As :func:`_save`, the stamp kept in the data (``"stamp"``) for a redraw from the data file."""
    return _save(fig, name, stamp, {**data, "stamp": data.get("stamp", stamp)}, out_dir)


def save_roofline_prefill_decode(result: dict, references: list[dict] | None = None, out_dir=None,
                                 name: str = "10-4-roofline-prefill-decode") -> list[Path]:
    fig = plot_roofline_prefill_decode(result, references)
    return _save(fig, name, stamp_of(result), result, out_dir)


def save_stall_rasters(runs: list[dict], stamp: str, measured_prefill_ms: float | None = None, out_dir=None,
                       name: str = "10-4-prefill-stall") -> list[Path]:
    fig = plot_stall_rasters(runs, measured_prefill_ms)
    data = {"runs": runs, "measured_prefill_ms": measured_prefill_ms}
    return _save_stamped(fig, name, stamp, data, out_dir)


def save_chunk_tradeoff(tradeoff: dict, stamp: str, slo_ms: float | None = None, out_dir=None,
                        name: str = "10-4-chunk-tradeoff") -> list[Path]:
    fig = plot_chunk_tradeoff(tradeoff, slo_ms)
    return _save_stamped(fig, name, stamp, {"tradeoff": tradeoff, "slo_ms": slo_ms}, out_dir)


# Drawn from a data file's dict alone (figures/data/NAME.json), the stamp aside (save_figure adds it)
def roofline_prefill_decode_from_data(d: dict):
    return plot_roofline_prefill_decode(d)


def stall_rasters_from_data(d: dict):
    return plot_stall_rasters(d["runs"], d.get("measured_prefill_ms"))


def chunk_tradeoff_from_data(d: dict):
    return plot_chunk_tradeoff(d["tradeoff"], d.get("slo_ms"))


# figure name → the function that draws it from its data file's dict (tests/test_figures_clean.py)
REDRAW = {"10-4-roofline-prefill-decode": roofline_prefill_decode_from_data,
          "10-4-prefill-stall": stall_rasters_from_data,
          "10-4-chunk-tradeoff": chunk_tradeoff_from_data}
