"""Prefill and decode are two different workloads (chapter 10.4; design.md §3, §9).

Three measurements, each from the engine's own records (traces and StepRecords):

1. **One roofline for both.** A prompt-length sweep of prefill (one request of T tokens, the
   whole prompt in one engine step: the served path) beside decode steps at batch 1 … 64 (timed
   as ``minillm.bench.sweep`` times them). Every row reports time, tokens/s, FLOPs, bytes,
   arithmetic intensity, FLOP/s, MFU and MBU against this machine's measured ceilings.
2. **The stall as a timeline.** :func:`run_stall` runs ``workload.stall_scenario`` under one
   policy and budget and keeps, per decoding request, each token's time *and the engine step
   that produced it*, plus the long prompt's prefill chunks. Which gap holds the long prefill is
   decided from step numbers (:func:`gaps_by_steps`), never from durations.
3. **The trade-off.** :func:`chunk_tradeoff` sweeps the chunk budget (the step's token budget,
   ``max_num_batched_tokens``) and reports the decoders' max and p99 ITL, the long request's TTFT
   and aggregate output tokens/s.

The formulas (``n`` new tokens of one request whose first ``start`` tokens are already in the KV
cache; ``s`` = 1 when the chunk is the prompt's last and samples a token, else 0):

    FLOPs ≈ 2·P_body·n + 2·V·h·s + 4·layers·heads·head_dim·pairs,
            pairs = n·start + n(n+1)/2          (causal: query i sees start + i + 1 keys)
    bytes ≈ W(n) + n·k + (start + n)·k

- ``P_body``: the matmul parameters without the LM head (q/k/v/o and the MLP); minillm runs the
  LM head (``V·h``) only on the row that samples, so a prefill pays for it once, not T times.
  From position 0 this is 2·P·T plus causal attention ≈ 2·T²·layers·heads·head_dim.
- ``W(n)``: ``roofline.weight_bytes_per_step(cfg, dtype_bytes, n)``: every weight read once, the
  embedding table only for the n rows it gathers, the LM head in full.
- ``n·k``: the K/V this chunk writes; ``(start + n)·k``: the K/V attention reads, counted once.
- **Not counted**: activations (``n·hidden`` per layer and the MLP's ``n·intermediate``, written
  and read between kernels). At long prompts they can outweigh W where they spill out of the
  caches, so the intensity here is the ideal one (an upper bound), the same convention as the
  decode formulas of 10.3.

One new token from ``start = L − 1`` is a decode step at context L: ``prefill_flops(cfg, 1, L − 1)
== roofline.decode_step_flops(cfg, 1, L)``; the bytes differ by the one K/V written (``k``),
which the decode formula leaves out.

MFU = achieved FLOP/s ÷ the measured matmul peak (an n×n×n matmul in the model's dtype).
MBU = achieved bytes/s ÷ the measured **read** bandwidth (``hardware.measure_read_bandwidth``: a sum
over a buffer past the last-level cache; a decode step reads its weights and writes almost nothing).
The copy bandwidth (bytes read + written) is measured and shown beside it, labelled, never the bound.
Result files written before this change hold the copy figure as ``bandwidth`` (``bandwidth_kind``
absent: read as "copy").

``python -m minillm.experiments.prefill_decode`` runs everything and writes one JSON (a reference
run with provenance: host, hardware, versions, command, every sample).
"""
from __future__ import annotations

import math
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

import minillm.perf.roofline as rf
from minillm.core.device import cpu_cores, dtype_bytes, dtype_name
from minillm.hardware.machine import (
    describe_hardware,
    measure_copy_bandwidth,
    measure_matmul_peak,
    measure_read_bandwidth,
)
from minillm.hardware.quiet import NOISY_SPREAD as _NOISY_SPREAD
from minillm.model.config import ModelConfig

NOISY_SPREAD = _NOISY_SPREAD   # p90 / p10 of a row's repeats above which it is flagged (busy.py)

# ----------------------------------------------------------------------------- formulas

