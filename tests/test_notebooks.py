"""Every notebook is committed without outputs and executes in fast mode (design.md §5)."""
import os
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"00_start_here.ipynb", "03_decode_roofline.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: clear the outputs"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    assert any("FAST" in c.source and "MINILLM_FAST" in c.source for c in nb.cells if c.cell_type == "code")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_executes_in_fast_mode(path, tmp_path, monkeypatch):
    from nbclient import NotebookClient
    monkeypatch.setenv("MINILLM_FAST", "1")
    monkeypatch.setenv("MINILLM_FIGURES_DIR", str(tmp_path))     # never touch the committed figures
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
