"""``python -m minillm bench-client``: how many requests/s ``bench-serve`` itself can issue, so a
lecture demo knows the client is never its bottleneck (10.6: "is the load generator the thing
you measured?").

The server is a stub that answers instantly: one ASGI app (Starlette) streaming what an
OpenAI-compatible completions stream looks like — one text chunk, a usage chunk, ``[DONE]`` — with
no model behind it. It runs under uvicorn in a **separate process** (a thread would share the
client's GIL and halve both). Printed side by side, in one run:

* ``bench-serve`` against the stub: requests/s, over ``rounds`` rounds (median and spread);
* ``wrk`` against the same stub with the same request (when ``wrk`` is installed): what the stub
  server sustains with a client written in C. It is the bound here: bench-serve cannot beat the
  server it talks to, and its ratio to it says how much of the gap is the Python client.

Both share the machine's cores with the stub server, so on 2 cores these are the figures of a
client and a server competing for them — as in a lecture demo on one laptop.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field


def stub_app():
    """An OpenAI-compatible completions endpoint that answers instantly, no model behind it."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    chunk = ('data: {"id":"stub","object":"text_completion",'
             '"choices":[{"index":0,"text":" ok","finish_reason":"length"}]}\n\n')
    usage = ('data: {"id":"stub","object":"text_completion","choices":[],'
             '"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}\n\n')

    async def completions(request):
        await request.body()

        async def gen():
            yield chunk
            yield usage
            yield "data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StubServer:
    """``with StubServer() as url:`` — the stub under uvicorn in a child process."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or _free_port()
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        code = ("import uvicorn; from minillm.loadgen.client_overhead import stub_app; "
                f"uvicorn.run(stub_app(), host='127.0.0.1', port={self.port}, log_level='warning', "
                "access_log=False)")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        import httpx
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the stub server exited: {self.proc.stderr.read().decode()[-500:]}")
            try:
                if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                    return url
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("the stub server did not start within 30 s")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@dataclass
class ClientOverhead:
    num_prompts: int
    max_concurrency: int
    bench_serve_rps: list[float] = field(default_factory=list)     # one per round
    bench_serve_failed: list[int] = field(default_factory=list)
    wrk_rps: list[float] = field(default_factory=list)
    wrk_missing: str | None = None
    cores: int = os.cpu_count() or 1

    @staticmethod
    def _spread(xs: list[float]) -> str:
        if not xs:
            return "-"
        return f"{statistics.median(xs):8.0f} req/s (min {min(xs):.0f}, max {max(xs):.0f}, {len(xs)} rounds)"

    def ratio(self) -> float | None:
        if not self.bench_serve_rps or not self.wrk_rps:
            return None
        return statistics.median(self.bench_serve_rps) / statistics.median(self.wrk_rps)

    def table(self, target: float = 500.0) -> str:
        med = statistics.median(self.bench_serve_rps) if self.bench_serve_rps else math.nan
        lines = [f"client overhead: {self.num_prompts} streamed requests per round, {self.max_concurrency} "
                 f"in flight, stub server in its own process, {self.cores} cores shared",
                 f"  bench-serve (this client) {self._spread(self.bench_serve_rps)}"
                 f"   failed per round: {self.bench_serve_failed}",
                 "  wrk (C client, the bound) "
                 f"{self._spread(self.wrk_rps) if self.wrk_rps else self.wrk_missing}"]
        r = self.ratio()
        if r is not None:
            lines.append(f"  bench-serve / wrk = {r:.2f}")
        lines.append(f"  target ≥ {target:.0f} req/s: {'met' if med >= target else 'NOT met'} ({med:.0f})")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {**asdict(self), "ratio_to_wrk": self.ratio()}


def _bench_serve_round(url: str, n: int, concurrency: int) -> tuple[float, int]:
    from minillm.loadgen.bench_serve import BenchConfig, run_bench
    res = run_bench(BenchConfig(base_url=url, model="stub", num_prompts=n, max_concurrency=concurrency,
                                random_input_len=4, random_output_len=1, timeout_s=60))
    return float(res.summary.requests_s), res.n_failed


def _wrk_round(url: str, concurrency: int, duration_s: float) -> float | None:
    wrk = shutil.which("wrk")
    if wrk is None:
        return None
    body = json.dumps({"model": "stub", "prompt": "a b c d", "max_tokens": 1, "stream": True,
                       "stream_options": {"include_usage": True}})
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(f'wrk.method = "POST"\nwrk.body = {json.dumps(body)}\n'
                'wrk.headers["Content-Type"] = "application/json"\n')
        script = f.name
    try:
        out = subprocess.run([wrk, "-t1", f"-c{concurrency}", f"-d{duration_s:g}s", "-s", script,
                              url + "/v1/completions"], capture_output=True, text=True,
                             timeout=duration_s + 30).stdout
    finally:
        os.unlink(script)
    for line in out.splitlines():
        if line.startswith("Requests/sec:"):
            return float(line.split()[1])
    return None


def measure_client_overhead(num_prompts: int = 2000, max_concurrency: int = 64, rounds: int = 3,
                            wrk_duration_s: float = 5.0) -> ClientOverhead:
    """Rounds alternate bench-serve and wrk against one stub server (interleaved, so a change in
    the machine's load shows in both)."""
    if num_prompts < 1 or max_concurrency < 1 or rounds < 1:
        raise ValueError("num_prompts, max_concurrency and rounds must be ≥ 1")
    out = ClientOverhead(num_prompts, max_concurrency)
    with StubServer() as url:
        _bench_serve_round(url, min(200, num_prompts), max_concurrency)      # warm-up, not counted
        for _ in range(rounds):
            rps, failed = _bench_serve_round(url, num_prompts, max_concurrency)
            out.bench_serve_rps.append(rps)
            out.bench_serve_failed.append(failed)
            w = _wrk_round(url, max_concurrency, wrk_duration_s)
            if w is None:
                out.wrk_missing = "wrk not on the PATH (apt install wrk): no bound measured"
            else:
                out.wrk_rps.append(w)
    return out
