"""Peers at every batch: the aggregate decode rate of each engine at B = 1, 2, …, the llama.cpp side
read from llama-batched-bench's own table, and the report's arithmetic (per request = aggregate ÷ B,
% of the bound = aggregate ÷ (B × BW ÷ bytes per step))."""
from __future__ import annotations

import stat
import sys
import textwrap
import types

import pytest

from minillm.bench import peers_batch as pb

BATCHED_BENCH_OUTPUT = """\
main: n_kv_max = 2048, n_batch = 2048, n_ubatch = 512, flash_attn = 0, n_gpu_layers = 0

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |      8 |    1 |     24 |    0.010 |  1600.00 |    0.080 |   100.00 |    0.090 |   266.67 |
|    16 |      8 |    2 |     48 |    0.020 |  1600.00 |    0.100 |   160.00 |    0.120 |   400.00 |
"""


def test_the_batched_bench_table_gives_the_aggregate_generation_speed_per_batch():
    assert pb.parse_batched_bench(BATCHED_BENCH_OUTPUT) == {1: 100.0, 2: 160.0}
    assert pb.parse_batched_bench("no table here") == {}


@pytest.fixture(scope="module")
def report():
    return pb.run_batch_peers(model="tiny", dtype="fp32", batches=(2, 1), prompt_tokens=8, new_tokens=6,
                              rounds=2, engines=("minillm", "transformers", "llama.cpp"),
                              llama_batched_bench="/nonexistent/llama-batched-bench")


def test_every_engine_has_a_row_at_every_batch_and_a_missing_peer_is_unavailable(report):
    assert report.batches == [1, 2]
    for engine in ("minillm", "transformers"):
        for b in (1, 2):
            row = report.get(engine, b)
            assert row.status == "ok" and len(row.samples_tok_s) == 2 and row.tok_s > 0
            assert row.per_request_tok_s == pytest.approx(row.tok_s / b)
            bound = b * report.read_bw / report.bytes_per_step[str(b)]
            assert row.pct_of_bound == pytest.approx(row.tok_s / bound)
    assert all(report.get("llama.cpp", b).status.startswith("unavailable: llama-batched-bench not found")
               for b in (1, 2))
    assert report.bytes_per_step["2"] > report.bytes_per_step["1"]     # the K/V of the second sequence


def test_minillm_is_also_timed_over_its_forwards_alone_in_the_same_runs(report):
    """The companion row: each run's rows ÷ its decode steps' forward time, taken from the same generate, so
    one sample per round, each faster than the engine's whole-step rate it sits beside."""
    for b in (1, 2):
        engine, forward = report.get("minillm", b), report.get("minillm" + pb.FORWARD_ONLY, b)
        assert forward.status == "ok" and len(forward.samples_tok_s) == len(engine.samples_tok_s) == 2
        assert all(f > e for f, e in zip(forward.samples_tok_s, engine.samples_tok_s))
        assert len(forward.read_now) == 2
    assert report.get("transformers" + pb.FORWARD_ONLY, 1) is None      # a peer keeps no such row


def test_the_forward_only_rate_counts_full_decode_steps_after_the_mark():
    from minillm.bench.decode import forward_tok_s
    from minillm.core.step_record import PHASES, StepRecord

    def step(i, decode, prefill=0, forward_ms=4.0, **kw):
        r = StepRecord(i, 0, num_decode_rows=decode, num_prefill_rows=prefill, **kw)
        for t in (1, 2, 2 + forward_ms, 2 + forward_ms, 9, 10):      # phase ends, ms
            r.mark(int(t * 1e6))
        assert len(r.t_ns) == len(PHASES)
        return r

    records = [step(0, 2, forward_ms=1.0), step(1, 0, prefill=2), step(2, 2), step(3, 2, forward_ms=6.0),
               step(4, 1), step(5, 2, compile_ms=900.0)]
    # after step 0: steps 2 and 3 ran both rows and nothing else, 4 + 6 ms for 4 tokens
    assert forward_tok_s(records, since_step=0, batch=2) == pytest.approx(4 / 0.010)
    assert forward_tok_s(records, since_step=3, batch=2) is None          # step 5 compiled: not counted


