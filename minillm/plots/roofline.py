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


def plot_roofline(result: dict, references: list[dict] | None = None, ax=None,
                  published: list[dict] | None = None, formula_panel: bool = True):
    """Two panels. Left, this run: x batch (log2), y tok/s (log); measured per-request and aggregate
    tok/s, the bandwidth ÷ model-size bound and its KV-corrected form, the compute roof, B* and the
    knee. Right (unless ``formula_panel`` is False or an ``ax`` is given): the chapter's crossover by
    the formulas for ``llama-3.1-8b`` bf16 on datasheet GPUs, with ``published`` GPU measurements and
    the references of that model and dtype (this project's H200 run) as points."""
    import matplotlib.pyplot as plt
    on_formula = ([r for r in references or [] if _fits_formula_panel(r)]
                  if formula_panel and ax is None else [])
    references = [r for r in references or [] if not any(r is f for f in on_formula)]
    fax = None
    if ax is None and formula_panel:
        fig, (ax, fax) = plt.subplots(1, 2, figsize=(15, 7.8))
        # room below the axes for both legends, above the stamp save_figure writes at the bottom
        fig.subplots_adjust(bottom=0.29, top=0.92, wspace=0.2)
    elif ax is None:
        fig, ax = plt.subplots(figsize=(7.5, 5))
    fig = ax.figure
    cfg = ModelConfig(**result["config"])
    nbytes = {"bf16": 2, "fp16": 2, "fp32": 4}[result["dtype"]]
    bw, peak, L = result["ceilings"]["bandwidth"], result["ceilings"]["peak_flops"], result["context"]
    ok = _ok(result)
    xs = [b["batch"] for b in result["batches"]]
    grid = sorted(set(xs) | {2 ** i for i in range(0, int(math.log2(max(xs))) + 1)})

    # the bounds, from the measured ceilings of this run: labelled where they end, so the legend
    # holds only what was measured (a slide's legend of ten entries is not read)
    flat = bw / rf.weight_bytes(cfg, nbytes)
    ax.plot(grid, [flat * b for b in grid], ":", color="tab:gray")
    ax.plot(grid, [b * bw / rf.decode_step_bytes(cfg, nbytes, b, L) for b in grid], "--", color="tab:gray")
    ax.text(0.02, 0.98, f"grey, dotted: B × BW ÷ model bytes, the chapter's bound ({flat:.0f} tok/s at "
                        f"batch 1)\ngrey, dashed: B × BW ÷ bytes a step reads (+ K/V at L={L})",
            transform=ax.transAxes, ha="left", va="top", fontsize=7, color="0.35", zorder=6,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.9, "pad": 1.5})
    # the bound at the slowest and fastest read measured during the run, where it moved (10.6)
    drift = result.get("read_drift") or {}
    if drift.get("moved"):
        lo, hi = drift["low"], drift["high"]
        ax.fill_between(grid, [b * lo / rf.decode_step_bytes(cfg, nbytes, b, L) for b in grid],
                        [b * hi / rf.decode_step_bytes(cfg, nbytes, b, L) for b in grid], color="tab:gray",
                        alpha=0.15, lw=0, label=f"the dashed bound at the read measured during the run "
                                                f"({lo / 1e9:.0f}–{hi / 1e9:.0f} GB/s): it moved")
    compute = [peak / (rf.decode_step_flops(cfg, b, L) / b) for b in grid]
    ax.plot(grid, compute, "-.", color="tab:red", alpha=0.7)
    ax.annotate("compute roof: peak ÷ FLOPs per token", (grid[-1], compute[-1]), xytext=(-3, 4),
                textcoords="offset points", ha="right", va="bottom", fontsize=7, color="tab:red")
    # what each request can get: the shared step time bounds every request in the batch (it falls
    # through the measured lines, so it keeps its legend entry instead of a label)
    ax.plot(grid, [min(bw / rf.decode_step_bytes(cfg, nbytes, b, L), peak / rf.decode_step_flops(cfg, b, L))
                   for b in grid], "--", color="tab:orange", alpha=0.5,
            label="per-request bound (step time ≥ max(t_mem, t_compute))")

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
    at = result.get("crossover_at_reads") or {}
    if at.get("moved"):      # B* is the peak over the bandwidth: where the read moved, B* moved with it
        lo, hi = at["fastest"]["b_star"], at["slowest"]["b_star"]
        if math.isfinite(lo) and math.isfinite(hi):
            ax.axvspan(lo, hi, color="tab:red", alpha=0.07,
                       label=f"B* over the read the run met: {lo:.1f}–{hi:.1f}")
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
    if fax is None:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # outside: never hides a line
        return fig
    # below the plot: the formula panel takes the right
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    plot_formula_panel(fax, published, on_formula)
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
            f"{result['dtype']}; "
            f"{rf.path_line(result.get('matmul'), result.get('cuda_graphs'), result.get('batches'))}; "
            f"{rf.ceilings_line(result['ceilings'])}; torch {result['torch_version']}; "
            f"{result.get('command', '')}")


