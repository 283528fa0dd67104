"""The engine's options through the server, over real HTTP (tiny model, CPU fp32): the engine's options in
ServerConfig, prefix-cache hits in ``usage.prompt_tokens_details.cached_tokens``, ``GET /v1/steps``,
and sampling values validated in one place (SamplingParams) and served safely.

No timing asserts: every check is about values (texts, counts, order), not durations.
"""
from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from minillm.core.step_record import PHASES
from minillm.engine.config import EngineConfig
from minillm.engine.prefix_cache import BLOCK
from minillm.loadgen.http_overhead import arun_concurrent, stream_completion
from minillm.serving.app import MAX_STEPS_LIMIT
from minillm.serving.server import ServerConfig, ServerThread
from minillm.serving.state import _STEP_COPY_TRIES

KEY = "sk-test-v2-0123456789"
MAX_LEN = 256


def _config(**kw) -> ServerConfig:
    return ServerConfig(model="tiny", device="cpu", dtype="fp32", port=0, max_model_len=MAX_LEN,
                        api_keys=[KEY], **kw)


@pytest.fixture(scope="module")
def server():
    srv = ServerThread(_config(max_batch_size=8)).start()
    yield srv
    srv.stop()


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def post(srv, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=auth(), timeout=120)


def complete(srv, body: dict, path: str = "/v1/completions") -> dict:
    r = post(srv, body, path)
    assert r.status_code == 200, r.text
    return r.json()


def long_prompt() -> str:
    """≥ 40 tokens, starting with a nonce: no earlier request shares a 16-token block with it."""
    return (f"{uuid.uuid4().hex} The scheduler admits a request, the prefill fills its KV slot, and "
            "every decode step reads the whole cache again while the batch keeps changing. ") * 2


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def wait_idle(srv, timeout: float = 30.0) -> None:
    import time
    t_end = time.monotonic() + timeout
    while not srv.state.idle():
        assert time.monotonic() < t_end, srv.state.stats()
        time.sleep(0.02)


# ---- ServerConfig holds an EngineConfig ------------------------------------------------------

def test_server_config_holds_the_engine_config():
    c = ServerConfig(model="tiny", device="cpu", max_batch_size=16, max_model_len=128, port=0,
                     scheduling_policy="prefill-first", enable_prefix_caching=False)
    assert c.engine == EngineConfig(model="tiny", device="cpu", max_batch_size=16, max_model_len=128,
                                    scheduling_policy="prefill-first", enable_prefix_caching=False)
    assert (c.model, c.max_batch_size, c.max_model_len, c.port) == ("tiny", 16, 128, 0)   # read through
    e = EngineConfig(model="tiny", max_num_batched_tokens=64)
    assert ServerConfig(engine=e).engine is e
    with pytest.raises(TypeError):
        ServerConfig(engine=e, max_batch_size=2)             # two sources for one option
    with pytest.raises(TypeError, match="nosuch"):
        ServerConfig(nosuch=1)
    with pytest.raises(ValueError, match="scheduling_policy"):
        ServerConfig(scheduling_policy="fifo")               # EngineConfig's own check
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=70000)


def test_engine_options_reach_the_engine():
    srv = ServerThread(_config(max_batch_size=2, scheduling_policy="prefill-first",
                               max_num_batched_tokens=300,
                               enable_prefix_caching=False))
    try:
        eng = srv.state.engine
        assert srv.state.llm.config is srv.config.engine
        assert (eng.scheduler.policy, eng.scheduler.max_num_batched_tokens) == ("prefill-first", 300)
        assert not eng.allocator.enable_prefix_caching
        srv.start()
        body = {"prompt": long_prompt(), "max_tokens": 4, "temperature": 0}
        first, again = complete(srv, body), complete(srv, body)
        assert cached(first["usage"]) == cached(again["usage"]) == 0     # no prefix cache: no hit
        assert first["choices"][0]["text"] == again["choices"][0]["text"]
    finally:
        srv.stop()


# ---- usage.prompt_tokens_details.cached_tokens -----------------------------------------------

