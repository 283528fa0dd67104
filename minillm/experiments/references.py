"""Reference runs shipped with the project (``figures/reference/``) and where to find them.

A reference run is real data from a machine a learner may not have (the H200 run in
``figures/reference/h200/``, a lecturer's own GPU run in ``runs/reference/``), drawn beside the
learner's own points and always labelled with its provenance. Each kind of result is found by its
file name, in any folder below a reference root:

- ``roofline-*.json``: decode sweeps (``python -m minillm roofline``), notebooks 03 and 07;
- ``prefill-decode-*.json``: 10.4's runs (``python -m minillm prefill-decode``), 04 and 07;
- ``outside-*.json``: 10.5's runs (``python -m minillm outside-reference``), 05.

A folder named ``raw`` holds a run's whole bundle for the record (its logs, every file it wrote,
runs of earlier code): it is read by people, never drawn.
"""
from __future__ import annotations

from pathlib import Path

REFERENCE_ROOTS = ("figures/reference", "runs/reference")
ARCHIVE = "raw"


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
