"""The model runner: the only place that turns a scheduled batch into tensors (design.md §8).

    rows [(seq, num_new)] ─► packed tokens [N], positions [N], attention metadata
        ─► forward (eager, or a CUDA-graph replay for decode) ─► logits of rows that finish
        their known tokens ─► min_tokens mask ─► batched sampling (+ logprobs for rows that
        ask) ─► one host read of the chosen ids and logprobs

Packing: rows with one new token (decodes) go first, then prefill chunks. A row samples only
when this step computes its last known token; a prompt's earlier chunks sample nothing.

Decode in static shapes: with ``static_decode`` on, a decode-only step is padded to a bucket
of rows (1, 2, 4, 8, 16, … up to the batch size) and of K/V length (powers of two), with the
lengths held as data and padding rows pointed at the cache's reserved slot. On CUDA each
bucket is captured once as a CUDA graph and replayed (off with ``enforce_eager``); on a CPU the
same static path runs eagerly, which is how the tests pin it against the dynamic one.

With ``compile`` (``EngineConfig.compile``), decode steps always take the static path and the
step is ``torch.compile``d (``minillm.engine.compiled``): on a CPU one graph per row bucket (the
K/V length is a dynamic size), or one for 1 row and one for every bucket from 2 up where every matmul
takes its row count as a symbol (``rows_dynamic``); on CUDA one per bucket (each captured as a CUDA
graph). The
step that builds a graph pays the compilation, kept in ``compile_s`` (by bucket) and in that
step's ``StepRecord.compile_ms``.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time

import torch
import torch._dynamo

from minillm.core.device import synchronize
from minillm.core.step_record import StepRecord
from minillm.core.trace import now_ns
from minillm.engine import attention_kernel
from minillm.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    attention_for_capture,
    avoid_per_shape_attention_plans,
    build_metadata,
)
from minillm.engine.cuda_graphs import GraphPool
from minillm.engine.kv_cache import KVCache
from minillm.engine.matmul import decode_attention_in_fp32
from minillm.engine.matmul import prepare as prepare_matmuls
from minillm.engine.matmul_kernels import PackedLinear
from minillm.engine.sampling import (
    Sampler,
    TokenLogprobs,
    ban_tokens,
    logprobs_on_device,
    read_sampled,
    unpack_logprobs,
)
from minillm.engine.scheduler import ScheduledBatch
from minillm.engine.sequence import Sequence
from minillm.engine.weight_pages import move_to_huge_pages

log = logging.getLogger(__name__)


def buckets_up_to(n: int) -> list[int]:
    """1, 2, 4, 8, 16, then multiples of 16 (as vLLM's capture sizes), up to n."""
    out = [b for b in (1, 2, 4, 8) if b < n] + list(range(16, n, 16))
    return out + [n]


KV_STEP = 16          # the compiled CPU decode's K/V length: a multiple of this (static_kv_len)


class StaticDecode:
    """Fixed input buffers for one (rows, K/V length) bucket."""

    def __init__(self, cache: KVCache, rows: int, kv_len: int, device: torch.device):
        self.rows, self.kv_len = rows, kv_len
        z = lambda: torch.zeros(rows, dtype=torch.long, device=device)   # noqa: E731
        self.tokens, self.positions, self.write_loc, self.slots, self.lens = z(), z(), z(), z(), z()
        self.logits_index = torch.arange(rows, device=device)
        self.kv_pos = torch.arange(kv_len, device=device)                    # [kv_len]
        self.meta = AttentionMetadata(write_loc=self.write_loc, num_decode=rows, all_decode=True,
                                      decode_len=kv_len, decode_slots=self.slots, decode_lens=self.lens,
                                      decode_pos=self.kv_pos)
        self.cache = cache
        # On a CPU the step's values are written through numpy views of the buffers: no torch call. Right
        # after a forward has streamed the weights through the caches the host's code runs cold, and one
        # tensor and five copies took 0.130 ms a step there (bf16 cpu-small, batch 1, median of 300 steps,
        # AMD EPYC VM), the views 0.076 ms (chapter 10.5: the time outside the forward).
        self._buffers = (self.tokens, self.positions, self.write_loc, self.slots, self.lens)
        self._host_views = [t.numpy() for t in self._buffers] if device.type == "cpu" else None

    def prepare_for_replay(self, tokens: list[int], slots: list[int], cached: list[int]) -> None:
        """Copy one step's values in; rows past len(tokens) are padding (reserved slot, trash row)."""
        c, pad = self.cache, self.rows - len(tokens)
        values = [
            tokens + [0] * pad,
            cached + [0] * pad,                                              # position = cached length
            [c.loc(s, L) for s, L in zip(slots, cached)] + [c.trash_loc] * pad,
            slots + [c.reserved_slot] * pad,
            [L + 1 for L in cached] + [1] * pad,                             # read the new token too
        ]
        if self._host_views is not None:
            for view, v in zip(self._host_views, values):
                view[:] = v
            return
        host = torch.tensor(values, dtype=torch.long)
        if self.tokens.device.type == "cuda":
            host = host.pin_memory()
        for dst, src in zip(self._buffers, host):
            dst.copy_(src, non_blocking=True)


def rows_can_be_dynamic(model: torch.nn.Module) -> bool:
    """Every linear layer of ``model`` runs one kernel that takes its row count as a symbol."""
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    return bool(linears) and all(isinstance(m, PackedLinear) and m.runs_any_row_count() for m in linears)


class ModelRunner:
    def __init__(self, model, cache: KVCache, max_batch_size: int, *, enforce_eager: bool = False,
                 sync_timing: bool = True, seed: int = 0, compile: bool = False, matmul: str = "aten"):
        cfg = model.config
        self.model, self.cache, self.device = model, cache, model.device
        # decode matmuls that share the weight read across a batch, chosen on this CPU (10.3)
        self.matmul_choice = prepare_matmuls(model, matmul, compiled=compile)
        # and their weights in 2 MiB pages, which a step streams faster (weight_pages.py measures it)
        self.weight_pages = move_to_huge_pages(model) if self.matmul_choice is not None else None
        self.backend = AttentionBackend(cache, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.backend.decode_upcast = decode_attention_in_fp32(model, matmul, self.matmul_choice)
        # decode attention from each row's cache slot, beside the chosen matmuls (the plain path keeps SDPA)
        self.backend.decode_kernel = matmul == "auto" and attention_kernel.available(model.dtype, self.device)
        avoid_per_shape_attention_plans(self.device)
        self.sampler = Sampler(self.device, seed)
        self.sync_timing = sync_timing
        self.use_cuda_graphs = self.device.type == "cuda" and not enforce_eager
        self.row_buckets = buckets_up_to(max_batch_size)
        self._static: dict[tuple[int, int], StaticDecode] = {}
        self.graphs = GraphPool()
        # torch.compile of the static decode (one graph per bucket); eager is the default
        self.compile = compile
        self.compile_s: dict[tuple[int, int], float] = {}      # bucket → first step's time (compile + run)
        self._graphs_built: set = set()
        self._compiled = None
        if compile:
            from minillm.engine.compiled import compile_step, compile_unavailable
            why = compile_unavailable(self.device)
            if why:
                raise ValueError(f"compile=True, but torch.compile cannot run here: {why}")
            kv_buckets = max(1, cache.max_len.bit_length() - 3)          # 16, 32, … max_len
            self._compiled = compile_step(self._static_step, len(self.row_buckets) * kv_buckets + 4, model)
            # fp32 on a CPU without the decode attention kernel (the plain path): attention fused with
            # the K/V gather is faster there than the gather and SDPA (attention.py). Beside the kernel,
            # the two ran level (0.99, 0.99, 1.03× at 1, 8, 64 rows) and the kernel's graphs compiled in
            # 14.5-15.0 s and 16.2-16.4 s at 1 and 2 rows against 19.1-20.8 and 22.6-27.2 (AMD EPYC VM).
            self.backend.decode_by_reduction = (self.device.type == "cpu" and model.dtype == torch.float32
                                                and not self.backend.decode_kernel)
        self.static_decode = self.use_cuda_graphs or compile   # tests turn it on for the CPU
        # the compiled CPU decode: one graph for 1 row, one for every bucket from 2 rows up, where every
        # decode matmul takes its row count as a symbol (else one graph per row bucket)
        self.rows_dynamic = compile and self.device.type == "cpu" and rows_can_be_dynamic(model)
        if self.rows_dynamic:
            # and the cache's slot count: an engine of another batch size on the same model (the sweep
            # builds one per batch) then reuses the graphs instead of compiling its own
            for t in cache.k_flat + cache.v_flat:
                torch._dynamo.mark_dynamic(t, 0)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch,
                rec: StepRecord) -> tuple[list[int | None], list[TokenLogprobs | None]]:
        """Run the forward for ``batch`` and sample. Returns, per row of ``batch.rows``, the token
        id (None for a row that computed a prompt chunk and samples nothing) and its logprobs
        (None unless the request asked for them)."""
        rows = sorted(batch.rows, key=lambda r: r[1] > 1)         # decodes (1 token) first, stable
        sampling = [s.num_computed + n == s.num_tokens for s, n in rows]
        sample_seqs = [s for (s, _), yes in zip(rows, sampling) if yes]
        rec.num_sampled = len(sample_seqs)
        static = self._static_for(rows) if self.static_decode else None
        if static is not None:
            static.prepare_for_replay([s.last_token for s, _ in rows], [s.slot for s, _ in rows],
                                      [s.num_computed for s, _ in rows])
            rec.bucket = (static.rows, static.kv_len)
        else:
            tokens, positions, logits_index, meta = self._pack(rows, sampling)
        rec.mark(now_ns())                                                          # prepared
        events = self._device_events()
        if static is not None:
            logits = self._run_static(static, rec)[: len(rows)]                      # [R, V]
            rec.cuda_graph = self.use_cuda_graphs
        else:
            self.backend.begin(meta)
            logits = self.model.forward_packed(tokens, positions, self.backend, logits_index)  # [R, V]
        if events:
            events[1].record()
        rec.mark(now_ns())                                                          # forward issued
        if self.sync_timing:
            synchronize(self.device)              # stamp when the device finished, not when we launched
        rec.mark(now_ns())                                                          # device done
        ids, logprobs = self._sample(logits, sample_seqs)                  # the step's one host sync
        if events:
            rec.device_ms = events[0].elapsed_time(events[1])
        rec.mark(now_ns())                                                          # sampled
        it = iter(zip(ids, logprobs))
        by_seq = {id(s): (next(it) if yes else (None, None)) for (s, _), yes in zip(rows, sampling)}
        picked = [by_seq[id(s)] for s, _ in batch.rows]
        return [t for t, _ in picked], [lp for _, lp in picked]

    def _sample(self, logits: torch.Tensor,
                seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [S, V], row i for seqs[i] → the chosen ids and, for the rows that ask, their
        logprobs, read on the host together. Rows that ask for nothing cost nothing extra."""
        V = logits.shape[-1]
        # min_tokens masks EOS / stop ids for the draw only: the logprobs below are computed
        # from the unmasked logits, vLLM's default "raw" logprobs (the model's distribution,
        # before the mask, temperature and top-k/top-p reshape it).
        masked = ban_tokens(logits, [s.banned_ids(V) for s in seqs])                       # [S, V]
        ids = self.sampler(masked, [s.params for s in seqs], [s.generator for s in seqs])   # [S]
        asked = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        k = max((seqs[i].params.logprobs for i in asked), default=0)    # one top-k for all rows
        lp = logprobs_on_device(logits, ids, asked, k) if asked else None                 # [L, 2 + 2k]
        host_ids, rows = read_sampled(ids, lp, V)
        out: list[TokenLogprobs | None] = [None] * len(seqs)
        for i, values in zip(asked, rows):
            out[i] = unpack_logprobs(host_ids[i], values, k, seqs[i].params.logprobs)
        return host_ids, out

    def _pack(self, rows: list[tuple[Sequence, int]], sampling: list[bool]):
        tokens, positions, logits_index = [], [], []
        decode, prefill = [], []
        for (s, n), yes in zip(rows, sampling):
            start = s.num_computed
            tokens.extend(s.token_ids(start, start + n))
            positions.extend(range(start, start + n))
            if yes:
                logits_index.append(len(tokens) - 1)
            (decode.append((s.slot, start)) if n == 1 else prefill.append((s.slot, start, n)))
        meta = build_metadata(self.cache, decode, prefill, self.device)
        host = torch.tensor([tokens, positions], dtype=torch.long)
        if self.device.type == "cuda":
            host = host.pin_memory()
        host = host.to(self.device, non_blocking=True)
        return host[0], host[1], torch.tensor(logits_index, dtype=torch.long, device=self.device), meta

    def _device_events(self):
        if self.device.type != "cuda":
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return start, end

    # ------------------------------------------------------------------ static decode
    def _static_for(self, rows: list[tuple[Sequence, int]]) -> StaticDecode | None:
        """The bucket for a decode-only step, or None when the step holds a prefill chunk.
        A one-token chunk in the middle of a prompt is not a decode (its token is not the last
        one and it samples nothing), so every row must be computing its last known token."""
        if any(n != 1 or s.num_to_compute != 1 for s, n in rows):
            return None
        B = self.static_bucket_rows(len(rows))
        need = max(s.num_computed for s, _ in rows) + 1
        L = self.static_kv_len(need)
        key = (B, L)
        if key not in self._static:
            sd = self._static[key] = StaticDecode(self.cache, B, L, self.device)
            if self.compile and not self.use_cuda_graphs:
                # One compiled graph per row bucket, whatever the K/V length: L is the size of
                # ``kv_pos``, marked dynamic. Without it every (rows, L) bucket compiled its own
                # graph, and with frozen weights (bf16) each held its own packed copy of them.
                torch._dynamo.mark_dynamic(sd.kv_pos, 0)
                if B > 1 and self.rows_dynamic:  # one graph for every row bucket from 2 up: rows dynamic
                    for t in (sd.tokens, sd.positions, sd.write_loc, sd.slots, sd.lens, sd.logits_index):
                        torch._dynamo.mark_dynamic(t, 0)
        return self._static[key]

    def static_kv_len(self, need: int) -> int:
        """The K/V length a static decode reads for ``need`` cached positions. A CUDA graph fixes
        every shape, so lengths go in powers of two (a graph per bucket). The CPU's compiled decode
        takes the length as a dynamic size (one graph whatever it is), so it only rounds up to
        ``KV_STEP``: with powers of two, 128 cached tokens were read through 256 positions, by the
        formula 403 MB of K/V a step at batch 64 against 201 MB (``cpu-small`` fp32), and the
        compiled step took 113 ms there against 81 ms eager (the 2-core Xeon VM)."""
        if self.compile and not self.use_cuda_graphs:
            L = -(-need // KV_STEP) * KV_STEP
        else:
            L = 16
            while L < need:
                L *= 2
        return min(L, self.cache.max_len)

    def static_bucket_rows(self, rows: int) -> int:
        """The row bucket a decode of ``rows`` rows runs in (padded up to it)."""
        return next(b for b in self.row_buckets if b >= rows)

    def _static_step(self, sd: StaticDecode) -> torch.Tensor:
        """One decode step on a bucket's static buffers (what a CUDA graph captures and what
        ``torch.compile`` compiles)."""
        if self.rows_dynamic:
            # Every layer's cache has the same slot count: said once here, the graph takes one size where it
            # took one per tensor (24 for cpu-small), each passed as a tensor and read back every step.
            # Measured on a 12-layer model with tiny weights (the step's fixed cost alone): 0.47 → 0.38 ms.
            n = self.cache.k_flat[0].shape[0]
            for t in self.cache.k_flat + self.cache.v_flat:
                torch._check(t.shape[0] == n)
        self.backend.begin(sd.meta)
        return self.model.forward_packed(sd.tokens, sd.positions, self.backend, sd.logits_index)  # [rows, V]

    def _compiling(self, rows: int):
        from minillm.engine.compiled import compiling
        return compiling(self.device, self.model.dtype, rows)

    def _run_static(self, sd: StaticDecode, rec: StepRecord | None = None) -> torch.Tensor:
        step = self._compiled or self._static_step
        key = (sd.rows, sd.kv_len)
        # what a new compilation (or capture) serves: a CUDA graph per bucket, a CPU graph per row count
        graph = key if self.use_cuda_graphs else min(sd.rows, 2) if self.rows_dynamic else sd.rows
        first = self.compile and graph not in self._graphs_built
        if first:
            self._graphs_built.add(graph)
        t0 = time.perf_counter()
        with self._compiling(sd.rows) if first else contextlib.nullcontext():
            if not self.use_cuda_graphs:
                out = step(sd)
            else:
                replay = self.graphs.graphs.get(key)
                if replay is None:
                    with attention_for_capture():        # fixed shapes: cuDNN's plan is built once
                        replay = self.graphs.capture(key, lambda: step(sd))
                out = replay()
        if first:       # the bucket's first step: compilation (and capture on CUDA) included
            synchronize(self.device)
            # Compiling allocates tens of thousands of Python objects (and leaves cyclic garbage:
            # 1,984 objects for `tiny`), which pushes the collector's counters towards a full
            # collection of the whole heap; left alone, it fell inside a later decode step
            # (measured: 148 ms in one timed 64-token decode, cpu-small fp32). Collecting now resets
            # the counters, in the step that already pays for the compile (10.5).
            gc.collect()
            self.compile_s[key] = time.perf_counter() - t0
            if rec is not None:
                rec.compile_ms = self.compile_s[key] * 1e3
            log.info("torch.compile: decode bucket (rows %d, K/V length %d) compiled%s in %.1f s",
                     sd.rows, sd.kv_len, " and captured" if self.use_cuda_graphs else "", self.compile_s[key])
        return out