# ----------------------------------------------------------------------------- the formula panel (10.3)
# The chapter's crossover by the formulas alone: one request ≤ bandwidth ÷ model bytes, a batch
# shares that read until the step turns compute-bound at B*. Datasheet numbers, never a measurement.
FORMULA_MODEL, FORMULA_DTYPE, FORMULA_CONTEXT = "llama-3.1-8b", "bf16", 512
FORMULA_BATCHES = [2 ** i for i in range(10)]                  # 1 → 512
# (spec-table name, what the chapter calls it, colour): the chapter's "2 TB/s card" is the H100 PCIe's
# datasheet row (2.0 TB/s); the H200 SXM is the GPU of this project's own reference run
FORMULA_GPUS = (("H100 PCIe 80GB", "the chapter's 2 TB/s card", "tab:blue"),
                ("H200 SXM 141GB", "the GPU of this project's run", "tab:red"))
# the chapter's illustrative pair (notebooks 00 and 07): 40 tok/s alone, 2000 tok/s in total at 64
CHAPTER_EXAMPLE = {"batch_1_tok_s": 40.0, "batch": 64, "aggregate_tok_s": 2000.0}
FIGURE_KEYS = ("formula_panel", "references_drawn")            # what the figure adds to a sweep's data
PUBLISHED_MARKERS = ("D", "P", "X", "v", "<", ">")


def _fits_formula_panel(ref: dict) -> bool:
    """A measured reference of the formula panel's model and dtype goes on that panel."""
    return ref.get("model") == FORMULA_MODEL and ref.get("dtype") == FORMULA_DTYPE


def formula_panel_data() -> dict:
    """Per-request and aggregate tok/s bounds for B = 1 → 512, each datasheet GPU, with and without
    the KV read at L = 512, and B* with and without it: what the formula panel draws."""
    from minillm.model.config import PRESETS
    from minillm.perf.calculator import gpu_spec
    cfg, nb, L = PRESETS[FORMULA_MODEL], 2, FORMULA_CONTEXT
    cards = []
    for name, role, _ in FORMULA_GPUS:
        spec = gpu_spec(name)
        bw, peak = spec.bandwidth, spec.flops[FORMULA_DTYPE]
        card = {"gpu": spec.name, "role": role, "source": spec.source, "bandwidth": bw, "peak_flops": peak,
                "bandwidth_bound_tok_s": rf.bandwidth_bound_tok_s(rf.weight_bytes(cfg, nb), bw),
                "crossover": rf.crossover_batch(cfg, nb, bw, peak, 0),
                "crossover_kv": rf.crossover_batch(cfg, nb, bw, peak, L)}
        for key, ctx in (("weights_only", 0), ("with_kv", L)):
            agg = [rf.aggregate_bound(cfg, nb, b, ctx, bw, peak) for b in FORMULA_BATCHES]
            card[key] = {"context": ctx, "aggregate_tok_s": agg,
                         "per_request_tok_s": [a / b for a, b in zip(agg, FORMULA_BATCHES)]}
        cards.append(card)
    return {"kind": "formula, datasheet numbers (not a measurement)", "model": FORMULA_MODEL,
            "dtype": FORMULA_DTYPE, "context": L, "batches": FORMULA_BATCHES,
            "model_bytes": rf.weight_bytes(cfg, nb), "cards": cards, "chapter_example": CHAPTER_EXAMPLE}


def _short(text: str) -> str:
    """'gpt-fast (native PyTorch)' → 'gpt-fast'; 'A100-80GB, power limited' → 'A100-80GB'."""
    return text.split(" (")[0].split(",")[0]


