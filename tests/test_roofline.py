"""The roofline formulas (design.md §3, chapter 10.3) against numbers worked out by hand, and the
live sweep on the tiny model: well-formed, consistent units, data and figure written and loadable."""
import math
import statistics

import pytest

from minillm.model.config import PRESETS, ModelConfig
from minillm.perf import roofline as rf

# ----------------------------------------------------------------------------- a toy model by hand
# hidden 8, 2 layers, 2 heads of dim 4, 1 KV head, MLP 16, vocab 10, untied embeddings.
TOY = ModelConfig(name="toy", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2,
                  num_heads=2, num_kv_heads=1, tie_word_embeddings=False)
# per layer: q 8·8 = 64, k 8·4 = 32, v 32, o 64 → 192; MLP 3·8·16 = 384 → 576; × 2 layers = 1152
# LM head 10·8 = 80 → P (matmul params) = 1232; + norms 2·2·8 + 8 = 40, + embedding 80 → 1352
TOY_P, TOY_N = 1232, 1352


def test_toy_parameter_counts():
    assert TOY.head_dim == 4
    assert TOY.matmul_params == TOY_P
    assert TOY.num_params == TOY_N


def test_toy_bytes_per_step_counts_gathered_embedding_rows_and_kv():
    # fp32: W per step = (all params − embedding table + B gathered rows of 8) × 4
    B, L = 3, 5
    k = 2 * 2 * 1 * 4 * 4                                   # 2 · layers · kv_heads · head_dim · bytes = 64
    assert TOY.kv_bytes_per_token(4) == k
    w_step = (TOY_N - 80 + B * 8) * 4
    assert rf.weight_bytes_per_step(TOY, 4, B) == w_step
    assert rf.decode_step_bytes(TOY, 4, B, L) == w_step + B * L * k
    assert rf.decode_step_bytes(TOY, 4, B, 0) == w_step    # no context, no KV traffic


def test_toy_flops_per_step():
    B, L = 3, 5
    attention = 4 * B * L * 2 * 2 * 4                      # 4 · B · L · layers · heads · head_dim = 960
    assert rf.decode_step_flops(TOY, B, L) == 2 * TOY_P * B + attention == 8352


def test_tied_embedding_keeps_the_lm_head_in_the_weight_read():
    tied = ModelConfig(name="toy-tied", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2,
                       num_heads=2, num_kv_heads=1, tie_word_embeddings=True)
    assert tied.num_params == TOY_N - 80                   # the table is stored once
    assert rf.weight_bytes_per_step(tied, 2, 1) == (TOY_N - 80 + 8) * 2   # LM head read in full + 1 row


# ----------------------------------------------------------------------------- the chapter's example
def llama8b_by_hand():
    """Llama-3.1-8B's published shape → parameter counts, computed here without minillm."""
    h, inter, layers, heads, kv, d, vocab = 4096, 14336, 32, 32, 8, 128, 128256
    attn = h * heads * d + 2 * h * kv * d + heads * d * h          # q, k, v, o
    mlp = 3 * h * inter                                           # gate, up, down
    P = layers * (attn + mlp) + vocab * h                         # + LM head
    N = P + layers * 2 * h + h + vocab * h                        # + norms + input embedding (untied)
    return dict(h=h, layers=layers, heads=heads, kv=kv, d=d, vocab=vocab, P=P, N=N)


def test_llama_8b_preset_is_8b_parameters_16gb_in_bf16():
    m, cfg = llama8b_by_hand(), PRESETS["llama-3.1-8b"]
    assert m["N"] == 8_030_261_248 and m["P"] == 7_504_658_432
    assert cfg.num_params == m["N"] and cfg.matmul_params == m["P"]
    assert rf.weight_bytes(cfg, 2) == 2 * m["N"]                  # 16.06 GB: "8B in bf16 = 16 GB"
    assert 16.0e9 < rf.weight_bytes(cfg, 2) < 16.1e9


def test_chapter_example_16gb_at_2tbs_is_8ms_125_tok_s():
    # 16e9 bytes / 2e12 B/s = 8 ms per token → 125 tok/s
    assert rf.t_mem(16e9, 2e12) == pytest.approx(8e-3)
    assert rf.bandwidth_bound_tok_s(16e9, 2e12) == pytest.approx(125.0)
    cfg = PRESETS["llama-3.1-8b"]
    real = rf.bandwidth_bound_tok_s(rf.weight_bytes(cfg, 2), 2e12)
    assert real == pytest.approx(2e12 / (2 * 8_030_261_248)) and real <= 125
    # H200 at its 4.8 TB/s spec: ≈ 300 tok/s
    assert rf.bandwidth_bound_tok_s(rf.weight_bytes(cfg, 2), 4.8e12) == pytest.approx(298.9, abs=0.1)