def lm_head_params(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.hidden_size


def attention_pairs(tokens: int, start: int = 0) -> int:
    """(query, key) pairs of causal attention for ``tokens`` new queries after ``start`` cached
    positions: query i (0-based) sees ``start + i + 1`` keys."""
    return tokens * start + tokens * (tokens + 1) // 2


def prefill_flops(cfg: ModelConfig, tokens: int, start: int = 0, sampled_rows: int = 1) -> int:
    """FLOPs of one prefill chunk (see the module docstring). ``sampled_rows``: rows that go
    through the LM head (1 for a prompt's last chunk, 0 for the chunks before it)."""
    if tokens < 1 or start < 0:
        raise ValueError(f"a prefill chunk needs tokens ≥ 1 and start ≥ 0, got {tokens}, {start}")
    body = cfg.matmul_params - lm_head_params(cfg)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * attention_pairs(tokens, start)
    return 2 * body * tokens + 2 * lm_head_params(cfg) * sampled_rows + attention


def prefill_bytes(cfg: ModelConfig, dtype_bytes_: int, tokens: int, start: int = 0) -> int:
    """Bytes one prefill chunk moves at least: W(n) + n·k written + (start + n)·k read."""
    if tokens < 1 or start < 0:
        raise ValueError(f"a prefill chunk needs tokens ≥ 1 and start ≥ 0, got {tokens}, {start}")
    k = cfg.kv_bytes_per_token(dtype_bytes_)
    return rf.weight_bytes_per_step(cfg, dtype_bytes_, tokens) + tokens * k + (start + tokens) * k


def prefill_intensity(cfg: ModelConfig, dtype_bytes_: int, tokens: int, start: int = 0) -> float:
    return rf.arithmetic_intensity(prefill_flops(cfg, tokens, start), prefill_bytes(cfg, dtype_bytes_, tokens, start))


def prefill_ridge_length(cfg: ModelConfig, dtype_bytes_: int, ridge: float, max_tokens: int = 1 << 20) -> int | None:
    """The shortest prompt whose prefill intensity reaches the ridge point I* (the formula's
    answer to "when does prefill become compute-bound?"). None if not within max_tokens."""
    if prefill_intensity(cfg, dtype_bytes_, max_tokens) < ridge:
        return None
    lo, hi = 1, max_tokens                       # intensity grows with T: bisect
    while lo < hi:
        mid = (lo + hi) // 2
        if prefill_intensity(cfg, dtype_bytes_, mid) >= ridge:
            hi = mid
        else:
            lo = mid + 1
    return lo


def chunk_sizes(tokens: int, budget: int, decode_rows: int = 0) -> list[int]:
    """How the chunked policy splits a prompt of ``tokens`` when ``decode_rows`` decodes take one
    token each of a ``budget``-token step first (as long as they all keep decoding)."""
    per = budget - decode_rows
    if per < 1:
        raise ValueError(f"a budget of {budget} leaves no room for prefill next to {decode_rows} decodes")
    return [per] * (tokens // per) + ([tokens % per] if tokens % per else [])


def chunked_prefill_flops(cfg: ModelConfig, chunks: Sequence[int]) -> int:
    start, total = 0, 0
    for i, n in enumerate(chunks):
        total += prefill_flops(cfg, n, start, sampled_rows=int(i == len(chunks) - 1))
        start += n
    return total


def chunked_prefill_bytes(cfg: ModelConfig, dtype_bytes_: int, chunks: Sequence[int]) -> int:
    """Bytes of a prompt prefilled chunk by chunk, counted for the prompt alone: every chunk reads
    W again and the K/V of the prompt so far. (When decodes share the step, they share that
    weight read: this is the prompt's own traffic, not the step's.)"""
    start, total = 0, 0
    for n in chunks:
        total += prefill_bytes(cfg, dtype_bytes_, n, start)
        start += n
    return total


# ----------------------------------------------------------------------------- links (PD disaggregation)

@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float            # bytes/s, one direction, spec (not measured)
    source: str


G = 1e9
LINKS: dict[str, Link] = {
    # PCI-SIG PCIe 4.0 / 5.0 base specifications: 16 / 32 GT/s per lane, 128b/130b encoding, x16 link
    "PCIe 4.0 x16": Link("PCIe 4.0 x16", 16e9 * 16 * 128 / 130 / 8, "PCI-SIG PCIe 4.0: 16 GT/s/lane, x16, 128b/130b"),
    "PCIe 5.0 x16": Link("PCIe 5.0 x16", 32e9 * 16 * 128 / 130 / 8, "PCI-SIG PCIe 5.0: 32 GT/s/lane, x16, 128b/130b"),
    # NVIDIA H100 / H200 datasheets: "NVLink: 900 GB/s" (both directions together) for the SXM boards
    "NVLink 4 (H100/H200 SXM)": Link("NVLink 4 (H100/H200 SXM)", 450 * G,
                                     "NVIDIA H100/H200 datasheet: 900 GB/s bidirectional per GPU"),
    # NVIDIA ConnectX-7 / Quantum-2: InfiniBand NDR, 400 Gb/s per port
    "InfiniBand NDR 400G": Link("InfiniBand NDR 400G", 400e9 / 8, "NVIDIA ConnectX-7: 400 Gb/s per port"),
}


def kv_transfer_bytes(cfg: ModelConfig, dtype_bytes_: int, tokens: int) -> int:
    """The KV cache a prefill leaves behind: tokens × k (what PD disaggregation must move)."""
    return tokens * cfg.kv_bytes_per_token(dtype_bytes_)


def bandwidth_words(c: dict) -> str:
    """The ceilings' bandwidth in words: read (the bound) and copy beside it, or an older file's copy."""
    if c.get("bandwidth_kind") == "read":
        out = f"read {c['bandwidth'] / 1e9:.1f} GB/s (the bound)"
        if c.get("copy_bandwidth"):
            out += f", copy {c['copy_bandwidth'] / 1e9:.1f} GB/s (read + write)"
        return out
    return f"copy {c['bandwidth'] / 1e9:.1f} GB/s (read + write)"


def kv_transfer_s(cfg: ModelConfig, dtype_bytes_: int, tokens: int, link_bandwidth: float) -> float:
    return kv_transfer_bytes(cfg, dtype_bytes_, tokens) / link_bandwidth


# ----------------------------------------------------------------------------- rows and results

@dataclass
class RooflineRow:
    """One point of the prefill/decode roofline. Times in ms, rates per second, FLOPs and bytes
    per forward pass, MFU/MBU as fractions."""
    phase: str                              # "prefill" | "decode"
    tokens: int                             # tokens in the forward: the prompt length T, or the batch B
    batch: int                              # requests in the forward: 1 (prefill), B (decode)
    context: int                            # K/V positions a row attends to: T (prefill), L (decode)
    status: str = "ok"                      # "ok" | "oom" | "error: ..."
    time_ms: list[float] = field(default_factory=list)     # the forward's time, every sample
    time_ms_median: float | None = None
    time_ms_p10: float | None = None
    time_ms_p90: float | None = None
    ms_per_token: float | None = None
    tok_s: float | None = None              # tokens / forward time
    flops: int | None = None                # per forward (the formulas)
    bytes: int | None = None
    intensity: float | None = None          # FLOP / byte
    achieved_flops: float | None = None     # FLOP/s
    achieved_bw: float | None = None        # bytes/s
    mfu: float | None = None                # achieved_flops / measured matmul peak
    mbu: float | None = None                # achieved_bw / measured read bandwidth
    # the served path: prefill = prefill_start → prefill_end in the trace (prepare + forward +
    # sample), decode = the whole LLMEngine.step(); and the prefill's TTFT (received → first token)
    served_ms: list[float] = field(default_factory=list)
    served_ms_median: float | None = None
    ttft_ms_median: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def noisy(self) -> bool:
        return bool(self.ok and self.time_ms_p10 and self.time_ms_p90 / self.time_ms_p10 > NOISY_SPREAD)


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=10, method="inclusive")
    return statistics.median(xs), q[0], q[-1]


def _fill(row: RooflineRow, flops: int, bytes_: int, bw: float, peak: float) -> RooflineRow:
    row.time_ms_median, row.time_ms_p10, row.time_ms_p90 = _quantiles(row.time_ms)
    t = row.time_ms_median / 1e3
    row.ms_per_token = row.time_ms_median / row.tokens
    row.tok_s = row.tokens / t
    row.flops, row.bytes = int(flops), int(bytes_)
    row.intensity = rf.arithmetic_intensity(flops, bytes_)
    row.achieved_flops, row.achieved_bw = flops / t, bytes_ / t
    row.mfu, row.mbu = row.achieved_flops / peak, row.achieved_bw / bw
    if row.served_ms:
        row.served_ms_median = statistics.median(row.served_ms)
    return row


@dataclass
class PrefillDecodeResult:
    model: str
    dtype: str
    device: str
    hardware: dict
    host: str
    torch_version: str
    python: str
    command: str
    config: dict
    ceilings: dict                          # bandwidth (B/s, read), copy_bandwidth, peak_flops (FLOP/s), samples
    ridge_point: float                      # I* = peak / bandwidth, FLOP/byte
    decode_context: int
    prefill: list[RooflineRow]
    decode: list[RooflineRow]
    settings: dict = field(default_factory=dict)
    load: dict = field(default_factory=dict)     # 1-min load average before and after, cores
    started: str = ""
    duration_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> PrefillDecodeResult:
        d = dict(d)
        d["prefill"] = [RooflineRow(**r) for r in d["prefill"]]
        d["decode"] = [RooflineRow(**r) for r in d["decode"]]
        return cls(**d)

    def ok(self, phase: str) -> list[RooflineRow]:
        return [r for r in getattr(self, phase) if r.ok]

    def table(self) -> str:
        c = self.ceilings
        out = [f"{self.model} {self.dtype} on {self.hardware.get('summary', self.device)}",
               f"ceilings ({c['source']}): " + bandwidth_words(c) + ", "
               f"matmul {c['peak_flops'] / 1e9:.1f} GFLOP/s → ridge point I* = {self.ridge_point:.1f} FLOP/byte",
               f"{'phase':<8}{'T or B':>7}{'ms':>10}{'ms/tok':>9}{'tok/s':>10}{'FLOP/B':>9}"
               f"{'GFLOP/s':>10}{'GB/s':>8}{'MFU':>7}{'MBU':>7}"]
        for r in self.prefill + self.decode:
            if not r.ok:
                out.append(f"{r.phase:<8}{r.tokens:>7} {r.status}")
                continue
            out.append(f"{r.phase:<8}{r.tokens:>7}{r.time_ms_median:>10.2f}{r.ms_per_token:>9.3f}{r.tok_s:>10.0f}"
                       f"{r.intensity:>9.1f}{r.achieved_flops / 1e9:>10.1f}{r.achieved_bw / 1e9:>8.1f}"
                       f"{100 * r.mfu:>6.0f}%{100 * r.mbu:>6.0f}%{' *' if r.noisy else ''}")
        ratio = cost_ratio(self)
        if ratio:
            out.append(f"one batch-1 decode token costs as much time as {ratio['decode_b1_over_prefill']:.0f} "
                       f"prefill tokens (T={ratio['prefill_tokens']}); at batch {ratio['batch']}: "
                       f"{ratio['decode_bmax_over_prefill']:.1f}")
        for w in busy_warnings(self):
            out.append("WARNING: " + w)
        return "\n".join(out)

    def write(self, path: str | Path) -> Path:
        from minillm.bench.sweep import dumps_strict
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(dumps_strict(self.to_dict()))
        return p


def _load_avg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def busy_warnings(result: PrefillDecodeResult | dict) -> list[str]:
    """Signs that something else used the machine while it was measured (chapter 10.6): rows
    whose samples spread more than NOISY_SPREAD (p90/p10), and a 1-minute load average above the
    core count before the run started. An empty list: no such sign."""
    d = result.to_dict() if isinstance(result, PrefillDecodeResult) else result
    out = []
    noisy = [f"{r['phase']} {r['tokens']}" for r in d["prefill"] + d["decode"]
             if r["status"] == "ok" and r.get("time_ms_p10") and r["time_ms_p90"] / r["time_ms_p10"] > NOISY_SPREAD]
    if noisy:
        out.append(f"noisy rows (p90/p10 of the samples > {NOISY_SPREAD}): {', '.join(noisy)}; something else "
                   f"was using the machine, rerun before trusting them")
    for key, what in (("bandwidth_samples", f"{d.get('ceilings', {}).get('bandwidth_kind', 'copy')} bandwidth"),
                      ("peak_samples", "matmul peak")):
        xs = d.get("ceilings", {}).get(key) or []
        if len(xs) >= 3:
            _, p10, p90 = _quantiles(list(xs))
            if p90 / p10 > NOISY_SPREAD:
                out.append(f"the {what} samples spread ×{p90 / p10:.1f} (p90/p10): the ceilings themselves are noisy")
    load, cores = d.get("load", {}).get("before"), d.get("load", {}).get("cores")
    if load is not None and cores and load > cores:
        out.append(f"the 1-minute load average was {load:.1f} on {cores} cores before the run: "
                   f"other processes competed for the CPU")
    after = d.get("load", {}).get("after")
    if after is not None and cores and after > cores + 1:       # this run's own threads count ~cores
        out.append(f"the 1-minute load average was {after:.1f} on {cores} cores after the run: "
                   f"more runnable work than this run's own threads")
    return out


# ----------------------------------------------------------------------------- the prefill sweep

def default_lengths(device: torch.device | str, fast: bool = False) -> list[int]:
    """16 … 2048 on a CPU, 16 … 4096 on a GPU (powers of two); fast mode: four lengths."""
    if fast:
        return [16, 64, 256, 1024]
    top = 2048 if torch.device(device).type == "cpu" else 4096
    return [2 ** i for i in range(4, int(math.log2(top)) + 1)]


def _engine(llm, **options):
    """A fresh LLMEngine over ``llm``'s model and tokenizer (weights shared, nothing reloaded)."""
    from minillm.engine.config import EngineConfig
    from minillm.engine.engine import LLMEngine
    cfg = EngineConfig(model=llm.model_name, device=str(llm.device), dtype=dtype_name(llm.dtype),
                       enable_prefix_caching=False, **options)
    return LLMEngine(llm.model, llm.tokenizer, cfg)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "out of memory" in str(e).lower()


def measure_prefill(engine, tokens: int, repeats: int = 3, warmup: int = 1, seed: int = 0) -> RooflineRow:
    """Prefill one request of ``tokens`` unique prompt tokens, ``warmup + repeats`` times, each in
    one engine step (the step budget is raised to hold the whole prompt). The forward time is the
    StepRecord's ``forward_issue + device`` phases; the served time is the trace's
    prefill_start → prefill_end. Checks, from the step records, that each run was exactly one
    step holding this prompt and nothing else."""
    from minillm.engine.sampling import SamplingParams
    from minillm.loadgen.workload import LengthDist, make_prompts
    if tokens >= engine.max_model_len:
        raise ValueError(f"a {tokens}-token prompt does not fit this engine's context ({engine.max_model_len})")
    engine.scheduler.max_num_batched_tokens = max(engine.scheduler.max_num_batched_tokens, tokens)
    vocab = engine.config.vocab_size
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    row = RooflineRow("prefill", tokens, 1, tokens)
    ttft = []
    for i in range(warmup + repeats):
        prompt = make_prompts(1, LengthDist.fixed(tokens), seed=seed + 7919 * tokens + i, vocab_size=vocab)[0]
        engine.allocator.forget()
        last = engine.step_history[-1].step if engine.step_history else -1
        rid = engine.add_request(prompt, params, f"prefill-{tokens}-{i}")
        while not engine.get(rid).finished:
            engine.step()
        seq = engine.pop_finished(rid)
        if seq.finish_reason == "error":
            raise RuntimeError(seq.error)
        recs = [r for r in engine.step_history if r.step > last]
        if len(recs) != 1 or recs[0].num_prefill_tokens != tokens or recs[0].num_rows != 1:
            raise RuntimeError(f"the {tokens}-token prefill was not one step of its own: "
                               f"{[(r.num_prefill_tokens, r.num_decode_rows) for r in recs]}")
        if i < warmup:
            continue
        ph = recs[0].phase_ms
        row.time_ms.append(ph["forward_issue"] + ph["device"])
        tr = seq.trace
        row.served_ms.append((tr.first("prefill_end").t_ns - tr.first("prefill_start").t_ns) / 1e6)
        ttft.append((tr.first("token").t_ns - tr.first("received").t_ns) / 1e6)
    row.ttft_ms_median = statistics.median(ttft)
    return row


def run_prefill_decode(llm=None, model: str | None = None, device: str | None = None, dtype: str | None = None,
                       lengths: list[int] | None = None, batches: list[int] | None = None,
                       context: int | None = None, repeats: int = 3, warmup: int = 1, steps: int = 10,
                       decode_warmup: int = 3, cuda_graphs: bool = True, copy_bytes: int | None = None,
                       matmul_n: int | None = None, seed: int = 0, command: str | None = None,
                       progress: bool = False) -> PrefillDecodeResult:
    """The prefill sweep over ``lengths`` and the decode sweep over ``batches`` at ``context``,
    on one model, against ceilings measured first. ``llm``: an ``LLM`` whose model to use (its
    own engine is not touched); else one is built from ``model``/``device``/``dtype`` (the model
    ``sweep.default_model_for`` picks: cpu-small on a CPU, the llama-3.1-8b twin on a big GPU)."""
    from minillm.bench.sweep import DEFAULT_BATCHES, default_model_for, measure_batch
    from minillm.core.device import pick_device
    from minillm.engine.llm import LLM
    t_start = time.time()
    load_before = _load_avg()
    if llm is None:
        dev = pick_device(device)
        llm = LLM(model or default_model_for(dev), device=str(dev), dtype=dtype, max_batch_size=1,
                  max_model_len=16, seed=seed, enforce_eager=not cuda_graphs)
    dev, dt = llm.device, llm.dtype
    cfg, nb = llm.model.config, dtype_bytes(dt)
    lengths = sorted(set(lengths or default_lengths(dev)))
    batches = sorted(set(batches or DEFAULT_BATCHES))
    context = context or (128 if dev.type == "cpu" else 512)
    hw = describe_hardware(dev)

    rd_m = measure_read_bandwidth(dev, copy_bytes)      # a small copy_bytes (tests, fast mode) shrinks both
    cp_m = measure_copy_bandwidth(dev, nbytes=copy_bytes)
    pk_m = measure_matmul_peak(dev, dt, n=matmul_n)
    bw, peak = rd_m.value, pk_m.value
    ceil = {"bandwidth": bw, "bandwidth_kind": "read", "copy_bandwidth": cp_m.value, "peak_flops": peak,
            "source": "measured", "bandwidth_method": rd_m.method, "copy_method": cp_m.method,
            "peak_method": pk_m.method, "bandwidth_samples": rd_m.samples, "copy_samples": cp_m.samples,
            "peak_samples": pk_m.samples,
            "spec_bandwidth": hw.spec_bandwidth, "spec_flops": (hw.spec_flops or {}).get(dtype_name(dt))}

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(lengths) + len(batches), desc=f"prefill/decode {llm.model_name}", file=sys.stderr)

    prefill_rows: list[RooflineRow] = []
    max_len = min(max(lengths) + 8, cfg.max_position_embeddings)
    engine = _engine(llm, max_batch_size=1, max_model_len=max_len, max_num_batched_tokens=max(lengths),
                     enforce_eager=not cuda_graphs, seed=seed)
    for T in lengths:
        try:
            row = measure_prefill(engine, T, repeats, warmup, seed)
            _fill(row, prefill_flops(cfg, T), prefill_bytes(cfg, nb, T), bw, peak)
        except Exception as e:         # one length failing must not end the sweep
            row = RooflineRow("prefill", T, 1, T, status="oom" if _is_oom(e) else f"error: {type(e).__name__}: {e}")
            for rid in list(engine._seqs):
                engine.abort(rid)
                engine._seqs.pop(rid, None)
        prefill_rows.append(row)
        if bar is not None:
            bar.update(1)
    del engine

    decode_rows: list[RooflineRow] = []
    for B in batches:
        eng = None
        try:
            eng = _engine(llm, max_batch_size=B, kv_memory_fraction=0.9, enforce_eager=not cuda_graphs, seed=seed,
                          max_model_len=context + context // 2 + decode_warmup + 3 * steps + 8)
            r = measure_batch(eng, B, context, decode_warmup, steps, cuda_graphs, served=False)
            row = RooflineRow("decode", B, B, context, time_ms=list(r.forward_ms), served_ms=list(r.engine_ms))
            _fill(row, rf.decode_step_flops(cfg, B, context), rf.decode_step_bytes(cfg, nb, B, context), bw, peak)
        except Exception as e:
            row = RooflineRow("decode", B, B, context, status="oom" if _is_oom(e) else f"error: {type(e).__name__}: {e}")
        finally:
            del eng
            if dev.type == "cuda":
                try:
                    torch.cuda.empty_cache()
                except RuntimeError:
                    pass
        decode_rows.append(row)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()

    from minillm.bench.sweep import _hw_dict
    return PrefillDecodeResult(
        model=llm.model_name, dtype=dtype_name(dt), device=str(dev), hardware=_hw_dict(hw),
        host=socket.gethostname(), torch_version=torch.__version__, python=platform.python_version(),
        command=command or "minillm.experiments.prefill_decode.run_prefill_decode(...)", config=cfg.to_dict(),
        ceilings=ceil, ridge_point=rf.ridge_point(peak, bw), decode_context=context,
        prefill=prefill_rows, decode=decode_rows,
        settings={"lengths": lengths, "batches": batches, "repeats": repeats, "warmup": warmup, "steps": steps,
                  "decode_warmup": decode_warmup, "cuda_graphs": bool(cuda_graphs and dev.type == "cuda"),
                  "prefix_caching": False, "unique_prompts": True,
                  "prefill_time": "StepRecord forward_issue + device of the one step holding the prompt",
                  "decode_time": "forward alone on the ideal layout (sweep.measure_batch)"},
        load={"before": load_before, "after": _load_avg(), "cores": cpu_cores()},
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t_start)), duration_s=time.time() - t_start)


