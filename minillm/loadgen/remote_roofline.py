"""10.3's crossover measured through any OpenAI-compatible server (``roofline --base-url``).

For each batch B, B streaming requests are held open at once with long outputs (``ignore_eos``), and
from the client's chunk times (the one SSE client, :func:`minillm.loadgen.bench_serve.send_one`):

* **per-request decode tok/s** = 1 / TPOT over the *middle* of each stream: the first and last
  ``trim`` of its chunks are dropped (the first holds the prefill, the last the wind-down), the median
  over the B streams;
* **aggregate tok/s** = every stream's tokens inside the window in which all B were in their middle
  part, divided by that window: the batch really was B there.

Beside them the bounds of :mod:`minillm.perf.roofline`, from the model's config and the hardware's
bandwidth: one request ≤ BW / bytes(B), the batch ≤ B · BW / bytes(B) (bytes(B) = W + B·L·k).

What HTTP adds: every token is one SSE event through the server's HTTP stack and the client's, so a
chunk's time is the step's end plus serialisation, the socket and the client's event loop; a server
that packs several tokens into one chunk hides the gaps inside it (tokens per chunk is reported).
The sweep stops at the server's limit: when a batch's requests fail, or queue (the B streams were
never all in their middle part at once: the server ran fewer than B at a time).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from minillm.loadgen.bench_serve import BenchConfig, RequestRecord, first_model, send_one
from minillm.loadgen.datasets import BenchRequest

HTTP_NOTE = ("measured through HTTP: each token is one SSE event through the server's HTTP stack and the "
             "client's (serialisation, socket, event loop), so these rates include that path; a chunk "
             "holding several tokens hides the gaps inside it")
QUEUED_OVERLAP = 0.5     # all B streams must share at least half of a stream's middle part


@dataclass
class RemoteRow:
    batch: int
    n_ok: int
    n_failed: int
    per_request_tok_s: float | None       # median over streams of 1 / TPOT(middle)
    per_request_spread: tuple[float, float] | None    # min, max over the streams
    aggregate_tok_s: float | None         # tokens of all streams in the shared window / window
    window_s: float                       # the shared middle window (≤ 0: the streams never overlapped)
    tokens_per_chunk: float | None        # usage.completion_tokens / non-empty chunks
    status: str                           # "ok" | "queued" | "failed"
    note: str = ""
    bound_per_request_tok_s: float | None = None
    bound_aggregate_tok_s: float | None = None
    server_running: float | None = None   # the most the server's own gauge said (None: not exported)
    server_waiting: float | None = None


@dataclass
class Bound:
    """The roofline beside the measurement: where each number came from."""
    bandwidth: float | None               # bytes/s, all devices together (× tp)
    bandwidth_source: str
    weight_bytes: float | None            # W read per step at batch 1
    kv_bytes_per_token: float | None
    context: int                          # the mean tokens in the KV cache over the middle of a stream
    config_source: str
    dtype: str | None
    peak_flops: float | None = None

    def per_request(self, cfg, dtype_bytes: int, batch: int) -> float | None:
        from minillm.perf.roofline import decode_step_bytes
        if self.bandwidth is None or cfg is None:
            return None
        return self.bandwidth / decode_step_bytes(cfg, dtype_bytes, batch, self.context)


@dataclass
class RemoteRooflineResult:
    base_url: str
    model: str
    max_tokens: int
    trim: float
    rows: list[RemoteRow]
    bound: Bound
    stopped: str | None                   # why the sweep ended before the last batch asked
    hardware: str | None
    parallel: str
    started: str
    http_note: str = HTTP_NOTE
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        b = self.bound
        bw = (f"{b.bandwidth / 1e9:.0f} GB/s ({b.bandwidth_source})" if b.bandwidth
              else f"not known ({b.bandwidth_source})")
        wb = f"{b.weight_bytes / 1e9:.3f} GB" if b.weight_bytes else "not known"
        lines = [f"decode roofline through {self.base_url} (model {self.model}, hardware "
                 f"{self.hardware or 'not stated'}, {self.parallel})",
                 f"bandwidth {bw}; weights read per step {wb} ({b.config_source}, {b.dtype or 'dtype ?'}); "
                 f"KV context ≈ {b.context} tokens",
                 HTTP_NOTE, "",
                 f"{'B':>4} {'status':>7} {'per-req tok/s':>14} {'bound':>9} {'aggregate tok/s':>16} "
                 f"{'bound':>10} {'window s':>9} {'tok/chunk':>9} {'srv run/wait':>12}"]
        for r in self.rows:
            waiting = "-" if r.server_waiting is None else f"{r.server_waiting:g}"
            srv = "-" if r.server_running is None else f"{r.server_running:g}/{waiting}"
            lines.append(f"{r.batch:>4} {r.status:>7} {_f(r.per_request_tok_s):>14} "
                         f"{_f(r.bound_per_request_tok_s):>9} {_f(r.aggregate_tok_s):>16} "
                         f"{_f(r.bound_aggregate_tok_s):>10} {r.window_s:>9.2f} "
                         f"{_f(r.tokens_per_chunk, 2):>9} "
                         f"{srv:>12}" + (f"  {r.note}" if r.note else ""))
        if self.stopped:
            lines.append(f"stopped: {self.stopped}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


# ---------------------------------------------------------------------------------------------
# From chunk times to rates
def _token_chunks(rec: RequestRecord) -> list[int]:
    """The arrival times (ns) of the chunks that carried text."""
    return [t for t, _, text in rec.record.chunks if text]


def _middle(times: Sequence[int], trim: float) -> tuple[int, int] | None:
    """Indices (i, j) of the middle part: ``trim`` of the chunks dropped at each end, at least one."""
    n = len(times)
    k = max(1, int(n * trim))
    i, j = k, n - 1 - k
    return (i, j) if j > i else None


def stream_rates(records: Sequence[RequestRecord], trim: float = 0.1) -> dict[str, Any]:
    """Per-request and aggregate steady-state tok/s of streams that ran together (module docstring)."""
    per, spans, tpcs = [], [], []
    for rec in records:
        times = _token_chunks(rec)
        mid = _middle(times, trim)
        if mid is None or not rec.ok:
            continue
        i, j = mid
        tokens = rec.record.completion_tokens or len(times)
        tpc = tokens / len(times)
        dt = (times[j] - times[i]) / 1e9
        if dt <= 0:
            continue
        per.append((j - i) * tpc / dt)
        spans.append((times[i], times[j], times, tpc))
        tpcs.append(tpc)
    if not per:
        return {"per_request": None, "spread": None, "aggregate": None, "window_s": 0.0, "tpc": None,
                "overlap": 0.0}
    w0, w1 = max(s[0] for s in spans), min(s[1] for s in spans)
    window = (w1 - w0) / 1e9
    median_span = statistics.median((s[1] - s[0]) / 1e9 for s in spans)
    aggregate = None
    if window > 0:
        # a chunk at t counts for the gap that ends at t: those in (w0, w1]
        tokens = sum(sum(1 for t in times if w0 < t <= w1) * tpc for _, _, times, tpc in spans)
        aggregate = tokens / window
    return {"per_request": statistics.median(per), "spread": (min(per), max(per)), "aggregate": aggregate,
            "window_s": window, "tpc": statistics.median(tpcs),
            "overlap": window / median_span if median_span > 0 else 0.0}


# ---------------------------------------------------------------------------------------------
# Running the batches
@dataclass
class RemoteRooflineConfig:
    base_url: str
    batches: list[int]
    api_key: str | None = None
    model: str | None = None
    max_tokens: int = 256
    prompt: str = "Tell a long story about the sea."
    trim: float = 0.1
    timeout_s: float = 600.0
    endpoint: str = "/v1/completions"
    poll_s: float = 0.25                  # how often /metrics is read during a batch


async def _run_batch(client, cfg: RemoteRooflineConfig, model: str, batch: int,
                     tag: str) -> tuple[list[RequestRecord], dict[str, float | None]]:
    """B streams at once, while the server's /metrics is polled for its own running and waiting
    counts (the most it reported during the batch; None where it exports none)."""
    import asyncio

    bc = BenchConfig(base_url=cfg.base_url, endpoint=cfg.endpoint, api_key=cfg.api_key, ignore_eos=True,
                     timeout_s=cfg.timeout_s)
    req = BenchRequest(prompt=cfg.prompt, input_len=len(cfg.prompt.split()), output_len=cfg.max_tokens)
    tasks = [asyncio.create_task(send_one(client, bc, model, req, f"roofline-{tag}-b{batch}-{i}", i))
             for i in range(batch)]
    gauges: dict[str, float | None] = {"running": None, "waiting": None}
    await asyncio.wait(tasks, timeout=cfg.poll_s / 4)      # the first poll once the streams are under way
    while not all(t.done() for t in tasks):
        await _poll_gauges(client, cfg.base_url, gauges)
        await asyncio.wait(tasks, timeout=cfg.poll_s)
    return [t.result() for t in tasks], gauges


async def _poll_gauges(client, base_url: str, gauges: dict[str, float | None]) -> None:
    from minillm.loadgen.server_metrics import ascrape, detect_engine
    sc, _ = await ascrape(base_url, client)
    engine = detect_engine(sc) if sc is not None else None
    for key in ("running", "waiting"):
        name = engine.gauges.get(key) if engine else None
        v = sc.value(name) if (sc is not None and name) else None
        if v is not None:
            gauges[key] = max(v, gauges[key] or 0.0)


def _bound_rows(rows: list[RemoteRow], bound: Bound, model_cfg, dtype_bytes: int | None) -> None:
    if model_cfg is None or dtype_bytes is None:
        return
    for r in rows:
        per = bound.per_request(model_cfg, dtype_bytes, r.batch)
        r.bound_per_request_tok_s = per
        r.bound_aggregate_tok_s = per * r.batch if per is not None else None


async def arun_remote_roofline(cfg: RemoteRooflineConfig, bound: Bound, model_cfg=None,
                               dtype_bytes: int | None = None, hardware: str | None = None,
                               parallel: str = "tp=1", transport=None) -> RemoteRooflineResult:
    import os

    import httpx

    kw: dict[str, Any] = {"transport": transport} if transport is not None else {}
    n = max(cfg.batches) + 4
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    rows: list[RemoteRow] = []
    stopped = None
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    tag = os.urandom(3).hex()
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(cfg.timeout_s), **kw) as client:
        model = cfg.model or await first_model(client, cfg.base_url, cfg.api_key)
        await _run_batch(client, cfg, model, 1, tag + "-warmup")       # the first request pays start-up
        for b in cfg.batches:
            recs, gauges = await _run_batch(client, cfg, model, b, tag)
            rows.append(_row(b, recs, cfg.trim, gauges))
            if rows[-1].status != "ok":
                stopped = f"B={b}: {rows[-1].note}"
                break
    _bound_rows(rows, bound, model_cfg, dtype_bytes)
    return RemoteRooflineResult(cfg.base_url, model, cfg.max_tokens, cfg.trim, rows, bound, stopped, hardware,
                                parallel, started)


def _row(batch: int, recs: list[RequestRecord], trim: float, gauges: dict[str, float | None]) -> RemoteRow:
    ok = [r for r in recs if r.ok]
    failed = len(recs) - len(ok)
    rates = stream_rates(ok, trim)
    running, waiting = gauges.get("running"), gauges.get("waiting")
    status, note = "ok", ""
    if failed:
        reasons = sorted({(r.error or "?")[:80] for r in recs if not r.ok})
        status, note = "failed", f"{failed} of {batch} requests failed ({'; '.join(reasons)})"
    elif rates["per_request"] is None:
        status, note = "failed", "no stream had a middle part (max_tokens too small?)"
    elif batch > 1 and rates["overlap"] < QUEUED_OVERLAP:
        status = "queued"
        note = (f"the {batch} streams shared only {rates['overlap']:.0%} of a stream's middle part: the "
                "server ran fewer at once and queued the rest")
    return RemoteRow(batch, len(ok), failed, rates["per_request"], rates["spread"], rates["aggregate"],
                     rates["window_s"], rates["tpc"], status, note, server_running=running,
                     server_waiting=waiting)


def run_remote_roofline(cfg: RemoteRooflineConfig, bound: Bound, model_cfg=None,
                        dtype_bytes: int | None = None, hardware: str | None = None,
                        parallel: str = "tp=1") -> RemoteRooflineResult:
    """:func:`arun_remote_roofline` from synchronous code (a fresh event loop, Jupyter too)."""
    from minillm.loadgen.http_overhead import run_in_fresh_loop
    return run_in_fresh_loop(
        lambda: arun_remote_roofline(cfg, bound, model_cfg, dtype_bytes, hardware, parallel),
        "minillm-remote-roofline")


# ---------------------------------------------------------------------------------------------
# What the bound is computed from
def parse_parallel(text: str | None) -> int:
    """``tp=4`` (or ``tp=4, pp=1``) → 4; the tensor-parallel degree multiplies the bandwidth."""
    if not text:
        return 1
    for part in text.replace(" ", "").split(","):
        k, _, v = part.partition("=")
        if k == "tp":
            tp = int(v)
            if tp < 1:
                raise ValueError(f"--parallel tp must be ≥ 1, got {v}")
            return tp
    raise ValueError(f"--parallel takes tp=N, got {text!r}")


def load_model_config(path: str | None, server_info: dict):
    """(ModelConfig, where it came from): ``--config`` (a checkpoint dir or its config.json), else
    minillm's /v1/server-info ``root`` (a preset name or a local checkpoint dir); (None, why) otherwise."""
    from pathlib import Path

    from minillm.model.config import ModelConfig, get_preset
    if path:
        p = Path(path)
        p = p / "config.json" if p.is_dir() else p
        return ModelConfig.from_hf(p), f"config {p}"
    root = server_info.get("root")
    if root:
        try:
            return get_preset(str(root)), f"preset {root} (from /v1/server-info)"
        except (KeyError, ValueError):
            pass
        p = Path(str(root)) / "config.json"
        if p.is_file():
            return ModelConfig.from_hf(p), f"config {p} (from /v1/server-info)"
    return None, "no model config (give --config DIR_OR_config.json)"


