"""Chapter 10.4: prefill vs decode on one roofline, the stall, the chunk trade-off.

The formulas are checked on hand-computed values and against the decode formulas of 10.3. The
measurements are checked for shape and units (every derived number recomputed from the row's own
samples), never for speed. The stall is checked through step numbers (traces and StepRecords),
never through durations."""
import json
import math

import matplotlib
import pytest

matplotlib.use("Agg")

import minillm.perf.roofline as rf
from minillm import LLM
from minillm.experiments import prefill_decode as pd
from minillm.experiments import stall
from minillm.metrics.findings import slo_crossing
from minillm.metrics.stutter import token_gaps
from minillm.model.config import PRESETS, ModelConfig
from minillm.perf import prefill as pf
from minillm.plots import prefill_decode as pp

# vocab 10, hidden 4, intermediate 6, 2 layers, 2 heads, 1 kv head, head_dim 2, untied
TOY = ModelConfig(name="toy", vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=2, num_heads=2,
                  num_kv_heads=1, max_position_embeddings=64)


# ----------------------------------------------------------------------------- formulas by hand
def test_toy_sizes_by_hand():
    # per layer: q 4·4 + k,v 2·4·2 + o 4·4 = 48, MLP 3·4·6 = 72 → 120; ×2 layers + LM head 10·4
    assert TOY.matmul_params == 280 and pf.lm_head_params(TOY) == 40
    assert TOY.num_params == 280 + 20 + 40          # + norms (2·2·4 + 4) + input embedding
    assert TOY.kv_bytes_per_token(2) == 16          # 2 · 2 layers · 1 · 2 · 2 bytes


def test_prefill_flops_by_hand():
    # T=3 from 0: 2·240·3 (body) + 2·40·1 (LM head, one row) + 4·2·2·2·(1+2+3) (causal attention)
    assert pf.attention_pairs(3) == 6
    assert pf.prefill_flops(TOY, 3) == 1440 + 80 + 192 == 1712
    # a later chunk of 2 after 5 cached: pairs 2·5 + 3 = 13; a middle chunk samples nothing
    assert pf.attention_pairs(2, 5) == 13
    assert pf.prefill_flops(TOY, 2, start=5, sampled_rows=0) == 2 * 240 * 2 + 32 * 13 == 1376


def test_prefill_bytes_by_hand():
    # W(3) = (340 − 40 embedding + 3 gathered rows · 4) · 2 bytes = 624; + 3·16 written + 3·16 read
    assert rf.weight_bytes_per_step(TOY, 2, 3) == 624
    assert pf.prefill_bytes(TOY, 2, 3) == 624 + 48 + 48 == 720
    assert pf.prefill_bytes(TOY, 2, 2, start=5) == (300 + 8) * 2 + 2 * 16 + 7 * 16 == 760
    assert pf.prefill_intensity(TOY, 2, 3) == pytest.approx(1712 / 720)


@pytest.mark.parametrize("name", ["tiny", "cpu-small", "llama-3.1-8b"])
@pytest.mark.parametrize("L", [1, 128, 4096])
def test_one_prefill_token_is_a_decode_step(name, L):
    cfg = PRESETS[name]
    assert pf.prefill_flops(cfg, 1, start=L - 1) == rf.decode_step_flops(cfg, 1, L)
    # the decode formula leaves out the one K/V the step writes
    assert (pf.prefill_bytes(cfg, 2, 1, start=L - 1)
            == rf.decode_step_bytes(cfg, 2, 1, L) + cfg.kv_bytes_per_token(2))