def test_llama_8b_step_bytes_and_flops_with_kv():
    m, cfg = llama8b_by_hand(), PRESETS["llama-3.1-8b"]
    k = 2 * m["layers"] * m["kv"] * m["d"] * 2                    # 131072 B = 128 KiB per token in bf16
    assert cfg.kv_bytes_per_token(2) == k == 131072
    B, L = 16, 1000
    w_step = (m["N"] - m["vocab"] * m["h"] + B * m["h"]) * 2
    assert rf.decode_step_bytes(cfg, 2, B, L) == w_step + B * L * k
    flops = 2 * m["P"] * B + 4 * B * L * m["layers"] * m["heads"] * m["d"]
    assert rf.decode_step_flops(cfg, B, L) == flops
    assert rf.arithmetic_intensity(flops, w_step + B * L * k) == pytest.approx(flops / (w_step + B * L * k))
    # batch 1 in bf16, no context: about 1 FLOP per byte (2 FLOPs per 2-byte weight)
    i1 = rf.arithmetic_intensity(rf.decode_step_flops(cfg, 1, 0), rf.decode_step_bytes(cfg, 2, 1, 0))
    assert 0.9 < i1 < 1.0


def test_ridge_point_and_step_time_is_the_max():
    assert rf.ridge_point(989.5e12, 4.8e12) == pytest.approx(206.146, rel=1e-4)
    cfg, bw, peak = PRESETS["llama-3.1-8b"], 4.8e12, 989.5e12
    t1 = rf.predicted_step_time(cfg, 2, 1, 512, bw, peak)
    assert t1 == pytest.approx(rf.decode_step_bytes(cfg, 2, 1, 512) / bw)        # batch 1: memory-bound
    t_big = rf.predicted_step_time(cfg, 2, 4096, 0, bw, peak)
    assert t_big == pytest.approx(rf.decode_step_flops(cfg, 4096, 0) / peak)     # huge batch: compute-bound


def test_single_and_aggregate_bounds():
    cfg, bw, peak = PRESETS["llama-3.1-8b"], 2e12, 312e12
    L = 512
    assert rf.single_request_bound(cfg, 2, L, bw) == pytest.approx(bw / rf.decode_step_bytes(cfg, 2, 1, L))
    assert rf.single_request_bound(cfg, 2, L, bw) < rf.single_request_bound(cfg, 2, 0, bw)   # KV costs
    B = 8
    mem = B * bw / rf.decode_step_bytes(cfg, 2, B, L)
    comp = peak * B / rf.decode_step_flops(cfg, B, L)
    assert rf.aggregate_bound(cfg, 2, B, L, bw, peak) == pytest.approx(min(mem, comp))
    p = rf.roofline_point(cfg, 2, B, L, bw, peak)
    assert p.bound_tok_s == pytest.approx(min(mem, comp)) and p.t_mem_s > p.t_compute_s


def test_crossover_batch_by_hand():
    m, cfg = llama8b_by_hand(), PRESETS["llama-3.1-8b"]
    bw, peak = 4.8e12, 989.5e12
    i_star = peak / bw
    W0 = (m["N"] - m["vocab"] * m["h"]) * 2                       # weights read at batch 0
    # t_compute = t_mem:  2·P·B / peak = (W0 + B·h·2) / BW  →  B* = I*·W0 / (2P − I*·2h)
    expected = i_star * W0 / (2 * m["P"] - i_star * 2 * m["h"])
    bstar = rf.crossover_batch(cfg, 2, bw, peak)
    assert bstar == pytest.approx(expected)
    assert bstar == pytest.approx(i_star, rel=0.1)                # ≈ peak/BW for bf16 weights
    lo, hi = math.floor(bstar), math.ceil(bstar) + 1
    assert rf.t_mem(rf.decode_step_bytes(cfg, 2, lo, 0),
                    bw) > rf.t_compute(rf.decode_step_flops(cfg, lo, 0), peak)
    assert rf.t_mem(rf.decode_step_bytes(cfg, 2, hi, 0),
                    bw) < rf.t_compute(rf.decode_step_flops(cfg, hi, 0), peak)


def test_crossover_with_long_context_kv_never_turns_compute_bound():
    cfg = PRESETS["llama-3.1-8b"]
    # per sequence at L=4096: 536.9 MB of KV vs ≈ 17 GFLOP — far below I* = 206 FLOP/byte
    assert rf.crossover_batch(cfg, 2, 4.8e12, 989.5e12, context=4096) == math.inf
    short = rf.crossover_batch(cfg, 2, 4.8e12, 989.5e12, context=16)
    assert rf.crossover_batch(cfg, 2, 4.8e12, 989.5e12) < short < math.inf    # KV pushes B* out


# ----------------------------------------------------------------------------- the measured knee
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]