def test_against_llama_cpp_the_forward_alone_is_compared_too():
    """llama-batched-bench times its decode calls alone, so minillm's forward-only rate gets a ratio line
    against llama.cpp; against transformers, whose rate spans whole generate steps, it does not."""
    rows = [pb.BatchPeerRow(e, 1, tok_s=t, pct_of_bound=0.5) for e, t in
            (("minillm compiled", 90.0), ("minillm compiled" + pb.FORWARD_ONLY, 100.0), ("llama.cpp", 80.0),
             ("transformers", 50.0))]
    text = pb.BatchPeerReport("tiny", "cpu", "fp32", 8, 4, 1, 2, 1e10, [1], {"1": 10**6}, rows).table()
    assert "minillm compiled ÷ llama.cpp at B = 1: 1.12×" in text
    assert "minillm compiled forward only ÷ llama.cpp at B = 1: 1.25×" in text
    assert "forward only ÷ transformers" not in text and "llama-batched-bench's span" in text


def test_the_table_shows_each_grid_and_names_what_did_not_run(report):
    text = report.table()
    for heading in ("aggregate decode tok/s", "per-request tok/s", "% of the bound",
                    "bound (BW ÷ bytes a step)"):
        assert heading in text
    assert "n/a" in text and "minillm ÷ transformers at B = 1, 2:" in text
    assert "llama.cpp: unavailable: llama-batched-bench not found" in text
    # the bound's buffer read again before each batch of each round and after each engine's run there:
    # 2 rounds × 2 batches × (1 + 2 engines), and each run's rate also taken against the read around it
    assert len(report.read_drift["samples"]) == 12 and "over 12 samples" in text
    assert all(len(report.get(e, b).read_now) == 2 for e in ("minillm", "transformers") for b in (1, 2))
    assert "% of the read measured around each run" in text
    assert "the same, each as a share of the read around its runs:" in text


def test_the_report_round_trips_through_json(report):
    again = pb.BatchPeerReport.from_dict(report.to_dict())
    assert again.get("minillm", 2).tok_s == report.get("minillm", 2).tok_s


