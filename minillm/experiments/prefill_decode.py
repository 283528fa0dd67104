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

``python -m minillm prefill-decode`` (:func:`write_reference`) runs everything and writes one JSON (a
reference run with provenance: host, hardware, versions, command, every sample).
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

import minillm.perf.roofline as rf
from minillm.core.device import cpu_cores, dtype_bytes, dtype_name, is_oom
from minillm.experiments.stall import chunk_tradeoff, stall_setup
from minillm.hardware.machine import (
    decode_read_bytes,
    describe_hardware,
    measure_copy_bandwidth,
    measure_matmul_peak,
    measure_read_bandwidth,
)
from minillm.hardware.provenance import RunProvenance
from minillm.hardware.quiet import NOISY_SPREAD, load_average, median_p10_p90, too_wide
from minillm.perf.prefill import bandwidth_words, cost_ratio, prefill_bytes, prefill_flops

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
        return bool(self.ok and too_wide(self.time_ms_p10, self.time_ms_p90))


def _fill(row: RooflineRow, flops: int, bytes_: int, bw: float, peak: float) -> RooflineRow:
    row.time_ms_median, row.time_ms_p10, row.time_ms_p90 = median_p10_p90(row.time_ms)
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
class PrefillDecodeResult(RunProvenance):
    config: dict
    ceilings: dict                       # bandwidth (B/s, read), copy_bandwidth, peak_flops (FLOP/s), samples
    ridge_point: float                   # I* = peak / bandwidth, FLOP/byte
    decode_context: int
    prefill: list[RooflineRow]
    decode: list[RooflineRow]
    settings: dict = field(default_factory=dict)
    load: dict = field(default_factory=dict)     # 1-min load average before and after, cores
    started: str = ""
    duration_s: float = 0.0

    @classmethod
    def from_dict(cls, d: dict) -> PrefillDecodeResult:
        d = dict(d)
        d["prefill"] = [RooflineRow(**r) for r in d["prefill"]]
        d["decode"] = [RooflineRow(**r) for r in d["decode"]]
        return cls(**d)

    def ok(self, phase: str) -> list[RooflineRow]:
        return [r for r in getattr(self, phase) if r.ok]

    def samples(self) -> dict[str, list[float]]:
        """Every measured row's forward-time samples (ms), keyed ``"phase tokens"`` (e.g. ``"decode 4"``):
        what ``hardware.quiet.report`` checks for a spread."""
        return {f"{r.phase} {r.tokens}": r.time_ms for r in self.prefill + self.decode if r.ok}

    def summary(self, fraction: float = 0.8) -> str:
        """The table's findings in four lines: the ridge point (and the prompt length at which the
        formulas put prefill past it), the best prefill and where it gets within ``fraction`` of it,
        decode at the smallest and largest batch, and what a decode token costs in prefill tokens."""
        from minillm.model.config import ModelConfig
        from minillm.perf.prefill import prefill_ridge_length
        pre, dec = self.ok("prefill"), self.ok("decode")
        try:
            t_ridge = prefill_ridge_length(ModelConfig(**self.config), dtype_bytes(self.dtype),
                                           self.ridge_point)
        except (TypeError, ValueError):      # a config this version cannot rebuild
            t_ridge = None
        out = [f"ridge point I* = {self.ridge_point:.1f} FLOP/byte; the formulas put prefill past it from "
               f"T = {t_ridge}"]
        if pre:
            best = max(pre, key=lambda r: r.achieved_flops)
            out.append(f"prefill: best {best.achieved_flops / 1e9:.1f} GFLOP/s at T={best.tokens} "
                       f"(MFU {best.mfu:.0%}); within {fraction * 100:.0f} % of that from T = "
                       f"{roof_reached_at(self, fraction)}")
        if dec:
            out.append(f"decode: batch {dec[0].batch} at {dec[0].tok_s:.1f} tok/s, MBU {dec[0].mbu:.0%}; "
                       f"batch {dec[-1].batch} at {dec[-1].tok_s:.0f} tok/s, MFU {dec[-1].mfu:.0%}")
        ratio = cost_ratio(self)
        if ratio:
            out.append(f"one batch-1 decode token costs the time of {ratio['decode_b1_over_prefill']:.0f} "
                       f"prefill tokens (T={ratio['prefill_tokens']}); at batch {ratio['batch']}: "
                       f"{ratio['decode_bmax_over_prefill']:.1f}")
        return "\n".join(out)

    def table(self) -> str:
        c = self.ceilings
        took = f", measured in {self.duration_s:.1f} s" if self.duration_s else ""
        out = [f"{self.model} {self.dtype} on {self.hardware.get('summary', self.device)}{took}",
               f"ceilings ({c['source']}): " + bandwidth_words(c) + f", matmul {c['peak_flops'] / 1e9:.1f} "
                                                                    "GFLOP/s → ridge point I* = "
                                                                    f"{self.ridge_point:.1f} FLOP/byte",
               f"{'phase':<8}{'T or B':>7}{'ms':>10}{'ms/tok':>9}{'tok/s':>10}{'FLOP/B':>9}"
               f"{'GFLOP/s':>10}{'GB/s':>8}{'MFU':>7}{'MBU':>7}"]
        for r in self.prefill + self.decode:
            if not r.ok:
                out.append(f"{r.phase:<8}{r.tokens:>7} {r.status}")
                continue
            out.append(f"{r.phase:<8}{r.tokens:>7}{r.time_ms_median:>10.2f}{r.ms_per_token:>9.3f}"
                       f"{r.tok_s:>10.0f}{r.intensity:>9.1f}"
                       f"{r.achieved_flops / 1e9:>10.1f}{r.achieved_bw / 1e9:>8.1f}"
                       f"{100 * r.mfu:>6.0f}%{100 * r.mbu:>6.0f}%{' *' if r.noisy else ''}")
        ratio = cost_ratio(self)
        if ratio:
            out.append("one batch-1 decode token costs as much time as "
                       f"{ratio['decode_b1_over_prefill']:.0f} prefill tokens (T={ratio['prefill_tokens']}); "
                       f"at batch {ratio['batch']}: {ratio['decode_bmax_over_prefill']:.1f}")
        for w in busy_warnings(self):
            out.append("WARNING: " + w)
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, p, cycle: bool) -> None:      # IPython/Jupyter show the table
        p.text(self.table())

    def write(self, path: str | Path) -> Path:
        from minillm.core.result import dumps_strict
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(dumps_strict(self.to_dict()))
        return p


