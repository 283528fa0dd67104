"""What the notebooks teach, checked where it can be checked without running them: the GPU of the
worked example chosen by its exact spec name, figures written where they should be, the burst drawn
in the order the server received it, and the load of notebook 02 set from a measured service rate."""
import re
import types
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MS = 1_000_000


def _code(path: Path) -> str:
    nb = nbformat.read(path, as_version=4)
    return "\n".join(c.source for c in nb.cells if c.cell_type == "code")


# ----------------------------------------------------------------------------- the H200 of 10.3
def test_no_notebook_picks_a_gpu_spec_by_a_name_prefix():
    # "H200" matches the NVL card first in the spec table (B* ≈ 174), the calculator means the SXM (≈ 206)
    for path in NOTEBOOKS:
        code = _code(path)
        assert not re.search(r"startswith\(\s*[\"']H\d", code), \
            f"{path.name}: select a GPU by its exact spec name"
        assert "GPU_SPECS if" not in code, \
            f"{path.name}: select a GPU by its exact spec name (calculator.gpu_spec)"


def test_notebook_03_selects_the_h200_sxm():
    import minillm.perf.roofline as rf
    from minillm.model.config import PRESETS
    from minillm.perf.calculator import bounds, gpu_spec
    code = _code(ROOT / "notebooks" / "03_decode_roofline.ipynb")
    lines = [ln for ln in code.splitlines() if re.match(r"(SPEC_GPU|h200)\s*=", ln)]
    assert len(lines) == 2, lines
    ns: dict = {"gpu_spec": gpu_spec}
    for ln in lines:                       # the notebook's own selection, run as it is written
        exec(ln, ns)  # noqa: S102  (one assignment line of the notebook, checked above)
    h200 = ns["h200"]
    assert h200.name == "H200 SXM 141GB"
    bstar = rf.crossover_batch(PRESETS["llama-3.1-8b"], 2, h200.bandwidth, h200.flops["bf16"], 0)
    assert bstar == pytest.approx(bounds("H200 SXM 141GB", "llama-3.1-8b").crossover)
    assert 200 < bstar < 210                                         # and not the NVL's
    nvl = gpu_spec("H200 NVL 141GB")
    assert rf.crossover_batch(PRESETS["llama-3.1-8b"], 2, nvl.bandwidth, nvl.flops["bf16"], 0) < 180
    assert "bounds(SPEC_GPU" in code                                 # the calculator cell uses the same card


def test_notebook_04_selects_the_h200_sxm():
    from minillm.perf.calculator import gpu_spec
    code = _code(ROOT / "notebooks" / "04_prefill_vs_decode.ipynb")
    (line,) = [ln for ln in code.splitlines() if re.match(r"h200\s*=", ln)]
    ns: dict = {"gpu_spec": gpu_spec}
    exec(line, ns)  # noqa: S102  (the notebook's own assignment line)
    assert ns["h200"].name == "H200 SXM 141GB"


