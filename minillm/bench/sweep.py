"""The live roofline measurement (chapter 10.3): decode tok/s against batch size.

For each batch size B we put B requests in the running batch at a fixed context length L,
warm up, then time N decode steps twice:
- ``forward``: the model's forward pass alone (the part the roofline describes);
- ``engine``: the whole ``LLMEngine.step()`` — scheduling, sampling, detokenizing, traces
  (the difference is chapter 10.5's "time outside the accelerator").
Both use the *ideal* layout: equal lengths, contiguous slots, so attention reads a view of the
cache and moves exactly W + B·L·k bytes (the roofline's formula). Then a third time:
- ``served``: ``LLMEngine.step()`` with lengths drawn uniformly in [L/2, 3L/2] and scattered
  slots, as a served batch looks. Rows of different lengths are read through one gather of
  B·max(L) positions (read, copied, read again by attention: ≈ W + 3·B·max(L)·k), where Σ L
  would be the minimum. The gap per batch is what serving pays for that layout.
Step times are synchronised device times (we wait for the device before reading the clock).

The bound is drawn with the measured *read* bandwidth (a decode step reads its weights and
writes almost nothing); the copy bandwidth (read + write) is measured and shown beside it.
Output files are named from a safe slug of the model (``model_slug``): a checkpoint path never
puts its slashes in a file name, and a directory that cannot be written is refused before
the sweep starts, not after it ran.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

import minillm.perf.roofline as rf
from minillm.bench.sweep_result import BatchResult, SweepResult, check_writable, default_model_for
from minillm.core.device import dtype_bytes, dtype_name, is_oom, synchronize
from minillm.core.result import json_finite
from minillm.core.trace import Trace
from minillm.engine.sampling import SamplingParams
from minillm.engine.sequence import Sequence, Status
from minillm.hardware.machine import (
    decode_read_bytes,
    describe_hardware,
    measure_copy_bandwidth,
    measure_matmul_peak,
    measure_read_bandwidth,
)
from minillm.hardware.provenance import RunProvenance
from minillm.hardware.quiet import NOISY_SPREAD as _NOISY_SPREAD
from minillm.hardware.read_probe import ReadDrift, ReadProbe

DEFAULT_BATCHES = [1, 2, 4, 8, 16, 32, 48, 64]
NOISY_SPREAD = _NOISY_SPREAD   # p90 / p10 of a row's repeats above which it is flagged (busy.py)


# ---------------------------------------------------------------------------- timing
def _time_steps(fn: Callable[[], object], device: torch.device, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def fill_running_batch(engine, batch: int, context: int | list[int], order: list[int] | None = None
                       ) -> list[Sequence]:
    """Put ``batch`` requests in the running batch as if each had ``context`` tokens cached
    (one int, or one length per row). The KV values are whatever the cache holds: decode speed
    depends on shapes, not values, so skipping B real prefills keeps the sweep at seconds
    instead of minutes. ``order``: the rows' slots are taken in this order (scattered slots)."""
    lens = context if isinstance(context, list) else [context] * batch
    params = SamplingParams(max_tokens=10**9, temperature=0, ignore_eos=True)
    g = torch.Generator(device=engine.device).manual_seed(batch)
    slots = [engine.allocator.allocate(f"sweep-{batch}-{i}")[0] for i in range(batch)]
    if order is not None:
        slots = [slots[i] for i in order]
    seqs = []
    for i, (slot, L) in enumerate(zip(slots, lens)):
        rid = f"sweep-{batch}-{i}"
        engine.allocator._owner[slot] = rid
        seq = Sequence(rid, None, [1] * L, params, Trace(rid), slot=slot, status=Status.RUNNING,
                       output_ids=[1], num_computed=L)   # the "last sampled" token: next step decodes it
        seq.output = engine.output.new_state([])
        _fill_kv(engine.cache, slot, L, g)
        engine._seqs[rid] = seq
        engine.scheduler.running.append(seq)
        seqs.append(seq)
    return seqs


