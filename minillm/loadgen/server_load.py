"""``python -m minillm bench-server``: how many requests per second ``serve`` sustains, and what
each request costs in memory, measured from outside the server process.

- **Throughput**: ``serve --model tiny`` in its own process; ``wrk`` (a well-kept load generator
  in C, Debian's ``wrk`` package) posts ``max_tokens=1`` completions over N connections for D
  seconds. Without ``wrk`` on the PATH the command says so and stops: a Python load generator on
  the same 2 cores would measure itself.
- **Memory**: the server's resident set size (``VmRSS`` in ``/proc/<pid>/status``) after a
  warm-up and after every further 1,000 requests, with the trace store's byte bound as given
  (``--trace-store-bytes``): growth per 1,000 requests, before and after the bound is reached.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from minillm.core.result import Result
from minillm.loadgen.serve_process import ServeProcess

WRK_LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %(key)s"
wrk.body = '%(body)s'
"""


@dataclass
class ServerLoad(Result):
    model: str
    connections: int
    duration_s: float
    wrk: str | None
    requests_per_s: float | None = None
    latency_p50_ms: float | None = None
    latency_p99_ms: float | None = None
    non_2xx: int = 0
    rss_mb: list[float] = field(default_factory=list)      # after the warm-up, then every 1,000 requests
    trace_store_bytes: int = 0

    def table(self) -> str:
        out = [f"serve --model {self.model}: wrk {self.wrk}, {self.connections} connections, "
               f"{self.duration_s:g} s, max_tokens=1"]
        if self.requests_per_s is not None:
            out.append(f"  {self.requests_per_s:.0f} requests/s; latency p50 {self.latency_p50_ms:.1f} ms, "
                       f"p99 {self.latency_p99_ms:.1f} ms; non-2xx {self.non_2xx}")
        if len(self.rss_mb) > 1:
            steps = [b - a for a, b in zip(self.rss_mb, self.rss_mb[1:])]
            out.append(f"  RSS {self.rss_mb[0]:.1f} MB after the warm-up; per 1,000 requests: "
                       + ", ".join(f"{d:+.1f}" for d in steps) + " MB "
                       f"(trace store bound {self.trace_store_bytes / 2**20:g} MiB)")
        return "\n".join(out)


def _rss_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024


def _send(url: str, key: str, n: int, concurrency: int = 16) -> None:
    """n short requests (closed loop, ``concurrency`` at a time) for the memory rounds."""
    import asyncio

    import httpx

    async def main():
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {key}"}) as c:
            async def one(i):
                async with sem:
                    r = await c.post(url + "/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 1})
                    r.raise_for_status()
            await asyncio.gather(*(one(i) for i in range(n)))
    asyncio.run(main())


def _parse_wrk(text: str) -> tuple[float, float, float, int]:
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
    unit = {"us": 1e-3, "ms": 1.0, "s": 1e3}

    def pct(p: str) -> float:
        m = re.search(rf"\s{p}%\s+([\d.]+)(us|ms|s)\b", text)
        return float(m.group(1)) * unit[m.group(2)] if m else float("nan")
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    return rps, pct("50"), pct("99"), int(non2xx.group(1)) if non2xx else 0


def run_server_load(model: str = "tiny", connections: int = 16, duration_s: float = 20, rounds: int = 3,
                    trace_store_bytes: int = 64 << 20, port: int = 8765,
                    torch_threads: int | None = None) -> ServerLoad:
    wrk = shutil.which("wrk")
    res = ServerLoad(model, connections, duration_s, wrk, trace_store_bytes=trace_store_bytes)
    srv = ServeProcess(["--model", model, "--log-level", "warning", "--trace-store-bytes",
                        str(trace_store_bytes)],
                       port=port, torch_threads=torch_threads)
    with srv:
        url, key, pid = srv.url, srv.key, srv.proc.pid
        _send(url, key, 200)                                          # warm-up
        res.rss_mb.append(_rss_mb(pid))
        for _ in range(rounds):
            _send(url, key, 1000)
            res.rss_mb.append(_rss_mb(pid))
        if wrk:
            body = json.dumps({"prompt": "hello", "max_tokens": 1})
            with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
                f.write(WRK_LUA % {"key": key, "body": body})
            out = subprocess.run([wrk, "-t", "1", "-c", str(connections), "-d", f"{duration_s:g}s",
                                  "--latency",
                                  "-s", f.name, url + "/v1/completions"], capture_output=True, text=True,
                                 check=True)
            res.requests_per_s, res.latency_p50_ms, res.latency_p99_ms, res.non_2xx = _parse_wrk(out.stdout)
    return res
