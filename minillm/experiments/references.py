"""Reference runs shipped with the project (``figures/reference/``) and where to find them.

A reference run is real data from a machine a learner may not have (the H200 run in
``figures/reference/h200/``, a lecturer's own GPU run in ``runs/reference/``), drawn beside the
learner's own points and always labelled with its provenance. Each kind of result is found by its
file name, in any folder below a reference root:

- ``roofline-*.json``: decode sweeps (``python -m minillm roofline``), notebooks 03 and 07;
- ``prefill-decode-*.json``: 10.4's runs (``python -m minillm prefill-decode``), 04 and 07;
- ``outside-*.json``: 10.5's runs (``python -m minillm outside-reference``), 05.

Published GPU measurements (``figures/reference/published/*.json``, one file per source) are not
runs of this engine: each holds a source's URL, engine, hardware and the numbers it quotes,
verbatim, drawn on 10-3's formula panel beside this project's own H200 run.

A folder named ``raw`` holds a run's whole bundle for the record (its logs, every file it wrote,
runs of earlier code): it is read by people, never drawn.
"""
from __future__ import annotations

from pathlib import Path

REFERENCE_ROOTS = ("figures/reference", "runs/reference")
ARCHIVE = "raw"
PUBLISHED_DIR = "figures/reference/published"
# what every published file must say (chapter 10.3: a number without its source is not evidence)
PUBLISHED_FIELDS = ("source", "url", "engine", "hardware", "points")
PUBLISHED_POINT_FIELDS = ("model", "dtype", "batch", "metric", "tok_s", "quote")


def repository_root() -> Path:
    """The checkout this package runs from (the notebooks pass ``..`` instead)."""
    return Path(__file__).resolve().parents[2]


def reference_paths(pattern: str, roots: tuple[str | Path, ...] | list[str | Path] = REFERENCE_ROOTS,
                    base: str | Path | None = None) -> list[Path]:
    """Files matching ``pattern`` in any folder below ``roots`` (relative to ``base``, default the
    repository), skipping ``raw`` archives; sorted, each once."""
    base = Path(base) if base is not None else repository_root()
    found: list[Path] = []
    seen: set[Path] = set()
    for root in roots:
        top = base / root
        if not top.is_dir():
            continue
        for p in sorted(top.rglob(pattern)):
            if ARCHIVE in p.relative_to(top).parts[:-1] or p.resolve() in seen:
                continue
            seen.add(p.resolve())
            found.append(p)
    return found


def load_roofline_references(roots: tuple[str | Path, ...] | list[str | Path] = REFERENCE_ROOTS,
                             base: str | Path | None = None) -> list[dict]:
    """Decode sweeps of this engine on other machines (``roofline-*.json``, e.g. the H200 run),
    each with ``_path`` (where it was read); an empty list when there are none."""
    from minillm.bench.sweep_result import load_result
    out = []
    for p in reference_paths("roofline-*.json", roots, base):
        ref = load_result(p)
        ref["_path"] = str(p)
        out.append(ref)
    return out


def check_published(doc: dict) -> list[str]:
    """What a published reference lacks (empty when complete): its source's fields, and for each
    point the fields and a tok/s that appears, as written, in the quoted text."""
    problems = [f"no {k}" for k in PUBLISHED_FIELDS if not doc.get(k)]
    for i, pt in enumerate(doc.get("points") or []):
        problems += [f"point {i}: no {k}" for k in PUBLISHED_POINT_FIELDS if pt.get(k) in (None, "")]
        if pt.get("metric") not in ("per_request", "aggregate"):
            problems.append(f"point {i}: metric is {pt.get('metric')!r}, not per_request or aggregate")
        quote = str(pt.get("quote", "")).replace(",", "")
        for key in ("tok_s", "gb_s"):
            if key in pt and f"{pt[key]:g}" not in quote:
                problems.append(f"point {i}: {key} {pt[key]:g} is not in its quote")
    return problems


def load_published_references(base: str | Path | None = None, folder: str | Path = PUBLISHED_DIR
                              ) -> list[dict]:
    """Published GPU measurements (``folder/*.json``, one per source), each with ``_path``, in
    the shape of :func:`load_roofline_references`; a file that lacks a field is refused by name."""
    import json
    top = (Path(base) if base is not None else repository_root()) / folder
    out = []
    for p in sorted(top.glob("*.json")) if top.is_dir() else []:
        doc = json.loads(p.read_text())
        problems = check_published(doc)
        if problems:
            raise ValueError(f"{p}: " + "; ".join(problems))
        doc["_path"] = str(p)
        out.append(doc)
    return out
