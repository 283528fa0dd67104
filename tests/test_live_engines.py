"""The chapter's tools against real third-party servers that are running now: the interop tests.

Skipped unless ``MINILLM_LIVE_URLS`` names running OpenAI-compatible servers, e.g.
``MINILLM_LIVE_URLS="vllm=http://127.0.0.1:8101,llamacpp=http://127.0.0.1:8102"`` after
``scripts/engines/three_engines.sh``'s set-up (or any vLLM, SGLang or llama-server of your own);
run them with ``python -m pytest -m live_engines tests/test_live_engines.py``. CI has no such
server: ``tests/test_engine_fixtures.py`` checks the same parsers on recorded bytes instead.
"""
from __future__ import annotations

import os

import pytest

from minillm.loadgen.bench_serve import BenchConfig, run_bench
from minillm.loadgen.remote_roofline import Bound, RemoteRooflineConfig, run_remote_roofline
from minillm.loadgen.server_metrics import scrape, server_view


def _servers() -> list[tuple[str, str]]:
    spec = os.environ.get("MINILLM_LIVE_URLS", "")
    pairs = [p.split("=", 1) for p in spec.split(",") if "=" in p]
    return [(name.strip(), url.strip().rstrip("/")) for name, url in pairs]


pytestmark = [pytest.mark.live_engines,
              pytest.mark.skipif(not _servers(), reason="MINILLM_LIVE_URLS names no running server")]
SERVERS = _servers() or [("none", "http://127.0.0.1:9")]


@pytest.mark.parametrize("name, url", SERVERS, ids=[n for n, _ in SERVERS])
def test_every_request_is_accounted_for_and_the_servers_counters_agree(name, url):
    before, _ = scrape(url)
    res = run_bench(BenchConfig(base_url=url, num_prompts=8, max_concurrency=4, dataset_name="lognormal",
                                random_input_len=64, random_output_len=16, ignore_eos=True,
                                tokenizer="default", seed=3))
    assert res.n_ok + res.n_failed == 8 and res.n_ok >= 6, [r.error for r in res.records if not r.ok]
    after, why = scrape(url)
    if after is None:
        pytest.skip(f"{name} has no /metrics: {why}")
    view = server_view(after, before)
    generated = view.counters.get("generation_tokens")
    if generated is not None:           # the server counted what the client received
        assert generated == sum(r.record.completion_tokens or 0 for r in res.records)


@pytest.mark.parametrize("name, url", SERVERS, ids=[n for n, _ in SERVERS])
def test_the_crossover_through_the_server_gives_a_row_per_batch(name, url):
    bound = Bound(None, "not computed here", None, None, 0, "none", None)
    res = run_remote_roofline(RemoteRooflineConfig(base_url=url, batches=[1, 2], max_tokens=48), bound)
    assert [r.batch for r in res.rows] == [1, 2]
    assert all(r.per_request_tok_s and r.aggregate_tok_s for r in res.rows if r.status == "ok")