def hardware_bandwidth(hardware: str | None, server_info: dict, tp: int,
                       stated_gbs: float | None = None) -> tuple[float | None, float | None, str, str | None]:
    """(bandwidth B/s × tp, peak FLOP/s or None, its source, the hardware's name). ``--bandwidth``
    first, then ``--hardware`` or /v1/server-info's hardware looked up in the GPU spec table."""
    from minillm.hardware.machine import lookup_gpu_spec
    name = hardware or server_info.get("hardware")
    dtype = server_info.get("dtype") or "bf16"
    if stated_gbs:
        return stated_gbs * 1e9 * tp, None, f"--bandwidth {stated_gbs:g} GB/s × tp={tp}", name
    spec = lookup_gpu_spec(name) if name else None
    if spec is None:
        why = (f"{name!r} is not in the GPU spec table (minillm/hardware/machine.py); give --bandwidth GB/s"
               if name else "no hardware stated: give --hardware NAME or --bandwidth GB/s")
        return None, None, why, name
    peak = spec.flops.get(dtype)
    return spec.bandwidth * tp, (peak * tp if peak else None), f"{spec.source} × tp={tp}", spec.name


def config_dtype(path: str | None) -> str | None:
    """The dtype a Hugging Face config names (``torch_dtype``, or ``dtype`` in newer files), or None."""
    import json
    from pathlib import Path
    if not path:
        return None
    p = Path(path)
    p = p / "config.json" if p.is_dir() else p
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = d.get("torch_dtype") or d.get("dtype")
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(str(name)) if name else None