def test_llama_cpp_runs_through_the_binary_and_reads_its_table(tmp_path, monkeypatch):
    fake = tmp_path / "llama-batched-bench"
    fake.write_text("#!/bin/sh\ncat <<'EOF'\n" + BATCHED_BENCH_OUTPUT + "EOF\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setitem(sys.modules, "gguf", types.ModuleType("gguf"))
    monkeypatch.setattr(pb, "write_gguf", lambda model, path, tokenizer: "F32")
    rep = pb.run_batch_peers(model="tiny", dtype="fp32", batches=(1, 2), prompt_tokens=16, new_tokens=8,
                             rounds=1, engines=("llama.cpp",), llama_batched_bench=str(fake))
    assert [rep.get("llama.cpp", b).tok_s for b in (1, 2)] == [100.0, 160.0]
    assert "llama-batched-bench, GGUF F32" in rep.notes["llama.cpp"]


def test_minillm_compiled_is_unavailable_with_the_reason_where_nothing_compiles(monkeypatch):
    from minillm.engine import compiled
    monkeypatch.setattr(compiled, "compile_unavailable", lambda dev: "no C++ compiler here")
    rep = pb.run_batch_peers(model="tiny", dtype="fp32", batches=(1,), prompt_tokens=8, new_tokens=4,
                             rounds=1, engines=("minillm", "minillm compiled"))
    assert rep.get("minillm", 1).status == "ok"
    assert rep.get("minillm compiled", 1).status == "unavailable: no C++ compiler here"
    with pytest.raises(ValueError, match="minillm compiled"):
        pb.run_batch_peers(model="tiny", batches=(1,), engines=("sglang",))


def test_the_faster_minillm_path_is_compared_batch_by_batch():
    """Eager wins at B = 2, compiled at B = 1: the "faster path" line takes each batch's better one."""
    rows = [pb.BatchPeerRow("minillm", 1, tok_s=50.0), pb.BatchPeerRow("minillm", 2, tok_s=120.0),
            pb.BatchPeerRow("minillm compiled", 1, tok_s=80.0),
            pb.BatchPeerRow("minillm compiled", 2, tok_s=90.0),
            pb.BatchPeerRow("llama.cpp", 1, tok_s=40.0), pb.BatchPeerRow("llama.cpp", 2, tok_s=100.0)]
    for r in rows:
        r.pct_of_bound = 0.5
    rep = pb.BatchPeerReport("tiny", "cpu", "fp32", 8, 4, 1, 2, 1e10, [1, 2], {"1": 10**6, "2": 10**6}, rows)
    assert rep.ours_tok_s("minillm, faster path", 1) == 80.0
    assert rep.ours_tok_s("minillm, faster path", 2) == 120.0
    text = rep.table()
    assert "minillm ÷ llama.cpp at B = 1, 2: 1.25×, 1.20×" in text
    assert "minillm compiled ÷ llama.cpp at B = 1, 2: 2.00×, 0.90×" in text
    assert "minillm, faster path ÷ llama.cpp at B = 1, 2: 2.00×, 1.20×" in text


def test_each_run_is_also_taken_against_the_read_measured_around_it():
    """Hand-computed: the bound is 100 tok/s at a read of 10 GB/s. Our two rounds ran at 80 and 120 tok/s
    while the memory read 10 and 15 GB/s (so 80 % and 80 % of the bound of that moment); the peer's ran at
    90 and 90 while it read 15 and 10 (60 % and 90 %). The plain medians say 100 against 90 (1.11×); against
    the read around each run, 80 % against 75 % (1.07×)."""
    ours = pb.BatchPeerRow("minillm", 1, samples_tok_s=[80.0, 120.0], read_now=[10e9, 15e9])
    peer = pb.BatchPeerRow("llama.cpp", 1, samples_tok_s=[90.0, 90.0], read_now=[15e9, 10e9])
    for r in (ours, peer):
        pb._finish(r, bound=100.0, read_bw=10e9)
    assert ours.pct_of_read_now == pytest.approx(0.80) and peer.pct_of_read_now == pytest.approx(0.75)
    rep = pb.BatchPeerReport("tiny", "cpu", "fp32", 8, 4, 2, 2, 10e9, [1], {"1": 10**8}, [ours, peer])
    text = rep.table()
    assert "minillm ÷ llama.cpp at B = 1: 1.11×" in text
    assert "the same, each as a share of the read around its runs: 1.07×" in text
    assert pb._finish(pb.BatchPeerRow("x", 1, samples_tok_s=[5.0]), 100.0, 10e9).pct_of_read_now is None


# ------------------------------------------------------------------------------ vLLM, in its own Python
def test_vllms_aggregate_is_the_sum_of_each_requests_decode_rate():
    from minillm.bench.vllm_worker import aggregate_tok_s
    # 4 gaps in 0.4 s and 4 in 0.5 s: 10 + 8 tok/s
    assert aggregate_tok_s([(5, 10.0, 10.4), (5, 10.0, 10.5)]) == pytest.approx(18.0)
    with pytest.raises(ValueError, match="no decode to time"):
        aggregate_tok_s([(1, 10.0, 10.0)])


def test_vllm_is_unavailable_with_the_reason_where_no_python_has_it(monkeypatch):
    monkeypatch.delenv("MINILLM_VLLM_PYTHON", raising=False)
    rep = pb.run_batch_peers(model="tiny", dtype="fp32", batches=(1,), prompt_tokens=8, new_tokens=4,
                             rounds=1, engines=("minillm", "vLLM"), vllm_python="/nonexistent/python")
    assert rep.get("minillm", 1).status == "ok"
    assert rep.get("vLLM", 1).status.startswith("unavailable: no Python with vLLM given")
    assert "vLLM: unavailable" in rep.table()


FAKE_VLLM = """\
import os
import types
__version__ = "0.0-fake"
print("a banner vLLM prints on stdout")
os.write(1, b"and a log line its C++ libraries write to descriptor 1\\n")


class SamplingParams:
    def __init__(self, max_tokens, **kw):
        self.max_tokens = max_tokens


class LLM:
    def __init__(self, model, **kw):
        import os
        if os.environ.get("FAKE_VLLM_FAILS"):
            raise RuntimeError("this model is not supported")
        assert os.path.isfile(os.path.join(model, "config.json"))

    def generate(self, prompts, params, use_tqdm=False):
        n = params.max_tokens   # each request: n tokens 10 ms apart, so 100 tok/s per request
        return [types.SimpleNamespace(
            outputs=[types.SimpleNamespace(token_ids=[p["prompt_token_ids"][-1]] * n)],
            metrics=types.SimpleNamespace(first_token_ts=5.0, last_token_ts=5.0 + (n - 1) / 100))
            for p in prompts]
"""


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A stand-in ``vllm`` package on the worker's path: the worker's protocol, not vLLM's speed."""
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                   "    return {'prompt_token_ids': prompt_token_ids}\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return sys.executable


def test_vllm_runs_in_its_own_process_and_reports_its_own_stamps(fake_vllm):
    rep = pb.run_batch_peers(model="tiny", dtype="fp32", batches=(1, 2), prompt_tokens=8, new_tokens=5,
                             rounds=2, engines=("vLLM",), vllm_python=fake_vllm)
    assert [rep.get("vLLM", b).samples_tok_s for b in (1, 2)] == [[pytest.approx(100.0)] * 2,
                                                                   [pytest.approx(200.0)] * 2]
    note = rep.notes["vLLM"]
    assert "vLLM 0.0-fake" in note and "offline LLM.generate in its own Python" in note
    assert "greedy tokens in the warm-up:" in note and "of 5 as minillm's" in note


def test_a_vllm_that_fails_to_start_is_unavailable_with_its_error(fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAILS", "1")
    rep = pb.run_batch_peers(model="tiny", dtype="fp32", batches=(1,), prompt_tokens=8, new_tokens=4,
                             rounds=1, engines=("vLLM",), vllm_python=fake_vllm)
    assert rep.get("vLLM", 1).status == ("unavailable: vLLM did not start: "
                                         "RuntimeError: this model is not supported")


def test_a_vllm_worker_that_dies_mid_run_fails_that_engine_only(tmp_path):
    dead = tmp_path / "python"
    dead.write_text(textwrap.dedent("""\
        #!/bin/sh
        echo '{"ready": true, "vllm": "0.0-dies"}'
        echo "killed by the kernel" >&2
        """))
    dead.chmod(dead.stat().st_mode | stat.S_IEXEC)
    rep = pb.run_batch_peers(model="tiny", dtype="fp32", batches=(1,), prompt_tokens=8, new_tokens=4,
                             rounds=1, engines=("minillm", "vLLM"), vllm_python=str(dead))
    assert rep.get("minillm", 1).status == "ok"
    status = rep.get("vLLM", 1).status
    assert status.startswith("failed: RuntimeError: vLLM's worker exited (0)") and "killed by" in status


def test_the_cli_adds_vllm_at_every_batch_and_lists_it_unavailable_without_its_python(tmp_path, monkeypatch):
    import json

    from minillm.cli import main
    monkeypatch.delenv("MINILLM_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("MINILLM_LLAMA_BATCHED_BENCH", raising=False)
    out = tmp_path / "peers.json"
    assert main(["bench", "--model", "tiny", "--dtype", "fp32", "--peers", "--batches", "1,2",
                 "--rounds", "1", "--prompt-tokens", "8", "--new-tokens", "4", "--no-transformers",
                 "--llama-batched-bench", "/nonexistent/llama-batched-bench",
                 "--vllm-python", "/nonexistent/python", "--json", str(out)]) == 0
    rows = {(r["engine"], r["batch"]): r["status"] for r in json.loads(out.read_text())["rows"]}
    assert rows[("minillm", 1)] == rows[("minillm", 2)] == "ok"
    assert all(rows[("vLLM", b)].startswith("unavailable: no Python with vLLM given") for b in (1, 2))
    assert rows[("llama.cpp", 1)].startswith("unavailable")