def busy_warnings(result: PrefillDecodeResult | dict) -> list[str]:
    """Signs that something else used the machine while it was measured (chapter 10.6): rows
    whose samples spread more than NOISY_SPREAD (p90/p10), and a 1-minute load average above the
    core count before the run started. An empty list: no such sign."""
    d = result.to_dict() if isinstance(result, PrefillDecodeResult) else result
    out = []
    noisy = [f"{r['phase']} {r['tokens']}" for r in d["prefill"] + d["decode"]
             if r["status"] == "ok" and too_wide(r.get("time_ms_p10"), r.get("time_ms_p90"))]
    if noisy:
        out.append(f"noisy rows (p90/p10 of the samples > {NOISY_SPREAD}): {', '.join(noisy)}; something "
                   "else was using the machine, rerun before trusting them")
    for key, what in (("bandwidth_samples",
                       f"{d.get('ceilings', {}).get('bandwidth_kind', 'copy')} bandwidth"),
                      ("peak_samples", "matmul peak")):
        xs = d.get("ceilings", {}).get(key) or []
        if len(xs) >= 3:
            _, p10, p90 = median_p10_p90(list(xs))
            if too_wide(p10, p90):
                out.append(f"the {what} samples spread ×{p90 / p10:.1f} (p90/p10): the ceilings themselves "
                           "are noisy")
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


