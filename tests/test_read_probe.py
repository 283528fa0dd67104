"""The memory read speed sampled again during a run (hardware/read_probe.py): the drift arithmetic on
hand-made samples, the probe on this CPU, and a sweep that carries its samples."""
import pytest
import torch

from minillm.bench.sweep_result import BatchResult, SweepResult, read_moved
from minillm.hardware.read_probe import DRIFT, ReadDrift, ReadProbe


def test_drift_arithmetic_by_hand():
    d = ReadDrift((30e9, 45e9, 31e9), bound=40e9)
    assert d.low == 30e9 and d.high == 45e9
    assert d.ratio == pytest.approx(1.5)
    assert d.moved                                   # 1.5 > DRIFT
    assert "30.0–45.0 GB/s over 3 samples" in d.line() and "MOVED" in d.line() and "40.0 GB/s" in d.line()
    steady = ReadDrift((40e9, 41e9, 42e9))
    assert steady.ratio == pytest.approx(1.05) and not steady.moved
    assert "steady" in steady.line()
    empty = ReadDrift(())
    assert empty.ratio is None and not empty.moved and "not sampled" in empty.line()
    assert d.to_dict()["samples"] == [30e9, 45e9, 31e9] and d.to_dict()["moved"] is True


def test_probe_reads_on_a_cpu_and_only_there():
    p = ReadProbe("cpu", 8 * 2**20, passes=2)
    assert p.active
    a, b = p.sample(), p.sample()
    assert a > 0 and b > 0 and p.samples == [a, b]
    assert p.drift(1e9).samples == (a, b)
    p.close()
    assert p.sample() is None and not p.active
    if torch.cuda.is_available():
        assert not ReadProbe("cuda", 8 * 2**20).active


def test_a_row_is_flagged_only_against_a_measured_read_bound():
    read = {"bandwidth": 40e9, "bandwidth_kind": "read"}
    assert not read_moved([39e9, 41e9], read)
    assert read_moved([30e9, 31e9], read)                      # 40 / 30.5 > DRIFT
    assert read_moved([50e9, 51e9], read)                      # faster counts too
    assert not read_moved([30e9], {"bandwidth": 40e9, "source": "spec"})
    assert not read_moved([], read)
    assert 40 / 30.5 > DRIFT


def _result(now: list[float], drift: dict) -> SweepResult:
    b = BatchResult(1, "ok", 8, forward_ms=[1.0], engine_ms=[1.1], forward_ms_median=1.0,
                    engine_ms_median=1.1,
                    forward_ms_p10=1.0, forward_ms_p90=1.0, per_request_tok_s=1000.0, aggregate_tok_s=1000.0,
                    mbu=0.5, mfu=0.01, pct_of_bound=0.5, read_bw_now=now)
    return SweepResult(model="tiny", dtype="fp32", device="cpu", hardware={}, host="h", torch_version="t",
                       python="p", command="test",
                       context=8, warmup=1, steps=1, cuda_graphs=False,
                       ceilings={"bandwidth": 40e9, "bandwidth_kind": "read", "peak_flops": 1e11},
                       model_bytes=1, config={}, predicted_crossover=1.0, predicted_crossover_kv=1.0,
                       measured_knee=None, batches=[b], read_drift=drift)


def test_the_table_says_when_the_memory_moved_under_a_row():
    moved = _result([25e9, 27e9], ReadDrift((25e9, 27e9), 40e9).to_dict()).table()
    assert " †" in moved and "† the memory read at 26.0 GB/s, not the bound's 40.0" in moved
    steady = _result([40e9, 41e9], ReadDrift((40e9, 41e9), 40e9).to_dict()).table()
    assert "†" not in steady and "steady within" in steady