# ----------------------------------------------------------------------------- where figures go
def test_figures_default_to_runs_figures_under_the_working_directory(tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import minillm
    from minillm.plots.figures import figures_dir, save_figure
    monkeypatch.delenv("MINILLM_FIGURES_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    d = figures_dir()
    assert d.resolve() == (tmp_path / "runs" / "figures").resolve()
    assert Path(minillm.__file__).resolve().parent not in d.resolve().parents
    fig, _ = plt.subplots()
    paths = save_figure(fig, "10-0-test", "stamp", data={"x": 1})
    plt.close(fig)
    assert all(p.resolve().parent == (tmp_path / "runs" / "figures").resolve() for p in paths)
    assert (tmp_path / "runs" / "figures" / "data" / "10-0-test.json").exists()
    assert not (tmp_path / "figures").exists()
    # an explicit folder (a command's --figures figures/) and the environment still win
    assert figures_dir("figures").resolve() == (tmp_path / "figures").resolve()
    monkeypatch.setenv("MINILLM_FIGURES_DIR", str(tmp_path / "elsewhere"))
    assert figures_dir().resolve() == (tmp_path / "elsewhere").resolve()


def test_notebook_figures_dir_publishes_only_when_asked(tmp_path, monkeypatch):
    import os

    from minillm.plots.figures import notebook_figures_dir
    monkeypatch.delenv("MINILLM_FIGURES_DIR", raising=False)
    nbdir = tmp_path / "notebooks"
    nbdir.mkdir()
    assert notebook_figures_dir(cwd=nbdir) == tmp_path / "runs" / "figures"
    assert os.environ["MINILLM_FIGURES_DIR"] == str(tmp_path / "runs" / "figures")
    assert notebook_figures_dir(publish=True, cwd=nbdir) == tmp_path / "figures"
    # a kernel that published, then runs again without PUBLISH, goes back to runs/figures
    assert notebook_figures_dir(cwd=nbdir) == tmp_path / "runs" / "figures"
    # fast mode never writes the committed figures, PUBLISH or not
    fast = notebook_figures_dir(publish=True, fast=True, cwd=nbdir)
    assert tmp_path not in fast.parents and fast.exists()
    assert os.environ["MINILLM_FIGURES_DIR"] == str(fast)


def test_every_figure_writing_notebook_has_a_publish_switch():
    for path in NOTEBOOKS:
        code = _code(path)
        if "save_" in code:
            assert re.search(r"^PUBLISH = False", code,
                             re.MULTILINE), f"{path.name}: PUBLISH = False in the parameters cell"
            assert "notebook_figures_dir(PUBLISH, FAST)" in code, path.name


def test_every_measuring_notebook_checks_the_machine_and_leaves_a_core_free():
    for path in NOTEBOOKS:
        code = _code(path)
        if path.name.startswith(("06_", "07_")):          # written by others, with their own checks
            continue
        assert "busy.machine_busy()" in code, f"{path.name}: check the load before measuring"
        assert ("measurement_threads" in code or "default_server_threads" in code), \
            f"{path.name}: cores − 1 torch threads on a CPU, as `serve` does"


# ----------------------------------------------------------------------------- figure 10-1b's order
def _server_trace(rid, received_ms, body_ms, scheduled_ms):
    from minillm.core.trace import Trace
    tr = Trace(rid)
    tr.record("received", t_ns=received_ms * MS)
    tr.record("authenticated", t_ns=received_ms * MS + 1000)
    tr.record("body_read", t_ns=body_ms * MS)
    tr.record("tokenized", t_ns=body_ms * MS + 1000)
    tr.record("scheduled", t_ns=scheduled_ms * MS)
    tr.record("token", t_ns=(scheduled_ms + 5) * MS, index=0, token_id=7)
    tr.record("finished", t_ns=(scheduled_ms + 5) * MS, reason="length")
    return tr


def test_the_burst_is_drawn_in_the_order_bodies_were_received():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minillm.core.trace import Trace
    from minillm.plots import lifecycle as PL
    # "early" connected first but its body came last: the server could only queue it last
    early = _server_trace("early", 0, 30, 40)
    mid = _server_trace("mid", 5, 6, 7)
    late = _server_trace("late", 10, 11, 12)
    assert [t.request_id for t in PL.arrival_order([early, mid, late])] == ["mid", "late", "early"]
    assert PL.arrival_ns(early) == 30 * MS
    inproc = Trace("in-process")                   # no HTTP: no body_read, ordered by received
    inproc.record("received", t_ns=20 * MS)
    inproc.record("token", t_ns=21 * MS, index=0, token_id=1)
    assert PL.arrival_ns(inproc) == 20 * MS
    assert [t.request_id for t in PL.arrival_order([early, inproc, mid])] == ["mid", "in-process", "early"]
    fig, ax = plt.subplots()
    PL.plot_concurrent_timeline([early, mid, late], ax)
    assert "body received" in ax.get_ylabel()
    plt.close(fig)


# ----------------------------------------------------------------------------- notebook 02's load
def _fake_run(arrivals_ms, ttft_ms, e2e_ms):
    from minillm.core.trace import Trace
    from minillm.metrics.definitions import metrics_from_traces
    traces = []
    for k, (a, f, e) in enumerate(zip(arrivals_ms, ttft_ms, e2e_ms)):
        tr = Trace(f"r{k}")
        tr.record("received", t_ns=round(a * MS))
        tr.record("token", t_ns=round((a + f) * MS), index=0, token_id=7)
        tr.record("token", t_ns=round((a + e) * MS), index=1, token_id=7)
        tr.record("finished", t_ns=round((a + e) * MS), reason="length")
        traces.append(tr)
    return types.SimpleNamespace(arrivals_s=[a / 1e3 for a in arrivals_ms],
                                 metrics=metrics_from_traces(traces))


def test_rate_check_sees_a_run_that_keeps_up():
    from minillm.loadgen.service_rate import rate_check
    n = 30
    run = _fake_run([100.0 * k for k in range(n)], [5.0] * n, [50.0] * n)       # 10 req/s, each done in 50 ms
    chk = rate_check(run, offered_rps=10.0)
    assert chk.arrived_rps == pytest.approx(10.0) and chk.achieved_rps == pytest.approx(10.0)
    assert chk.kept_up and "kept up" in chk.line() and chk.ttft_growth == pytest.approx(1.0)


def test_rate_check_sees_an_overloaded_run():
    from minillm.loadgen.service_rate import rate_check
    n = 30
    arrivals = [10.0 * k for k in range(n)]                   # 100 req/s offered
    done = [100.0 * (k + 1) for k in range(n)]                # the engine finishes 10 req/s
    run = _fake_run(arrivals, [d - a - 40 for a, d in zip(arrivals, done)],
                    [d - a for a, d in zip(arrivals, done)])
    chk = rate_check(run, offered_rps=100.0)
    assert chk.achieved_rps == pytest.approx(10.0) and not chk.kept_up
    assert chk.ttft_growth > 3 and "did NOT keep up" in chk.line()


def test_closed_loop_keeps_its_concurrency_and_measures_a_service_rate(tiny_llm):
    from minillm.loadgen.service_rate import measure_service_rate
    from minillm.loadgen.workload import LengthDist, make_requests, run_closed_loop
    reqs = make_requests(6, LengthDist.fixed(8), LengthDist.fixed(3),
                         vocab_size=tiny_llm.engine.config.vocab_size,
                         prefix="cl")
    res = run_closed_loop(tiny_llm, reqs, concurrency=2)
    assert [o.request_id for o in res.outputs] == [r.request_id for r in reqs]
    spans = [(o.trace.first("received").t_ns, o.trace.last("finished").t_ns) for o in res.outputs]
    for t, _ in spans:                                        # never more than 2 in flight when one is sent
        assert sum(a <= t < b for a, b in spans) <= 2
    assert not tiny_llm.engine.has_unfinished()
    sr = measure_service_rate(tiny_llm, LengthDist.fixed(8), LengthDist.fixed(3), concurrency=4, repeats=2)
    assert len(sr.samples_rps) == 2 and sr.rps > 0 and sr.n_requests == 8 and "median" in sr.line()
    with pytest.raises(ValueError):
        run_closed_loop(tiny_llm, reqs, concurrency=0)