def cost_ratio(result: PrefillDecodeResult | dict) -> dict | None:
    """How many prefill tokens cost as much time as one decode token: decode ms/token at batch 1
    (and at the largest batch) ÷ prefill ms/token at the longest measured prompt."""
    d = result.to_dict() if isinstance(result, PrefillDecodeResult) else result
    pre = [r for r in d["prefill"] if r["status"] == "ok"]
    dec = [r for r in d["decode"] if r["status"] == "ok"]
    if not pre or not dec:
        return None
    p, d1, dm = pre[-1], dec[0], dec[-1]
    return {"prefill_tokens": p["tokens"], "prefill_ms_per_token": p["ms_per_token"],
            "decode_b1_ms_per_token": d1["ms_per_token"], "batch": dm["batch"],
            "decode_bmax_ms_per_token": dm["ms_per_token"],
            "decode_b1_over_prefill": d1["ms_per_token"] / p["ms_per_token"],
            "decode_bmax_over_prefill": dm["ms_per_token"] / p["ms_per_token"]}


def prefill_time_ms(result: PrefillDecodeResult | dict, tokens: int) -> float | None:
    """The measured prefill forward time at ``tokens``: the row itself, or log-log interpolation
    between the two nearest measured lengths (None outside the measured range)."""
    d = result.to_dict() if isinstance(result, PrefillDecodeResult) else result
    pts = sorted((r["tokens"], r["time_ms_median"]) for r in d["prefill"] if r["status"] == "ok")
    exact = [t for n, t in pts if n == tokens]
    if exact:
        return exact[0]
    for (a, ta), (b, tb) in zip(pts, pts[1:]):
        if a <= tokens <= b:
            f = (math.log(tokens) - math.log(a)) / (math.log(b) - math.log(a))
            return math.exp(math.log(ta) + f * (math.log(tb) - math.log(ta)))
    return None


