"""The roofline formulas (design.md §3, chapter 10.3) against numbers worked out by hand, and the
live sweep on the tiny model: well-formed, consistent units, data and figure written and loadable."""
import math

import pytest

from minillm.measure import roofline as rf
from minillm.model.config import PRESETS, ModelConfig

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
    assert rf.t_mem(rf.decode_step_bytes(cfg, 2, lo, 0), bw) > rf.t_compute(rf.decode_step_flops(cfg, lo, 0), peak)
    assert rf.t_mem(rf.decode_step_bytes(cfg, 2, hi, 0), bw) < rf.t_compute(rf.decode_step_flops(cfg, hi, 0), peak)


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
    from minillm.measure.sweep import run_sweep
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
        assert 0 < b.mbu < 1.5 and 0 < b.mfu
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
    from minillm.plots.roofline import save_roofline_figure
    from minillm.measure.sweep import load_result
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
