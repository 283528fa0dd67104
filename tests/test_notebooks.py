"""Every notebook is committed without outputs and executes in fast mode (design.md §5).

Parametrized over whatever ``notebooks/*.ipynb`` holds, so a new notebook is checked without
editing this file. Execution: ``MINILLM_FAST=1`` in the kernel's environment (set here, inherited
by the kernel process), the kernel's cwd ``notebooks/``, and ``MINILLM_FIGURES_DIR`` pointed at a
temporary folder as a second guard (the notebooks set it themselves in fast mode) so a test run
never overwrites the committed figures.
"""
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
FIGURES = ROOT / "figures"
CELL_TIMEOUT_S = 300


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"00_start_here.ipynb", "03_decode_roofline.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i}: clear the outputs before committing"
            assert cell.execution_count is None, f"{path.name} cell {i}: execution_count must be None"
    assert "widgets" not in nb.metadata, f"{path.name}: saved widget state is an output too"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_first_cell_names_the_section_and_there_is_a_fast_flag(path):
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0]
    assert first.cell_type == "markdown", f"{path.name}: the first cell must be markdown"
    heading = first.source.lstrip().splitlines()[0]
    assert heading.startswith("# "), f"{path.name}: the first cell must open with a '# ' heading"
    if not path.name.startswith("00_"):                       # 00 is the series' introduction
        assert re.search(r"\b10\.\d+\b", first.source), f"{path.name}: name the section (10.x) first"
    assert re.search(r"[\u4e00-\u9fff]", first.source), f"{path.name}: give the chapter's Chinese heading too"
    assert any('os.environ.get("MINILLM_FAST") == "1"' in c.source for c in nb.cells if c.cell_type == "code"), \
        f"{path.name}: needs the parameters cell FAST = os.environ.get(\"MINILLM_FAST\") == \"1\""


def _snapshot(folder: Path) -> dict:
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*") if p.is_file()} \
        if folder.exists() else {}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_executes_in_fast_mode(path, tmp_path, monkeypatch):
    from nbclient import NotebookClient
    monkeypatch.setenv("MINILLM_FAST", "1")
    monkeypatch.setenv("MINILLM_FIGURES_DIR", str(tmp_path / "figures"))
    before = _snapshot(FIGURES)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()   # raises on an error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"
    assert _snapshot(FIGURES) == before, f"{path.name} wrote into figures/ in fast mode"