def test_cached_tokens_zero_then_a_hit_with_the_same_text(server):
    body = {"prompt": long_prompt(), "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    first = complete(server, body)
    n_prompt = first["usage"]["prompt_tokens"]
    assert n_prompt >= 40
    assert cached(first["usage"]) == 0
    again = complete(server, body)                       # the first one has finished: its slot remembers
    hit = cached(again["usage"])
    assert 0 < hit < n_prompt and hit % BLOCK == 0, again["usage"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    # streamed: the final usage chunk carries the hit too, and the text is the same
    with httpx.Client(timeout=120) as c:
        res = stream_completion(c, server.url, {**body, "stream_options": {"include_usage": True}}, KEY)
    assert res.ok, res.error
    assert res.text == first["choices"][0]["text"]
    assert cached(res.usage) > 0 and cached(res.usage) % BLOCK == 0, res.usage
    # the trace agrees: the `scheduled` event records the hit
    (tr,) = server.traces([again["id"]])
    assert tr.first("scheduled").extra["cached_tokens"] == hit


def test_cached_tokens_in_chat_completions(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    kw = dict(model="tiny", messages=[{"role": "system", "content": long_prompt()},
                                      {"role": "user", "content": "Summarise."}],
              max_tokens=8, temperature=0)
    first = client.chat.completions.create(**kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(**kw)
    hit = again.usage.prompt_tokens_details.cached_tokens
    assert hit > 0 and hit % BLOCK == 0
    assert again.choices[0].message.content == first.choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


# ---- GET /v1/steps ---------------------------------------------------------------------------

def get_steps(srv, headers=None, **params) -> httpx.Response:
    return httpx.get(srv.url + "/v1/steps", params=params, headers=auth() if headers is None else headers,
                     timeout=60)


def test_steps_of_one_request(server):
    wait_idle(server)
    before = get_steps(server, limit=1).json()["data"]
    last_step = before[-1]["step"] if before else -1
    max_tokens = 6
    out = complete(server,
                   {"prompt": long_prompt(), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert cached(out["usage"]) == 0
    body = get_steps(server, limit=100).json()
    assert body["phases"] == list(PHASES)
    mine = [r for r in body["data"] if r["step"] > last_step]
    # the server was idle: these steps are this request's alone (one prefill, then decodes)
    assert [r["step"] for r in mine] == list(range(last_step + 1, last_step + 1 + len(mine)))
    assert sum(r["num_prefill_tokens"] for r in mine) == out["usage"]["prompt_tokens"]
    # the first token comes from the prefill
    assert sum(r["num_decode_tokens"] for r in mine) == max_tokens - 1
    assert sum(r["num_sampled"] for r in mine) == max_tokens
    assert mine[0]["num_prefill_rows"] == 1 and all(r["num_decode_rows"] == 1 for r in mine[1:])
    for r in mine:
        assert r["error"] is None
        assert len(r["t_ns"]) == len(PHASES)
        stamps = [r["t_start_ns"], *r["t_ns"]]
        assert stamps == sorted(stamps), r                    # consecutive phases
        assert set(r["phase_ms"]) == set(PHASES)
        assert sum(r["phase_ms"].values()) == pytest.approx(r["wall_ms"])
    # one request's steps follow each other: each starts after the previous one ended
    assert all(b["t_start_ns"] >= a["t_ns"][-1] for a, b in zip(mine, mine[1:]))


def test_steps_limit_auth_and_validation(server):
    complete(server, {"prompt": "a few steps", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    everything = get_steps(server).json()["data"]
    assert len(everything) >= 4
    two = get_steps(server, limit=2).json()["data"]
    assert [r["step"] for r in two] == [r["step"] for r in everything[-2:]]       # the latest, oldest first
    assert get_steps(server, limit=0).json()["data"] == []
    assert len(get_steps(server, limit=10 ** 30).json()["data"]) <= MAX_STEPS_LIMIT   # capped, not an error
    for bad in ("-1", "abc", "1.5", "", "²", " 3"):
        r = get_steps(server, limit=bad)
        assert r.status_code == 400, (bad, r.status_code, r.text)
        assert r.json()["error"]["param"] == "limit"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = get_steps(server, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "data" not in r.json()


def test_steps_read_while_the_engine_steps(server):
    # readers race the engine thread appending to the ring buffer: never a 500
    async def run() -> tuple[list, list[int]]:
        bodies = [{"prompt": f"{i} racing the ring buffer", "max_tokens": 24, "temperature": 0,
                   "ignore_eos": True}
                  for i in range(4)]
        streams = asyncio.ensure_future(arun_concurrent(server.url, bodies, KEY))
        codes = []
        async with httpx.AsyncClient(timeout=60) as c:
            while not streams.done():
                r = await c.get(server.url + "/v1/steps", headers=auth())
                codes.append(r.status_code)
        return await streams, codes

    results, codes = asyncio.run(run())
    assert all(r.ok for r in results) and codes and set(codes) == {200}


class _ChangingHistory:
    """A step history that is 'appended to' during the first ``failures`` copies."""

    def __init__(self, items: list, failures: int) -> None:
        self.items, self.failures, self.copies = items, failures, 0

    def __iter__(self):
        self.copies += 1
        if self.failures:
            self.failures -= 1
            raise RuntimeError("deque mutated during iteration")
        return iter(self.items)


@pytest.mark.parametrize("failures", [1, _STEP_COPY_TRIES])     # a retry; the last resort (the engine's lock)
def test_step_snapshot_retries_a_copy_that_raced_the_engine(server, monkeypatch, failures):
    complete(server, {"prompt": "three steps", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    wait_idle(server)                                   # nobody steps (appends) while the fake is in place
    real = list(server.state.engine.step_history)[-3:]
    fake = _ChangingHistory(real, failures)
    monkeypatch.setattr(server.state.engine, "step_history", fake)
    assert [r["step"] for r in server.state.steps(2)] == [r.step for r in real[-2:]]
    assert fake.copies == failures + 1
    assert server.state.steps(0) == []


# ---- sampling values: one validation, served safely ------------------------------------------

def test_tiny_temperature_among_six_normal_streams(server):
    prompt = "Greedy below the epsilon"
    greedy = complete(server, {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    wait_idle(server)
    steps_before = get_steps(server, limit=1).json()["data"][-1]["step"]
    normal = [{"prompt": f"stream {i}: sampled as usual", "max_tokens": 16, "temperature": 0.9, "top_p": 0.95,
               "top_k": 50, "seed": i, "ignore_eos": True} for i in range(6)]
    tiny = {"prompt": prompt, "max_tokens": 16, "temperature": 3e-39, "ignore_eos": True}
    results = asyncio.run(arun_concurrent(server.url, [*normal[:3], tiny, *normal[3:]], KEY))
    assert [r.ok for r in results] == [True] * 7, [r.error for r in results]
    assert all(r.finish_reason == "length" and r.usage is None for r in results)
    assert [len(r.record.chunks) > 0 for r in results] == [True] * 7
    # temperature 3e-39 is greedy (not inf logits, not NaN): the greedy text, token for token
    assert results[3].text == greedy["choices"][0]["text"]
    # and it did share steps with the others (else this test would prove nothing)
    steps = [r for r in get_steps(server, limit=500).json()["data"] if r["step"] > steps_before]
    assert max(r["num_rows"] for r in steps) >= 2 and all(r["error"] is None for r in steps)


def test_tiny_top_p_is_served_and_keeps_the_top_token(server):
    prompt = "Only the most likely token survives"
    greedy = complete(server, {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    out = complete(server, {"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "top_p": 1e-300,
                            "seed": 7, "ignore_eos": True})
    assert out["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_top_k_zero_means_off_as_in_sampling_params(server):
    from minillm.engine.sampling import SamplingParams
    assert SamplingParams(top_k=0).top_k == 0                         # accepted: 0 = off
    base = {"prompt": "Sample me with a seed", "max_tokens": 12, "temperature": 1.0, "seed": 1234,
            "ignore_eos": True}
    off = complete(server, {**base, "top_k": -1})["choices"][0]["text"]
    zero = complete(server, {**base, "top_k": 0})["choices"][0]["text"]
    assert zero == off
    r = post(server, {**base, "top_k": -2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
    assert "top_k" in r.json()["error"]["message"]


def test_include_stop_str_in_output(server):
    base = {"prompt": "Where does it stop?", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    text = complete(server, base)["choices"][0]["text"]
    assert len(text) >= 4, text
    stop = text[2:4]
    i = text.find(stop)
    without = complete(server, {**base, "stop": [stop]})
    with_stop = complete(server, {**base, "stop": [stop], "include_stop_str_in_output": True})
    assert without["choices"][0]["text"] == text[:i] and without["choices"][0]["finish_reason"] == "stop"
    assert with_stop["choices"][0]["text"] == text[:i + len(stop)]
    r = post(server, {**base, "include_stop_str_in_output": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include_stop_str_in_output"