def measure_prefill(engine, tokens: int, repeats: int = 3, warmup: int = 1, seed: int = 0) -> RooflineRow:
    """Prefill one request of ``tokens`` unique prompt tokens, ``warmup + repeats`` times, each in
    one engine step (the step budget is raised to hold the whole prompt). The forward time is the
    StepRecord's ``forward_issue + device`` phases; the served time is the trace's
    prefill_start → prefill_end. Checks, from the step records, that each run was exactly one
    step holding this prompt and nothing else."""
    from minillm.engine.sampling import SamplingParams
    from minillm.loadgen.workload import LengthDist, make_prompts
    if tokens >= engine.max_model_len:
        raise ValueError(f"a {tokens}-token prompt does not fit this engine's context "
                         f"({engine.max_model_len})")
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


def run_prefill_decode(llm=None, model: str | None = None, device: str | None = None,
                       dtype: str | None = None,
                       lengths: list[int] | None = None, batches: list[int] | None = None,
                       context: int | None = None, repeats: int = 3, warmup: int = 1, steps: int = 10,
                       decode_warmup: int = 3, cuda_graphs: bool = True, copy_bytes: int | None = None,
                       matmul_n: int | None = None, seed: int = 0, command: str | None = None,
                       progress: bool = False) -> PrefillDecodeResult:
    """The prefill sweep over ``lengths`` and the decode sweep over ``batches`` at ``context``,
    on one model, against ceilings measured first. ``llm``: an ``LLM`` whose model to use (its
    own engine is not touched); else one is built from ``model``/``device``/``dtype`` (the model
    ``sweep.default_model_for`` picks: cpu-small on a CPU, the llama-3.1-8b twin on a big GPU)."""
    from minillm.bench.sweep import DEFAULT_BATCHES, measure_batch
    from minillm.bench.sweep_result import default_model_for
    from minillm.core.device import pick_device
    from minillm.engine.llm import LLM
    t_start = time.time()
    load_before = load_average()
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

    # a small copy_bytes (tests, fast mode) shrinks both; else the decode bound's one rule
    rd_m = measure_read_bandwidth(dev,
                                  copy_bytes or decode_read_bytes(dev,
                                                                  rf.decode_step_bytes(cfg, nb, 1, context)))
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
        bar = tqdm(total=len(lengths) + len(batches), desc=f"prefill/decode {llm.model_name}",
                   file=sys.stderr)

    prefill_rows: list[RooflineRow] = []
    max_len = min(max(lengths) + 8, cfg.max_position_embeddings)
    engine = _engine(llm, max_batch_size=1, max_model_len=max_len, max_num_batched_tokens=max(lengths),
                     enforce_eager=not cuda_graphs, seed=seed)
    for T in lengths:
        try:
            row = measure_prefill(engine, T, repeats, warmup, seed)
            _fill(row, prefill_flops(cfg, T), prefill_bytes(cfg, nb, T), bw, peak)
        except Exception as e:         # one length failing must not end the sweep
            row = RooflineRow("prefill", T, 1, T,
                              status="oom" if is_oom(e) else f"error: {type(e).__name__}: {e}")
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
            eng = _engine(llm, max_batch_size=B, kv_memory_fraction=0.9, enforce_eager=not cuda_graphs,
                          seed=seed,
                          max_model_len=context + context // 2 + decode_warmup + 3 * steps + 8)
            r = measure_batch(eng, B, context, decode_warmup, steps, cuda_graphs, served=False)
            row = RooflineRow("decode", B, B, context, time_ms=list(r.forward_ms),
                              served_ms=list(r.engine_ms))
            _fill(row, rf.decode_step_flops(cfg, B, context), rf.decode_step_bytes(cfg, nb, B, context), bw,
                  peak)
        except Exception as e:
            row = RooflineRow("decode", B, B, context,
                              status="oom" if is_oom(e) else f"error: {type(e).__name__}: {e}")
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

    return PrefillDecodeResult(
        **RunProvenance.here(llm.model_name, dtype_name(dt), str(dev), hw,
                             command or "minillm.experiments.prefill_decode.run_prefill_decode(...)"),
        config=cfg.to_dict(),
        ceilings=ceil, ridge_point=rf.ridge_point(peak, bw), decode_context=context,
        prefill=prefill_rows, decode=decode_rows,
        settings={"lengths": lengths, "batches": batches, "repeats": repeats, "warmup": warmup,
                  "steps": steps,
                  "decode_warmup": decode_warmup, "cuda_graphs": bool(cuda_graphs and dev.type == "cuda"),
                  "prefix_caching": False, "unique_prompts": True,
                  "prefill_time": "StepRecord forward_issue + device of the one step holding the prompt",
                  "decode_time": "forward alone on the ideal layout (sweep.measure_batch)"},
        load={"before": load_before, "after": load_average(), "cores": cpu_cores()},
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t_start)),
        duration_s=time.time() - t_start)


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