def roof_reached_at(result: PrefillDecodeResult | dict, fraction: float = 0.8) -> int | None:
    """The shortest measured prompt whose prefill reaches ``fraction`` of the best prefill
    FLOP/s measured: where the curve flattens under the compute roof."""
    d = result.to_dict() if isinstance(result, PrefillDecodeResult) else result
    pre = [r for r in d["prefill"] if r["status"] == "ok"]
    if not pre:
        return None
    best = max(r["achieved_flops"] for r in pre)
    return next(r["tokens"] for r in pre if r["achieved_flops"] >= fraction * best)


# ----------------------------------------------------------------------------- the stall, step by step

@dataclass(frozen=True)
class StepGap:
    """One inter-token gap of one request, in engine steps: token ``index - 1`` came out of step
    ``step_from``, token ``index`` out of ``step_to``. The gap spans steps step_from + 1 … step_to
    (the token of step_to appears only when that step's whole forward is done)."""
    request_id: str
    index: int
    step_from: int
    step_to: int
    chunk_steps: tuple[int, ...]       # steps of the long prefill's chunks inside this gap
    whole_prefill: bool                # every chunk of the long prefill is inside


def gaps_by_steps(token_steps: dict[str, list[int]], chunk_steps: Sequence[int]) -> list[StepGap]:
    """Every gap of every request in ``token_steps`` (request → the step of each of its tokens),
    with the long prefill's chunk steps that fall inside it. Pure bookkeeping, no clocks."""
    chunks = sorted(chunk_steps)
    out = []
    for rid, steps in token_steps.items():
        for k, (a, b) in enumerate(zip(steps, steps[1:]), start=1):
            inside = tuple(c for c in chunks if a < c <= b)
            out.append(StepGap(rid, k, a, b, inside, bool(chunks) and len(inside) == len(chunks)))
    return out


