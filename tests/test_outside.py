"""Chapter 10.5's measurements (minillm.measure.outside_*): step phases, sampling cost, tokenizer
cost, HTTP shares, profile_steps, the CUDA-graph comparison and the reference files. Nothing here
asserts a speed: the tests pin the bookkeeping (phases add up, one row per setting, units) and
the correctness of the sampling baseline the benchmark compares against."""
from __future__ import annotations

import itertools
import json
import math
from collections import Counter

import pytest
import torch

from minillm.core.step_record import OUTSIDE_PHASES, PHASES
from minillm.engine.sampling import Sampler, SamplingParams
from minillm.experiments.outside_sampling import (
    METHODS,
    per_row_filter,
    per_row_generators,
    per_row_sample,
    run_sampling_bench,
)
from minillm.experiments.outside_steps import (
    PhaseCase,
    decode_engine,
    measure_step_phases,
    phase_noise_warning,
    phase_table,
    run_decode_steps,
)


@pytest.fixture(scope="module")
def tiny():
    from minillm.engine.tokenizer import load_tokenizer
    from minillm.model.loader import load_model
    return load_model("tiny", "cpu", torch.float32, 0), load_tokenizer(None)


# --------------------------------------------------------------------------------- step phases
@pytest.mark.parametrize("batch, params", [(1, None), (4, SamplingParams(temperature=0.8, top_p=0.9))])
def test_step_record_phases_are_consecutive_and_sum_to_the_wall(tiny, batch, params):
    m, tok = tiny
    engine = decode_engine(m, tok, batch, context=32, steps=5, warmup=1, params=params)
    recs = run_decode_steps(engine, steps=5, warmup=1)
    assert len(recs) == 5
    for r in recs:
        assert len(r.t_ns) == len(PHASES)
        stamps = [r.t_start_ns, *r.t_ns]
        assert all(b >= a for a, b in itertools.pairwise(stamps)), "phase timestamps must be consecutive"
        assert set(r.phase_ms) == set(PHASES)
        assert sum(r.phase_ms.values()) == pytest.approx(r.wall_ms, abs=1e-9)
        assert r.num_decode_rows == batch and r.num_sampled == batch


def test_phase_case_shares_add_up_and_survive_json(tiny):
    m, tok = tiny
    case = measure_step_phases("tiny", batch=2, context=32, steps=4, warmup=1, device="cpu", loaded=m,
                               tokenizer=tok)
    assert case.steps == 4 and all(len(case.phase_ms[p]) == 4 for p in PHASES) and len(case.wall_ms) == 4
    assert sum(case.shares.values()) == pytest.approx(1.0)
    assert case.outside_share == pytest.approx(sum(case.shares[p] for p in OUTSIDE_PHASES))
    assert 0 <= case.outside_share <= 1 and case.reaches(0.0) and not case.reaches(1.01)
    back = PhaseCase.from_dict(json.loads(json.dumps(case.to_dict())))
    assert back.shares == pytest.approx(case.shares) and back.label == "tiny, batch 2"
    assert "tiny, batch 2" in phase_table([case])


def test_run_decode_steps_needs_a_running_batch(tiny):
    from minillm.engine.engine import LLMEngine
    m, tok = tiny
    with pytest.raises(RuntimeError, match="no running requests"):
        run_decode_steps(LLMEngine(m, tok, max_batch_size=1, max_model_len=64), 1)


def test_noisy_warning_names_the_noisy_series():
    assert phase_noise_warning({"steady": [1.0, 1.01, 0.99, 1.0]}) is None
    w = phase_noise_warning({"steady": [1.0] * 5, "jumpy": [1.0, 1.0, 5.0, 1.0, 9.0]})
    assert w is not None and "jumpy" in w and "steady" not in w


# --------------------------------------------------------------------------------- profile_steps
def test_profile_steps_reports_busy_share_launches_and_ops(tiny):
    from minillm.experiments.outside_profile import profile_decode, profile_steps
    m, _ = tiny
    p = profile_decode("tiny", batch=1, context=32, n_steps=4, warmup=1, device="cpu", loaded=m)
    assert 0.0 <= p.device_busy <= 1.0
    assert p.launches_per_step > 0 and p.n_steps == 4 and p.rows == 1
    assert p.device_ms > 0 and p.wall_ms > 0 and p.plain_step_ms > 0
    assert p.ops and all(o.calls_per_step > 0 and o.ms_per_step >= 0 for o in p.ops)
    assert any(o.name == "aten::mm" and o.counted for o in p.ops)
    assert all(not o.counted for o in p.ops if o.name in ("aten::view", "aten::linear", "aten::as_strided"))
    assert "aten::mm" in p.op_table() and "device busy" in p.summary()
    d = p.to_dict()
    assert d["device_busy"] == p.device_busy and isinstance(d["ops"], list)
    # an LLM works as well as an engine, and an idle one is refused
    from minillm import LLM
    llm = LLM(model="tiny", device="cpu", dtype="fp32", max_batch_size=1)
    with pytest.raises(RuntimeError, match="no running requests"):
        profile_steps(llm, 2)