@pytest.mark.parametrize("knee", [16.0, 12.0, 40.0])
def test_measured_knee_recovers_a_known_knee(knee):
    a, b = 10e-3, 10e-3 / knee                                     # t = max(a, b·B), meets at B = a/b
    times = [max(a, b * B) for B in BATCHES]
    assert rf.measured_knee(BATCHES, times) == pytest.approx(knee, rel=1e-6)


def test_measured_knee_tolerates_noise():
    a, b = 10e-3, 10e-3 / 16
    noise = [1.03, 0.98, 1.01, 0.97, 1.02, 0.99, 1.02, 0.98]
    times = [max(a, b * B) * n for B, n in zip(BATCHES, noise)]
    assert 11 < rf.measured_knee(BATCHES, times) < 23


def test_measured_knee_none_when_flat_or_too_few_points():
    assert rf.measured_knee(BATCHES, [5e-3] * len(BATCHES)) is None
    assert rf.measured_knee([1, 2], [1.0, 2.0]) is None
    # the rising part needs ≥ 2 points: a knee beyond the last batch is not in range
    assert rf.measured_knee(BATCHES, [max(10e-3, 10e-3 / 1000 * B) for B in BATCHES]) is None


def test_measured_knee_ignores_failed_points_and_order():
    a, b = 10e-3, 10e-3 / 16
    pairs = [(B, max(a, b * B)) for B in BATCHES][::-1] + [(256, None), (512, float("nan"))]
    assert rf.measured_knee([p[0] for p in pairs], [p[1] for p in pairs]) == pytest.approx(16.0)


# ----------------------------------------------------------------------------- the live sweep (tiny)
@pytest.fixture(scope="module")
def tiny_sweep():
    from minillm.bench.sweep import run_sweep
    return run_sweep(model="tiny", device="cpu", batches=[1, 2, 4], steps=2, warmup=1,
                     copy_bytes=32 * 2**20, matmul_n=256, progress=False)


def test_sweep_result_is_well_formed(tiny_sweep):
    res = tiny_sweep
    cfg = PRESETS["tiny"]
    nb = {"fp32": 4, "bf16": 2, "fp16": 2}[res.dtype]
    assert [b.batch for b in res.batches] == [1, 2, 4]
    assert res.model == "tiny" and res.device == "cpu" and res.ceilings["source"] == "measured"
    bw, peak = res.ceilings["bandwidth"], res.ceilings["peak_flops"]
    assert bw > 0 and peak > 0
    assert res.model_bytes == rf.weight_bytes(cfg, nb)
    assert res.predicted_crossover == pytest.approx(rf.crossover_batch(cfg, nb, bw, peak, 0))
    assert res.measured_knee is None or res.measured_knee > 0
    for b in res.batches:
        assert b.status == "ok", b.status
        assert len(b.forward_ms) == 2 and len(b.engine_ms) == 2
        assert b.forward_ms_median > 0 and b.engine_ms_median > 0
        assert b.per_request_tok_s == pytest.approx(1e3 / b.forward_ms_median)
        assert b.aggregate_tok_s == pytest.approx(b.batch * b.per_request_tok_s)
        assert b.bytes_per_step == rf.decode_step_bytes(cfg, nb, b.batch, res.context)
        assert b.flops_per_step == rf.decode_step_flops(cfg, b.batch, res.context)
        assert b.achieved_bw == pytest.approx(b.bytes_per_step / (b.forward_ms_median / 1e3))
        # units, not efficiency: tiny's 7 MB of weights sit in the CPU's cache, and the read ceiling
        # (a 32 MiB sum here) dips on a busy machine, so MBU can pass 1
        assert 0 < b.mbu < 10 and 0 < b.mfu
        assert b.pct_of_bound == pytest.approx(b.aggregate_tok_s / b.bound_tok_s)
        # "served": the engine step with lengths in [L/2, 3L/2] and scattered slots
        L = res.context
        assert len(b.served_ms) == 2 and L // 2 <= b.served_max_context <= L + L // 2
        assert b.served_aggregate_tok_s == pytest.approx(b.batch / (b.served_ms_median / 1e3))
        assert b.served_bytes_per_step == (rf.weight_bytes_per_step(cfg, nb, b.batch)
                                           + 3 * b.batch * b.served_max_context * cfg.kv_bytes_per_token(nb))
        assert b.served_gap == pytest.approx(b.served_ms_median / b.engine_ms_median)
    assert "B*" in res.table() and "measured knee" in res.table() and "served ms" in res.table()