def token_steps_of(trace, records) -> list[int]:
    """The step that produced each ``token`` of ``trace``: a token is stamped with its step's
    "sampled" mark (StepRecord.t_ns after the sample phase), so the two are matched exactly."""
    from minillm.core.step_record import PHASES
    i = PHASES.index("sample")
    by_t = {r.t_ns[i]: r.step for r in records if len(r.t_ns) > i}
    try:
        return [by_t[t] for t in trace.times("token")]
    except KeyError as e:
        raise ValueError(f"request {trace.request_id}: a token stamped {e} matches no step record "
                         f"(the step history is too short?)") from None


@dataclass
class StallRun:
    """One run of the stall scenario, as plain data: times in ms from the long request's arrival."""
    policy: str
    budget: int
    setup: dict
    short_ids: list[str]
    long_id: str
    tokens_ms: dict[str, list[float]]       # request → its token times
    token_steps: dict[str, list[int]]       # request → the step of each token
    chunks: list[dict]                      # the long prefill's chunks: step, t_start_ms, t_end_ms, tokens, decode_rows
    steps: list[dict]                       # the scenario's StepRecords, abridged
    stalled: list[dict]                     # short requests' gaps holding the whole long prefill
    itl_max_ms: float
    itl_p99_ms: float
    itl_p50_ms: float
    output_tok_s: float                     # all output tokens / (first arrival → last token)
    long_ttft_ms: float
    long_prefill_ms: float                  # prefill_start → prefill_end of the long request
    max_chunk_gap_ms: float                 # the longest decoder gap that holds any chunk of it

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    def gaps(self) -> list[StepGap]:
        return gaps_by_steps({r: self.token_steps[r] for r in self.short_ids}, [c["step"] for c in self.chunks])