def test_union_of_device_intervals():
    from minillm.experiments.outside_profile import _union_us
    assert _union_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert _union_us([]) == 0


# --------------------------------------------------------------------------------- sampling benchmark
def test_sampling_bench_one_row_per_setting_in_consistent_units():
    batches, vocabs, methods = (1, 3), (64, 256), ("greedy", "top-p", "top-k+top-p")
    b = run_sampling_bench(batches, vocabs, methods, repeats=2, device="cpu")
    keys = [(r.impl, r.method, r.batch, r.vocab) for r in b.rows]
    assert len(keys) == len(set(keys)) == 2 * len(methods) * len(batches) * len(vocabs)
    for impl in ("batched", "per-row"):
        assert {(m, B, V) for i, m, B, V in keys if i == impl} == \
            {(m, B, V) for m in methods for B in batches for V in vocabs}
    for r in b.rows:
        assert len(r.ms) == 2 and all(x > 0 for x in r.ms)
        assert r.ms_p10 <= r.ms_median <= r.ms_p90
        assert r.us_per_row == pytest.approx(r.ms_median * 1e3 / r.batch)      # ms per step, µs per row
    assert b.get("top-p", 3, 256).impl == "batched" and b.get("top-p", 3, 256, "per-row").impl == "per-row"
    assert "vocabulary 256" in b.table() and "×" in b.speedup_table()
    again = type(b).from_dict(json.loads(json.dumps(b.to_dict())))
    assert [r.ms_median for r in again.rows] == [r.ms_median for r in b.rows]
    with pytest.raises(ValueError, match="unknown"):
        run_sampling_bench((1,), (64,), ("nucleus",))


# --------------------------------------------------------------------------------- batched vs per-row
# The engine's batched Sampler draws with an exponential race (argmax of p / q, q ~ Exp(1)); the
# per-row loop it replaced drew with torch.multinomial. Both pick token i with probability p_i,
# but they consume random numbers differently, so the same seed does NOT give the same tokens in
# general. What must agree: greedy rows (no randomness: the argmax); settings that leave one
# token (top-k = 1, a tiny top-p) collapse both to the argmax; and for real sampling, the
# distributions: many draws from each, compared with the exact filtered softmax and with each
# other by total-variation distance on a small vocabulary (seeded, so the test is deterministic).

def _both(logits, params, seed=0):
    batched = Sampler(torch.device("cpu"), seed)(logits, params, [None] * len(params)).tolist()
    per_row = per_row_sample(logits, params, per_row_generators(params, seed))
    return batched, per_row


def test_greedy_rows_agree_alone_and_next_to_sampled_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 512, generator=g)                                 # [B, V]
    argmax = logits.argmax(-1).tolist()
    greedy = [SamplingParams(temperature=0.0)] * 16
    assert _both(logits, greedy) == (argmax, argmax)
    mixed = [SamplingParams(temperature=0.0) if i % 2 == 0 else METHODS["top-k+top-p"] for i in range(16)]
    b, p = _both(logits, mixed)
    assert [b[i] for i in range(0, 16, 2)] == [p[i] for i in range(0, 16, 2)] == argmax[::2]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=1),
                                    SamplingParams(temperature=1.0, top_p=1e-6),
                                    SamplingParams(temperature=0.7, top_k=1, top_p=0.5)])
def test_a_filter_that_leaves_one_token_collapses_both_to_argmax(params):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(12, 1000, generator=g)
    argmax = logits.argmax(-1).tolist()
    for seed in range(3):
        assert _both(logits, [params] * 12, seed) == (argmax, argmax)