def _fill_kv(cache, slot: int, length: int, g: torch.Generator) -> None:
    """Give the pretend-cached positions ordinary values. The pool is allocated empty (never
    zero-filled), and leftover memory could hold NaNs or denormal floats, which a CPU computes
    with many times slower: the timing must not depend on what the allocator handed back."""
    for t in cache.k + cache.v:
        t[slot, :length].normal_(generator=g)             # on the device, in its dtype


def _forward_fn(engine, seqs: list[Sequence], use_graphs: bool):
    """The model's forward alone on the ideal layout: equal lengths, contiguous slots (a view of
    the cache, no gather, no mask). Bytes: W + B·L·k exactly."""
    from minillm.engine.attention import build_metadata
    from minillm.engine.cuda_graphs import GraphPool
    model, dev, backend = engine.model, engine.device, engine.runner.backend
    meta = build_metadata(engine.cache, [(s.slot, s.num_computed) for s in seqs], [], dev)
    tokens = torch.ones(len(seqs), dtype=torch.long, device=dev)                 # [B]
    positions = torch.tensor([s.num_computed for s in seqs], device=dev)        # [B]
    index = torch.arange(len(seqs), device=dev)

    def forward():
        backend.begin(meta)
        return model.forward_packed(tokens, positions, backend, index)          # [B, V]
    if use_graphs and dev.type == "cuda":
        return GraphPool().capture((len(seqs), meta.decode_len), forward)
    return forward


