"""Devices, dtypes, the spec table and the measured ceilings (on whatever machine runs the tests)."""
from pathlib import Path

import pytest
import torch

from minillm.core import device
from minillm.doctor import run_checks
from minillm.hardware import machine as hw


def test_pick_device_defaults_and_errors():
    assert device.pick_device(None).type in ("cuda", "mps", "cpu")
    assert device.pick_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device"):
        device.pick_device("tpu-ish")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            device.pick_device("cuda")


@pytest.mark.parametrize("name,dt,nbytes", [("bf16", torch.bfloat16, 2), ("float16", torch.float16, 2),
                                            ("fp32", torch.float32, 4), (torch.bfloat16, torch.bfloat16, 2)])
def test_dtypes(name, dt, nbytes):
    assert device.parse_dtype(name) is dt and device.dtype_bytes(name) == nbytes
    assert device.parse_dtype(device.dtype_name(name)) is dt


def test_bad_dtype():
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        device.parse_dtype("int3")


@pytest.mark.parametrize("name,expected", [
    ("NVIDIA H200", "H200 SXM 141GB"), ("NVIDIA H100 80GB HBM3", "H100 SXM 80GB"),
    ("NVIDIA H100 PCIe", "H100 PCIe 80GB"), ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"), ("NVIDIA L4", "L4"), ("NVIDIA L40S", "L40S"),
    ("Tesla T4", "T4"), ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090"), ("NVIDIA A10", "A10"),
    ("NVIDIA GeForce RTX 3090", "GeForce RTX 3090"), ("NVIDIA GeForce RTX 5090", "GeForce RTX 5090"),
])
def test_spec_table_lookup(name, expected):
    spec = hw.lookup_gpu_spec(name)
    assert spec is not None and spec.name == expected
    assert spec.bandwidth > 1e11 and all(v > 1e12 for v in spec.flops.values())


def test_unknown_gpu_has_no_spec():
    assert hw.lookup_gpu_spec("Some Future Accelerator 9000") is None


def test_nvml_bandwidth_formula():
    # A100 80GB: 1593 MHz x 2 x 5120 bit / 8 = 2.039 TB/s (its datasheet figure)
    assert hw.nvml_spec_bandwidth({"mem_clock_mhz": 1593,
                                   "bus_width_bits": 5120}) == pytest.approx(2.039e12, rel=1e-3)
    assert hw.nvml_spec_bandwidth(None) is None and hw.nvml_spec_bandwidth({"name": "x"}) is None


def test_describe_hardware_cpu():
    info = hw.describe_hardware("cpu")
    assert info.kind == "cpu" and info.cpu_cores >= 1 and info.spec_bandwidth is None
    assert "CPU" in info.summary()


def test_measured_ceilings_are_plausible():
    bw = hw.measure_copy_bandwidth("cpu", nbytes=32 * 2**20, repeats=3, warmup=1)
    assert bw.unit == "B/s" and len(bw.samples) == 3 and 1e8 < bw.value < 1e13
    assert bw.value == sorted(bw.samples)[1]                      # the median
    pk = hw.measure_matmul_peak("cpu", "fp32", n=256, repeats=3, warmup=1)
    assert pk.unit == "FLOP/s" and 1e7 < pk.value < 1e15 and pk.params["n"] == 256


def test_copy_too_small_is_refused():
    with pytest.raises(ValueError, match="cache"):
        hw.measure_copy_bandwidth("cpu", nbytes=1000)


def test_ceilings_without_measuring_on_cpu_are_unknown():
    c = hw.ceilings("cpu", "fp32", measure=False)
    assert c["source"] == "unknown" and c["bandwidth"] is None