def test_sweep_writes_data_that_loads_back_and_a_figure(tiny_sweep, tmp_path):
    from minillm.bench.sweep_result import load_result
    from minillm.plots.roofline import save_roofline_figure
    jp, cp = tiny_sweep.write(tmp_path / "runs")
    back = load_result(jp)
    assert back["model"] == "tiny" and [b["batch"] for b in back["batches"]] == [1, 2, 4]
    assert back["batches"][0]["forward_ms"] == tiny_sweep.batches[0].forward_ms      # every sample kept
    rows = cp.read_text().strip().splitlines()
    assert rows[0].startswith("batch,status") and len(rows) == 1 + 3
    paths = save_roofline_figure(back, [back], out_dir=tmp_path / "fig")             # a reloaded run overlays
    assert [p.name for p in paths] == ["10-3-decode-roofline.png", "10-3-decode-roofline.svg"]
    assert all(p.exists() and p.stat().st_size > 1000 for p in paths)
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- read bandwidth, file names
def _small_ceilings(monkeypatch, read_value: float | None = None):
    """Shrink the sweep's ceiling measurements to a few MiB and a small matmul (seconds, not
    minutes); with ``read_value``, the read bandwidth is that number (a stand-in measurement)."""
    from minillm.bench import sweep
    from minillm.hardware import machine as hw
    calls = []

    def read(dev, nbytes=None, **kw):
        calls.append(("read", nbytes))
        m = hw.measure_read_bandwidth(dev, nbytes=8 * 2**20, repeats=2, warmup=1)
        if read_value is not None:
            m = hw.Measurement(read_value, "B/s", [read_value], {}, "stand-in read measurement")
        return m
    monkeypatch.setattr(sweep, "measure_read_bandwidth", read)
    monkeypatch.setattr(sweep, "measure_copy_bandwidth",
                        lambda dev, nbytes=None,
                        **kw: hw.measure_copy_bandwidth(dev, nbytes=8 * 2**20, repeats=2, warmup=1))
    monkeypatch.setattr(sweep, "measure_matmul_peak",
                        lambda dev, dt, n=None,
                        **kw: hw.measure_matmul_peak(dev, dt, n=128, repeats=2, warmup=1))
    return calls


def test_the_sweep_names_the_path_that_ran(tiny_sweep, monkeypatch, tmp_path):
    from minillm.bench.sweep import run_sweep
    from minillm.engine.matmul import CANDIDATES
    m = tiny_sweep.matmul
    assert m["mode"] == "auto" and m["choose_s"] >= 0
    picks = [r["chosen"] for r in m["choice"]["rows"]]
    assert picks and set(picks) <= set(CANDIDATES)
    assert "path: decode matmuls chosen on this machine" in tiny_sweep.table()
    # where the engines held the chosen weights (engine/weight_pages.py), in the JSON and the line
    if any(p != "aten" for p in picks):
        pages = m["weight_pages"]
        assert pages["tensors"] > 0 and pages["nbytes"] > 0 and pages["line"] in tiny_sweep.path_line()
    else:                                # every shape kept F.linear here: nothing held, nothing moved
        assert "weight_pages" not in m
    _small_ceilings(monkeypatch, read_value=7.5e9)
    plain = run_sweep(model="tiny", device="cpu", batches=[1], steps=1, warmup=1, progress=False,
                      served=False,
                      enforce_eager=True)
    assert plain.matmul["mode"] == "aten" and plain.matmul["choice"] is None
    assert "weight_pages" not in plain.matmul                  # the plain path keeps torch's allocation
    assert "path: plain (torch's F.linear) (--enforce-eager)" in plain.table()
    assert rf.path_line(plain.to_dict()["matmul"]) == plain.path_line()


def test_the_bound_uses_the_read_bandwidth(monkeypatch):
    from minillm.bench.sweep import run_sweep
    calls = _small_ceilings(monkeypatch, read_value=7.5e9)
    res = run_sweep(model="tiny", device="cpu", batches=[1], steps=1, warmup=1, progress=False, served=False)
    c = res.ceilings
    assert calls and c["bandwidth"] == c["read_bandwidth"] == 7.5e9 and c["bandwidth_kind"] == "read"
    assert c["copy_bandwidth"] > 0 and c["copy_bandwidth"] != c["bandwidth"]     # measured and kept beside it
    b, cfg = res.batches[0], PRESETS["tiny"]
    assert b.status == "ok"
    assert b.mbu == pytest.approx(b.achieved_bw / 7.5e9)
    assert b.bound_tok_s == pytest.approx(rf.aggregate_bound(cfg, 4, 1, res.context, 7.5e9, c["peak_flops"]))
    assert res.predicted_crossover == pytest.approx(rf.crossover_batch(cfg, 4, 7.5e9, c["peak_flops"], 0))
    table = res.table()
    assert "read 7.5 GB/s (the bound's)" in table and "copy " in table and "(read + write)" in table
    from minillm.plots.roofline import stamp_of
    assert "read 7.5 GB/s" in stamp_of(res.to_dict()) and "copy " in stamp_of(res.to_dict())