def served_lengths(batch: int, context: int, seed: int = 0) -> list[int]:
    """The "served" path's context lengths: uniform in [L/2, 3L/2] (mean ≈ L), as a served batch
    holds requests at different points of their lives."""
    g = torch.Generator().manual_seed(seed + batch)
    return torch.randint(max(1, context // 2), context + context // 2 + 1, (batch,), generator=g).tolist()


def _compiled_step_fn(engine, rows: int):
    """The compiled path's step alone: the runner's compiled static decode of the bucket that the
    engine's last step filled (forward and logits, as ``_forward_fn``; no scheduling, no sampling)
    replayed on the same buffers, as a CUDA graph is replayed. K/V is read through the bucket's
    length, a power of two at or above the context: the engine's own decode, not the ideal view."""
    runner = engine.runner
    sd = next(sd for (b, _), sd in reversed(runner._static.items()) if b == rows)
    return lambda: runner._run_static(sd)                                      # [rows, V]


@torch.inference_mode()
def measure_batch(engine, batch: int, context: int, warmup: int, steps: int, use_graphs: bool,
                  served: bool = True) -> BatchResult:
    """One batch on ``engine``: its forward alone, its whole step on the ideal layout, and (``served``)
    its step on a served layout (see the module docstring). An engine that compiles its decode
    (``EngineConfig.compile``) pays the compile in a first step that no timing includes
    (``BatchResult.compile_s``), and its forward is its compiled step (``_compiled_step_fn``)."""
    compiled = engine.runner.compile
    need = context + context // 2 + warmup + 2 * steps + 3            # the engine steps advance the sequences
    if engine.max_model_len < need:
        # the KV cache shrank to fit memory: writing past it is a device-side assert on CUDA
        raise MemoryError(f"out of memory: the KV cache for batch {batch} holds {engine.max_model_len} "
                          f"tokens per slot, the sweep needs {need}")

    def engine_step_checked():
        outs = engine.step()
        failed = [o for o in outs if o.finish_reason == "error"]
        if failed or len(outs) != batch:      # a failed step returns fast: never time it as "ok"
            raise RuntimeError(engine.get(failed[0].request_id).error if failed else
                               f"the running batch shrank to {len(outs)}")

    def release(seqs):
        for s in seqs:
            engine.abort(s.request_id)
            engine._seqs.pop(s.request_id, None)
        engine.allocator.forget()

    seqs = fill_running_batch(engine, batch, context)
    compile_s = None
    try:
        if compiled:
            engine_step_checked()            # the bucket's first step compiles: timed apart, never mixed in
            compile_s = sum(engine.runner.compile_s.values())
            forward = _compiled_step_fn(engine, engine.runner.static_bucket_rows(batch))
        else:
            forward = _forward_fn(engine, seqs, use_graphs)
        fwd = _time_steps(forward, engine.device, warmup, steps)
        eng = _time_steps(engine_step_checked, engine.device, 1, steps)
    finally:
        release(seqs)
    r = BatchResult(batch, "ok", context, forward_ms=fwd, engine_ms=eng,
                    path="compiled" if compiled else "", compile_s=compile_s)
    if served:
        lens = served_lengths(batch, context)
        order = torch.randperm(batch, generator=torch.Generator().manual_seed(batch)).tolist()
        seqs = fill_running_batch(engine, batch, lens, order)
        try:
            r.served_ms = _time_steps(engine_step_checked, engine.device, warmup, steps)
        finally:
            release(seqs)
        r.served_max_context = max(lens)
    return r


def _fill_derived(r: BatchResult, cfg, nbytes: int, bw: float, peak: float) -> None:
    r.forward_ms_median = statistics.median(r.forward_ms)
    r.engine_ms_median = statistics.median(r.engine_ms)
    q = (statistics.quantiles(r.forward_ms, n=10, method="inclusive") if len(r.forward_ms) > 1
         else [r.forward_ms[0]] * 9)
    r.forward_ms_p10, r.forward_ms_p90 = q[0], q[-1]
    step_s = r.forward_ms_median / 1e3
    r.per_request_tok_s = 1 / step_s
    r.aggregate_tok_s = r.batch / step_s
    r.engine_aggregate_tok_s = r.batch / (r.engine_ms_median / 1e3)
    r.bytes_per_step = rf.decode_step_bytes(cfg, nbytes, r.batch, r.context)
    r.flops_per_step = rf.decode_step_flops(cfg, r.batch, r.context)
    r.achieved_bw, r.achieved_flops = r.bytes_per_step / step_s, r.flops_per_step / step_s
    r.mbu, r.mfu = r.achieved_bw / bw, r.achieved_flops / peak
    r.bound_tok_s = rf.aggregate_bound(cfg, nbytes, r.batch, r.context, bw, peak)
    r.pct_of_bound = r.aggregate_tok_s / r.bound_tok_s
    if r.served_ms:
        r.served_ms_median = statistics.median(r.served_ms)
        r.served_aggregate_tok_s = r.batch / (r.served_ms_median / 1e3)
        kv = cfg.kv_bytes_per_token(nbytes)
        r.served_bytes_per_step = (rf.weight_bytes_per_step(cfg, nbytes, r.batch)
                                   + 3 * r.batch * r.served_max_context * kv)
        r.served_gap = r.served_ms_median / r.engine_ms_median


PATHS = ("fastest", "packed", "compiled", "plain")


def resolve_path(path: str, enforce_eager: bool, dev: torch.device) -> tuple[str, str]:
    """The decode path a sweep runs, and why when it is not the one asked for.

    - ``plain``: torch's own ``F.linear`` (``--enforce-eager``), the readable reference;
    - ``packed``: the decode matmuls chosen on this machine (engine/matmul.py), eager otherwise;
      on CUDA, CUDA graphs;
    - ``compiled``: the engine's compiled decode (engine/compiled.py: Inductor, weights frozen), one
      graph per batch, or one for 1 row and one for the rest where every matmul is the tiled kernel
      (its engines of other batch sizes reuse them); each batch's first step timed apart;
    - ``fastest``: ``packed`` at every batch, then ``compiled`` from the smallest batch up while it is
      faster; each row keeps the faster and both timings (``BatchResult.alternatives``).

    Why both on a CPU: measured on the 2-core Xeon VM (``cpu-small`` fp32, 2 threads, forward at
    128 cached tokens, one run), compiled against packed: 13.3/18.2, 15.2/20.1, 17.5/21.0,
    22.3/25.4, 29.8/32.3, 41.6/46.1, 63.8/58.2, 70.1/72.2 ms at B = 1, 2, 4, 8, 16, 32, 48, 64.
    Compiled wins where the time outside the matmuls weighs most; at 48 its rows are padded to the
    64-row bucket. Before the compiled K/V length went in steps of 16 (``ModelRunner.static_kv_len``),
    it lost from 16 on (113 ms against 81 at 64). A server does the same thing: vLLM captures CUDA
    graphs up to a batch size and runs eager above it."""
    if enforce_eager:
        return "plain", " (--enforce-eager)"
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    if path in ("compiled", "fastest"):
        from minillm.engine.compiled import compile_unavailable
        why = compile_unavailable(dev)
        if why is None and dev.type != "cpu" and path == "fastest":
            why = "on a GPU the decode runs through CUDA graphs; the compiled path is measured on a CPU only"
        if why is not None:
            if path == "compiled":
                raise ValueError(f"path 'compiled', but torch.compile cannot run here: {why}")
            return "packed", f" (fastest: no compiled path: {why})"
    return path, ""


def _sweep_rows(measure: Callable[[int, bool], BatchResult], batches: list[int], path: str,
                desc: str | None) -> list[BatchResult]:
    """Every batch on ``path`` (``measure(batch, compiled)``). For ``fastest``, each batch runs packed and
    then, right after it, compiled, from the smallest batch up until the packed row was the faster at two
    batches in a row (past them, the measurements in ``resolve_path`` found it faster still, so no more
    compiles are paid; one loss alone can be noise: a 10-step median at B = 4 once read 21.4 ms where 20
    steps read 17.5). Back to back, because this VM's memory changes speed over seconds to minutes (10.6):
    when every packed row ran first and the compiled ones after, one fp32 run met 52–55 GB/s for the
    packed rows and chose them from B = 2 on, where the run before had chosen compiled at every batch but
    2 and 64."""
    bar = None
    if desc:
        from tqdm.auto import tqdm
        total = len(batches) * (2 if path == "fastest" else 1)
        bar = tqdm(total=total, desc=desc, unit="batch", file=sys.stderr)

    def one(b: int, compiled: bool) -> BatchResult:
        r = measure(b, compiled)
        if bar is not None:
            bar.update(1)
            if r.status == "ok":
                bar.set_postfix_str(f"B={b}{' compiled' if compiled else ''}: {r.aggregate_tok_s:.0f} tok/s")
        return r

    results = []
    trying, losses = path == "fastest", 0         # compiled beside packed, while it is worth its compiles
    for b in batches:
        r = one(b, path == "compiled")
        if trying and r.status == "ok":
            c = one(b, True)
            r.alternatives = {"packed": r.timings()}
            if c.status != "ok":
                r.alternatives["compiled"] = {"status": c.status}
                trying = False
            else:
                r.alternatives["compiled"] = c.timings()
                if c.forward_ms_median >= r.forward_ms_median:
                    losses += 1
                    trying = losses < 2
                else:
                    losses = 0
                    c.alternatives = r.alternatives
                    r = c
        results.append(r)
    if bar is not None:
        bar.close()
    return results


def _more_rounds(results: list[BatchResult], measure: Callable[[int, bool], BatchResult], rounds: int,
                 fill: Callable[[BatchResult], None]) -> None:
    """Rounds 2 … ``rounds``: every batch measured again on the path its first round settled on, the
    batches in turn, and the samples added to its row, so that each row's median spans the whole run.
    Why: one round measures the batches one after another, and on the project's AMD EPYC VM the memory's
    read speed moved ×1.35–×2.3 within one ``roofline`` run, so batches measured once each met different
    speeds (bf16 ``cpu-small``: batch 8 at 73 % of batch 1 in one round, 79 % over three, in 90 s either
    way). A compiled batch reuses the graph its first round compiled. A row whose later round fails keeps
    what it had."""
    for _ in range(rounds - 1):
        for r in results:
            if r.status != "ok":
                continue
            again = measure(r.batch, r.path == "compiled")
            if again.status != "ok":
                continue
            r.forward_ms = r.forward_ms + again.forward_ms
            r.engine_ms = r.engine_ms + again.engine_ms
            r.served_ms = r.served_ms + again.served_ms if r.served_ms else r.served_ms
            r.read_bw_now = r.read_bw_now + again.read_bw_now
            r.rounds += 1
            fill(r)


def crossover_at_reads(cfg, nbytes: int, peak: float, drift: ReadDrift) -> dict:
    """B* (no K/V) at the slowest and the fastest read the probe met during a run. B* is the peak over the
    bandwidth (rf.crossover_batch), so where the memory's speed moves under a run the crossover moves
    with it (10.3, 10.6): on the AMD EPYC VM one fp32 ``roofline`` run printed B* = 13.0 from its start's
    read of 31.4 GB/s while the probe met 29.0–56.0 GB/s, which puts B* anywhere from 14.1 down to 7.3;
    its knee was 10.4. A row measured in a fast stretch meets the arithmetic sooner than the printed B*."""
    if not drift.samples:
        return {}

    def at(bw: float) -> dict:
        return {"read": bw, "b_star": rf.crossover_batch(cfg, nbytes, bw, peak, 0)}
    return {"slowest": at(drift.low), "fastest": at(drift.high), "moved": drift.moved}


def chosen_kernels_peak(choice) -> tuple[float, str] | None:
    """FLOP/s of the decode matmuls chosen on this machine at the choice's prefill-sized bucket (256 rows, far
    past B*: bound by arithmetic), the fastest weight shape's, and where that figure came from; None where
    the choice was not timed there. The compute roof is a measurement too: torch's square matmul is MKL's
    sgemm on a CPU, and on the project's AMD EPYC VM the tiled kernel outran it (on two threads 0.20–0.22
    against 0.14 TFLOP/s in fp32), so a sweep's MFU read 101–117 % from batch 16 against that roof and its
    B* came out low (8.4 against a knee measured at 11.5). The sweep's roof is the faster."""
    from minillm.engine.matmul import PREFILL_ROWS
    timed = [s for s in choice.rows if str(PREFILL_ROWS) in s.by_rows]
    if not timed:
        return None
    flops = {s.shape: 2 * PREFILL_ROWS * s.out_features * s.in_features / (s.chosen_ms(PREFILL_ROWS) / 1e3)
             for s in timed}
    best = max(timed, key=lambda s: flops[s.shape])
    kernel = best.by_rows[str(PREFILL_ROWS)]
    return flops[best.shape], (f"the chosen {kernel} kernel at {PREFILL_ROWS} rows of {best.shape}"
                               + (", cached" if choice.cached else ""))


def run_sweep(model: str | None = None, device: str | None = None, dtype: str | None = None,
              batches: list[int] | None = None, context: int | None = None, warmup: int = 3, steps: int = 10,
              cuda_graphs: bool = True, measure_ceilings: bool = True, progress: bool = True,
              command: str | None = None, copy_bytes: int | None = None, matmul_n: int | None = None,
              seed: int = 0, partial_path: str | Path | None = None, served: bool = True,
              read_bytes: int | None = None, out_dir: str | Path | None = None,
              figures_dir: str | Path | None = None, enforce_eager: bool = False,
              path: str = "packed", rounds: int = 1) -> SweepResult:
    """Sweep decode batches (see the module docstring). ``partial_path``: append each batch's result there as
    one JSON line as soon as it is measured, so a sweep killed by a time limit keeps what it measured.
    ``out_dir``, ``figures_dir`` (and ``partial_path``'s directory): checked for writing before anything is
    measured. ``read_bytes``: the read-bandwidth buffer (default: ``copy_bytes`` when that is given, so a
    small test stays small, else twice the last-level cache). ``path``: which decode runs
    (:func:`resolve_path`); the library's default is ``packed``, the decode matmuls chosen on this machine
    (engine/matmul.py, chosen before the first batch and not timed), because it compiles nothing; the
    ``roofline`` command's is ``fastest``. ``enforce_eager``: the plain path (torch's own matmuls, no CUDA
    graphs), whatever ``path`` says. ``rounds``: every batch measured that many times, the batches in
    turn (:func:`_more_rounds`)."""
    from minillm.core.device import default_dtype, parse_dtype, pick_device
    from minillm.engine.engine import LLMEngine
    from minillm.engine.matmul import prepare as prepare_matmuls
    from minillm.engine.tokenizer import load_tokenizer
    from minillm.model.loader import load_model

    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer ≥ 1, got {rounds!r}")
    t_start = time.time()
    check_writable(out_dir, figures_dir, Path(partial_path).parent if partial_path is not None else None)
    dev = pick_device(device)
    model = model or default_model_for(dev)
    dt = parse_dtype(dtype) if dtype else default_dtype(dev)
    batches = sorted(set(batches or DEFAULT_BATCHES))
    context = context or (128 if dev.type == "cpu" else 512)
    hw = describe_hardware(dev)
    m = load_model(model, dev, dt, seed)
    cfg, nbytes = m.config, dtype_bytes(dt)
    tok = load_tokenizer(None)

    if measure_ceilings:
        # the one decode bound of every command: a read over one step's bytes (hardware.decode_read_bytes)
        step1 = rf.decode_step_bytes(cfg, nbytes, 1, context)
        read_nbytes = read_bytes or copy_bytes or decode_read_bytes(dev, step1)
        rd_m = measure_read_bandwidth(dev, nbytes=read_nbytes)
        cp_m = measure_copy_bandwidth(dev, nbytes=copy_bytes)
        pk_m = measure_matmul_peak(dev, dt, n=matmul_n)
        bw, peak = rd_m.value, pk_m.value            # decode reads its weights: the read bandwidth
        ceil = {"bandwidth": bw, "bandwidth_kind": "read", "peak_flops": peak, "source": "measured",
                "read_bandwidth": rd_m.value, "read_method": rd_m.method, "read_samples": rd_m.samples,
                "copy_bandwidth": cp_m.value, "copy_method": cp_m.method, "copy_samples": cp_m.samples,
                "bandwidth_samples": rd_m.samples, "peak_samples": pk_m.samples,
                "spec_bandwidth": hw.spec_bandwidth, "spec_flops": (hw.spec_flops or {}).get(dtype_name(dt))}
    else:
        bw, peak = hw.spec_bandwidth, (hw.spec_flops or {}).get(dtype_name(dt))
        if not bw or not peak:
            raise ValueError("no spec ceilings are known for this hardware: measure them (drop --no-measure)")
        ceil = {"bandwidth": bw, "peak_flops": peak, "source": "spec"}

    path, path_why = resolve_path(path, enforce_eager, dev)
    cuda_graphs = cuda_graphs and path != "plain"
    mode = "aten" if path == "plain" else "auto"
    t_choose = time.perf_counter()
    choice = prepare_matmuls(m, mode)
    matmul = {"mode": mode, "choose_s": time.perf_counter() - t_choose, "path": path,
              "choice": choice.to_dict() if choice is not None else None,
              "why": (path_why if path_why
                      else "" if choice or path == "compiled" else f" (no choice on {dev.type})")}
    if choice is not None and progress:
        print(choice.summary(), file=sys.stderr)
    kernels_peak = chosen_kernels_peak(choice) if choice is not None and measure_ceilings else None
    if kernels_peak is not None:                 # the roof: the faster of the two matmuls measured here
        faster = kernels_peak[0] > peak
        ceil.update(square_matmul_flops=peak, peak_method=kernels_peak[1] if faster else pk_m.method)
        if faster:
            peak = ceil["peak_flops"] = kernels_peak[0]
    # the bound, measured again around every row: the memory's speed can move under a run (10.6)
    probe = ReadProbe(dev, read_nbytes) if measure_ceilings else None
    if partial_path is not None:               # this run's rows only
        Path(partial_path).parent.mkdir(parents=True, exist_ok=True)
        Path(partial_path).write_text("")

    def measure(b: int, compiled: bool, partial: bool = True) -> BatchResult:
        engine = None
        try:
            engine = LLMEngine(m, tok, max_batch_size=b, kv_memory_fraction=0.9, matmul=mode,
                               compile=compiled,
                               enforce_eager=path == "plain" or (not cuda_graphs and dev.type == "cuda"),
                               max_model_len=context + context // 2 + warmup + 3 * steps + 8)
            # one sample between two rows serves both (0.2 s each over cpu-small's fp32 step)
            before = (probe.samples[-1] if probe.samples else probe.sample()) if probe is not None else None
            r = measure_batch(engine, b, context, warmup, steps, cuda_graphs, served)
            after = probe.sample() if probe is not None else None
            r.read_bw_now = [v for v in (before, after) if v is not None]
            if not r.path:                # measure_batch names the compiled path itself
                r.path = "packed" if path == "fastest" else path
            _fill_derived(r, cfg, nbytes, bw, peak)
        except Exception as e:      # one batch failing must not end the sweep
            if not is_oom(e):
                r = BatchResult(b, f"error: {type(e).__name__}: {e}", context)
            else:
                r = BatchResult(b, "oom", context)
        finally:
            del engine
            if dev.type == "cuda":
                try:
                    torch.cuda.empty_cache()
                except RuntimeError:          # a sticky CUDA error: the row already says why
                    pass
        if partial and partial_path is not None:
            with open(partial_path, "a") as f:
                f.write(json.dumps(json_finite(asdict(r)), allow_nan=False) + "\n")
        return r

    results = _sweep_rows(measure, batches, path, f"roofline {model} {dtype_name(dt)}" if progress else None)
    _more_rounds(results, lambda b, c: measure(b, c, partial=False), rounds,
                 lambda r: _fill_derived(r, cfg, nbytes, bw, peak))
    pages = getattr(m, "weight_pages", None)          # where the engines held the chosen weights
    if pages is not None:
        matmul["weight_pages"] = {**asdict(pages), "line": pages.line()}
    if path == "fastest":
        matmul["compiled_up_to"] = max((r.batch for r in results if r.alternatives.get("compiled")),
                                       default=None)
    drift = probe.drift(bw) if probe is not None and probe.samples else None
    read_drift = drift.to_dict() if drift is not None else {}
    if probe is not None:
        probe.close()
    ok = [r for r in results if r.status == "ok"]
    fit = rf.knee_fit([r.batch for r in ok], [r.forward_ms_median for r in ok])
    knee = fit.knee
    return SweepResult(
        **RunProvenance.here(str(model), dtype_name(dt), str(dev), hw,
                             command or "minillm.bench.sweep.run_sweep(...)"),
        context=context, warmup=warmup, steps=steps,
        cuda_graphs=bool(cuda_graphs and dev.type == "cuda"), ceilings=ceil,
        model_bytes=rf.weight_bytes(cfg, nbytes), config=cfg.to_dict(),
        predicted_crossover=rf.crossover_batch(cfg, nbytes, bw, peak, 0),
        predicted_crossover_kv=rf.crossover_batch(cfg, nbytes, bw, peak, context),
        measured_knee=knee, batches=results,
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t_start)),
        duration_s=time.time() - t_start, knee_note=fit.reason, matmul=matmul, read_drift=read_drift,
        rounds=rounds, crossover_at_reads=crossover_at_reads(cfg, nbytes, peak, drift) if drift else {})