def stall_setup(n_short: int = 8, long_prompt_len: int = 2048, min_budget: int = 64, arrive_after_tokens: int = 16,
                short_prompt_len: int = 16, long_output: int = 1, tail: int = 16) -> dict:
    """``stall_scenario``'s keywords, with the decoders' output long enough that they are still
    decoding when the long prompt's last chunk runs at the smallest budget (so every budget of a
    trade-off sweep is measured against the same, still-running decoders).

    ``long_output`` = 1: the long request stops at its first token (its TTFT is what 10.4 asks
    about), so the decoders' gaps show the prefill alone. Were it to decode beside them, every
    such step would read its long context for every row (rows of different lengths are gathered
    to the longest, ``engine/attention.py``; chapter 11's paged attention removes that): a real
    cost, but a different one, and it would set the decoders' max ITL at every budget alike."""
    n_chunks = len(chunk_sizes(long_prompt_len, min_budget, n_short))
    return dict(n_short=n_short, short_prompt_len=short_prompt_len,
                short_output=arrive_after_tokens + n_chunks + tail, long_prompt_len=long_prompt_len,
                long_output=long_output, arrive_after_tokens=arrive_after_tokens)


def run_stall(llm, policy: str, budget: int, setup: dict, seed: int = 0) -> StallRun:
    """``workload.stall_scenario`` under ``policy`` with step budget ``budget`` (restored after),
    kept as a timeline: every token's time and step, the long prefill's chunks, the step records."""
    from minillm.loadgen.workload import stall_scenario
    from minillm.metrics.definitions import request_metrics
    eng = llm.engine
    sch = eng.scheduler
    saved = sch.policy, sch.max_num_batched_tokens
    sch.policy, sch.max_num_batched_tokens = policy, budget
    eng.allocator.forget()
    last = eng.step_history[-1].step if eng.step_history else -1
    try:
        res = stall_scenario(llm, seed=seed, **setup)
    finally:
        sch.policy, sch.max_num_batched_tokens = saved
    recs = [r for r in eng.step_history if r.step > last]
    if not recs or recs[0].step != last + 1:
        raise RuntimeError("the step history lost some of this run's steps: raise EngineConfig.step_history")
    traces = {o.request_id: o.trace for o in res.outputs}
    long_tr = traces[res.long_id]
    t0 = long_tr.first("received").t_ns
    ms = lambda t: (t - t0) / 1e6          # noqa: E731
    tokens_ms = {rid: [ms(t) for t in tr.times("token")] for rid, tr in traces.items()}
    token_steps = {rid: token_steps_of(tr, recs) for rid, tr in traces.items()}
    chunks = [{"step": e.extra["step"], "t_start_ms": ms(e.extra["t_start_ns"]), "t_end_ms": ms(e.t_ns),
               "tokens": e.extra["tokens"], "decode_rows": e.extra["decode_rows"]}
              for e in long_tr if e.event == "prefill_chunk"]
    steps = [{"step": r.step, "t_start_ms": ms(r.t_start_ns), "t_end_ms": ms(r.t_ns[-1]) if r.t_ns else None,
              "prefill_tokens": r.num_prefill_tokens, "decode_rows": r.num_decode_rows} for r in recs]
    gaps = gaps_by_steps({r: token_steps[r] for r in res.short_ids}, [c["step"] for c in chunks])
    gap_ms = lambda g: tokens_ms[g.request_id][g.index] - tokens_ms[g.request_id][g.index - 1]   # noqa: E731
    stalled = [{"request_id": g.request_id, "index": g.index, "step_from": g.step_from, "step_to": g.step_to,
                "gap_ms": gap_ms(g)} for g in gaps if g.whole_prefill]
    with_chunk = [gap_ms(g) for g in gaps if g.chunk_steps]

    mets = [request_metrics(o.trace) for o in res.outputs]
    itl = np.array([g for m in mets if m.request_id in res.short_ids for g in m.itl_s]) * 1e3
    start = min(m.t_start_ns for m in mets)
    end = max(m.t_end_ns for m in mets)
    long_m = next(m for m in mets if m.request_id == res.long_id)
    return StallRun(policy, budget, dict(setup), list(res.short_ids), res.long_id, tokens_ms, token_steps,
                    chunks, steps, stalled, float(itl.max()), float(np.percentile(itl, 99)),
                    float(np.percentile(itl, 50)), sum(m.output_tokens for m in mets) / ((end - start) / 1e9),
                    long_m.ttft_s * 1e3, (long_tr.first("prefill_end").t_ns - long_tr.first("prefill_start").t_ns) / 1e6,
                    max(with_chunk, default=0.0))