def _choice_timed_at_256_rows(ms_by_shape: dict[tuple[int, int], float | None]):
    from minillm.engine.matmul import MatmulChoice, ShapeChoice
    rows = [ShapeChoice(n, k, False, "tiled", ms={"tiled": {"1": 1.0, **({"256": ms} if ms else {})}},
                        by_rows={"1": "tiled", **({"256": "tiled"} if ms else {})})
            for (n, k), ms in ms_by_shape.items()]
    timed = [1, 256] if any(ms_by_shape.values()) else [1]
    return MatmulChoice("key", "machine", "2.13", 2, "float32", timed, rows)


def test_the_compute_roof_of_the_chosen_kernels_is_their_fastest_shape_at_256_rows():
    """By hand: 2 × 256 × 64 × 32 FLOPs in 1 ms is 1.048576 GFLOP/s; 128 × 32 in 1 ms twice that."""
    from minillm.bench.sweep import chosen_kernels_peak
    peak, how = chosen_kernels_peak(_choice_timed_at_256_rows({(64, 32): 1.0, (128, 32): 1.0}))
    assert peak == pytest.approx(2 * 256 * 128 * 32 / 1e-3) and "tiled" in how and "128x32" in how
    assert chosen_kernels_peak(_choice_timed_at_256_rows({(64, 32): None})) is None   # not timed there


@pytest.mark.parametrize("kernels_flops", [1e15, 1.0])
def test_the_sweeps_compute_roof_is_the_faster_of_the_square_matmul_and_the_chosen_kernels(
        monkeypatch, kernels_flops):
    from minillm.bench import sweep
    _small_ceilings(monkeypatch)
    monkeypatch.setattr(sweep, "chosen_kernels_peak", lambda choice: (kernels_flops, "stand-in kernels"))
    res = sweep.run_sweep(model="tiny", device="cpu", batches=[1], steps=1, warmup=1, progress=False,
                          served=False)
    c, cfg = res.ceilings, PRESETS["tiny"]
    square = c["square_matmul_flops"]
    assert square > 1.0 and c["peak_flops"] == max(square, kernels_flops)
    bw, peak = c["bandwidth"], c["peak_flops"]
    assert res.predicted_crossover == pytest.approx(rf.crossover_batch(cfg, 4, bw, peak, 0))
    assert res.batches[0].mfu == pytest.approx(res.batches[0].achieved_flops / c["peak_flops"])
    if kernels_flops > square:
        assert c["peak_method"] == "stand-in kernels"
        assert "(stand-in kernels; torch's square matmul" in rf.ceilings_line(c)
    else:
        assert "matmul in" in c["peak_method"] and "square matmul" not in rf.ceilings_line(c)


def test_model_slug_makes_safe_file_names(tmp_path):
    from minillm.bench.sweep_result import model_slug, output_stem
    ckpt = tmp_path / "My Model.v2"
    ckpt.mkdir()
    assert model_slug("cpu-small") == "cpu-small"
    assert model_slug(str(ckpt)) == "My-Model.v2" and model_slug(str(ckpt) + "/") == "My-Model.v2"
    assert model_slug("meta-llama/Llama-3.2-1B") == "meta-llama--Llama-3.2-1B"
    assert output_stem(str(ckpt), "bf16", "cuda:0") == "roofline-My-Model.v2-bf16-cuda"
    for weird in ("/", "../..", "a/b/c", "x y:z*"):
        assert "/" not in model_slug(weird) and model_slug(weird) not in ("", ".", "..")


def test_roofline_cli_with_a_checkpoint_directory_writes_json_csv_and_figure(tmp_path, monkeypatch):
    """The bug: a checkpoint path went into the output file name, slashes and all, so the sweep
    ran and then could not write anything (exit 2)."""
    import json

    from hf_reference import make_hf_model

    from minillm.cli import main
    ckpt = tmp_path / "ckpts" / "tiny-llama"
    make_hf_model("llama", ckpt)
    _small_ceilings(monkeypatch)
    out, figs = tmp_path / "runs", tmp_path / "figs"
    rc = main(["roofline", "--model", str(ckpt), "--device", "cpu", "--dtype", "fp32", "--batches", "1,2",
               "--context", "16", "--warmup", "1", "--steps", "1", "--out", str(out), "--figures", str(figs)])
    assert rc == 0
    jp, cp = out / "roofline-tiny-llama-fp32-cpu.json", out / "roofline-tiny-llama-fp32-cpu.csv"
    assert jp.exists() and cp.exists()
    data = json.loads(jp.read_text())
    assert data["model"] == str(ckpt) and [b["status"] for b in data["batches"]] == ["ok", "ok"]
    assert data["matmul"]["path"] == "fastest"      # the default: packed or compiled, batch by batch
    assert {b["path"] for b in data["batches"]} <= {"packed", "compiled"}
    assert len(cp.read_text().strip().splitlines()) == 3
    assert ((figs / "10-3-decode-roofline.png").stat().st_size > 1000
            and (figs / "10-3-decode-roofline.svg").exists())


