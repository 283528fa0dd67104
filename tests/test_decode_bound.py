"""One decode bound for every command: the read bandwidth over one step's bytes, at least twice
the last-level cache (hardware.decode_read_bytes), and its sensitivity to the buffer."""
from __future__ import annotations

import torch

from minillm.hardware import machine as hw

MiB = 2**20


def test_the_buffer_is_one_steps_bytes_but_never_cache_sized(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(hw, "_measurement_room_bytes", lambda dev: 4096 * MiB)
    monkeypatch.setattr(hw, "last_level_cache_bytes", lambda dev=None: 32 * MiB)
    assert hw.decode_read_bytes(cpu, 370 * MiB) == 370 * MiB        # cpu-small fp32: its own bytes
    assert hw.decode_read_bytes(cpu, 40 * MiB) == 64 * MiB          # twice the cache, at least
    monkeypatch.setattr(hw, "last_level_cache_bytes", lambda dev=None: 480 * MiB)
    assert hw.decode_read_bytes(cpu, 164 * MiB) == 960 * MiB        # a server CPU's large L3
    monkeypatch.setattr(hw, "_measurement_room_bytes", lambda dev: 500 * MiB)
    assert hw.decode_read_bytes(cpu, 16 * 2**30) == 500 * MiB       # capped by the room measurements keep to


def test_every_command_measures_the_bound_the_same_way(monkeypatch):
    """The sweep asks for the read over decode_read_bytes of one step at batch 1."""
    from minillm.bench import sweep
    from minillm.model.config import PRESETS
    from minillm.perf import roofline as rf
    asked = []

    def read(dev, nbytes=None, **kw):
        asked.append(nbytes)
        return hw.Measurement(1e10, "B/s", [1e10], {}, "stand-in")
    monkeypatch.setattr(sweep, "measure_read_bandwidth", read)
    monkeypatch.setattr(sweep, "measure_copy_bandwidth",
                        lambda dev, nbytes=None, **kw: hw.Measurement(1e10, "B/s", [1e10], {}, "stand-in"))
    monkeypatch.setattr(sweep, "measure_matmul_peak",
                        lambda dev, dt, n=None, **kw: hw.Measurement(1e11, "FLOP/s", [1e11], {}, "stand-in"))
    sweep.run_sweep(model="tiny", device="cpu", dtype="fp32", batches=[1], steps=1, warmup=1, progress=False,
                    served=False, context=32)
    step1 = rf.decode_step_bytes(PRESETS["tiny"], 4, 1, 32)
    assert asked == [hw.decode_read_bytes(torch.device("cpu"), step1)]


def test_read_bandwidth_by_size_reports_each_buffer_that_fits(monkeypatch):
    monkeypatch.setattr(hw, "_measurement_room_bytes", lambda dev: 16 * MiB)
    got = hw.read_bandwidth_by_size("cpu", sizes=(4 * MiB, 8 * MiB, 64 * MiB), repeats=1)
    assert [n for n, _ in got] == [4 * MiB, 8 * MiB] and all(v > 0 for _, v in got)
