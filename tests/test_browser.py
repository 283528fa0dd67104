"""The notebooks in a real browser: JupyterLab in headless Chromium, driven by Playwright.

tests/test_notebooks.py executes every notebook with nbclient, which sees the outputs a kernel sends
but not the page a learner reads: a figure that never displays, a widget that does not answer. Here
JupyterLab runs on 127.0.0.1 (a free port, a token) in a temporary copy of ``notebooks/`` and
``figures/`` (a Run All must never save outputs into the committed notebooks), with
``MINILLM_FAST=1`` in its environment, and each notebook of ``BROWSER_NOTEBOOKS`` is opened and run
with Run > Run All Cells, clicked in the menu. Then, in what the page shows:

- **no error**: every code cell ran (a Run All stops at an error, leaving the cells after it without
  a prompt number); no output area shows a traceback or a widget that failed to render; no output in
  the notebook's model is of type ``error``.
- **every promised figure is shown**. The rule: a figure is promised where a code cell's source
  draws one, ``plt.show()`` or ``display(Image(...))``; the markdown that leads to such a cell ("Now
  the figure of this section", "both drawn together") tells the learner to look at it. Each such cell
  must show an ``<img>`` the browser decoded (``naturalWidth > 0``). The cells are found from the
  source, so a figure added to a notebook is checked without editing this file, and a notebook
  checked here must promise at least one.
- **the calculator answers** (03): picking another GPU in its dropdown changes the widget's output
  text to the bounds of that GPU (the kernel runs the callback; nbclient cannot check this).
- **a second Run All in the same kernel keeps every figure** (state left by the first run, such as a
  matplotlib backend switched or a figure closed, must not blank the second).

Full-page screenshots go to ``runs/browser/`` (git ignores ``runs/``). Locally: ``apt-get install
chromium`` (or any Chromium at ``/usr/bin/chromium``), ``pip install playwright`` (its own browser
download is not needed), then ``python -m pytest tests/test_browser.py``. Without them the tests are
skipped, unless ``MINILLM_REQUIRE_BROWSER=1`` (set by ``.ci/run``) makes that a failure.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest

# One JupyterLab and one page for the whole file, in one test process: the second Run All checks the
# kernel the first one left (pyproject.toml runs the suite on two processes, grouped this way).
pytestmark = pytest.mark.xdist_group("browser")

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "runs" / "browser"
CHROMIUM = Path("/usr/bin/chromium")
# The flags without which Chromium's own background connections are refused by a closed network and
# its first-run machinery gets in the way; a fresh --user-data-dir is the persistent context's folder.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
BROWSER_NOTEBOOKS = ("01_request_lifecycle.ipynb", "03_decode_roofline.ipynb")
CALCULATOR_NOTEBOOK = "03_decode_roofline.ipynb"
DRAWS_A_FIGURE = re.compile(r"plt\.show\(\)|display\(\s*Image\(")
WIDGET_FAILED = re.compile(r"Error (displaying|rendering) (widget|output)")     # ipywidgets' own words
RUN_ALL_TIMEOUT_S = 420
SERVER_START_TIMEOUT_S = 90
VIEWPORT = {"width": 1400, "height": 1000}
# JupyterLab's user settings for the copy: every cell stays in the page (the default windowing
# drops cells scrolled out of view from the DOM), and no news or update checks go out.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                         "checkForUpdates": False},
}


# --- browser present, or skipped / failed ----------------------------------------------------------

def browser_missing(chromium: Path = CHROMIUM) -> str | None:
    """Why the browser test cannot run here, or None when it can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install playwright)"
    if not chromium.exists():
        return f"no Chromium at {chromium} (apt-get install chromium)"
    return None