def test_sweep_samples_the_read_speed_around_every_row():
    from minillm.bench.sweep import run_sweep
    res = run_sweep(model="tiny", device="cpu", batches=[1, 2], steps=1, warmup=1, served=False,
                    copy_bytes=8 * 2**20, matmul_n=128, progress=False)
    assert all(len(b.read_bw_now) == 2 and min(b.read_bw_now) > 0 for b in res.batches)
    # one sample between two rows serves both: before batch 1, between 1 and 2, after 2
    assert len(res.read_drift["samples"]) == 3
    assert res.batches[0].read_bw_now[1] == res.batches[1].read_bw_now[0] == res.read_drift["samples"][1]
    assert res.read_drift["bound"] == res.ceilings["bandwidth"]
    assert res.to_dict()["read_drift"]["ratio"] >= 1.0
    at = res.to_dict()["crossover_at_reads"]        # B* at the slowest and fastest of those samples
    assert at["slowest"]["read"] == res.read_drift["low"] and at["fastest"]["read"] == res.read_drift["high"]
    assert at["fastest"]["b_star"] <= at["slowest"]["b_star"]
    # the figure shades the bound between the slowest and fastest read, only where it moved
    import matplotlib
    matplotlib.use("Agg")
    from minillm.plots.roofline import plot_roofline
    data = res.to_dict()
    data["read_drift"] = ReadDrift((20e9, 40e9), data["ceilings"]["bandwidth"]).to_dict()
    labels = [t.get_text() for t in plot_roofline(data, formula_panel=False).axes[0].get_legend().get_texts()]
    assert any("read measured during the run (20–40 GB/s): it moved" in t for t in labels)
    data["crossover_at_reads"] = {"slowest": {"read": 20e9, "b_star": 14.1},
                                  "fastest": {"read": 40e9, "b_star": 7.3}, "moved": True}
    labels = [t.get_text() for t in plot_roofline(data, formula_panel=False).axes[0].get_legend().get_texts()]
    assert "B* over the read the run met: 7.3–14.1" in labels     # B* where the read moved: a band
    data["read_drift"] = ReadDrift((40e9, 41e9), data["ceilings"]["bandwidth"]).to_dict()
    data["crossover_at_reads"]["moved"] = False
    labels = [t.get_text() for t in plot_roofline(data, formula_panel=False).axes[0].get_legend().get_texts()]
    assert not any("it moved" in t or "B* over" in t for t in labels)


def test_the_crossover_moves_with_the_read_the_run_met():
    from minillm.bench.sweep import crossover_at_reads
    from minillm.model.config import PRESETS
    from minillm.perf import roofline as rf
    cfg, peak = PRESETS["llama-3.1-8b"], 989.5e12
    at = crossover_at_reads(cfg, 2, peak, ReadDrift((2.4e12, 4.8e12, 3.0e12), bound=4.8e12))
    for which, read in (("slowest", 2.4e12), ("fastest", 4.8e12)):
        assert at[which] == {"read": read, "b_star": pytest.approx(rf.crossover_batch(cfg, 2, read, peak))}
    assert at["moved"] is True
    # bf16 weights: B* ≈ peak ÷ bandwidth (≈ 206 at 4.8 TB/s), so half the read doubles it, to within 1 %
    assert at["slowest"]["b_star"] == pytest.approx(2 * at["fastest"]["b_star"], rel=0.01)
    assert crossover_at_reads(cfg, 2, peak, ReadDrift(())) == {}
    assert crossover_at_reads(cfg, 2, peak, ReadDrift((4.7e12, 4.8e12)))["moved"] is False


def test_the_table_says_where_b_star_went_only_when_the_memory_moved():
    res = _result([25e9, 27e9], ReadDrift((25e9, 50e9), 40e9).to_dict())
    res.crossover_at_reads = {"slowest": {"read": 25e9, "b_star": 14.1},
                              "fastest": {"read": 50e9, "b_star": 7.3}, "moved": True}
    line = ("B* moves with the memory: 7.3 at the run's fastest read (50.0 GB/s), "
            "14.1 at its slowest (25.0 GB/s)")
    assert line in res.table()
    res.crossover_at_reads["moved"] = False
    assert "B* moves" not in res.table()


def test_doctor_samples_the_read_speed_over_time():
    from minillm.doctor import check_read_drift
    [check] = check_read_drift(torch.device("cpu"), 8 * 2**20, samples=3, every_s=0.0)
    assert check.name == "read speed over time" and check.status in ("OK", "--")
    assert "over 3 reads" in check.detail and "GB/s" in check.detail
    assert ("moved" in check.detail) == (check.status == "--")
