"""GET /metrics under vLLM's names (minillm.serving.prom). Every expected number below is worked out
by hand from the timestamps of the traces in this file (1 ms = 1_000_000 ns); the rendered text
is read back with prometheus_client's own parser, as Prometheus would read it."""
import math

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from minillm.core.trace import Trace
from minillm.engine.prefix_cache import SlotAllocator
from minillm.metrics.definitions import ClientRecord, client_request_metrics, request_metrics
from minillm.serving.prom import (
    DASHBOARD_NAMES,
    LEGACY_DASHBOARD_NAMES,
    ServingMetrics,
    build_1_2_5_buckets,
)

MS = 1_000_000
MODEL = "tiny-llama"

# Every series that vLLM's example dashboard queries, copied from its PromQL expressions:
# vllm-project/vllm examples/observability/prometheus_grafana/grafana.json @ 4b5c627c
# (each filtered by {model_name="$model_name"}; the model picker is label_values(model_name)).
DASHBOARD_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",                      # sum by(finished_reason)
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)
# The older copy, examples/online_serving/prometheus_grafana/grafana.json @ e88892c9, queries these
# instead of inter_token_latency / kv_cache_usage_perc (its num_requests_swapped and
# cpu_cache_usage_perc are vLLM v0 only: vLLM v1 does not export them either).
LEGACY_DASHBOARD_SERIES = (
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:gpu_cache_usage_perc",
)
# vLLM's buckets, vllm/v1/metrics/loggers.py (PrometheusStatLogger)
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0]
VLLM_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                        60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def make_trace(rid, events):
    tr = Trace(rid)
    for ev in events:
        name, t_ms, extra = ev if len(ev) == 3 else (*ev, {})
        tr.record(name, t_ns=round(t_ms * MS), **extra)
    return tr


def trace_a():
    """4 tokens. queue 1→3 ms; prefill 3→12 ms (first token); decode 12→122 ms; gaps 20, 30, 60 ms."""
    return make_trace("a", [
        ("received", 0), ("tokenized", 1, {"n_tokens": 8}), ("enqueued", 1), ("scheduled", 3),
        ("prefill_start", 3), ("prefill_end", 11.5),
        ("token", 12), ("token", 32), ("token", 62), ("token", 122),
        ("finished", 122, {"reason": "length"})])


def trace_b():
    """1 token after 400 ms in the queue. queue 2→402; prefill 402→601; no decode."""
    return make_trace("b", [
        ("received", 0), ("tokenized", 2, {"n_tokens": 20}), ("enqueued", 2), ("scheduled", 402),
        ("prefill_start", 402), ("prefill_end", 600), ("token", 601),
        ("finished", 601, {"reason": "stop"})])


def trace_c():
    """Scheduled, then the client left before the first token: engine abort, server 'disconnected'."""
    return make_trace("c", [
        ("received", 0), ("tokenized", 1, {"n_tokens": 5}), ("enqueued", 1), ("scheduled", 2),
        ("finished", 50, {"reason": "abort"}),
        ("finished", 51, {"reason": "disconnected", "where": "server"})])


def trace_rejected():
    return make_trace("r", [("received", 0), ("rejected", 1, {"status": 429, "code": "rate_limited"})])


def scrape(pm: ServingMetrics):
    """{sample name: {frozenset(labels): value}} from the rendered body, and the families."""
    body, ctype = pm.render()
    assert isinstance(body, bytes) and ctype.startswith("text/plain")
    families = list(text_string_to_metric_families(body.decode()))
    out: dict[str, dict[frozenset, float]] = {}
    for fam in families:
        for s in fam.samples:
            out.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return out, {f.name: f for f in families}, body.decode()


def base_labels(**extra):
    return frozenset({"model_name": MODEL, "engine": "0", **extra}.items())


def value(samples, name, **labels):
    return samples[name][base_labels(**labels)]


def buckets(samples, name):
    """{le: cumulative count} of one histogram series."""
    return {float(dict(k)["le"]): v for k, v in samples[f"{name}_bucket"].items()}


@pytest.fixture
def observed():
    pm = ServingMetrics(MODEL, max_model_len=100)
    assert pm.observe_request(trace_a(), max_tokens=16) is True
    assert pm.observe_request(request_metrics(trace_b())) is True        # RequestMetrics or Trace
    assert pm.observe_request(trace_c()) is True
    assert pm.observe_request(trace_rejected()) is False                 # never reached the engine
    return pm