def skip_or_fail(reason: str) -> None:
    """A learner's laptop skips; CI (MINILLM_REQUIRE_BROWSER=1) must not pass without a browser."""
    if os.environ.get("MINILLM_REQUIRE_BROWSER") == "1":
        pytest.fail(f"MINILLM_REQUIRE_BROWSER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def test_a_missing_browser_fails_where_it_is_required(monkeypatch, tmp_path):
    reason = browser_missing(tmp_path / "no-chromium")
    assert reason is not None
    monkeypatch.setenv("MINILLM_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="MINILLM_REQUIRE_BROWSER=1 but"):
        skip_or_fail(reason)
    monkeypatch.delenv("MINILLM_REQUIRE_BROWSER")
    with pytest.raises(pytest.skip.Exception):
        skip_or_fail(reason)


# --- JupyterLab on a copy of the notebooks ---------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_the_notebooks(dest: Path) -> None:
    """notebooks/ and what they read beside it (../figures: the data and reference runs)."""
    ignore = shutil.ignore_patterns(".ipynb_checkpoints")
    for folder in ("notebooks", "figures"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=ignore)


def write_lab_settings(settings_dir: Path) -> None:
    for rel, values in LAB_SETTINGS.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


def lab_command(root: Path, port: int, token: str, settings: Path, workspaces: Path) -> list[str]:
    return [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
            f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={workspaces}",
            "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
            "--LabApp.expose_app_in_browser=True"]    # window.jupyterapp: the notebook's model, for errors


def wait_until_serving(proc: subprocess.Popen, base: str, token: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"JupyterLab exited with {proc.returncode}:\n{log.read_text()[-3000:]}",
                        pytrace=False)
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    pytest.fail(f"JupyterLab did not answer in {SERVER_START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}",
                pytrace=False)


def stop_lab(proc: subprocess.Popen, base: str, token: str) -> None:
    """POST /api/shutdown stops the kernels first (and with them the servers notebook 01 started)."""
    try:
        req = urllib.request.Request(f"{base}/api/shutdown", method="POST",
                                     headers={"Authorization": f"token {token}"})
        urllib.request.urlopen(req, timeout=10).close()
        proc.wait(timeout=30)
    except (urllib.error.URLError, ConnectionError, TimeoutError, subprocess.TimeoutExpired):
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Lab:
    def __init__(self, base: str, token: str, root: Path):
        self.base, self.token, self.root = base, token, root

    def url(self, notebook: str) -> str:
        # a workspace of its own, reset: the page holds this notebook alone, whatever was open before
        workspace = Path(notebook).stem
        return f"{self.base}/lab/workspaces/{workspace}/tree/notebooks/{notebook}?reset&token={self.token}"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    reason = browser_missing()
    if reason:
        skip_or_fail(reason)
    root = tmp_path_factory.mktemp("lab")
    copy_the_notebooks(root)
    write_lab_settings(root / ".lab" / "settings")
    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ, MINILLM_FAST="1", MINILLM_FIGURES_DIR=str(root / "fast-figures"),
               JUPYTER_CONFIG_DIR=str(root / ".lab" / "config"))     # none of this user's Jupyter config
    log = root / ".lab" / "lab.log"
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(lab_command(root, port, token, root / ".lab" / "settings",
                                            root / ".lab" / "workspaces"),
                                cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_serving(proc, base, token, log)
        yield Lab(base, token, root)
    finally:
        stop_lab(proc, base, token)
        SHOTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(log, SHOTS / "jupyterlab.log")      # beside the screenshots, for a failed CI run


@pytest.fixture(scope="module")
def browser(lab, tmp_path_factory):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM),
            args=CHROMIUM_ARGS, headless=True, viewport=VIEWPORT)
        try:
            yield context
        finally:
            context.close()


# --- the page: running, waiting, reading -----------------------------------------------------------

KERNEL_READY_JS = """() => {
    const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const session = panel && panel.sessionContext;
    const kernel = session && session.session && session.session.kernel;
    return !!kernel && session.isReady && kernel.connectionStatus === 'connected' && kernel.status === 'idle';
}"""

# Prompt numbers of the code cells, in order: None for a cell that has not run ("[ ]:"), 0 while
# queued or running ("[*]:").
PROMPTS_JS = """() => Array.from(document.querySelectorAll('.jp-Notebook .jp-Cell.jp-CodeCell')).map(c => {
    const t = (c.querySelector('.jp-InputPrompt') || {textContent: ''}).textContent;
    if (t.includes('*')) return 0;
    const m = t.match(/\\[(\\d+)\\]/);
    return m ? Number(m[1]) : null;
})"""

ALL_RAN_AFTER_JS = """(before) => {
    const indicator = document.querySelector('.jp-Notebook-ExecutionIndicator');
    const prompts = (%s)();
    return indicator && indicator.dataset.status === 'idle' && prompts.length > 0
        && prompts.every(n => n !== null && n > before);
}""" % PROMPTS_JS

# Some code cell queued, running or numbered anew: the Run All has started.
STARTED_AFTER_JS = """(before) => (%s)().some(n => n === 0 || n > before)""" % PROMPTS_JS

# A Run All that an error stopped: the kernel idle, nothing queued, some cell not numbered again.
STOPPED_AFTER_JS = """(before) => {
    const indicator = document.querySelector('.jp-Notebook-ExecutionIndicator');
    const prompts = (%s)();
    return indicator && indicator.dataset.status === 'idle' && !prompts.includes(0)
        && prompts.some(n => n === null || n <= before);
}""" % PROMPTS_JS