def server_bound(base_url: str, api_key: str | None, max_tokens: int, config: str | None = None,
                 hardware: str | None = None, tp: int = 1, bandwidth_gbs: float | None = None,
                 dtype: str | None = None):
    """Everything the bound of a server's batches needs, from what it says of itself
    (``/v1/server-info``, minillm's) and what the caller states: returns (the :class:`Bound`, the
    model's config or None, bytes per weight, the hardware's name)."""
    from minillm.core.device import dtype_bytes
    from minillm.perf.roofline import weight_bytes_per_step
    info = fetch_server_info(base_url, api_key)
    model_cfg, cfg_source = load_model_config(config, info)
    # vLLM's "auto" serves a checkpoint in the dtype its config names: a float32 checkpoint read as
    # bf16 halves the bytes and doubles the bound (seen against vLLM's CPU build)
    dtype = dtype or info.get("dtype") or config_dtype(config) or "bf16"
    nbytes = dtype_bytes(dtype)
    bw, peak, bw_source, hw = hardware_bandwidth(hardware, info, tp, bandwidth_gbs)
    context = max(1, max_tokens // 2 + 8)     # the KV cache's mean length over a stream's middle
    weights = weight_bytes_per_step(model_cfg, nbytes, 1) if model_cfg else None
    kv = model_cfg.kv_bytes_per_token(nbytes) if model_cfg else None
    return Bound(bw, bw_source, weights, kv, context, cfg_source, dtype, peak), model_cfg, nbytes, hw


def fetch_server_info(base_url: str, api_key: str | None) -> dict:
    """minillm's ``GET /v1/server-info``; {} from a server that has none (vLLM, SGLang, llama.cpp)."""
    import httpx
    root = base_url.rstrip("/")
    root = root[:-3] if root.endswith("/v1") else root
    try:
        r = httpx.get(root + "/v1/server-info", timeout=10,
                      headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    except httpx.HTTPError:
        return {}
    return r.json() if r.status_code == 200 else {}
