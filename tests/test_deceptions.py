"""The four self-deceptions of 10.6 (minillm/bench/deceptions.py) against a real tiny server:
each returns both variants with the fields notebook 06 plots, and the figures draw from them.
Correctness only: which run is which, what was sent, what the server reported; never timings."""
from __future__ import annotations

import json
import math

import pytest

from minillm.bench import deceptions as dec
from minillm.loadgen.bench_serve import BenchConfig
from minillm.serving.server import ServerConfig, ServerThread

KEY = "sk-deceptions-0123456789"


def _server() -> ServerThread:
    return ServerThread(ServerConfig(model="tiny", device="cpu", dtype="fp32", port=0, api_keys=[KEY],
                                     max_model_len=512, max_batch_size=8)).start()


@pytest.fixture(scope="module")
def server():
    srv = _server()
    yield srv
    srv.stop()


def _cfg(url: str, **kw) -> BenchConfig:
    base = dict(base_url=url, api_key=KEY, num_prompts=6, random_input_len=40, random_output_len=6,
                ignore_eos=True, timeout_s=120, max_concurrency=2)
    base.update(kw)
    return BenchConfig(**base)


def _check_pair(pair: dec.DeceptionPair, n: int) -> None:
    assert len(pair.deceptive.records) == n and len(pair.honest.records) == n
    assert pair.lesson and pair.numbers
    for k, (d, h) in pair.numbers.items():
        assert d is None or isinstance(d, float), k
    d = pair.to_dict()
    json.dumps(d)
    assert set(d) >= {"name", "numbers", "lesson", "deceptive", "honest"}
    assert "deceptive" in pair.table() and pair.lesson in pair.table()


def test_fixed_vs_lognormal_same_mean_longer_tail(server):
    pair = dec.fixed_vs_lognormal(_cfg(server.url, num_prompts=12, random_input_len=32, tokenizer="default"),
                                  sigma=1.0)
    _check_pair(pair, 12)
    assert pair.deceptive.config.dataset_name == "random" and pair.deceptive.config.random_range_ratio == 0
    assert pair.honest.config.dataset_name == "lognormal"
    # the lognormal's median is shrunk so its (unclipped) mean is the fixed length: e^(-1/2)·32 ≈ 19
    assert pair.honest.config.random_input_len == round(32 * math.exp(-0.5))
    fixed_in = {r.usage["prompt_tokens"] for r in pair.deceptive.records if r.usage}
    assert max(fixed_in) - min(fixed_in) <= 2       # one length in tokens (± a merge at the cut)
    longest = pair.extra["longest_prompt"]
    assert longest[1] > longest[0]                                     # the tail the fixed run left out
    assert set(pair.numbers) == {"ttft_p50_ms", "ttft_p99_ms", "e2e_p99_ms"}
    with pytest.raises(ValueError, match="sigma"):
        dec.fixed_vs_lognormal(_cfg(server.url), sigma=0)


def test_closed_vs_open_matches_the_rate(server):
    pair = dec.closed_vs_open(_cfg(server.url, num_prompts=8), concurrency=2)
    _check_pair(pair, 8)
    closed, opened = pair.deceptive.config, pair.honest.config
    assert math.isinf(closed.request_rate) and closed.max_concurrency == 2
    assert opened.max_concurrency is None
    assert opened.request_rate == pytest.approx(pair.deceptive.summary.requests_s)
    assert pair.extra["matched_rate_rps"] == opened.request_rate


def test_latency_vs_rate_and_its_crossing(server):
    sweep = dec.latency_vs_rate(_cfg(server.url, num_prompts=4), fractions=(1.0, 0.5), concurrency=2,
                                service_rate=20.0)
    assert [p["fraction"] for p in sweep.points] == [0.5, 1.0]
    assert [p["offered_rate"] for p in sweep.points] == [10.0, 20.0]
    assert sweep.closed["max_concurrency"] == 2 and math.isinf(sweep.closed["offered_rate"])
    assert all(p["n_ok"] + p["n_failed"] == 4 for p in sweep.points)
    json.dumps(sweep.to_dict(), default=str)
    # crossing, on constructed points: linear between the last point below and the first above
    s = dec.RateSweep(10, [{"offered_rate": 1, "ttft_p99_ms": 100}, {"offered_rate": 2, "ttft_p99_ms": 600},
                           {"offered_rate": 3, "ttft_p99_ms": 1600}], {})
    assert s.crossing(limit_ms=1000) == pytest.approx(2.4)
    assert s.crossing(limit_ms=5000) is None
    assert s.crossing(limit_ms=50) == 1
    with pytest.raises(ValueError):
        dec.latency_vs_rate(_cfg(server.url), fractions=(0,), service_rate=1)