def test_llama_8b_prefill_by_hand():
    cfg = PRESETS["llama-3.1-8b"]
    T = 4096
    body = cfg.matmul_params - 128256 * 4096
    attention = 4 * 32 * 32 * 128 * (T * (T + 1) // 2)        # ≈ 2·T²·layers·heads·head_dim
    assert pf.prefill_flops(cfg, T) == 2 * body * T + 2 * 128256 * 4096 + attention
    assert attention == pytest.approx(2 * T * T * 32 * 32 * 128, rel=1e-3)
    assert pf.prefill_bytes(cfg, 2, T) == rf.weight_bytes_per_step(cfg, 2, T) + 2 * T * 131072


def test_chunking_keeps_flops_and_adds_weight_and_kv_reads():
    cfg = PRESETS["cpu-small"]
    chunks = pf.chunk_sizes(2048, 256, 8)
    assert chunks == [248] * 8 + [64] and sum(chunks) == 2048
    assert pf.chunk_sizes(100, 60) == [60, 40] and pf.chunk_sizes(120, 60) == [60, 60]
    with pytest.raises(ValueError):
        pf.chunk_sizes(100, 8, 8)
    assert pf.chunked_prefill_flops(cfg, chunks) == pf.prefill_flops(cfg, 2048)
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    extra = (len(chunks) - 1) * rf.weight_bytes_per_step(cfg, 4, 0) + sum(starts) * cfg.kv_bytes_per_token(4)
    assert pf.chunked_prefill_bytes(cfg, 4, chunks) == pf.prefill_bytes(cfg, 4, 2048) + extra


def test_ridge_length_is_where_intensity_crosses_the_ridge():
    cfg = PRESETS["llama-3.1-8b"]
    ridge = rf.ridge_point(989.5e12, 4.8e12)                   # H200 SXM spec: ≈ 206 FLOP/byte
    T = pf.prefill_ridge_length(cfg, 2, ridge)
    assert pf.prefill_intensity(cfg, 2, T) >= ridge > pf.prefill_intensity(cfg, 2, T - 1)
    assert 150 < T < 260                                       # bf16: T ≈ I* (W ≈ 2·P bytes)
    assert pf.prefill_ridge_length(cfg, 2, 1e9, max_tokens=1024) is None


def test_kv_transfer_of_the_8b_twin():
    cfg = PRESETS["llama-3.1-8b"]
    assert pf.kv_transfer_bytes(cfg, 2, 4096) == 4096 * 128 * 1024          # 128 KiB per token → 512 MiB
    pcie5 = pf.LINKS["PCIe 5.0 x16"].bandwidth
    assert pcie5 == pytest.approx(63.0e9, rel=0.01)
    assert pf.kv_transfer_s(cfg, 2, 4096, pcie5) == pytest.approx(4096 * 131072 / pcie5)
    assert pf.LINKS["NVLink 4 (H100/H200 SXM)"].bandwidth == 450e9
    assert all(link.source for link in pf.LINKS.values())


def test_gaps_by_steps_by_hand():
    gaps = stall.gaps_by_steps({"a": [1, 2, 4, 5], "b": [1, 3, 4]}, chunk_steps=[3])
    assert [(g.request_id, g.index, g.step_from, g.step_to, g.chunk_steps,
             g.whole_prefill) for g in gaps] == [
("a", 1, 1, 2, (), False), ("a", 2, 2, 4, (3,), True), ("a", 3, 4, 5, (), False),
("b", 1, 1, 3, (3,), True), ("b", 2, 3, 4, (), False)]       # b's token came out of step 3 itself
    two = stall.gaps_by_steps({"a": [1, 2, 3, 4]}, chunk_steps=[2, 3])
    assert not any(g.whole_prefill for g in two) and [g.chunk_steps for g in two] == [(2,), (3,), ()]
    assert not any(g.whole_prefill for g in stall.gaps_by_steps({"a": [1, 2]}, []))


def test_slo_crossing_and_best_budget():
    budgets, p99 = [64, 128, 256, 512], [10.0, 20.0, 40.0, 80.0]
    assert slo_crossing(budgets, p99, 30.0) == pytest.approx(2 ** 7.5)    # halfway on log2
    assert slo_crossing(budgets, p99, 5.0) is None and slo_crossing(budgets, p99, 100.0) is None
    runs = [{"budget": b, "itl_p99_ms": v} for b, v in zip(budgets, p99)]
    assert stall.largest_budget_within(runs, 30.0) == 128 and stall.largest_budget_within(runs, 1.0) is None


def test_busy_warnings_on_hand_made_rows():
    row = dict(phase="decode", tokens=1, status="ok", time_ms_p10=1.0, time_ms_p90=1.2)
    quiet = {"prefill": [], "decode": [row], "load": {"before": 0.5, "cores": 2}}
    assert pd.busy_warnings(quiet) == []
    noisy = {"prefill": [], "decode": [dict(row, time_ms_p90=3.0)], "load": {"before": 5.0, "cores": 2}}
    w = pd.busy_warnings(noisy)
    assert len(w) == 2 and "decode 1" in w[0] and "load average" in w[1]


# ----------------------------------------------------------------------------- the measurement
@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", dtype="fp32", max_batch_size=5, max_model_len=1100,
               scheduling_policy="prefill-first", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def result(llm):
    return pd.run_prefill_decode(llm, lengths=[16, 64, 128], batches=[1, 2, 4], context=32, repeats=2,
                                 warmup=1, steps=2, decode_warmup=1, copy_bytes=4 * 2**20, matmul_n=64)


def test_rows_are_well_formed_with_consistent_units(result, llm):
    cfg, bw, peak = llm.model.config, result.ceilings["bandwidth"], result.ceilings["peak_flops"]
    assert result.ridge_point == pytest.approx(peak / bw)
    assert ([r.tokens for r in result.prefill] == [16, 64, 128]
            and [r.batch for r in result.decode] == [1, 2, 4])
    for r in result.prefill + result.decode:
        assert r.status == "ok", r.status
        assert len(r.time_ms) == 2                           # repeats (prefill), steps (decode)
        assert all(t > 0 and math.isfinite(t) for t in r.time_ms)
        t_s = r.time_ms_median / 1e3
        assert r.time_ms_p10 <= r.time_ms_median <= r.time_ms_p90
        assert r.ms_per_token == pytest.approx(r.time_ms_median / r.tokens)
        assert r.tok_s == pytest.approx(r.tokens / t_s)
        assert r.intensity == pytest.approx(r.flops / r.bytes)
        assert r.achieved_flops == pytest.approx(r.flops / t_s)
        assert r.achieved_bw == pytest.approx(r.bytes / t_s)
        assert r.mfu == pytest.approx(r.achieved_flops / peak) and r.mbu == pytest.approx(r.achieved_bw / bw)
        assert r.served_ms_median > 0
    for r in result.prefill:
        assert (r.batch, r.context) == (1, r.tokens)
        assert r.flops == pf.prefill_flops(cfg, r.tokens) and r.bytes == pf.prefill_bytes(cfg, 4, r.tokens)
        assert r.ttft_ms_median >= r.served_ms_median       # TTFT holds the prefill
    for r in result.decode:
        assert (r.tokens, r.context) == (r.batch, 32)
        assert (r.flops == rf.decode_step_flops(cfg, r.batch, 32)
                and r.bytes == rf.decode_step_bytes(cfg, 4, r.batch, 32))
    assert result.settings["prefix_caching"] is False and result.load["cores"] >= 1
    assert "prefill" in result.table() and "ridge point" in result.table()


def test_result_round_trips_through_json(result, tmp_path):
    from minillm.bench.sweep_result import load_result
    p = result.write(tmp_path / "pd.json")
    back = pd.PrefillDecodeResult.from_dict(load_result(p))
    assert back.to_dict() == json.loads(p.read_text())
    assert [r.tokens for r in back.prefill] == [16, 64, 128]
    ratio = pf.cost_ratio(back)
    assert ratio["decode_b1_over_prefill"] == pytest.approx(result.decode[0].ms_per_token
                                                            / result.prefill[-1].ms_per_token)
    assert pd.prefill_time_ms(back, 64) == result.prefill[1].time_ms_median
    assert min(r.time_ms_median for r in result.prefill[1:]) <= pd.prefill_time_ms(back, 100) <= \
        max(r.time_ms_median for r in result.prefill[1:])
    assert pd.prefill_time_ms(back, 4096) is None
    assert pd.roof_reached_at(back) in (16, 64, 128)


def test_a_prompt_longer_than_the_context_is_an_error_row(llm):
    res = pd.run_prefill_decode(llm, lengths=[16, 4096], batches=[1], context=16, repeats=1, steps=1,
                                decode_warmup=1, copy_bytes=2**20, matmul_n=32)
    assert res.prefill[0].status == "ok" and res.prefill[1].status.startswith("error")
    assert "context" in res.prefill[1].status and "error" in res.table()


# ----------------------------------------------------------------------------- the stall, by steps
SETUP = stall.stall_setup(n_short=3, long_prompt_len=512, min_budget=64, arrive_after_tokens=4, tail=4)


@pytest.fixture(scope="module")
def first(llm):
    return stall.run_stall(llm, "prefill-first", 1024, SETUP)


@pytest.fixture(scope="module")
def chunked(llm):
    return stall.run_stall(llm, "chunked", 64, SETUP)


def _records(llm, run):
    steps = {s["step"] for s in run.steps}
    return {r.step: r for r in llm.engine.step_history if r.step in steps}


def test_prefill_first_has_exactly_one_gap_per_decoder_holding_the_prefill(llm, first):
    assert first.policy == "prefill-first" and len(first.chunks) == 1
    chunk = first.chunks[0]
    rec = _records(llm, first)[chunk["step"]]
    # the step records: the long prefill was a step of its own, no decoder had a row in it
    assert rec.num_prefill_tokens == 512 and rec.num_decode_rows == 0 and chunk["decode_rows"] == 0
    gaps = first.gaps()
    for rid in first.short_ids:
        holding = [g for g in gaps if g.request_id == rid and g.whole_prefill]
        assert len(holding) == 1
        g = holding[0]
        assert g.step_from < chunk["step"] < g.step_to and g.index >= SETUP["arrive_after_tokens"]
    assert sorted(s["request_id"] for s in first.stalled) == sorted(first.short_ids)
    assert first.setup == SETUP and first.budget == 1024


def test_chunked_small_budget_no_gap_holds_the_whole_prefill(llm, chunked):
    recs = _records(llm, chunked)
    assert len(chunked.chunks) == len(pf.chunk_sizes(512, 64, 3)) > 1
    assert [c["tokens"] for c in chunked.chunks] == pf.chunk_sizes(512, 64, 3)
    for c in chunked.chunks:     # every chunk shared its step with all the decoders (stall_setup's promise)
        assert recs[c["step"]].num_decode_rows == 3 == c["decode_rows"]
        assert recs[c["step"]].num_prefill_tokens == c["tokens"]
    gaps = chunked.gaps()
    assert not any(g.whole_prefill for g in gaps) and chunked.stalled == []
    assert all(len(g.chunk_steps) <= 1 for g in gaps)
    # each decoder got a token out of every chunk's step
    for rid in chunked.short_ids:
        assert {c["step"] for c in chunked.chunks} <= set(chunked.token_steps[rid])


def test_the_step_view_matches_the_trace_view(llm, first):
    # the tokens' steps come from exact stamps; gaps by timestamps (workload.token_gaps) must agree
    from minillm.core.trace import Trace
    traces = []
    for rid, times in first.tokens_ms.items():
        tr = Trace(rid)
        for t in times:
            tr.record("token", t_ns=round(t * 1e6))
        if rid == first.long_id:
            c = first.chunks[0]
            tr.events.insert(0, type(tr.events[0])("prefill_start", round(c["t_start_ms"] * 1e6), {}))
            tr.events.insert(1, type(tr.events[0])("prefill_end", round(c["t_end_ms"] * 1e6), {}))
        traces.append(tr)
    by_time = {(g.request_id, g.index) for g in token_gaps(traces) if first.long_id in g.prefills}
    by_step = {(g["request_id"], g["index"]) for g in first.stalled}
    assert by_time == by_step


def test_run_stall_restores_the_scheduler(llm, first, chunked):
    assert llm.engine.scheduler.policy == "prefill-first" and not llm.engine.has_unfinished()
    for run in (first, chunked):
        d = run.to_dict()
        json.dumps(d)
        assert d["itl_max_ms"] >= d["itl_p99_ms"] >= d["itl_p50_ms"] > 0
        assert d["output_tok_s"] > 0 and d["long_ttft_ms"] > 0 and d["long_prefill_ms"] > 0


def test_tradeoff_table_and_figures(llm, result, first, chunked, tmp_path):
    tr = stall.Tradeoff(SETUP, first, [chunked])
    assert "prefill-first" in tr.table() and "chunked" in tr.table()
    assert isinstance(stall.stall_warnings([first, chunked]), list)
    p1 = pp.save_roofline_prefill_decode(result.to_dict(), [{"roofline": result.to_dict()}], out_dir=tmp_path)
    p2 = pp.save_stall_rasters([first.to_dict(), chunked.to_dict()], "stamp", 12.0, out_dir=tmp_path)
    p3 = pp.save_chunk_tradeoff(tr.to_dict(), "stamp", slo_ms=chunked.itl_p99_ms * 1.5, out_dir=tmp_path)
    names = sorted(p.name for p in p1 + p2 + p3)
    assert names == sorted(f"10-4-{n}.{e}" for n in ("roofline-prefill-decode", "prefill-stall",
                                                     "chunk-tradeoff")
                           for e in ("png", "svg"))
    for n in ("roofline-prefill-decode", "prefill-stall", "chunk-tradeoff"):
        json.loads((tmp_path / "data" / f"10-4-{n}.json").read_text())


def test_references_are_found_by_their_name_below_the_roots(tmp_path, result):
    assert pd.load_prefill_decode_references([tmp_path / "missing"]) == []
    d = tmp_path / "h200"
    (d / "raw" / "run1").mkdir(parents=True)
    doc = json.dumps({"roofline": json.loads(json.dumps(result.to_dict()))})
    (d / "prefill-decode-tiny-fp32-cpu.json").write_text(doc)
    (d / "raw" / "run1" / "prefill-decode-tiny-fp32-cpu.json").write_text(doc)   # an archive: not drawn
    (d / "roofline-tiny-fp32-cpu.json").write_text("{}")                          # notebook 03's, not 04's
    refs = pd.load_prefill_decode_references([tmp_path, tmp_path])
    assert len(refs) == 1 and refs[0]["roofline"]["model"] == "tiny"
    assert refs[0]["_path"].endswith("h200/prefill-decode-tiny-fp32-cpu.json")


def test_command_line_writes_a_reference_the_figure_can_draw(tmp_path):
    out = tmp_path / "prefill-decode"
    from minillm.cli import main
    assert main(["prefill-decode", "--model", "tiny", "--device", "cpu", "--dtype", "fp32", "--lengths",
                 "16,32", "--batches", "1,2",
                    "--context", "16", "--repeats", "1", "--steps", "1", "--stall-long", "128", "--n-short",
                 "2",
                    "--budgets", "32,64", "--copy-mib", "4", "--matmul-n", "64", "--out", str(out)]) == 0
    refs = pd.load_prefill_decode_references([out])
    assert len(refs) == 1
    ref = refs[0]
    assert ref["kind"] == "minillm prefill-decode reference" and ref["roofline"]["model"] == "tiny"
    assert [r["tokens"] for r in ref["roofline"]["prefill"]] == [16, 32]
    assert ref["roofline"]["command"].startswith("python -m minillm prefill-decode")
    tr = ref["tradeoff"]
    assert (tr["prefill_first"]["policy"] == "prefill-first"
            and [r["budget"] for r in tr["chunked"]] == [32, 64])
    assert len(tr["prefill_first"]["stalled"]) == 2              # one stalled gap per decoder
    assert all(r["stalled"] == [] for r in tr["chunked"])
    # a learner's run drawn over the reference
    pp.save_roofline_prefill_decode(ref["roofline"], refs, out_dir=tmp_path / "fig")
    pp.save_chunk_tradeoff(tr, "stamp", 10.0, out_dir=tmp_path / "fig")
