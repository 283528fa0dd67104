"""The teaching kit around every notebook (docs/notebooks.md): answers to its questions, the
full-mode results a fast-mode learner compares with, and committed figures that exist with their data.

Structure only: nothing here executes a notebook or reads a timing. ``test_notebooks.py`` checks the
order of the closing cells and executes the notebooks.
"""
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
FIGURES = ROOT / "figures"
# a committed figure as a notebook names it: relative to notebooks/, the kernel's working directory
FIGURE_PATH = re.compile(r"\.\./figures/[\w./-]+?\.png")
QUESTION = re.compile(r"^\s*\d+\.\s", re.MULTILINE)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")

# Notebooks other engineers are editing while this file was written; they lack a part checked here.
# Each reason names what is missing. Remove an entry once its notebook has it (xfail is not strict, so
# a notebook that gains the part passes meanwhile).
PENDING: dict[str, dict[str, str]] = {
    "answers": {},
    "expected": {},
    "fast_note": {},
}


def _params(check: str):
    return [pytest.param(p, id=p.stem, marks=pytest.mark.xfail(reason=PENDING[check][p.stem], strict=False))
            if p.stem in PENDING[check] else pytest.param(p, id=p.stem) for p in NOTEBOOKS]


def _first_line(cell) -> str:
    lines = cell.source.strip().splitlines()
    return lines[0].strip() if lines else ""


def _heading(path, cells, text: str) -> int:
    found = [i for i, c in enumerate(cells) if c.cell_type == "markdown" and _first_line(c) == text]
    assert len(found) == 1, f"{path.name}: needs one markdown cell opening with {text!r}, found {len(found)}"
    return found[0]


def _figures_shown(source: str) -> list[str]:
    return FIGURE_PATH.findall(source) if "Image(" in source else []


def test_there_are_notebooks_to_check():
    assert len(NOTEBOOKS) >= 8


@pytest.mark.parametrize("path", _params("answers"))
def test_questions_are_followed_by_their_answers(path):
    """'## Check your understanding' asks numbered questions; right after them (in the same cell or
    the next one) a collapsed <details><summary>Answers</summary> block answers each of them."""
    cells = nbformat.read(path, as_version=4).cells
    i = _heading(path, cells, "## Check your understanding")
    questions, _, rest = cells[i].source.partition("<details>")
    if not rest and i + 1 < len(cells) and cells[i + 1].cell_type == "markdown":
        rest = cells[i + 1].source.strip().removeprefix("<details>") if \
            cells[i + 1].source.strip().startswith("<details>") else ""
    assert rest, f"{path.name}: no <details> answers block right after the questions"
    assert rest.lstrip().startswith("<summary>Answers</summary>"), \
        f"{path.name}: the block opens with <summary>Answers</summary>"
    body, closed, _ = rest.partition("</details>")
    assert closed, f"{path.name}: the answers block is not closed with </details>"
    n_q, n_a = len(QUESTION.findall(questions)), len(QUESTION.findall(body))
    assert n_q >= 3, f"{path.name}: found {n_q} numbered questions"
    assert n_a == n_q, f"{path.name}: {n_q} questions but {n_a} numbered answers"


@pytest.mark.parametrize("path", _params("expected"))
def test_expected_results_come_with_the_committed_figures(path):
    """Before the Summary, '## Expected results' states the full-mode numbers with the date they were
    measured, and the next cell displays committed figures (IPython.display.Image) that exist."""
    cells = nbformat.read(path, as_version=4).cells
    i = _heading(path, cells, "## Expected results")
    assert i < _heading(path, cells, "## Summary"), f"{path.name}: Expected results come before the Summary"
    assert DATE.search(cells[i].source), f"{path.name}: Expected results name the date of their data"
    nxt = cells[i + 1] if i + 1 < len(cells) else None
    assert nxt is not None and nxt.cell_type == "code", \
        f"{path.name}: a code cell right after Expected results shows the figures"
    shown = _figures_shown(nxt.source)
    assert shown, f"{path.name}: the cell after Expected results displays no ../figures/NAME.png with Image"
    missing = [p for p in shown if not (NOTEBOOK_DIR / p).is_file()]
    assert not missing, f"{path.name}: displays figures that are not committed: {missing}"


@pytest.mark.parametrize("path", _params("fast_note"))
def test_the_first_cell_sends_fast_mode_to_the_expected_results(path):
    """Fast mode runs the tiny model: its numbers are not the lesson, and the first cell says where
    the full-mode ones are."""
    first = nbformat.read(path, as_version=4).cells[0].source
    assert "Expected results" in first and "not the lesson" in first, \
        f"{path.name}: the first cell says fast mode's numbers are not the lesson, and where to look"


def test_every_committed_figure_has_its_data():
    pngs = sorted(FIGURES.glob("*.png"))
    assert pngs, "no committed figures found"
    missing = [p.name for p in pngs if not (FIGURES / "data" / f"{p.stem}.json").is_file()]
    assert not missing, f"committed figures without figures/data/<name>.json: {missing}"


def test_every_figure_a_notebook_displays_exists():
    shown = {(path.name, p) for path in NOTEBOOKS for c in nbformat.read(path, as_version=4).cells
             if c.cell_type == "code" for p in _figures_shown(c.source)}
    assert shown, "no notebook displays a committed figure"
    missing = sorted((name, p) for name, p in shown if not (NOTEBOOK_DIR / p).is_file())
    assert not missing, f"notebooks display figures that do not exist: {missing}"