# What each cell shows: its kind and, for code cells, the text of its output areas and its images
# (decoded or not).
CELLS_JS = """() => Array.from(document.querySelectorAll('.jp-Notebook .jp-Cell')).map(c => ({
    code: c.classList.contains('jp-CodeCell'),
    outputs: Array.from(c.querySelectorAll('.jp-OutputArea-output')).map(o => ({
        mime: o.dataset.mimeType || '', text: o.innerText})),
    images: Array.from(c.querySelectorAll('.jp-OutputArea-output img'))
        .map(i => i.complete && i.naturalWidth > 0),
}))"""

# Outputs of type "error" in the notebook's model (the page shows them as stderr text).
MODEL_ERRORS_JS = """() => {
    const model = window.jupyterapp.shell.currentWidget.content.model;
    const errors = [];
    for (let i = 0; i < model.cells.length; i++) {
        const cell = model.cells.get(i);
        if (cell.type !== 'code') continue;
        for (let j = 0; j < cell.outputs.length; j++) {
            const o = cell.outputs.get(j).toJSON();
            if (o.output_type === 'error') errors.push([i, o.ename + ': ' + o.evalue]);
        }
    }
    return errors;
}"""


def open_notebook(context, lab: Lab, notebook: str):
    """Open the notebook and wait for its kernel. The status bar says "Idle" before the session
    settles (the kernel can still be swapped for another, and a Run All clicked then is lost), so
    this waits for the session's own kernel, connected and idle, twice a second apart."""
    page = context.new_page()
    page.goto(lab.url(notebook))
    for _ in range(2):
        page.wait_for_function(KERNEL_READY_JS, timeout=120_000, polling=250)
        fail_on_dialog(page)
        page.wait_for_timeout(1000)
    page.wait_for_function(KERNEL_READY_JS, timeout=120_000, polling=250)
    assert page.locator(".jp-NotebookPanel").count() == 1, "one notebook per page"
    return page


def fail_on_dialog(page) -> None:
    dialog = page.locator(".jp-Dialog")
    if dialog.count():
        pytest.fail(f"JupyterLab opened a dialog: {dialog.first.inner_text()[:500]}", pytrace=False)


def run_all_cells(page) -> None:
    """Run > Run All Cells, clicked as a learner would, then wait until every code cell has a new
    prompt number and the kernel is idle."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    before = max((n or 0) for n in page.evaluate(PROMPTS_JS))
    fail_on_dialog(page)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    try:      # a click that started nothing should say so now, not after the whole timeout
        page.wait_for_function(STARTED_AFTER_JS, arg=before, timeout=60_000, polling=250)
    except PlaywrightTimeout:
        fail_on_dialog(page)
        pytest.fail("Run > Run All Cells started no cell within 60 s", pytrace=False)
    try:
        page.wait_for_function(ALL_RAN_AFTER_JS, arg=before, timeout=RUN_ALL_TIMEOUT_S * 1000, polling=500)
    except PlaywrightTimeout:
        fail_on_dialog(page)
        stopped = page.evaluate(STOPPED_AFTER_JS, before)
        if not stopped:    # still running, or never went idle: nothing stopped it
            raise
        # an error stops a Run All, leaving later cells unnumbered: the assertions below name it
    page.wait_for_timeout(500)          # let the last outputs and images render


def save_full_page(page, name: str) -> Path:
    """The notebook scrolls inside the page, so a full-page screenshot first makes the window as
    tall as the notebook and scrolls it to the top."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    height = page.evaluate("() => document.querySelector('.jp-WindowedPanel-outer').scrollHeight")
    page.set_viewport_size({"width": VIEWPORT["width"], "height": min(height + 200, 30_000)})
    page.evaluate("() => { document.querySelector('.jp-WindowedPanel-outer').scrollTop = 0; }")
    page.wait_for_timeout(500)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    page.set_viewport_size(VIEWPORT)
    return path


def shown_errors(page) -> list[str]:
    """Errors as the learner sees them, and as the notebook's model records them."""
    found = []
    prompts = page.evaluate(PROMPTS_JS)
    never = sum(1 for n in prompts if not n)
    if never:
        found.append(f"{never} of {len(prompts)} code cells never ran (a Run All stops at an error)")
    for i, cell in enumerate(page.evaluate(CELLS_JS)):
        for out in cell["outputs"]:
            if "Traceback" in out["text"] or WIDGET_FAILED.search(out["text"]):
                found.append(f"cell {i} shows: {out['text'][:600]}")
    found += [f"cell {i} has an error output: {what}" for i, what in page.evaluate(MODEL_ERRORS_JS)]
    return found


