"""The parsers on what real engines sent (tests/fixtures/engines/: vLLM's CPU build and llama.cpp's
llama-server, recorded on this project's VM): the SSE stream of one streamed completion, fed in
pieces, and /metrics before and after 9 requests whose token counts the client recorded (the
streamed one: 10 prompt, 16 output tokens; the short run: 1,193 and 268)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from minillm.loadgen.server_metrics import LLAMACPP, VLLM, detect_engine, parse_metrics, server_view
from minillm.loadgen.sse import SSEParser, delta_text

FIXTURES = Path(__file__).parent / "fixtures" / "engines"
PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS = 10 + 1193, 16 + 268, 9


def _events(engine: str, seed: int) -> list[str]:
    raw = (FIXTURES / engine / "completions_stream.sse").read_text(encoding="utf-8")
    rng, parser, out, i = random.Random(seed), SSEParser(), [], 0
    while i < len(raw):                       # network reads end anywhere, mid-line included
        j = i + rng.randint(1, 40)
        out += parser.feed(raw[i:j])
        i = j
    return out + parser.close()


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_recorded_stream_parses_into_16_tokens_a_usage_event_and_done(engine, seed):
    events = _events(engine, seed)
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    texts = [t for has, t in (delta_text(p, chat=False) for p in payloads) if has and t]
    usage = [p["usage"] for p in payloads if p.get("usage")]
    assert usage and usage[-1]["prompt_tokens"] == 10 and usage[-1]["completion_tokens"] == 16
    # one event per token (llama.cpp sends its finish_reason in one more, empty); the greedy first
    # tokens all three engines give
    assert len(texts) == 16 and texts[:6] == ["cget"] * 5 + ["isit"]


def _view(engine: str):
    d = FIXTURES / engine
    before = parse_metrics((d / "metrics_before.txt").read_text(), 0.0)
    after = parse_metrics((d / "metrics_after.txt").read_text(), 60.0)
    return detect_engine(after), server_view(after, before)


def test_vllms_metrics_count_the_same_requests_and_tokens_as_the_client():
    engine, view = _view("vllm")
    assert engine is VLLM and view.engine == "vLLM" and view.missing() == []
    assert view.counters == {"prompt_tokens": PROMPT_TOKENS, "generation_tokens": OUTPUT_TOKENS}
    for stage in ("queue", "prefill", "decode", "ttft", "tpot", "e2e"):
        assert view.stages[stage].count == REQUESTS, stage
    assert view.stages["itl"].count == OUTPUT_TOKENS - REQUESTS       # one gap fewer than tokens, per request
    assert view.stages["ttft"].mean_s >= view.stages["prefill"].mean_s > 0


def test_llama_cpp_has_no_histograms_and_says_so_but_its_counters_agree():
    engine, view = _view("llamacpp")
    assert engine is LLAMACPP and set(view.missing()) == set(view.stages)
    assert all("not available from this server" in line for line in view.lines()[1:8])
    assert view.counters["prompt_tokens"] == PROMPT_TOKENS
    assert view.counters["generation_tokens"] == OUTPUT_TOKENS
    assert view.counters["generation_seconds"] > 0 and any("decode:" in line for line in view.lines())


def _bench_result_with(view):
    from minillm.loadgen.bench_serve import BenchConfig, BenchResult
    from minillm.metrics.summary import summarize
    return BenchResult(BenchConfig(base_url="http://vllm:8000"), "m", [], [], summarize([]), {},
                       server_view=view.to_dict() if view is not None else None)


def test_a_bench_run_on_vllm_is_diagnosed_from_its_histograms_alone():
    _, view = _view("vllm")
    d = _bench_result_with(view).server_diagnosis()
    assert d.n_completed == REQUESTS
    assert "vLLM names" in d.verdict or any("vLLM names" in n for n in d.notes)
    assert any("not available from this server" in n for n in d.notes)      # no step records in /metrics
    # the queue and prefill means it reports are the histograms' exact ones
    text = d.text()
    assert f"{view.stages['ttft'].mean_s * 1e3:.1f} ms" in text


def test_a_server_without_readable_metrics_gives_no_diagnosis_not_a_made_up_one():
    assert _bench_result_with(None).server_diagnosis() is None
    _, view = _view("llamacpp")                 # counters only: no TTFT or queue histogram
    d = _bench_result_with(view).server_diagnosis()
    assert "not available from this server" in d.verdict