def _published_label(doc: dict) -> str:
    pts = doc["points"]
    models = "/".join(dict.fromkeys(p["model"] for p in pts))
    dtypes = "/".join(dict.fromkeys(p["dtype"] for p in pts))
    bs = sorted({p["batch"] for p in pts})
    batch = f"batch {bs[0]}" if len(bs) == 1 else f"batch {bs[0]}–{bs[-1]}"
    return f"published: {_short(doc['engine'])} on {_short(doc['hardware'])}, {models} {dtypes}, {batch}"


def _draw_formula_lines(ax, data: dict) -> None:
    """Each card: aggregate and per-request bounds, solid without the KV read, dashed with it; B*."""
    xs = data["batches"]
    for card, (_, _, color) in zip(data["cards"], FORMULA_GPUS):
        kv = card["crossover_kv"]
        kv_txt = "never (KV grows as fast)" if not math.isfinite(kv) else f"{kv:,.0f}"
        label = (f"{card['role']}: {card['gpu']} datasheet, {card['bandwidth'] / 1e12:.1f} TB/s, "
                 f"{card['peak_flops'] / 1e12:.0f} TFLOP/s;\n  B* = {card['crossover']:.0f} "
                 f"(weights only), {kv_txt} with KV")
        for key, ls in (("weights_only", "-"), ("with_kv", "--")):
            line = card[key]
            ax.plot(xs, line["aggregate_tok_s"], ls, color=color, lw=1.5, alpha=0.85,
                    label=label if key == "weights_only" else None)
            ax.plot(xs, line["per_request_tok_s"], ls, color=color, lw=1.2, alpha=0.6)
        bstar = card["crossover"]
        if bstar <= xs[-1]:
            ax.axvline(bstar, color=color, lw=0.8, ls=":", alpha=0.8)
            # left of its line, each card at its own height: two B* a factor 2 apart never collide
            y = 1.6e5 if card is data["cards"][-1] else 1.0e5
            ax.text(bstar / 1.06, y, f"B* ≈ {bstar:.0f}", color=color, fontsize=7, va="top", ha="right")
    ax.plot([], [], "--", color="0.4", label=f"dashed: + the KV read at L = {data['context']} per sequence")
    # where the two families of lines are, said on the plot (the legend has room for six entries)
    ax.text(2.2, 2.2e4, "aggregate tok/s ≤ B × BW ÷ bytes per step", fontsize=7.5, rotation=0,
            color="0.25")
    ax.text(1.1, 14, "per-request tok/s: flat until B*, then falls", fontsize=7.5, color="0.25")


def _draw_chapter_example(ax, ex: dict) -> None:
    """The chapter's illustrative 40 → 2000 tok/s: two hollow stars and an arrow, no legend entry."""
    b, b1, agg = ex["batch"], ex["batch_1_tok_s"], ex["aggregate_tok_s"]
    ax.plot([1, b], [b1, agg], "*", ms=11, mfc="none", mec="black", zorder=6)
    ax.annotate("", xy=(b / 1.15, agg / 1.1), xytext=(1.2, b1 * 1.15),
                arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.8, "ls": "--"})
    ax.text(1.25, b1 / 1.9, f"the chapter's illustrative example: {b1:.0f} tok/s alone", fontsize=7.5)
    ax.text(b * 1.2, agg / 1.25, f"→ {agg:.0f} tok/s in total\n    at batch {b}", fontsize=7.5, va="top")


def _draw_published(ax, published: list[dict]) -> None:
    for doc, marker in zip(published, PUBLISHED_MARKERS):
        pts = doc["points"]
        ax.plot([p["batch"] for p in pts], [p["tok_s"] for p in pts], marker, ls="none", ms=6,
                color="tab:green", mec="black", mew=0.6, zorder=5, label=_published_label(doc))
        for i, p in enumerate(pts):
            # batch-1 points sit at the left edge: tags to their right, alternately up and down (two
            # models 10 % apart); the others to the left, clear of the chapter's star at batch 64
            right = p["batch"] == 1
            tag = (f"in/out {p['input_len']}/{p['output_len']}" if "input_len" in p else p["model"])
            ax.annotate(tag, (p["batch"], p["tok_s"]), fontsize=6, color="darkgreen",
                        xytext=(7 if right else -7, (4 if i % 2 == 0 else -9) if right else -3),
                        textcoords="offset points", ha="left" if right else "right")