def test_the_figure_pattern_finds_what_it_must():
    """The checks above are only as good as this pattern: it must see a displayed figure, and not a
    figure path in a cell that displays nothing."""
    cell = ('for png in ("../figures/10-6-report.png",\n "../figures/reference/h200/x.png"):\n'
            '    display(Image(png))')
    assert _figures_shown(cell) == ["../figures/10-6-report.png", "../figures/reference/h200/x.png"]
    assert _figures_shown('print("../figures/10-6-report.png")') == []


# ------------------------------------------------------------------ stale texts, fixed and pinned
def _cells(stem: str):
    return nbformat.read(NOTEBOOK_DIR / f"{stem}.ipynb", as_version=4).cells


def test_00_exercise_2_bounds_decode_by_the_read_bandwidth():
    """One decode step reads the weights and writes almost nothing: its bound is the read bandwidth
    (over at least twice the last-level cache), not a copy's, which reads and writes every byte."""
    path, cells = NOTEBOOK_DIR / "00_start_here.ipynb", _cells("00_start_here")
    exercises = cells[_heading(path, cells, "## Exercises")].source
    item = re.search(r"^2\.(.*?)(?=^\d+\.|\Z)", exercises, re.MULTILINE | re.DOTALL)
    assert item, "00's Exercises has no item 2"
    assert re.search(r"\*\*read\*\*\s+bandwidth", item.group(1)) and "decode_read_bytes" in item.group(1), \
        "00's exercise 2 asks for the bound from the read bandwidth over decode_read_bytes"
    (solution,) = [c.source for c in cells if c.cell_type == "code" and _first_line(c) == "# Solution 2"]
    assert "measure_read_bandwidth(" in solution and "decode_read_bytes(" in solution
    assert not re.search(r"bound\s*=\s*bw\.value", solution), \
        "00's solution 2 divides the copy bandwidth (bw, section 2's copy) by the step's bytes"


def test_03_names_the_read_bandwidth_as_the_ceiling_not_a_copy():
    path, cells = NOTEBOOK_DIR / "03_decode_roofline.ipynb", _cells("03_decode_roofline")
    stale = [c.source[:60] for c in cells if c.cell_type == "markdown" and "large copy" in c.source]
    assert not stale, f"03 still describes a large copy as the ceiling: {stale}"
    live = cells[_heading(path, cells, "## The live sweep")].source
    assert re.search(r"\*\*read\*\*\s+bandwidth", live), "03's live sweep names the read bandwidth"
    assert "decode_read_bytes" in live and "last-level cache" in live


def test_04_run_time_agrees_with_the_readme():
    """The README's 'Teaching with it' table: 04 takes 119 s in full mode on the 2-core Xeon VM."""
    first = _cells("04_prefill_vs_decode")[0].source
    assert "119 s" in (ROOT / "README.md").read_text(encoding="utf-8")
    seconds = re.findall(r"(\d+(?:\.\d+)?)\s*(?:s|seconds)\b", first)
    assert set(seconds) <= {"119"}, f"04's introduction states run times the README does not: {seconds}"
    assert "about a minute" not in first and "about 15 seconds" not in first


def test_05_carries_the_chapters_chinese_title():
    head = "\n".join(_cells("05_outside_the_accelerator")[0].source.strip().splitlines()[:3])
    assert "10.5 不只是 GPU 在花时间" in head, "05's first cell: the chapter's 10.5 title"


def test_00_lists_every_notebook():
    others = [p.stem for p in NOTEBOOKS if not p.name.startswith("00_")]
    cells = [c.source for c in _cells("00_start_here") if c.cell_type == "markdown"]
    assert any(all(f"`{stem}`" in src for stem in others) for src in cells), \
        f"00 lists the notebooks in one cell: {others}"


def _code_lines(nb) -> list[str]:
    return [line for c in nb.cells if c.cell_type == "code" for line in c.source.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def _formatting_share(lines: list[str]) -> float:
    """Lines that only format output: a print() call or an f-string."""
    f_string = re.compile(r"(?<![\w'\"])[rR]?[fF][rR]?[\"']")
    fmt = [ln for ln in lines if re.match(r"\s*print\(", ln) or f_string.search(ln)]
    return len(fmt) / len(lines)


def test_the_formatting_share_counts_prints_and_f_strings_only():
    assert _formatting_share(["x = 1", 'print("a")', 'y = f"{x}"', "z = 'f'", "if f'x'", 'rf"{a}"']) == 4 / 6


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_results_format_themselves_so_the_code_is_mostly_the_work(path):
    # LLMs-from-scratch style: a cell ends with a table or a result that displays itself; print and
    # f-string lines stay under a fifth of the code (they were 27–38 % before results formatted themselves)
    lines = _code_lines(nbformat.read(path, as_version=4))
    share = _formatting_share(lines)
    assert share < 0.20, f"{path.name}: {share:.0%} of code lines format output"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_pd_is_pandas_in_every_notebook(path):
    text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
    aliases = re.findall(r"import\s+([\w.]+)\s+as\s+pd\b", text)
    assert all(a == "pandas" for a in aliases), f"{path.name}: pd is {aliases}"