def _filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The exact distribution both samplers should draw from, via the old per-row filter."""
    return per_row_filter(row.double() / p.temperature, p.top_k, p.top_p).softmax(-1)


@pytest.mark.parametrize("method", ["temperature", "top-k", "top-p", "top-k+top-p"])
def test_batched_and_per_row_draw_from_the_same_distribution(method):
    V, N = 12, 6000
    p = SamplingParams(temperature=0.8, top_k=5 if "top-k" in method else -1,
                       top_p=0.85 if "top-p" in method else 1.0)
    row = torch.linspace(2.0, -1.5, V)[torch.randperm(V, generator=torch.Generator().manual_seed(3))]
    logits = row.expand(N, V).contiguous()                                      # N independent draws
    b, r = _both(logits, [p] * N, seed=4)
    expected = _filtered_probs(row, p)
    emp_b = torch.tensor([Counter(b)[i] for i in range(V)], dtype=torch.double) / N
    emp_r = torch.tensor([Counter(r)[i] for i in range(V)], dtype=torch.double) / N
    def tv(x, y):
        return 0.5 * float((x - y).abs().sum())
    support = expected > 0
    assert (emp_b[~support] == 0).all() and (emp_r[~support] == 0).all(), "a filtered-out token was drawn"
    # N = 6000 draws land ≈ 0.01–0.02 from the truth here; temperature 1.0 instead of 0.8 would be ≈ 0.075
    # away
    assert tv(emp_b, expected) < 0.04
    assert tv(emp_r, expected) < 0.04
    assert tv(emp_b, emp_r) < 0.05
    if method in ("top-k", "top-k+top-p"):
        assert int(support.sum()) <= 5


# --------------------------------------------------------------------------------- tokenizer
def test_tokenizer_bench_rows_for_each_text_and_a_passed_directory(tmp_path):
    from minillm.engine.tokenizer import load_tokenizer
    from minillm.experiments.outside_tokenizer import run_tokenizer_bench, sample_texts
    texts = sample_texts()
    assert set(texts) == {"English", "Chinese", "code"} and all(len(t) > 500 for t in texts.values())
    d = tmp_path / "my-tokenizer"
    load_tokenizer(None).save_pretrained(str(d))
    b = run_tokenizer_bench([None, str(d)], n_tokens=200, repeats=2)
    for label in ("default (8k BPE)", "my-tokenizer"):
        for text in ("English", "Chinese", "code"):
            for op in ("encode", "decode (DecodeStream)", "decode (window)"):
                r = b.get(label, text, op)
                assert r is not None and r.n_tokens >= 200 and r.us_per_token_median > 0 and r.same_text
    assert b.get("default (8k BPE)", "Chinese", "encode").chars_per_token < \
        b.get("default (8k BPE)", "English", "encode").chars_per_token
    assert "Chinese" in b.table()


# --------------------------------------------------------------------------------- HTTP
def test_http_costs_are_shares_of_ttft_and_itl():
    from minillm.experiments.outside_http import http_costs, sse_chunk_us
    report = {"model": "tiny", "hardware": "cpu", "mode": "subprocess", "n_requests": 10, "max_tokens": 8,
              "ttft": {"inproc_p50_ms": 4.0, "http_p50_ms": 6.0, "inproc_p99_ms": 5.0, "http_p99_ms": 9.0},
              "itl": {"inproc_p50_ms": 1.0, "http_p50_ms": 1.25, "inproc_p99_ms": 2.0, "http_p99_ms": 3.0}}
    us = sse_chunk_us(n=200, repeats=2)
    assert len(us) == 2 and all(u > 0 for u in us)
    c = http_costs(report, us)
    assert c.per_request_ms == pytest.approx(2.0) and c.share_of_ttft == pytest.approx(2.0 / 6.0)
    assert c.per_token_ms == pytest.approx(0.25) and c.share_of_itl == pytest.approx(0.2)
    assert c.per_request_p99_ms == pytest.approx(4.0)
    assert c.sse_json_share_of_itl == pytest.approx(c.sse_json_us / 1e3 / 1.25)
    assert "per token" in c.table() and json.dumps(c.to_dict())
    assert http_costs(report).sse_json_share_of_itl is None


def test_sse_chunk_is_what_the_server_sends():
    from minillm.experiments.outside_http import chunk_body
    from minillm.serving.responses import sse_line
    line = sse_line(chunk_body("cmpl-1", "hi"))
    assert line.startswith("data: ") and line.endswith("\n\n")
    assert json.loads(line[6:])["choices"][0]["text"] == "hi"


# --------------------------------------------------------------------------------- CUDA graphs, reference
# files
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_graphs_comparison_refuses_a_cpu():
    from minillm.experiments.outside_graphs import run_graphs_comparison
    with pytest.raises(RuntimeError, match="CUDA"):
        run_graphs_comparison(["tiny"], [1], device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_comparison_on_cuda():
    from minillm.experiments.outside_graphs import run_graphs_comparison
    r = run_graphs_comparison(["tiny"], [1, 2], context=64, steps=5, warmup=2, profile_n=3, progress=False)
    assert {(x.batch, x.mode) for x in r.rows} == {(1, "eager"), (1, "graphs"), (2, "eager"), (2, "graphs")}
    for x in r.rows:
        assert x.status == "ok" and x.tok_s > 0 and 0 <= x.device_busy <= 1 and x.launches_per_step > 0
        assert x.cuda_graph == (x.mode == "graphs")


def test_reference_files_round_trip(tmp_path):
    from minillm.cli import main
    from minillm.experiments.outside_graphs import GraphsResult, GraphsRow
    from minillm.experiments.outside_reference import load_outside_references, write_reference
    g = GraphsResult("cuda:0", "H200", "bf16", 4.0e12, "measured read", 512, 30, 5,
                     rows=[GraphsRow("tiny", 1, "eager", 512, step_ms=[1.0], step_ms_median=1.0, tok_s=1000.0,
                                     bound_tok_s=2e5, pct_of_bound=0.005, device_busy=0.1,
                                     launches_per_step=300)])
    p = write_reference(tmp_path / "figures" / "reference", "outside-graphs", g.to_dict(), "cpu", "test")
    assert p.name.startswith("outside-graphs-") and p.suffix == ".json"
    found = load_outside_references(["figures/reference", "runs/reference"], root=tmp_path)
    assert set(found) == {"outside-graphs", "outside-sampling", "outside-profile", "outside-phases"}
    (_, doc), = found["outside-graphs"]
    assert doc["provenance"]["command"] == "test" and "host" in doc["provenance"]
    back = GraphsResult.from_dict(doc["result"])
    assert back.get("tiny", 1, "eager").tok_s == 1000.0 and "tiny" in back.table()
    assert load_outside_references(["nowhere"], root=tmp_path)["outside-phases"] == []
    with pytest.raises(ValueError):
        write_reference(tmp_path, "outside-nonsense", {}, "cpu")
    if not torch.cuda.is_available():
        assert main(["outside-reference", "--out", str(tmp_path / "x")]) == 2   # a CPU is not a GPU reference


# --------------------------------------------------------------------------------- figures
def test_figures_are_saved_with_their_data(tmp_path, tiny):
    import matplotlib
    matplotlib.use("Agg")
    from minillm.plots.outside import save_sampling_cost, save_step_phases
    m, tok = tiny
    cases = [measure_step_phases("tiny", batch=b, context=32, steps=3, warmup=1, device="cpu", loaded=m,
                                 tokenizer=tok) for b in (1, 2)]
    paths = save_step_phases(cases, "stamp", references=[PhaseCase.from_dict(cases[0].to_dict())],
                             out_dir=tmp_path)
    assert [p.name for p in paths] == ["10-5-step-phases.png", "10-5-step-phases.svg"]
    data = json.loads((tmp_path / "data" / "10-5-step-phases.json").read_text())
    assert len(data["cases"]) == 2 and len(data["references"]) == 1
    b = run_sampling_bench((1, 2), (64,), ("greedy", "top-p"), repeats=2, device="cpu")
    paths = save_sampling_cost(b, "stamp", step_ms={"tiny B=1": 1.0}, out_dir=tmp_path)
    assert all(p.exists() for p in paths)
    d = json.loads((tmp_path / "data" / "10-5-sampling-cost.json").read_text())
    assert d["step_ms"] == {"tiny B=1": 1.0} and not math.isnan(d["sampling"]["rows"][0]["ms_median"])


def test_the_projects_own_kernels_count_as_compute_on_a_cpu():
    """The engine runs its decode matmuls and attention as `minillm::` operators where they are
    faster: their time is the step's compute, and their calls are operators called from Python."""
    from types import SimpleNamespace as Ev

    from minillm.experiments.outside_profile import analyse_events
    linear = Ev(name="minillm::tiled_linear", self_cpu_time_total=900.0, cpu_parent=None)
    events = [linear,
              Ev(name="aten::empty", self_cpu_time_total=50.0, cpu_parent=linear),    # inside it: not a call
              Ev(name="minillm::decode_attention", self_cpu_time_total=60.0, cpu_parent=None),
              Ev(name="aten::view", self_cpu_time_total=40.0, cpu_parent=None),
              Ev(name="Python frame", self_cpu_time_total=500.0, cpu_parent=None)]
    device_ms, launches, kernels, ops = analyse_events(events, n_steps=1, wall_ms=2.0, on_gpu=False)
    assert device_ms == pytest.approx(0.96)                  # the two kernels; not the view, not Python
    assert launches == 3 and kernels is None                 # the kernels and the view, not the inner empty
    assert {o.name: o.counted for o in ops} == {"minillm::tiled_linear": True, "aten::empty": False,
                                                "minillm::decode_attention": True, "aten::view": False}