def _draw_measured_references(ax, refs: list[dict]) -> None:
    for ref in refs:
        ok = _ok(ref)
        hw = ref.get("hardware", {}).get("name") or ref.get("device")
        ax.plot([b["batch"] for b in ok], [b["aggregate_tok_s"] for b in ok], "s-", color="tab:purple",
                ms=4, lw=1, zorder=4,
                label=f"this project's {hw} run (measured, L = {ref['context']}):\n"
                      "  ■ aggregate, □ per request")
        ax.plot([b["batch"] for b in ok], [b["per_request_tok_s"] for b in ok], "s-", color="tab:purple",
                mfc="white", ms=4, lw=1, zorder=4)


def plot_formula_panel(ax, published: list[dict] | None = None, measured: list[dict] | None = None) -> dict:
    """The right panel of 10-3: the formulas on datasheet numbers, the chapter's example, and
    published and measured GPU points. Returns what it drew (the formula data)."""
    data = formula_panel_data()
    _draw_formula_lines(ax, data)
    _draw_published(ax, published or [])
    _draw_measured_references(ax, measured or [])
    _draw_chapter_example(ax, data["chapter_example"])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylim(8, 2e5)
    ax.set_xlabel("batch size (concurrent decoding requests)")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"Formula, datasheet numbers (not a measurement): {data['model']} {data['dtype']}\n"
                 f"lines: bounds by the formulas; points: published and measured GPU runs", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1)
    return data


def _relative(path: str) -> str:
    """``path`` from the repository's root where it lies inside it; "" stays "" (a reference loaded
    without ``_path``: recording the working directory instead would name a folder, not the file)."""
    if not path:
        return ""
    root = Path(__file__).resolve().parents[2]
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return str(path)


def references_drawn(references: list[dict] | None, published: list[dict] | None) -> list[dict]:
    """Which references the figure drew, where each came from and on which panel: the data JSON's record."""
    out = []
    for doc in published or []:
        out.append({"kind": "published", "panel": "formula", "path": _relative(doc.get("_path", "")),
                    "url": doc["url"], "engine": doc["engine"], "hardware": doc["hardware"],
                    "points": [{k: p[k] for k in ("model", "dtype", "batch", "metric", "tok_s", "gb_s")
                                if k in p} for p in doc["points"]]})
    for ref in references or []:
        out.append({"kind": "measured run of this engine",
                    "panel": "formula" if _fits_formula_panel(ref) else "measurement",
                    "path": _relative(ref.get("_path", "")), "hardware": _label(ref),
                    "started": ref.get("started"), "context": ref.get("context"),
                    "points": [{"batch": b["batch"], "per_request_tok_s": b["per_request_tok_s"],
                                "aggregate_tok_s": b["aggregate_tok_s"]} for b in _ok(ref)]})
    return out


def figure_data(result: dict, references: list[dict] | None = None,
                published: list[dict] | None = None) -> dict:
    """The sweep's data unchanged, plus what the formula panel drew and which references."""
    data = {k: v for k, v in result.items() if k not in FIGURE_KEYS}
    data["formula_panel"] = formula_panel_data()
    data["references_drawn"] = references_drawn(references, published)
    return data


def save_roofline_figure(result: dict, references: list[dict] | None = None,
                         out_dir: str | Path | None = None, name: str = "10-3-decode-roofline",
                         published: list[dict] | None = None, formula_panel: bool = True) -> list[Path]:
    import matplotlib.pyplot as plt  # any backend saves a file; the caller's backend is left alone

    from minillm.plots.figures import save_figure
    result = {k: v for k, v in result.items() if k not in FIGURE_KEYS}
    fig = plot_roofline(result, references, published=published, formula_panel=formula_panel)
    data = figure_data(result, references, published) if formula_panel else result
    paths = save_figure(fig, name, stamp_of(result), out_dir, data=data)
    plt.close(fig)
    return paths


def redraw_roofline_figure(data_path: str | Path, out_dir: str | Path | None = None,
                           references: list[dict] | None = None, published: list[dict] | None = None,
                           name: str = "10-3-decode-roofline") -> list[Path]:
    """Draw 10-3 again from a saved sweep (a ``roofline-*.json`` or a figure's ``data/*.json``)
    without measuring anything: the measurement is read back as it was, the formula panel recomputed."""
    import json

    from minillm.core.result import restore_nonfinite
    result = json.loads(Path(data_path).read_text(), object_hook=restore_nonfinite)
    return save_roofline_figure(result, references, out_dir, name, published)
