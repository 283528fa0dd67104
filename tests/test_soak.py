"""A soak test: many clients, hang-ups, thousands of requests, then nothing leaked.

One server (tiny model, CPU fp32, ``max_batch_size=64`` so that most of the 200 streams wait),
one process: the clients are asyncio + ``httpx.AsyncClient`` in the test's thread.

1. warm-up: 200 short requests (allocators, caches, lazy imports settle), then RSS is read;
2. 200 concurrent streams (``max_tokens=8``, ``logprobs=0`` so every token is visible on the
   wire even when its text is held back), about 30 % hanging up at random points;
3. 2,000 short non-streamed requests (``max_tokens=1``), 32 at a time.

Then: no KV slot, queue place or request id leaked (the server goes idle, the allocator's free
slots equal its slots); ``usage`` is right for every completed request (completion_tokens ==
the tokens actually returned, prompt_tokens == ``/tokenize``'s count); the trace store is within
its byte bound; RSS grew by less than ``RSS_BOUND_MB`` after the warm-up (printed).

Sizes: the counts the issue asks for (200 streams, 2,000 requests), not scaled down: about 20 s
on a 2-core CPU (server and clients share one process and its GIL).
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import time

import httpx
import pytest

from minillm.serving.server import ServerConfig, ServerThread

KEY = "sk-soak-0123456789abcdef"
N_WARMUP = 200
N_STREAMS = 200
N_SHORT = 2_000
CONCURRENCY = 32
HANGUP_FRACTION = 0.3
STORE_BYTES = 2 << 20            # small enough that the soak fills it and evicts
RSS_BOUND_MB = 200
PROMPTS = [f"soak prompt {i}: " + " ".join(["prefill", "decode", "queue", "slot", "token", "cache"][j % 6]
                                            for j in range(i % 23 + 1)) for i in range(40)]


def rss_mb() -> float:
    try:
        import psutil
        return psutil.Process(os.getpid()).memory_info().rss / 2**20
    except ImportError:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    raise RuntimeError("cannot read this process' RSS")


@pytest.fixture(scope="module")
def server():
    srv = ServerThread(ServerConfig(model="tiny", device="cpu", dtype="fp32", port=0, api_keys=[KEY],
                                    max_batch_size=64, max_model_len=128, max_queue_depth=1024,
                                    trace_store_bytes=STORE_BYTES)).start()
    yield srv
    srv.stop()


def headers(rid: str | None = None) -> dict[str, str]:
    h = {"Authorization": f"Bearer {KEY}"}
    if rid is not None:
        h["X-Request-Id"] = rid
    return h


async def one_stream(client: httpx.AsyncClient, url: str, body: dict, stop_after: int | None,
                     rid: str | None) -> dict:
    """Stream one completion; count the tokens returned (one logprob entry per token).
    ``stop_after=k`` hangs up after k data events (0: right after the headers)."""
    out = {"status": None, "tokens": 0, "usage": None, "done": False, "finish": None, "id": None,
           "hung_up": False, "prompt": body["prompt"]}
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers(rid)) as r:
        out["status"], out["id"] = r.status_code, r.headers.get("x-request-id")
        if r.status_code != 200:
            await r.aread()
            out["error"] = r.text
            return out
        if stop_after == 0:
            out["hung_up"] = True
            return out
        n = 0
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            n += 1
            if data == "[DONE]":
                out["done"] = True
                break
            ev = json.loads(data)
            assert "error" not in ev, ev
            if ev.get("usage"):
                out["usage"] = ev["usage"]
            for c in ev.get("choices") or []:
                if c.get("logprobs"):
                    out["tokens"] += len(c["logprobs"]["token_logprobs"])
                if c.get("finish_reason"):
                    out["finish"] = c["finish_reason"]
            if stop_after is not None and n >= stop_after:
                out["hung_up"] = True
                break                        # leaving the `async with` closes the connection
    return out


async def one_short(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    r = await client.post(url + "/v1/completions", json=body, headers=headers())
    out = {"status": r.status_code, "prompt": body["prompt"]}
    if r.status_code == 200:
        d = r.json()
        out.update(usage=d["usage"], tokens=len(d["choices"][0]["logprobs"]["token_logprobs"]), id=d["id"])
    else:
        out["error"] = r.text
    return out


async def run_bounded(coros, limit: int) -> list:
    sem = asyncio.Semaphore(limit)

    async def guarded(c):
        async with sem:
            return await c
    return list(await asyncio.gather(*(guarded(c) for c in coros)))


def short_body(rng: random.Random) -> dict:
    return {"prompt": rng.choice(PROMPTS), "max_tokens": 1, "logprobs": 0,
            "temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randrange(1000)}


async def soak(url: str, rng: random.Random) -> tuple[list, list, float]:
    limits = httpx.Limits(max_connections=N_STREAMS + 16, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300), limits=limits) as client:
        await run_bounded([one_short(client, url, short_body(rng)) for _ in range(N_WARMUP)], CONCURRENCY)
        gc.collect()
        rss0 = rss_mb()
        streams = []
        for i in range(N_STREAMS):
            body = {"prompt": rng.choice(PROMPTS), "max_tokens": 8, "logprobs": 0, "stream": True,
                    "stream_options": {"include_usage": True}, "temperature": rng.choice([0, 1.0]),
                    "ignore_eos": rng.random() < 0.5}
            stop = rng.choice([0, 1, 2, 3, 5]) if rng.random() < HANGUP_FRACTION else None
            rid = f"soak-{i}" if i % 3 == 0 else None          # client-chosen ids: claimed, then released
            streams.append(one_stream(client, url, body, stop, rid))
        stream_results = list(await asyncio.gather(*streams))
        short_results = await run_bounded([one_short(client, url, short_body(rng)) for _ in range(N_SHORT)],
                                          CONCURRENCY)
    return stream_results, short_results, rss0


def test_soak_leaks_nothing(server):
    t0 = time.monotonic()
    with httpx.Client(timeout=60) as c:       # prompt_tokens must equal /tokenize's count
        counts = {p: c.post(server.url + "/tokenize", json={"prompt": p}, headers=headers()).json()["count"]
                  for p in PROMPTS}
    streams, shorts, rss0 = asyncio.run(soak(server.url, random.Random(2024)))
    t_load = time.monotonic() - t0

    # -- nothing left inside ------------------------------------------------------------------
    t_end = time.monotonic() + 60
    while not server.state.idle():
        assert time.monotonic() < t_end, f"not idle: {server.state.stats()}"
        time.sleep(0.05)
    engine = server.state.engine
    assert engine.allocator.num_free == engine.cache.num_slots
    stats = server.state.stats()
    assert stats["running"] == stats["waiting"] == stats["streams"] == stats["sequences"] == 0, stats
    assert server.state.gateway.admission.depth == 0
    assert not server.state._ids_in_use, "client request ids were never released"
    assert server.state.loop.failures == 0 and server.state.loop.alive

    # -- usage is right for every completed request -----------------------------------------
    hung = [s for s in streams if s["hung_up"]]
    completed = [s for s in streams if not s["hung_up"]]
    assert all(s["status"] == 200 for s in streams), [s for s in streams if s["status"] != 200][:3]
    assert len(hung) >= N_STREAMS * HANGUP_FRACTION / 2, len(hung)
    for s in completed:
        assert s["done"] and s["usage"] is not None and s["finish"] in ("length", "stop"), s
        assert s["usage"]["completion_tokens"] == s["tokens"] and 1 <= s["tokens"] <= 8, s
        assert s["usage"]["prompt_tokens"] == counts[s["prompt"]], s
        assert s["usage"]["total_tokens"] == s["usage"]["prompt_tokens"] + s["tokens"]
    for s in shorts:
        assert s["status"] == 200, s
        assert s["usage"]["completion_tokens"] == s["tokens"] == 1, s
        assert s["usage"]["prompt_tokens"] == counts[s["prompt"]], s
    assert len({s["id"] for s in shorts}) == N_SHORT

    # -- the trace store keeps to its bound; the hang-ups are recorded -------------------------
    st = server.state.trace_store.stats()
    assert 0 < st["bytes"] <= STORE_BYTES and st["dropped"] > 0, st
    assert st["traces"] + st["dropped"] == N_WARMUP + N_STREAMS + N_SHORT, st

    # -- memory ------------------------------------------------------------------------------
    gc.collect()
    growth = rss_mb() - rss0
    print(f"\nsoak: {N_WARMUP} warm-up + {N_STREAMS} streams ({len(hung)} hung up) + {N_SHORT} short "
          f"requests in {t_load:.1f} s; RSS {rss0:.0f} MB after warm-up, growth {growth:+.1f} MB (bound "
          f"{RSS_BOUND_MB} MB); trace store {st['bytes']} B in {st['traces']} traces, "
          f"{st['dropped']} dropped")
    assert growth < RSS_BOUND_MB, f"RSS grew by {growth:.0f} MB"