# ----------------------------------------------------------------------------- references

def load_prefill_decode_references(roots: Sequence[str | Path] | None = None,
                                   base: str | Path | None = None) -> list[dict]:
    """Reference runs (``prefill-decode-*.json``, written by ``python -m minillm prefill-decode``)
    below the reference folders (``minillm.experiments.references``); an empty list when there are none."""
    from minillm.bench.sweep_result import load_result
    from minillm.experiments.references import REFERENCE_ROOTS, reference_paths
    out = []
    for p in reference_paths("prefill-decode-*.json", tuple(roots or REFERENCE_ROOTS), base):
        ref = load_result(p)
        ref["_path"] = str(p)
        out.append(ref)
    return out


# ----------------------------------------------------------------------------- command line

def write_reference(out_dir: str | Path = "runs/prefill-decode", model: str | None = None,
                    device: str | None = None,
                    dtype: str | None = None, lengths: list[int] | None = None,
                    batches: list[int] | None = None,
                    context: int | None = None, repeats: int = 3, steps: int = 10, cuda_graphs: bool = True,
                    copy_bytes: int | None = None, matmul_n: int | None = None, stall_long: int | None = None,
                    n_short: int = 8, budgets: Sequence[int] = (64, 128, 256, 512, 1024, 2048),
                    command: str = "") -> Path:
    """Everything this module measures, in one JSON with provenance (a reference run):
    ``python -m minillm prefill-decode``. Returns the file written."""
    import json

    from minillm.bench.sweep_result import default_model_for
    from minillm.core.device import pick_device
    from minillm.core.result import dumps_strict
    from minillm.engine.llm import LLM
    from minillm.model.config import PRESETS
    dev = pick_device(device)
    model = model or default_model_for(dev)
    lengths = lengths or default_lengths(dev)
    budgets = list(budgets)
    long_len = stall_long if stall_long is not None else (2048 if dev.type == "cpu" else 4096)
    setup = stall_setup(n_short, long_len, min(budgets)) if long_len else None
    max_len = max(lengths + ([long_len + setup["long_output"] + 8] if setup else [])) + 8
    if model in PRESETS:                   # a preset's context caps everything (a dry run on `tiny`)
        max_len = min(max_len, PRESETS[model].max_position_embeddings)
    if setup and long_len + setup["long_output"] >= max_len:
        print(f"no stall runs: a {long_len}-token prompt does not fit {model}'s context ({max_len})",
              flush=True)
        setup = None
    llm = LLM(model, device=str(dev), dtype=dtype, max_batch_size=n_short + 1, max_model_len=max_len,
              scheduling_policy="prefill-first", enable_prefix_caching=False, enforce_eager=not cuda_graphs)
    t0 = time.time()
    res = run_prefill_decode(llm, lengths=lengths, batches=batches, context=context, repeats=repeats,
                             steps=steps, cuda_graphs=cuda_graphs, command=command, progress=True,
                             copy_bytes=copy_bytes, matmul_n=matmul_n)
    print(res.table(), flush=True)
    out = {"kind": "minillm prefill-decode reference", "roofline": res.to_dict()}
    if setup:
        tr = chunk_tradeoff(llm, budgets, setup)
        print(tr.table(), flush=True)
        out["tradeoff"] = tr.to_dict()
    out["duration_s"] = time.time() - t0
    path = Path(out_dir) / f"prefill-decode-{llm.model_name}-{res.dtype}-{dev.type}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps_strict(out))
    print(f"wrote {path} ({json.dumps(round(out['duration_s'], 1))} s)")
    return path