@dataclass
class Tradeoff:
    """The chunk-budget sweep: the prefill-first run (one whole-prompt step) and a chunked run
    per budget, all on the same scenario."""
    setup: dict
    prefill_first: StallRun
    chunked: list[StallRun]

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        s = self.setup
        out = [f"{s['n_short']} requests decoding, a {s['long_prompt_len']}-token prompt arrives after "
               f"{s['arrive_after_tokens']} tokens",
               f"{'policy':<14}{'budget':>7}{'chunks':>7}{'ITL max ms':>11}{'ITL p99 ms':>11}{'ITL p50 ms':>11}"
               f"{'long TTFT ms':>13}{'out tok/s':>10}"]
        for r in [self.prefill_first, *self.chunked]:
            out.append(f"{r.policy:<14}{r.budget:>7}{r.n_chunks:>7}{r.itl_max_ms:>11.1f}{r.itl_p99_ms:>11.1f}"
                       f"{r.itl_p50_ms:>11.1f}{r.long_ttft_ms:>13.1f}{r.output_tok_s:>10.1f}")
        out += ["WARNING: " + w for w in stall_warnings([self.prefill_first, *self.chunked])]
        return "\n".join(out)


def stall_warnings(runs: Sequence[StallRun | dict], spike: float = 3.0) -> list[str]:
    """Signs of a busy machine in stall runs, read from their step records:
    - a run whose decode steps before the long prompt arrived (the same requests, the same work
      in every run) spread more than NOISY_SPREAD (p90/p10), or whose median is that far off
      the other runs';
    - a step with no prefill in it that took more than ``spike`` × the median of the run's
      decode-only steps with as many rows: the scheduler put nothing extra in it, so the machine
      did (another process, the OS)."""
    med, out = {}, []
    for r in runs:
        d = r.to_dict() if isinstance(r, StallRun) else r
        tag = f"{d['policy']} {d['budget']}"
        decode = [s for s in d["steps"] if s["prefill_tokens"] == 0 and s["t_end_ms"] is not None]
        wall = lambda s: s["t_end_ms"] - s["t_start_ms"]          # noqa: E731
        before = [wall(s) for s in decode if s["t_start_ms"] < 0]
        if len(before) >= 3:
            m, p10, p90 = _quantiles(before)
            med[tag] = m
            if p90 / p10 > NOISY_SPREAD:
                out.append(f"{tag}: decode steps before the arrival spread ×{p90 / p10:.1f} (p90/p10)")
        spikes = []
        for rows in {s["decode_rows"] for s in decode}:
            same = [wall(s) for s in decode if s["decode_rows"] == rows]
            m = statistics.median(same)
            spikes += [(w, m) for w in same if w > spike * m]
        if spikes:
            w, m = max(spikes)
            out.append(f"{tag}: {len(spikes)} decode-only step(s) took over {spike:g}× the median of their batch "
                       f"(up to {w:.1f} ms against {m:.1f} ms) with no prefill in them")
    if med:
        mid = statistics.median(med.values())
        out += [f"{tag}: decode steps before the arrival took {m:.1f} ms against {mid:.1f} ms in the other runs"
                for tag, m in med.items() if max(m / mid, mid / m) > NOISY_SPREAD]
    if out:
        out.append("something else was using the machine: rerun before trusting these runs' max ITL")
    return out


def illustrative_slo_ms(tradeoff: Tradeoff | dict) -> float:
    """An ITL SLO for machines where no real one (e.g. 50 ms p99 for chat) is within reach, as
    on a CPU: the geometric mean of the smallest budget's p99 ITL and prefill-first's, so that the
    crossing falls inside the measured range. It illustrates the reading, it is no requirement."""
    d = tradeoff.to_dict() if isinstance(tradeoff, Tradeoff) else tradeoff
    small = min(d["chunked"], key=lambda r: r["budget"])["itl_p99_ms"]
    return math.sqrt(small * d["prefill_first"]["itl_p99_ms"])


def warm_up_stall(llm, setup: dict) -> None:
    """One untimed run of the scenario: allocations, kernel choice and (on CUDA) the decode
    graphs of every bucket it will meet are paid here, not inside a measured gap."""
    run_stall(llm, "prefill-first", max(2048, setup["long_prompt_len"]), setup, seed=991)