def promised_figures(path: Path) -> dict[int, str]:
    """Cells that draw a figure (index → the first line of the markdown above it)."""
    cells = nbformat.read(path, as_version=4).cells
    promised = {}
    for i, cell in enumerate(cells):
        if cell.cell_type == "code" and DRAWS_A_FIGURE.search(cell.source):
            lead = next((c.source.strip().splitlines()[0] for c in reversed(cells[:i])
                         if c.cell_type == "markdown" and c.source.strip()), "")
            promised[i] = lead
    return promised


def missing_figures(page, path: Path) -> list[str]:
    cells = page.evaluate(CELLS_JS)
    return [f"cell {i} (below the markdown '{lead}') shows no image: outputs "
            f"{[o['mime'] or 'widget' for o in cells[i]['outputs']]}, images decoded {cells[i]['images']}"
            for i, lead in promised_figures(path).items() if not any(cells[i]["images"])]


# --- the tests -------------------------------------------------------------------------------------

class Opened:
    """Each notebook opened once and run once; the tests below read the same page in turn."""

    def __init__(self, context, lab: Lab):
        self.context, self.lab, self.pages = context, lab, {}

    def source(self, notebook: str) -> Path:
        """The copy JupyterLab runs (the committed one may be edited meanwhile)."""
        return self.lab.root / "notebooks" / notebook

    def after_run_all(self, notebook: str):
        if notebook not in self.pages:
            page = open_notebook(self.context, self.lab, notebook)
            self.pages[notebook] = page
            try:
                run_all_cells(page)
            finally:                  # what the page showed, also when the run failed
                save_full_page(page, f"{Path(notebook).stem}-run-all")
        return self.pages[notebook]


@pytest.fixture(scope="module")
def opened(browser, lab):
    return Opened(browser, lab)


@pytest.mark.parametrize("notebook", BROWSER_NOTEBOOKS)
def test_run_all_shows_no_error(opened, notebook):
    errors = shown_errors(opened.after_run_all(notebook))
    assert not errors, f"{notebook} after Run All Cells:\n" + "\n".join(errors)


@pytest.mark.parametrize("notebook", BROWSER_NOTEBOOKS)
def test_every_promised_figure_is_shown(opened, notebook):
    assert promised_figures(opened.source(notebook)), \
        f"{notebook} draws no figure: the rule above finds no cell to check"
    missing = missing_figures(opened.after_run_all(notebook), opened.source(notebook))
    assert not missing, f"{notebook} after Run All Cells:\n" + "\n".join(missing)


def calculator_cell(page, path: Path):
    cells = nbformat.read(path, as_version=4).cells
    index = next(i for i, c in enumerate(cells) if "calculator_widget(" in c.source and c.cell_type == "code")
    return page.locator(".jp-Notebook .jp-Cell").nth(index)


def plain(text: str) -> str:
    """ipywidgets writes the dropdown's labels with no-break spaces."""
    return text.replace("\xa0", " ").strip()


def test_the_calculator_answers_another_gpu(opened):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    page = opened.after_run_all(CALCULATOR_NOTEBOOK)
    cell = calculator_cell(page, opened.source(CALCULATOR_NOTEBOOK))
    gpu = cell.locator(".widget-dropdown", has_text="GPU").locator("select")
    result = cell.locator(".widget-output")
    assert gpu.count() == 1 and result.count() == 1, "the calculator widget is not shown"
    before = plain(result.inner_text())
    current = plain(gpu.evaluate("s => s.options[s.selectedIndex].textContent"))
    assert f"on {current}" in before, f"the calculator starts on {current}, its output says:\n{before}"
    labels = gpu.locator("option").all_inner_texts()
    other = next(label for label in labels if "H100" in label and plain(label) != current)
    gpu.select_option(label=other)
    wanted = f"on {plain(other)}"
    try:
        page.wait_for_function("([el, text]) => el.innerText.replace(/\\u00a0/g, ' ').includes(text)",
                               arg=[result.element_handle(), wanted], timeout=30_000)
    except PlaywrightTimeout:
        pass                           # the assertion below shows what the widget says instead
    finally:
        save_full_page(page, f"{Path(CALCULATOR_NOTEBOOK).stem}-calculator")
    after = plain(result.inner_text())
    assert wanted in after and f"on {current}" not in after, \
        f"the calculator's output did not follow the GPU picked, {plain(other)}; it says:\n{after}"


@pytest.mark.parametrize("notebook", BROWSER_NOTEBOOKS)
def test_a_second_run_all_keeps_every_figure(opened, notebook):
    page = opened.after_run_all(notebook)
    try:
        run_all_cells(page)
    finally:
        save_full_page(page, f"{Path(notebook).stem}-second-run-all")
    problems = shown_errors(page) + missing_figures(page, opened.source(notebook))
    assert not problems, \
        f"{notebook} after a second Run All Cells in the same kernel:\n" + "\n".join(problems)
