"""One helper through which every chapter figure is saved (design.md §5): PNG + SVG, named like
``10-3-decode-roofline``, stamped with what it was measured on, and the data it was drawn from
beside it in ``data/NAME.json``, so it can be redrawn and checked.

Where they go: ``runs/figures/`` relative to the working directory (git ignores ``runs/``), or
``MINILLM_FIGURES_DIR``, or the folder a caller names (``--figures DIR`` on a command). Only an
explicit request writes the committed ``figures/``: ``--figures figures/`` from the repository, or
``PUBLISH = True`` in a notebook's parameters cell (:func:`notebook_figures_dir`). Never a folder
inside the installed package: an installed copy has no ``figures/`` to write to.
"""
from __future__ import annotations

import os
import tempfile
import textwrap
from pathlib import Path

from minillm.plots.fonts import bilingual, use_cjk_font

DEFAULT_DIR = Path("runs") / "figures"      # relative to the working directory

# The chapter's sections, English and the Chinese chapter's own headings, for the line under each figure.
SECTIONS = {
    "10.1": ("The lifecycle of one inference request", "一个推理请求的生命周期"),
    "10.2": ("Four metrics", "四个指标"),
    "10.3": ("Back to the three formulas: the decode roofline", "回到第一册的三个公式"),
    "10.4": ("Prefill and decode", "Prefill 与 Decode"),
    "10.5": ("Time outside the accelerator", "不只是 GPU 在花时间"),
    "10.6": ("Benchmarking without fooling yourself", "怎么压测才不骗自己"),
    "10.7": ("Core Q&A", "核心问答"),
}


def figures_dir(out_dir: str | Path | None = None) -> Path:
    d = Path(out_dir or os.environ.get("MINILLM_FIGURES_DIR") or DEFAULT_DIR)
    d.mkdir(parents=True, exist_ok=True)
    return d


def notebook_figures_dir(publish: bool = False, fast: bool = False, cwd: str | Path | None = None) -> Path:
    """Where a notebook's figures go; sets ``MINILLM_FIGURES_DIR`` so every helper uses it.

    - fast mode (CI): a fresh temporary folder, whatever ``publish`` says: fast-mode figures are
      never the chapter's;
    - ``publish=True``: the committed ``figures/`` (``../figures`` from ``notebooks/``, where
      Jupyter runs a notebook);
    - otherwise ``MINILLM_FIGURES_DIR`` if set, else ``runs/figures/`` of the repository
      (``../runs/figures`` from ``notebooks/``), which git ignores.
    """
    here = Path(cwd) if cwd is not None else Path.cwd()
    root = here.parent if here.name == "notebooks" else here
    if fast:
        if publish:
            print("PUBLISH ignored in fast mode: fast-mode figures never replace the committed ones")
        d = Path(tempfile.mkdtemp(prefix="minillm-fig-"))
    elif publish:
        d = root / "figures"
    else:
        env = os.environ.get("MINILLM_FIGURES_DIR")
        if env and Path(env).resolve() == (root / "figures").resolve():
            env = None               # left over from a PUBLISH run in this kernel: not asked for now
        d = Path(env) if env else root / DEFAULT_DIR
    d.mkdir(parents=True, exist_ok=True)
    os.environ["MINILLM_FIGURES_DIR"] = str(d)
    return d


def section_line(name: str) -> str | None:
    """``"Figure 10-3 · 10.3 Back to the three formulas: … · 回到第一册的三个公式"`` for a chapter
    figure's name (the Chinese heading only where a CJK font can draw it), None for any other name."""
    number = name[:4]
    section = number.replace("-", ".")
    if section not in SECTIONS:
        return None
    en, zh = SECTIONS[section]
    return f"Figure {number} · {section} {bilingual(en, zh)}"


def save_figure(fig, name: str, stamp: str, out_dir: str | Path | None = None, data=None) -> list[Path]:
    """Stamp ``fig`` (bottom-left, small grey text: hardware, model, dtype, date) and save
    ``name.png`` and ``name.svg``; with ``data`` (plain, JSON-able), also ``data/name.json``
    (strict JSON: infinities as strings). Returns the two image paths."""
    if not name or "/" in name or name.endswith((".png", ".svg")):
        raise ValueError(f"figure name must be a bare slug like '10-3-decode-roofline', got {name!r}")
    # wrapped, so a long command line does not make the saved figure three times wider
    stamp = "\n".join(textwrap.wrap(stamp, 150))
    heading = section_line(name)
    fig.text(0.005, 0.005, f"{heading}\n{stamp}" if heading else stamp, fontsize=6, color="0.45",
             ha="left", va="top")
    use_cjk_font(fig)
    d = figures_dir(out_dir)
    paths = [d / f"{name}.png", d / f"{name}.svg"]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    # SVGs stay diffable: no random ids or dates inside
    import matplotlib
    with matplotlib.rc_context({"svg.hashsalt": "minillm"}):
        fig.savefig(paths[1], bbox_inches="tight", metadata={"Date": None})
    if data is not None:
        from minillm.core.result import dumps_strict
        (d / "data").mkdir(exist_ok=True)
        (d / "data" / f"{name}.json").write_text(dumps_strict(data))
    return paths
