"""The chapter 10.3 figure, drawn from sweep *data* (a SweepResult dict or its JSON file), so a
lecturer's reference run and a learner's live run go on the same axes."""
from __future__ import annotations

import math
from pathlib import Path

import minillm.perf.roofline as rf
from minillm.model.config import ModelConfig


def _ok(res: dict) -> list[dict]:
    return [b for b in res["batches"] if b["status"] == "ok"]


def _label(res: dict) -> str:
    hw = res.get("hardware", {})
    name = hw.get("name") or res.get("device")
    return f"{res['model']} {res['dtype']} on {name}"


def plot_roofline(result: dict, references: list[dict] | None = None, ax=None):
    """x: batch (log2), y: tok/s (log). Measured per-request and aggregate tok/s, the
    bandwidth ÷ model-size bound and its KV-corrected form, the compute roof, B* and the knee."""
    import matplotlib.pyplot as plt
    if ax is None:
        fig, ax = plt.subplots(figsize=(7.5, 5))
    fig = ax.figure
    cfg = ModelConfig(**result["config"])
    nbytes = {"bf16": 2, "fp16": 2, "fp32": 4}[result["dtype"]]
    bw, peak, L = result["ceilings"]["bandwidth"], result["ceilings"]["peak_flops"], result["context"]
    ok = _ok(result)
    xs = [b["batch"] for b in result["batches"]]
    grid = sorted(set(xs) | {2 ** i for i in range(0, int(math.log2(max(xs))) + 1)})

    # the bounds, from the measured ceilings of this run
    flat = bw / rf.weight_bytes(cfg, nbytes)
    ax.plot(grid, [flat * b for b in grid], ":", color="tab:gray",
            label=f"B × BW / model bytes (the chapter's bound; batch 1: {flat:.1f} tok/s)")
    ax.plot(grid, [b * bw / rf.decode_step_bytes(cfg, nbytes, b, L) for b in grid], "--", color="tab:gray",
            label=f"B × BW / bytes a step reads (weights + KV at L={L})")
    # what each request can get: the shared step time bounds every request in the batch
    ax.plot(grid, [min(bw / rf.decode_step_bytes(cfg, nbytes, b, L), peak / rf.decode_step_flops(cfg, b, L))
                   for b in grid], "--", color="tab:orange", alpha=0.5,
            label="per-request bound (step time ≥ max(t_mem, t_compute))")
    compute = [peak / (rf.decode_step_flops(cfg, b, L) / b) for b in grid]
    ax.plot(grid, compute, "-.", color="tab:red", alpha=0.7, label="compute roof (peak / FLOPs per token)")

    for ref in references or []:
        rok = _ok(ref)
        ax.plot([b["batch"] for b in rok], [b["aggregate_tok_s"] for b in rok], "s-", color="tab:purple",
                alpha=0.5, ms=4, label=f"reference: {_label(ref)} (aggregate)")
        ax.plot([b["batch"] for b in rok], [b["per_request_tok_s"] for b in rok], "s--", color="tab:purple",
                alpha=0.35, ms=3, label="reference (per-request)")
    ax.plot([b["batch"] for b in ok], [b["aggregate_tok_s"] for b in ok], "o-", color="tab:blue",
            label="measured aggregate tok/s")
    ax.plot([b["batch"] for b in ok], [b["per_request_tok_s"] for b in ok], "o-", color="tab:orange",
            label="measured per-request tok/s")
    # rows whose repeats spread widely (something else ran): ringed in red, so nobody reads them as data
    from minillm.hardware.quiet import NOISY_SPREAD, noisy_rows
    noisy = noisy_rows({b["batch"]: b.get("forward_ms") or [] for b in ok})
    if noisy:
        nb_ = [b for b in ok if b["batch"] in noisy]
        ax.scatter([b["batch"] for b in nb_] * 2,
                   [b["aggregate_tok_s"] for b in nb_] + [b["per_request_tok_s"] for b in nb_],
                   s=160, facecolors="none", edgecolors="red", linewidths=1.4, zorder=5,
                   label=f"noisy: step times spread > ×{NOISY_SPREAD:g} (p90/p10): rerun")
    served = [b for b in ok if b.get("served_aggregate_tok_s")]
    if served:   # the same engine step as serving runs it: mixed lengths, scattered slots (a gather)
        ax.plot([b["batch"] for b in served], [b["served_aggregate_tok_s"] for b in served], "^:",
                color="tab:green",
                ms=5, label="served: engine step, lengths L/2–3L/2, scattered slots (aggregate)")
    for b in result["batches"]:
        if b["status"] != "ok":
            ax.annotate(b["status"][:12], (b["batch"], flat), fontsize=7, color="tab:red", rotation=90)

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    # vertical markers go in the legend: annotations at axis limits get lost on log axes
    bstar = result.get("predicted_crossover")
    if bstar and math.isfinite(bstar):
        ax.axvline(bstar, color="tab:red", lw=0.9, alpha=0.6, label=f"predicted crossover B* = {bstar:.0f}")
    # the knee from the data drawn, by the one definition (an older file's stored knee may predate it)
    fit = rf.knee_fit([b["batch"] for b in ok], [b["forward_ms_median"] for b in ok])
    if fit.knee:
        ax.axvline(fit.knee, color="tab:blue", lw=0.9, ls="--", alpha=0.6,
                   label=f"measured knee ≈ {fit.knee:.0f}")
    elif fit.candidate and not fit.reason.startswith("no knee in this range"):
        ax.plot([], [], " ",
                label="measured knee: none (the step times do not have\nthe roofline's flat-then-∝B shape)")
    else:
        ax.plot([], [], " ", label="measured knee: none in this range")
    ax.set_xlabel("batch size (concurrent decoding requests)")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"Decode roofline: {_label(result)}\n(context {L}, ceilings {result['ceilings']['source']}: "
                 f"{bw / 1e9:.0f} GB/s {_bw_kind(result)}, {peak / 1e12:.2f} TFLOP/s)", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # outside: never hides a line
    return fig


def _bw_kind(result: dict) -> str:
    """Which bandwidth the bound uses: 'read' (since the read ceiling exists); runs measured
    before it drew their bound with the copy bandwidth."""
    c = result["ceilings"]
    if c.get("source") != "measured":
        return c.get("source", "")
    return c.get("bandwidth_kind", "copy")


def stamp_of(result: dict) -> str:
    hw = result.get("hardware", {})
    return (f"measured {result.get('started', '')} on "
            f"{hw.get('summary') or hw.get('name') or result['device']}; model {result['model']} "
            f"{result['dtype']}; {rf.path_line(result.get('matmul'), result.get('cuda_graphs'))}; "
            f"{rf.ceilings_line(result['ceilings'])}; torch {result['torch_version']}; "
            f"{result.get('command', '')}")


def save_roofline_figure(result: dict, references: list[dict] | None = None,
                         out_dir: str | Path | None = None, name: str = "10-3-decode-roofline") -> list[Path]:
    import matplotlib.pyplot as plt  # any backend saves a file; the caller's backend is left alone

    from minillm.plots.figures import save_figure
    fig = plot_roofline(result, references)
    paths = save_figure(fig, name, stamp_of(result), out_dir, data=result)
    plt.close(fig)
    return paths