# ------------------------------------------------------------------------------------ names
def test_every_dashboard_series_is_exposed_with_model_name():
    pm = ServingMetrics(MODEL)
    samples, _, _ = scrape(pm)
    for name in DASHBOARD_SERIES:
        assert name in samples, f"the dashboard queries {name}, not exposed"
        assert all(dict(k).get("model_name") == MODEL for k in samples[name]), name
    for name in LEGACY_DASHBOARD_SERIES:
        assert name not in samples, f"{name} is deprecated in vLLM: only with legacy_names=True"
    # the module's own list (for the README and the server) says the same as the dashboard
    assert ({n for n in DASHBOARD_NAMES}
            == {s.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                for s in DASHBOARD_SERIES})
    assert (set(LEGACY_DASHBOARD_NAMES)
            == {s.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                for s in LEGACY_DASHBOARD_SERIES})


def test_legacy_dashboard_series_with_legacy_names():
    pm = ServingMetrics(MODEL, legacy_names=True)
    pm.observe_request(trace_a())
    pm.set_load(1, 2, 0.25)
    samples, _, _ = scrape(pm)
    for name in DASHBOARD_SERIES + LEGACY_DASHBOARD_SERIES:
        assert name in samples, name
    # the old names carry the same observations as the new ones, as in vLLM
    assert (buckets(samples, "vllm:time_per_output_token_seconds")
            == buckets(samples, "vllm:inter_token_latency_seconds"))
    assert value(samples, "vllm:time_per_output_token_seconds_sum") == pytest.approx(0.110, abs=1e-12)
    assert value(samples, "vllm:gpu_cache_usage_perc") == value(samples, "vllm:kv_cache_usage_perc") == 0.25


def test_types_and_exact_exposed_names():
    """Counters are declared without _total (prometheus_client adds it): the exposed sample is
    exactly vLLM's name, once, and never a doubled ..._total_total."""
    _, families, text = scrape(ServingMetrics(MODEL))
    expected = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
        "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
        "vllm:request_time_per_output_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
        "vllm:request_inference_time_seconds": "histogram",
        "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
        "vllm:request_max_num_generation_tokens": "histogram", "vllm:request_params_max_tokens": "histogram",
    }
    for name, typ in expected.items():
        assert families[name].type == typ, name
    lines = text.splitlines()
    for counter in ("prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits"):
        assert sum(line.startswith(f"vllm:{counter}_total{{") for line in lines) == 1, counter
        assert f"# TYPE vllm:{counter}_total counter" in lines
    assert "_total_total" not in text
    assert sum(line.startswith("vllm:request_success_total{") for line in lines) == 5


def test_label_sets_are_vllms():
    pm = ServingMetrics(MODEL)
    pm.observe_request(trace_a())
    samples, _, _ = scrape(pm)
    for name, series in samples.items():
        if not name.startswith("vllm:"):
            continue
        for labels in series:
            keys = set(dict(labels))
            if name.startswith("vllm:request_success"):
                assert keys == {"model_name", "engine", "finished_reason"}, name
            elif name.endswith("_bucket"):
                assert keys == {"model_name", "engine", "le"}, name
            else:
                assert keys == {"model_name", "engine"}, name
            assert dict(labels)["model_name"] == MODEL and dict(labels)["engine"] == "0"
    reasons = {dict(k)["finished_reason"] for k in samples["vllm:request_success_total"]}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}    # vLLM's FINISH_REASON_STRINGS


