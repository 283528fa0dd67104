"""The busy-machine check (minillm.hardware.quiet, design.md §9): the load before measuring, noisy
rows after, and the cores − 1 torch threads a CPU measurement uses. Constructed numbers only."""
import pytest

from minillm.hardware import quiet as busy


def test_load_check_fires_above_the_threshold_and_not_below():
    quiet = busy.machine_busy(load1=0.4, cores=2)
    assert not quiet and quiet.warning is None and "quiet" in quiet.line()
    loaded = busy.machine_busy(load1=1.8, cores=2)
    assert loaded and loaded.busy
    assert "busy" in loaded.warning and "1.80" in loaded.warning and "2 cores" in loaded.warning
    assert loaded.line() == loaded.warning
    assert not busy.machine_busy(load1=1.8, cores=2, threshold=1.0)          # the threshold is a parameter


def test_load_check_without_a_load_average_says_so():
    check = busy.LoadCheck(None, 4)
    assert not check and check.warning is None and "not available" in check.line()


def test_spread_is_p90_over_p10_and_needs_two_positive_samples():
    assert busy.spread([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert busy.spread([1.0, 2.0]) == pytest.approx(1.9 / 1.1)
    assert busy.spread([1.0]) is None and busy.spread([]) is None
    assert busy.spread([0.0, 0.0, 0.0, 1.0]) is None             # p10 of 0: no ratio
    assert busy.spread([1.0, float("nan"), 1.0]) == pytest.approx(1.0)


def test_noisy_rows_names_only_the_rows_that_spread():
    rows = {1: [10.0, 10.2, 9.9, 10.1], 4: [10.0, 31.0, 10.0, 55.0, 10.0], 16: [20.0, 20.5, 19.8]}
    bad = busy.noisy_rows(rows)
    assert list(bad) == [4] and bad[4] > busy.NOISY_SPREAD
    assert busy.noisy_rows(rows, rel_spread=100) == {}


def test_the_warning_fires_on_a_constructed_noisy_result(capsys):
    # a sweep-like result on a busy machine: batch 2's steps spread ×4, the others are steady
    result = {"batches": [{"batch": 1, "status": "ok", "forward_ms": [17.0, 17.1, 16.9, 17.2]},
                          {"batch": 2, "status": "ok", "forward_ms": [18.0, 72.0, 19.0, 70.0, 18.5]},
                          {"batch": 4, "status": "oom"}]}
    from minillm.bench.sweep_result import noisy_batches
    assert list(noisy_batches(result)) == [2]
    samples = {f"batch {b['batch']}": b["forward_ms"] for b in result["batches"] if b["status"] == "ok"}
    msgs = busy.warnings_for(busy.machine_busy(load1=3.0, cores=2), samples)
    assert len(msgs) == 2 and "busy" in msgs[0] and "batch 2" in msgs[1] and "batch 1" not in msgs[1]
    busy.report(busy.machine_busy(load1=3.0, cores=2), samples, quiet_line="quiet")
    out = capsys.readouterr().out
    assert out.count("WARNING:") == 2 and "!!!!" in out and "quiet" not in out
    busy.report(busy.machine_busy(load1=0.1, cores=2), {"batch 1": samples["batch 1"]},
                quiet_line="all quiet")
    assert capsys.readouterr().out.strip() == "all quiet"


def test_measurement_threads_are_the_servers_cores_minus_one():
    from minillm.core.device import cpu_cores, default_server_threads
    n = busy.measurement_threads("cpu", apply=False)
    assert n == default_server_threads("cpu") == max(1, cpu_cores() - 1)


def test_measurement_threads_apply_sets_torch(monkeypatch):
    import torch
    before = torch.get_num_threads()
    try:
        n = busy.measurement_threads("cpu")
        assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)


def test_one_spread_test_for_rows_and_summaries():
    """A row flagged from its samples (noisy_rows) is flagged from its p10/p90 too (too_wide)."""
    import numpy as np

    from minillm.experiments import outside_steps
    rows = {"steady": [1.0, 1.02, 0.99, 1.01, 1.0], "jumpy": [1.0, 1.0, 5.0, 1.0, 9.0],
            "edge": [1.0, 1.0, 1.3, 1.4]}
    flagged = busy.noisy_rows(rows)
    for key, xs in rows.items():
        p10, p90 = np.percentile(xs, [10, 90])
        assert busy.too_wide(p10, p90) == (key in flagged)
    assert not busy.too_wide(None, 2.0) and not busy.too_wide(0.0, 2.0)
    w = outside_steps.phase_noise_warning({"steady": [1.0] * 5, "jumpy": [1.0, 1.0, 5.0, 1.0, 9.0]})
    assert w.startswith("WARNING") and "jumpy" in w and "steady" not in w
