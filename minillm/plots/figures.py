"""One helper through which every chapter figure is saved (design.md §5): PNG + SVG in
``figures/``, named like ``10-3-decode-roofline``, stamped with what it was measured on, and the
data it was drawn from beside it in ``figures/data/NAME.json``, so it can be redrawn and checked."""
from __future__ import annotations

import os
import textwrap
from pathlib import Path

FIGURES_DIR = Path(__file__).resolve().parents[2] / "figures"


def figures_dir(out_dir: str | Path | None = None) -> Path:
    d = Path(out_dir or os.environ.get("MINILLM_FIGURES_DIR") or FIGURES_DIR)
    d.mkdir(parents=True, exist_ok=True)
    return d


def save_figure(fig, name: str, stamp: str, out_dir: str | Path | None = None, data=None) -> list[Path]:
    """Stamp ``fig`` (bottom-left, small grey text: hardware, model, dtype, date) and save
    ``name.png`` and ``name.svg``; with ``data`` (plain, JSON-able), also ``data/name.json``
    (strict JSON: infinities as strings). Returns the two image paths."""
    if not name or "/" in name or name.endswith((".png", ".svg")):
        raise ValueError(f"figure name must be a bare slug like '10-3-decode-roofline', got {name!r}")
    # wrapped, so a long command line does not make the saved figure three times wider
    stamp = "\n".join(textwrap.wrap(stamp, 150))
    fig.text(0.005, 0.005, stamp, fontsize=6, color="0.45", ha="left", va="top")
    d = figures_dir(out_dir)
    paths = [d / f"{name}.png", d / f"{name}.svg"]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    # SVGs stay diffable: no random ids or dates inside
    import matplotlib
    with matplotlib.rc_context({"svg.hashsalt": "minillm"}):
        fig.savefig(paths[1], bbox_inches="tight", metadata={"Date": None})
    if data is not None:
        from minillm.measure.sweep import dumps_strict
        (d / "data").mkdir(exist_ok=True)
        (d / "data" / f"{name}.json").write_text(dumps_strict(data))
    return paths