def test_buckets_are_vllms():
    samples, _, _ = scrape(ServingMetrics(MODEL, max_model_len=2048))
    def finite(name):
        return sorted(le for le in buckets(samples, name) if math.isfinite(le))
    assert finite("vllm:time_to_first_token_seconds") == VLLM_TTFT_BUCKETS
    assert finite("vllm:inter_token_latency_seconds") == VLLM_ITL_BUCKETS
    assert finite("vllm:request_time_per_output_token_seconds") == VLLM_ITL_BUCKETS
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert finite(f"vllm:{name}") == VLLM_LATENCY_BUCKETS, name
    assert finite("vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]


def test_everything_starts_at_zero():
    samples, _, _ = scrape(ServingMetrics(MODEL))
    assert value(samples, "vllm:prompt_tokens_total") == 0
    assert value(samples, "vllm:num_requests_running") == 0
    assert value(samples, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(samples, "vllm:time_to_first_token_seconds_count") == 0


# ------------------------------------------------------------------------------ the values
def test_counters_add_up(observed):
    samples, _, _ = scrape(observed)
    # prompt/generation tokens only for requests that got a token (c never did): 8 + 20, 4 + 1
    assert value(samples, "vllm:prompt_tokens_total") == 28
    assert value(samples, "vllm:generation_tokens_total") == 5
    ok = {r: value(samples, "vllm:request_success_total", finished_reason=r)
          for r in ("stop", "length", "abort", "error", "repetition")}
    assert ok == {"stop": 1, "length": 1, "abort": 1, "error": 0, "repetition": 0}   # c: disconnected → abort


def test_ttft_and_itl_histograms(observed):
    samples, _, _ = scrape(observed)
    # TTFT: a 12 ms, b 601 ms
    assert value(samples, "vllm:time_to_first_token_seconds_count") == 2
    assert value(samples, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.613, abs=1e-12)
    b = buckets(samples, "vllm:time_to_first_token_seconds")
    assert (b[0.01], b[0.02], b[0.5], b[0.75], b[math.inf]) == (0, 1, 1, 2, 2)
    # ITL: a's gaps 20, 30, 60 ms (b has one token: no gap)
    assert value(samples, "vllm:inter_token_latency_seconds_count") == 3
    assert value(samples, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.110, abs=1e-12)
    b = buckets(samples, "vllm:inter_token_latency_seconds")
    assert (b[0.01], b[0.025], b[0.05], b[0.075], b[math.inf]) == (0, 1, 2, 3, 3)
    # per-request TPOT: only a (≥ 2 tokens): (122 − 12) / 3 ms
    assert value(samples, "vllm:request_time_per_output_token_seconds_count") == 1
    assert value(samples,
                 "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.110 / 3, abs=1e-12)


def test_e2e_queue_prefill_decode_histograms(observed):
    samples, _, _ = scrape(observed)
    # E2E: a 122 ms, b 601 ms, c (no token) received → last finished = 51 ms
    assert value(samples, "vllm:e2e_request_latency_seconds_count") == 3
    assert value(samples, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(0.774, abs=1e-12)
    b = buckets(samples, "vllm:e2e_request_latency_seconds")
    assert (b[0.3], b[0.5], b[0.8]) == (2, 2, 3)
    # queue: a 1 → 3 ms = 2 ms, b 2 → 402 ms = 400 ms (c: no token, no split)
    assert value(samples, "vllm:request_queue_time_seconds_count") == 2
    assert value(samples, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.402, abs=1e-12)
    b = buckets(samples, "vllm:request_queue_time_seconds")
    assert (b[0.3], b[0.5]) == (1, 2)
    # prefill: scheduled → first token: a 3 → 12 ms, b 402 → 601 ms
    assert value(samples, "vllm:request_prefill_time_seconds_count") == 2
    assert value(samples, "vllm:request_prefill_time_seconds_sum") == pytest.approx(0.009 + 0.199, abs=1e-12)
    # decode: first → last token: a 12 → 122 ms, b 0
    assert value(samples, "vllm:request_decode_time_seconds_count") == 2
    assert value(samples, "vllm:request_decode_time_seconds_sum") == pytest.approx(0.110, abs=1e-12)
    # inference = prefill + decode: a 3 → 122 ms, b 402 → 601 ms
    assert value(samples,
                 "vllm:request_inference_time_seconds_sum") == pytest.approx(0.119 + 0.199, abs=1e-12)


def test_phase_times_reuse_the_ttft_breakdown():
    """queue and prefill are the breakdown's stages (minillm.metrics.definitions.STAGES), not new clocks."""
    m = request_metrics(trace_a())
    queue, prefill, decode = ServingMetrics.phase_times(m)
    assert queue == m.breakdown["queue"] == pytest.approx(0.002, abs=1e-12)
    assert prefill == pytest.approx(m.breakdown["prefill"] + m.breakdown["first_token"], abs=1e-15)
    assert prefill == pytest.approx(0.009, abs=1e-12)
    assert decode == pytest.approx(sum(m.itl_s), abs=1e-12)


def test_request_length_histograms(observed):
    samples, _, _ = scrape(observed)
    # prompts 8, 20, 5 (buckets 1, 2, 5, 10, 20, 50, 100 for max_model_len 100)
    assert value(samples, "vllm:request_prompt_tokens_count") == 3
    assert value(samples, "vllm:request_prompt_tokens_sum") == 33
    b = buckets(samples, "vllm:request_prompt_tokens")
    assert (b[2], b[5], b[10], b[20], b[100]) == (0, 1, 2, 3, 3)
    # outputs 4, 1, 0
    assert value(samples, "vllm:request_generation_tokens_sum") == 5
    assert value(samples, "vllm:request_max_num_generation_tokens_sum") == 5
    assert value(samples, "vllm:request_max_num_generation_tokens_count") == 3
    # max_tokens was given for a only
    assert value(samples, "vllm:request_params_max_tokens_count") == 1
    assert value(samples, "vllm:request_params_max_tokens_sum") == 16


def test_trace_and_metrics_give_the_same_scrape():
    by_trace, by_metrics = ServingMetrics(MODEL), ServingMetrics(MODEL)
    for tr in (trace_a(), trace_b(), trace_c()):
        by_trace.observe_request(tr)
        by_metrics.observe_request(request_metrics(tr))
    def drop_created(s):
        return {k: v for k, v in s.items() if not k.endswith("_created")}
    assert drop_created(scrape(by_trace)[0]) == drop_created(scrape(by_metrics)[0])


def test_rejected_request_changes_nothing():
    pm = ServingMetrics(MODEL)
    before = scrape(pm)[0]
    assert pm.observe_request(trace_rejected()) is False
    assert scrape(pm)[0] == before


def test_client_side_metrics_are_refused():
    rec = ClientRecord("x", t_sent_ns=0, chunks=[(10 * MS, 1, "a"), (20 * MS, 1, "b")], t_done_ns=21 * MS,
                       prompt_tokens=3)
    with pytest.raises(ValueError, match="client"):
        ServingMetrics(MODEL).observe_request(client_request_metrics(rec))
    with pytest.raises(TypeError):
        ServingMetrics(MODEL).observe_request({"ttft_s": 0.1})


def test_unknown_finish_reason_is_still_counted():
    pm = ServingMetrics(MODEL)
    tr = make_trace("w", [("received", 0), ("token", 5), ("finished", 5, {"reason": "weird"})])
    pm.observe_request(tr)
    samples, _, _ = scrape(pm)
    assert value(samples, "vllm:request_success_total", finished_reason="weird") == 1


# ------------------------------------------------------------------------------ gauges, cache
def test_set_load_sets_the_gauges():
    pm = ServingMetrics(MODEL)
    pm.set_load(running=3, waiting=7, kv_usage=0.625)
    pm.set_load(running=2, waiting=5, kv_usage=0.5)            # a gauge is the latest value
    samples, _, _ = scrape(pm)
    assert value(samples, "vllm:num_requests_running") == 2
    assert value(samples, "vllm:num_requests_waiting") == 5
    assert value(samples, "vllm:kv_cache_usage_perc") == 0.5
    with pytest.raises(ValueError, match="fraction"):
        pm.set_load(1, 0, 62.5)                                # a percentage, not a fraction
    with pytest.raises(ValueError):
        pm.set_load(-1, 0, 0.1)


def test_prefix_cache_counts_tokens_like_vllm():
    """Feed the allocator's real decisions: queried = prompt tokens, hits = cached tokens."""
    pm = ServingMetrics(MODEL)
    alloc = SlotAllocator(2)
    p1 = list(range(1, 41))                                    # 40 tokens
    p2 = p1[:35] + [99] * 15                                   # shares 35, so 2 whole blocks = 32 hit
    queried = 0
    slot, cached = alloc.allocate("r1", p1)
    pm.add_prefix_cache(len(p1), cached)
    queried += len(p1)
    alloc.free(slot, p1)
    slot, cached = alloc.allocate("r2", p2)
    pm.add_prefix_cache(len(p2), cached)
    queried += len(p2)
    assert cached == 32
    samples, _, _ = scrape(pm)
    assert value(samples, "vllm:prefix_cache_queries_total") == queried == 90
    assert value(samples, "vllm:prefix_cache_hits_total") == alloc.hit_tokens == 32
    with pytest.raises(ValueError):
        pm.add_prefix_cache(10, 11)


# ------------------------------------------------------------------------------ registries
def test_each_instance_has_its_own_registry():
    a, b = ServingMetrics(MODEL), ServingMetrics(MODEL)         # would raise on a shared registry
    a.observe_request(trace_a())
    assert value(scrape(a)[0], "vllm:generation_tokens_total") == 4
    assert value(scrape(b)[0], "vllm:generation_tokens_total") == 0
    assert not any(n.startswith("vllm:") for n in REGISTRY._names_to_collectors)
    reg = CollectorRegistry()
    c = ServingMetrics("other", registry=reg)
    assert c.registry is reg and b"vllm:num_requests_running" in c.render()[0]


def test_constructor_checks():
    with pytest.raises(ValueError):
        ServingMetrics("")
    with pytest.raises(ValueError):
        ServingMetrics(MODEL, max_model_len=0)