def test_read_bandwidth_is_positive_and_counts_bytes_read():
    rd = hw.measure_read_bandwidth("cpu", nbytes=32 * 2**20, repeats=3, warmup=1)
    assert rd.unit == "B/s" and len(rd.samples) == 3 and rd.value > 0 and 1e8 < rd.value < 1e13
    assert rd.value == sorted(rd.samples)[1] and rd.params["bytes"] == 32 * 2**20
    assert "bytes read" in rd.method and "sum reduction" in rd.method
    if Path("/proc/self/smaps").exists():        # the pages it read through, as the engine's weights
        assert " pages" in rd.method
    with pytest.raises(ValueError, match="cache"):
        hw.measure_read_bandwidth("cpu", nbytes=1000)


def test_default_read_buffer_is_well_past_the_last_level_cache(monkeypatch):
    llc = hw.last_level_cache_bytes("cpu")
    assert llc is None or llc > 0
    # free memory held still (it moves between two reads): once plenty, once the binding term
    for free in (64 * 2**30, 2 * 2**30):
        monkeypatch.setattr(hw, "host_available_bytes", lambda free=free: free)
        n = hw.default_read_bytes(torch.device("cpu"))
        assert n == min(max(512 * 2**20, 2 * (llc or 0)), free // 8)
    assert n == 2 * 2**30 // 8                      # 256 MiB: under the 512 MiB floor, memory wins


def test_ceilings_measure_read_and_copy_and_the_bound_uses_read(monkeypatch):
    monkeypatch.setattr(hw, "measure_read_bandwidth",
                        lambda dev, nbytes=None: hw.Measurement(3e10, "B/s", [3e10], {}, "stand-in"))
    c = hw.ceilings("cpu", "fp32", copy_bytes=8 * 2**20, matmul_n=128)
    assert c["bandwidth"] == c["read_bandwidth"] == 3e10 and c["bandwidth_kind"] == "read"
    assert c["copy_bandwidth"] > 0 and c["source"] == "measured"


def test_cpu_bf16_flags_are_read():
    have = hw.cpu_bf16_instructions()
    assert have is None or set(have) <= set(hw.BF16_FLAGS)


def test_doctor_says_whether_the_cpu_has_native_bf16(monkeypatch):
    from minillm import doctor
    monkeypatch.setattr(hw, "cpu_bf16_instructions", lambda: [])
    (c,) = doctor.check_cpu_bf16()
    assert c.status == "--" and "no native bf16" in c.detail and "fp32" in c.detail
    monkeypatch.setattr(hw, "cpu_bf16_instructions", lambda: ["avx512_bf16", "amx_bf16"])
    (c,) = doctor.check_cpu_bf16()
    assert c.status == "OK" and "avx512_bf16" in c.detail


def test_doctor_shows_read_and_copy_bandwidth(monkeypatch):
    from minillm import doctor
    monkeypatch.setattr(hw, "default_read_bytes", lambda dev: 16 * 2**20)
    monkeypatch.setattr(hw, "default_copy_bytes", lambda dev: 16 * 2**20)
    monkeypatch.setattr(hw, "_measurement_room_bytes", lambda dev: 20 * 2**20)     # only the small buffers
    monkeypatch.setattr(hw, "read_bandwidth_by_size",
                        lambda dev, sizes=(8 * 2**20, 16 * 2**20, 64 * 2**20), repeats=1:
                        [(n, v) for n, v in [(8 * 2**20, 3e10), (16 * 2**20, 2.5e10)]])
    c, by_size, drift = doctor.check_bandwidth()
    assert drift.name == "read speed over time" and "over 8 reads" in drift.detail
    assert c.status == "OK" and "read " in c.detail and "copy " in c.detail and "bytes read" in c.detail
    assert by_size.status == "OK" and "8 MiB: 30.0 GB/s, 16 MiB: 25.0 GB/s" in by_size.detail


def test_doctor_reports_every_check():
    checks = run_checks(measure=False)
    names = {c.name for c in checks}
    assert {"torch", "transformers", "torch build", "cpu", "cpu bf16", "default tokenizer"} <= names
    assert all(c.status in ("OK", "FAIL", "--") for c in checks)
    assert not [c for c in checks if c.status == "FAIL"], [c.line() for c in checks if c.status == "FAIL"]