def test_a_sweep_that_cannot_write_says_so_before_it_starts(tmp_path, monkeypatch, capsys):
    from minillm.bench import sweep
    from minillm.cli import main
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")

    def never(*a, **k):
        raise AssertionError("the sweep started measuring")
    monkeypatch.setattr(sweep, "measure_read_bandwidth", never)
    rc = main(["roofline", "--model", "tiny", "--device", "cpu", "--batches", "1", "--out", str(not_a_dir)])
    assert rc == 2 and "cannot write results to" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cannot write"):
        sweep.run_sweep(model="tiny", device="cpu", batches=[1], progress=False,
                        figures_dir=not_a_dir / "sub")


# ----------------------------------------------------------------------------- when the data has no knee
# A CPU sweep whose step time grows from batch 1 on (measured on the 2-core machine: cpu-small fp32,
# context 128): per-request tok/s falls from the start; there is no flat part and no ∝ B part.
CPU_BATCHES = [1, 2, 4, 8, 16, 32, 48, 64]
CPU_STEP_MS = [16.92, 18.23, 27.73, 35.65, 41.22, 56.67, 69.04, 84.55]


def test_no_knee_when_the_step_time_has_no_flat_part():
    fit = rf.knee_fit(CPU_BATCHES, CPU_STEP_MS)
    assert fit.knee is None and rf.measured_knee(CPU_BATCHES, CPU_STEP_MS) is None
    assert fit.candidate is not None                          # a least-squares fit alone would have found one
    assert fit.reason.startswith("no knee") and "flat part" in fit.reason and "not ∝ B" in fit.reason
    assert fit.flat_slope > rf.KNEE_MAX_FLAT_SLOPE and fit.rising_slope < rf.KNEE_MIN_RISING_SLOPE


def test_no_knee_when_the_step_time_barely_grows():
    # a GPU-like sweep to batch 64: the KV reads lengthen the step a little, nothing turns compute-bound
    ts = [10 * (1 + 0.27 * B / 64) for B in CPU_BATCHES]
    fit = rf.knee_fit(CPU_BATCHES, ts)
    assert fit.knee is None and fit.reason.startswith("no knee in this range") and "nearly flat" in fit.reason


def test_no_knee_when_kv_traffic_not_compute_lengthens_the_step():
    cfg = PRESETS["llama-3.1-8b"]
    bs = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    # never compute-bound at L=512
    kv = [rf.predicted_step_time(cfg, 2, B, 512, 4.8e12, 989.5e12) for B in bs]
    assert rf.knee_fit(bs, kv).knee is None
    no_kv = [rf.predicted_step_time(cfg, 2, B, 0, 4.8e12, 989.5e12) for B in bs]
    assert rf.knee_fit(bs, no_kv).knee == pytest.approx(rf.crossover_batch(cfg, 2, 4.8e12, 989.5e12),
                                                        rel=0.02)


def test_the_knee_fit_reports_an_accepted_knee():
    a, b = 10e-3, 10e-3 / 16
    fit = rf.knee_fit(BATCHES, [max(a, b * B) for B in BATCHES])
    assert fit.knee == pytest.approx(16.0) and fit.reason.startswith("knee at B ≈ 16")
    assert fit.rms_log_residual == pytest.approx(0.0, abs=1e-9)


def test_flat_until_follows_the_formulas():
    cfg = PRESETS["llama-3.1-8b"]
    grid = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    last = rf.flat_until(cfg, 2, 4.8e12, 989.5e12, 512, grid)
    t = {B: rf.predicted_step_time(cfg, 2, B, 512, 4.8e12, 989.5e12) for B in grid}
    assert t[last] <= 1.1 * t[1] < t[grid[grid.index(last) + 1]]
    assert rf.flat_until(cfg, 2, 4.8e12, 989.5e12, 0, grid, tol=10.0) == 512


def _sweep_dict(step_ms, batches=CPU_BATCHES, spread=None):
    cfg = PRESETS["cpu-small"]
    rows = []
    for B, t in zip(batches, step_ms):
        samples = [t] * 5 if not (spread and B in spread) else [t, t * spread[B], t, t * spread[B], t]
        rows.append({"batch": B, "status": "ok", "forward_ms": samples, "forward_ms_median": t,
                     "per_request_tok_s": 1e3 / t, "aggregate_tok_s": B * 1e3 / t})
    return {"batches": rows, "config": cfg.to_dict(), "context": 128, "predicted_crossover": 25.1,
            "ceilings": {"bandwidth": 26e9, "peak_flops": 333e9, "source": "measured"}}