def test_unique_vs_repeated_counts_the_server_cache_hits(server):
    pair = dec.unique_vs_repeated(_cfg(server.url, max_concurrency=1))
    _check_pair(pair, 6)
    assert len({r.output_text is not None and r.input_len for r in pair.deceptive.records}) == 1
    cached_rep, cached_uni = pair.numbers["cached_prompt_tokens"]
    assert cached_rep > 0 and cached_uni == 0                     # one prompt → hits; unique → none
    hits_rep, hits_uni = pair.extra["prefix_cache_hits_metric"]   # the server's own counter agrees
    assert hits_rep == cached_rep and hits_uni == 0


def test_cold_vs_warm_knows_a_fresh_server():
    srv = _server()
    try:
        pair = dec.cold_vs_warm(_cfg(srv.url, num_prompts=3))
        _check_pair(pair, 3)
        assert pair.extra["server_was_fresh"] is True
        assert pair.honest.config.seed != pair.deceptive.config.seed   # no prompt repeats
        assert pair.deceptive.config.warmup == 0
        again = dec.cold_vs_warm(_cfg(srv.url, num_prompts=2))
        assert again.extra["server_was_fresh"] is False
    finally:
        srv.stop()


def test_scrape_counter_without_metrics_is_none():
    assert dec.scrape_counter(BenchConfig(base_url="http://127.0.0.1:9"), "vllm:request_success") is None


def test_figures_draw_from_the_pairs(server, tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    from minillm.plots import honest
    pair = dec.unique_vs_repeated(_cfg(server.url, num_prompts=3, max_concurrency=1))
    paths = honest.save(honest.plot_pair(pair), "10-6-repeated-prompt", "test", pair.to_dict(), tmp_path)
    assert all(p.exists() for p in paths) and (tmp_path / "data" / "10-6-repeated-prompt.json").exists()
    honest.save(honest.plot_cold_warm(pair), "10-6-cold-vs-warm", "test", pair.to_dict(), tmp_path)
    sweep = dec.RateSweep(4.0, [{"offered_rate": 1, "achieved_rate": 1, "ttft_p50_ms": 10, "ttft_p99_ms": 30},
                                {"offered_rate": 5, "achieved_rate": 3.9, "ttft_p50_ms": 200,
                                 "ttft_p99_ms": 900}],
                          {"achieved_rate": 3.5, "ttft_p99_ms": 25, "max_concurrency": 4})
    honest.save(honest.plot_latency_vs_rate(sweep, slo_ms=1000), "10-6-latency-vs-rate", "test",
                sweep.to_dict(), tmp_path)
    assert (tmp_path / "10-6-latency-vs-rate.svg").exists()


def test_bench_deceptions_command_runs_all_four_pairs(tmp_path, capsys):
    from minillm.cli import main
    rc = main(["bench-deceptions", "--model", "tiny", "--num-prompts", "4", "--input-len", "40",
               "--output-len", "4",
               "--concurrency", "2", "--json", str(tmp_path / "d.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    d = json.loads((tmp_path / "d.json").read_text())
    assert [p["name"] for p in d["pairs"]] == ["cold vs warm", "fixed length vs lognormal",
                                              "closed loop vs open loop", "repeated prompt vs unique prompts"]
    assert d["pairs"][0]["extra"]["server_was_fresh"] is True         # a server of its own, fresh
    assert d["pairs"][3]["numbers"]["cached_prompt_tokens"][1] == 0   # unique: nothing from earlier runs
    assert d["service_rate_rps"] > 0 and "deceptive" in out