def chunk_tradeoff(llm, budgets: Sequence[int], setup: dict, warmup: bool = True, seed: int = 0) -> Tradeoff:
    """The scenario once under prefill-first and once per chunk budget (chunked policy)."""
    if warmup:
        warm_up_stall(llm, setup)
    first = run_stall(llm, "prefill-first", max(2048, setup["long_prompt_len"]), setup, seed)
    runs = [run_stall(llm, "chunked", int(b), setup, seed) for b in sorted(budgets)]
    return Tradeoff(dict(setup), first, runs)


def slo_crossing(budgets: Sequence[float], values: Sequence[float], slo: float) -> float | None:
    """Where a curve (values against budgets) first crosses ``slo`` from below, interpolated on
    log2(budget). None when it never does (all within, or all over, the SLO)."""
    pts = sorted(zip(budgets, values))
    for (b0, v0), (b1, v1) in zip(pts, pts[1:]):
        if v0 <= slo < v1:
            f = (slo - v0) / (v1 - v0)
            return 2 ** (math.log2(b0) + f * (math.log2(b1) - math.log2(b0)))
    return None


def largest_budget_within(runs: Sequence[StallRun | dict], slo_ms: float, key: str = "itl_p99_ms") -> int | None:
    """The largest measured budget whose ``key`` stays ≤ slo_ms (the largest chunk keeps the
    long request's TTFT and the throughput best), or None."""
    ok = [(r["budget"] if isinstance(r, dict) else r.budget) for r in runs
          if (r[key] if isinstance(r, dict) else getattr(r, key)) <= slo_ms]
    return max(ok, default=None)


# ----------------------------------------------------------------------------- references

def load_references(roots: Sequence[str | Path] | None = None, base: str | Path | None = None) -> list[dict]:
    """Reference runs (``prefill-decode-*.json``, written by ``python -m minillm.experiments.prefill_decode``)
    below the reference folders (``minillm.experiments.references``); an empty list when there are none."""
    from minillm.bench.sweep import load_result
    from minillm.experiments.references import REFERENCE_ROOTS, reference_paths
    out = []
    for p in reference_paths("prefill-decode-*.json", tuple(roots or REFERENCE_ROOTS), base):
        ref = load_result(p)
        ref["_path"] = str(p)
        out.append(ref)
    return out


# ----------------------------------------------------------------------------- command line

def _ints(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def main(argv: list[str] | None = None) -> int:
    """Everything this module measures, in one JSON with provenance (a reference run)."""
    import argparse
    import json

    from minillm.bench.sweep import default_model_for, dumps_strict
    from minillm.core.device import pick_device
    from minillm.engine.llm import LLM
    ap = argparse.ArgumentParser(prog="python -m minillm.experiments.prefill_decode",
                                 description="chapter 10.4: prefill vs decode roofline, the stall, chunk trade-off")
    ap.add_argument("--model")
    ap.add_argument("--device")
    ap.add_argument("--dtype")
    ap.add_argument("--lengths", type=_ints, help="prefill prompt lengths, e.g. 16,32,...,8192")
    ap.add_argument("--batches", type=_ints, help="decode batches (default 1,2,4,8,16,32,48,64)")
    ap.add_argument("--context", type=int, help="decode context per sequence (default 128 CPU, 512 GPU)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--copy-mib", type=int, help="size of the bandwidth copy (default: past the last-level cache)")
    ap.add_argument("--matmul-n", type=int, help="size of the peak matmul (default 8192 CUDA, 2048 CPU)")
    ap.add_argument("--stall-long", type=int, help="the long prompt (default 2048 CPU, 4096 GPU; 0: no stall runs)")
    ap.add_argument("--n-short", type=int, default=8)
    ap.add_argument("--budgets", type=_ints, default=[64, 128, 256, 512, 1024, 2048])
    ap.add_argument("--out", default="runs/prefill-decode", help="folder for the JSON")
    a = ap.parse_args(argv)
    dev = pick_device(a.device)
    model = a.model or default_model_for(dev)
    lengths = a.lengths or default_lengths(dev)
    long_len = a.stall_long if a.stall_long is not None else (2048 if dev.type == "cpu" else 4096)
    setup = stall_setup(a.n_short, long_len, min(a.budgets)) if long_len else None
    max_len = max(lengths + ([long_len + setup["long_output"] + 8] if setup else [])) + 8
    from minillm.model.config import PRESETS
    if model in PRESETS:                   # a preset's context caps everything (a dry run on `tiny`)
        max_len = min(max_len, PRESETS[model].max_position_embeddings)
    if setup and long_len + setup["long_output"] >= max_len:
        print(f"no stall runs: a {long_len}-token prompt does not fit {model}'s context ({max_len})", flush=True)
        setup = None
    llm = LLM(model, device=str(dev), dtype=a.dtype, max_batch_size=a.n_short + 1, max_model_len=max_len,
              scheduling_policy="prefill-first", enable_prefix_caching=False, enforce_eager=a.no_cuda_graphs)
    command = "python -m minillm.experiments.prefill_decode " + " ".join(argv if argv is not None else sys.argv[1:])
    t0 = time.time()
    res = run_prefill_decode(llm, lengths=lengths, batches=a.batches, context=a.context, repeats=a.repeats,
                             steps=a.steps, cuda_graphs=not a.no_cuda_graphs, command=command, progress=True,
                             copy_bytes=a.copy_mib * 2**20 if a.copy_mib else None, matmul_n=a.matmul_n)
    print(res.table(), flush=True)
    out = {"kind": "minillm prefill-decode reference", "roofline": res.to_dict()}
    if setup:
        tr = chunk_tradeoff(llm, a.budgets, setup)
        print(tr.table(), flush=True)
        out["tradeoff"] = tr.to_dict()
    out["duration_s"] = time.time() - t0
    path = Path(a.out) / f"prefill-decode-{llm.model_name}-{res.dtype}-{dev.type}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps_strict(out))
    print(f"wrote {path} ({json.dumps(round(out['duration_s'], 1))} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