def test_describe_run_says_what_the_data_shows():
    from minillm.bench.sweep_result import describe_run
    lines = describe_run(_sweep_dict(CPU_STEP_MS))
    text = " ".join(lines)
    assert "then falls" in lines[0] or "not flat" in lines[0]         # never "stays nearly flat" on this data
    assert "59.1" in lines[0] and "11.8" in lines[0]                    # the numbers come from the data
    assert "Knee fit: no knee" in text and "B* = 25.1" in text
    flat = " ".join(describe_run(_sweep_dict([17.0] * 8)))
    assert "stays within 10 %" in flat and "no knee in this range" in flat


def test_describe_run_and_the_figure_mark_noisy_rows():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minillm.bench.sweep_result import describe_run
    from minillm.plots.roofline import plot_roofline
    d = _sweep_dict(CPU_STEP_MS, spread={4: 3.0})
    d.update(model="cpu-small", dtype="fp32", device="cpu", hardware={"name": "test cpu"})
    assert any("Noisy rows" in line and "batch 4" in line for line in describe_run(d))
    fig = plot_roofline(d)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any(lab.startswith("noisy") for lab in labels)
    assert any("measured knee: none" in lab for lab in labels)
    plt.close(fig)


def test_no_knee_with_one_point_past_the_turn_says_so_without_nan():
    """A sweep of 1, 2, 4, 8, 64 leaves one point past a candidate knee near 10: there is no slope
    to read there, and the reason must say so instead of printing B^nan."""
    fit = rf.knee_fit([1, 2, 4, 8, 64], [17.65, 18.54, 19.65, 25.92, 70.93])
    assert fit.knee is None
    assert "nan" not in fit.reason and "one point only (64)" in fit.reason


def test_the_fastest_path_keeps_the_faster_of_packed_and_compiled_at_each_batch(monkeypatch):
    """One batch, both paths measured: the row is the faster one's, both timings are kept, the
    compile is timed apart (never one of the timed steps), and the table and the JSON say which
    path ran."""
    from minillm.bench.sweep import run_sweep
    from minillm.engine.compiled import compile_unavailable
    if compile_unavailable("cpu"):
        pytest.skip(compile_unavailable("cpu"))
    _small_ceilings(monkeypatch)
    res = run_sweep(model="tiny", device="cpu", batches=[1], steps=3, warmup=1, progress=False, served=False,
                    path="fastest")
    row = res.batches[0]
    assert row.status == "ok" and res.matmul["path"] == "fastest"
    alt = row.alternatives
    assert set(alt) == {"packed", "compiled"}
    assert alt["compiled"]["compile_s"] > 0 and alt["packed"]["compile_s"] is None
    faster = min(alt, key=lambda p: alt[p]["forward_ms_median"])
    assert row.path == faster and row.forward_ms_median == alt[faster]["forward_ms_median"]
    assert len(row.forward_ms) == 3 and len(row.engine_ms) == 3     # the compiling step is not among them
    if faster == "compiled":
        assert row.compile_s == alt["compiled"]["compile_s"]
        assert "path: fastest per batch: compiled decode at B = 1" in res.table()
    else:
        assert "the compiled decode was slower" in res.table()
    assert res.table().splitlines()[2].endswith("path")
    assert res.to_dict()["batches"][0]["path"] == row.path


def test_a_path_that_cannot_run_here_is_refused_or_replaced_with_the_reason(monkeypatch):
    from minillm.bench import sweep
    from minillm.engine import compiled
    cpu = sweep.torch.device("cpu")
    assert sweep.resolve_path("packed", False, cpu) == ("packed", "")
    assert sweep.resolve_path("fastest", True, cpu) == ("plain", " (--enforce-eager)")
    with pytest.raises(ValueError, match="path must be one of fastest, packed, compiled, plain"):
        sweep.resolve_path("turbo", False, cpu)
    monkeypatch.setattr(compiled, "compile_unavailable", lambda dev: "no C++ compiler here")
    path, why = sweep.resolve_path("fastest", False, cpu)
    assert path == "packed" and "no C++ compiler here" in why
    with pytest.raises(ValueError, match=r"cannot run here: no C\+\+ compiler here"):
        sweep.resolve_path("compiled", False, cpu)


def test_the_path_line_names_the_compiled_batches_and_the_rest():
    matmul = {"mode": "auto", "path": "fastest", "choose_s": 0.0,
              "choice": {"rows": [{"chosen": "onednn-packed"}], "cached": True}}
    rows = [{"batch": 1, "status": "ok", "path": "compiled", "compile_s": 14.2},
            {"batch": 2, "status": "ok", "path": "compiled", "compile_s": 15.9}]
    line = rf.path_line(matmul, False, rows)
    assert "compiled decode at B = 1, 2" in line and "first steps 14–16 s per batch" in line
    assert "at B = none" not in line and "faster there than the decode matmuls chosen" in line
    rows.append({"batch": 4, "status": "ok", "path": "packed", "compile_s": None})
    assert rf.path_line(matmul, False, rows).endswith("cached) at B = 4")


def test_the_fastest_path_measures_each_batch_on_both_paths_back_to_back_until_compiled_loses_twice():
    """The memory's speed can change between two measurements minutes apart, so each batch's compiled
    decode runs right after its packed one; after two batches in a row where packed was the faster, no
    more compiles are paid. A fake measurement: compiled faster at 1 and 4, slower at 2, 8 and 16."""
    from minillm.bench.sweep import BatchResult, _sweep_rows
    ms = {(1, False): 10, (1, True): 8, (2, False): 10, (2, True): 12, (4, False): 10, (4, True): 9,
          (8, False): 10, (8, True): 11, (16, False): 10, (16, True): 12, (32, False): 10, (32, True): 1}
    order = []

    def measure(b, compiled):
        order.append((b, compiled))
        r = BatchResult(b, "ok", 128, forward_ms=[ms[(b, compiled)]], engine_ms=[ms[(b, compiled)]],
                        path="compiled" if compiled else "packed", compile_s=1.0 if compiled else None)
        r.forward_ms_median = r.engine_ms_median = statistics.median(r.forward_ms)
        return r

    rows = _sweep_rows(measure, [1, 2, 4, 8, 16, 32], "fastest", None)
    assert order == [(1, False), (1, True), (2, False), (2, True), (4, False), (4, True),
                     (8, False), (8, True), (16, False), (16, True), (32, False)]
    assert [r.path for r in rows] == ["compiled", "packed", "compiled", "packed", "packed", "packed"]
    assert set(rows[0].alternatives) == {"packed", "compiled"} and rows[5].alternatives == {}


def test_more_rounds_measure_every_batch_again_in_turn_and_pool_its_samples():
    """Rounds 2 … N (bench/sweep._more_rounds): the batches in turn, each on the path its first round
    chose, its samples added to its row; a failed row stays failed, a failed later round keeps the row."""
    from minillm.bench.sweep import _more_rounds
    from minillm.bench.sweep_result import BatchResult
    rows = [BatchResult(1, "ok", 128, forward_ms=[10.0, 10.0], engine_ms=[11.0], path="compiled",
                        read_bw_now=[3e10]),
            BatchResult(2, "oom", 128),
            BatchResult(4, "ok", 128, forward_ms=[12.0], engine_ms=[13.0], served_ms=[14.0], path="packed")]
    calls = []

    def measure(b, compiled):
        calls.append((b, compiled))
        if b == 4 and len(calls) > 2:                  # batch 4's third round fails
            return BatchResult(b, "error: boom", 128)
        return BatchResult(b, "ok", 128, forward_ms=[20.0], engine_ms=[21.0], served_ms=[22.0],
                           read_bw_now=[5e10])

    filled = []
    _more_rounds(rows, measure, 3, lambda r: filled.append(r.batch))
    assert calls == [(1, True), (4, False), (1, True), (4, False)]          # in turn, each on its path
    assert rows[0].forward_ms == [10.0, 10.0, 20.0, 20.0] and rows[0].rounds == 3
    assert rows[0].served_ms == [] and rows[0].read_bw_now == [3e10, 5e10, 5e10]
    assert rows[1].status == "oom" and rows[1].rounds == 1
    assert rows[2].forward_ms == [12.0, 20.0] and rows[2].served_ms == [14.0, 22.0] and rows[2].rounds == 2
    assert filled == [1, 4, 1]
    _more_rounds(rows, measure, 1, filled.append)                            # one round: nothing more
    assert len(calls) == 4


def test_a_sweep_in_rounds_says_so_and_its_rows_hold_every_rounds_samples(monkeypatch):
    from minillm.bench.sweep import run_sweep
    _small_ceilings(monkeypatch, read_value=7.5e9)
    res = run_sweep(model="tiny", device="cpu", batches=[1, 2], steps=2, warmup=1, progress=False,
                    served=False, rounds=2)
    assert res.rounds == 2 and res.to_dict()["rounds"] == 2
    assert all(b.rounds == 2 and len(b.forward_ms) == 4 for b in res.batches)
    assert "each batch measured in 2 rounds" in res.table()
    with pytest.raises(ValueError, match="rounds"):
        run_sweep(model="tiny", device="cpu", batches=[1], rounds=0, progress=False)


def test_the_roofline_command_refuses_zero_rounds(capsys):
    from minillm.cli import main
    assert main(["roofline", "--model", "tiny", "--rounds", "0"]) == 2
    assert "--rounds must be ≥ 1" in capsys.readouterr().err
