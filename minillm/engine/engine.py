"""The engine: ``LLMEngine.step()`` is one forward pass (design.md §8).

    add_request ─► tokenize ─► Sequence ─► Scheduler.schedule() ─► [(seq, num_new), …]
        ─► ModelRunner: pack, forward, sample ─► OutputProcessor: detokenize, stop rules
        ─► StepOutputs (and one StepRecord)

Continuous batching (10.3): the running batch is re-formed every step. A request that
finishes leaves at once and frees its KV slot; a waiting one joins as soon as the policy lets
it (chunked: in the same step as the decodes). Nobody waits for the slowest request of a "batch".
"""
from __future__ import annotations

import itertools
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from minillm.core.device import free_memory_bytes
from minillm.core.step_record import StepHistory, StepRecord
from minillm.core.trace import Trace, now_ns
from minillm.engine.config import EngineConfig
from minillm.engine.gc_pauses import GC_CLOCK
from minillm.engine.kv_cache import KVCache, size_kv_cache
from minillm.engine.output import OutputProcessor
from minillm.engine.prefix_cache import SlotAllocator
from minillm.engine.runner import ModelRunner
from minillm.engine.sampling import SamplingParams, TokenLogprobs, make_generator
from minillm.engine.scheduler import ScheduledBatch, Scheduler
from minillm.engine.sequence import Sequence
from minillm.engine.tokenizer import encode_prompt
from minillm.model.config import ModelConfig
from minillm.model.transformer import Transformer

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine cannot run (empty prompt, too long for the context, bad ids)."""


@dataclass
class StepOutput:
    request_id: str
    token_id: int | None       # None when the step failed for this request (finish_reason "error")
    delta: str                 # new text, possibly "" (e.g. half of a UTF-8 character)
    finished: bool
    finish_reason: str | None
    logprobs: TokenLogprobs | None = None   # this token's, when the request asked (SamplingParams.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    trace: Trace = field(repr=False)
    num_cached_tokens: int = 0        # prompt tokens served by the prefix cache
    logprobs: list[TokenLogprobs] | None = None   # one per token of token_ids; None when not asked

    @property
    def metrics(self):
        from minillm.metrics.definitions import request_metrics
        return request_metrics(self.trace)


class LLMEngine:
    def __init__(self, model: Transformer, tokenizer, config: EngineConfig | None = None,
                 eos_ids: set[int] | None = None, **options):
        """``config`` (or the same fields as keywords) holds every option; see EngineConfig."""
        self.engine_config = config or EngineConfig(**options)
        ec = self.engine_config
        self.model, self.tokenizer = model, tokenizer
        self.config: ModelConfig = model.config
        self.device = model.device
        self.sync_timing = ec.sync_timing
        if ec.max_model_len is not None and ec.max_model_len > self.config.max_position_embeddings:
            raise ValueError(f"max_model_len={ec.max_model_len} is longer than the model's context "
                             f"({self.config.max_position_embeddings} positions)")
        spec = size_kv_cache(self.config, model.dtype, ec.max_batch_size, ec.max_model_len,
                             free_bytes=free_memory_bytes(self.device), memory_fraction=ec.kv_memory_fraction)
        self.max_model_len = spec.max_len
        self.cache = KVCache(self.config, spec.num_slots, spec.max_len, self.device, model.dtype)
        log.info("KV cache: %d slots × %d tokens = %.2f GiB on %s%s", spec.num_slots, spec.max_len,
                 spec.bytes_total / 2**30, self.device,
                 "" if ec.max_model_len else " (max_model_len: the model's context, capped to fit)")
        self.allocator = SlotAllocator(spec.num_slots, ec.enable_prefix_caching)
        self.scheduler = Scheduler(self.allocator, ec.max_batch_size, ec.resolved_budget(self.max_model_len),
                                   ec.scheduling_policy)
        self.runner = ModelRunner(model, self.cache, ec.max_batch_size, enforce_eager=ec.enforce_eager,
                                  sync_timing=ec.sync_timing, seed=ec.seed, compile=ec.compile,
                                  matmul=ec.resolved_matmul())
        self.output = OutputProcessor(tokenizer, self.max_model_len)
        self.step_history = StepHistory(ec.step_history)
        self.eos_ids = frozenset(eos_ids if eos_ids is not None else self._eos_ids())
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._steps = itertools.count()
        self._lock = threading.RLock()   # add/abort may come from other threads (the server)
        self._stepping_thread: int | None = None

    def _eos_ids(self) -> set[int]:
        """EOS ids from config.json and the tokenizer (``LLM`` adds generation_config.json)."""
        ids: set[int] = set()
        eos = self.config.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ------------------------------------------------------------------ requests in and out
    def prepare(self, prompt: str | list[int], params: SamplingParams | None = None,
                request_id: str | None = None, trace: Trace | None = None) -> Sequence:
        """Tokenize and validate, without queueing: a bad request fails here and disturbs nobody."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        rid = request_id or f"req-{next(self._ids)}"
        trace = trace or Trace(rid)
        if trace.first("received") is None:
            trace.record("received")
        if isinstance(prompt, str):
            ids = encode_prompt(self.tokenizer, prompt)
            text = prompt
        elif (isinstance(prompt, (list, tuple))
              and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            ids, text = list(prompt), None
        else:
            raise RequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if trace.first("tokenized") is None:       # the server counted the ids already (one pass)
            trace.record("tokenized", n_tokens=len(ids))
        self.validate_prompt_ids(ids)
        seq = Sequence(rid, text, ids, params, trace, eos_ids=self.eos_ids)
        seq.generator = make_generator(params, self.device)
        seq.output = self.output.new_state(ids)
        return seq

    def validate_prompt_ids(self, ids: list[int]) -> None:
        if not ids:
            raise RequestError("the prompt is empty: at least one token is needed")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens, but this engine's context is "
                               f"{self.max_model_len} tokens (max_model_len) and at least one must be left "
                               f"for the output")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary "
                               f"[0, {self.config.vocab_size})")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, trace: Trace | None = None) -> str:
        seq = self.prepare(prompt, params, request_id, trace)
        return self.enqueue(seq)

    def enqueue(self, seq: Sequence) -> str:
        with self._lock:
            if seq.request_id in self._seqs:
                raise RequestError(f"request id {seq.request_id!r} is already in use")
            self._seqs[seq.request_id] = seq
            self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its KV slot is free when this returns."""
        with self._lock:
            seq = self._seqs.get(request_id)
            if seq is None or seq.finished:
                return False
            self._finish(seq, "abort")
            return True

    def get(self, request_id: str) -> Sequence:
        return self._seqs[request_id]

    def pop_finished(self, request_id: str) -> Sequence:
        """Forget a finished request (the engine keeps no history by itself)."""
        with self._lock:
            seq = self._seqs[request_id]
            if not seq.finished:
                raise RuntimeError(f"request {request_id!r} is still {seq.status.value}")
            return self._seqs.pop(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ one step = one forward
    def step(self) -> list[StepOutput]:
        self._check_thread()
        with self._lock:
            rec = StepRecord(next(self._steps), now_ns())
            batch = self.scheduler.schedule()
            if batch is None:
                return []
            self._describe(batch, rec)
            rec.mark(now_ns())                                                    # scheduled
            self._record_prefill_start(batch, rec.t_ns[-1])
            try:
                token_ids, logprobs = self.runner.execute(batch, rec)
            except Exception as e:   # e.g. out of memory: fail this batch, keep the engine alive
                rec.error = f"{type(e).__name__}: {e}"
                rec.gc_ms = GC_CLOCK.in_window_ns(rec.t_start_ns, now_ns()) / 1e6
                self.step_history.append(rec)
                return self._fail_batch(batch, e)
            t = rec.t_ns[-1]
            outs = []
            for (seq, n), tok, lp in zip(batch.rows, token_ids, logprobs):
                was_prefill = seq.in_prefill
                seq.num_computed += n
                if was_prefill:
                    self._record_chunk(seq, n, rec, t)
                if tok is not None:
                    outs.append(self._append_token(seq, tok, lp, t))
            rec.mark(now_ns())                                                    # outputs processed
            rec.gc_ms = GC_CLOCK.in_window_ns(rec.t_start_ns, rec.t_ns[-1]) / 1e6     # inside wall_ms
            rec.gc_output_ms = GC_CLOCK.in_window_ns(t, rec.t_ns[-1]) / 1e6           # after the sampled mark
            self.step_history.append(rec)
            return outs

    def _check_thread(self) -> None:
        """Only one thread steps an engine (the server's engine thread, or the caller of
        ``LLM.generate``): two steppers would interleave forwards on one KV cache."""
        me = threading.get_ident()
        if self._stepping_thread is None:
            self._stepping_thread = me
        elif self._stepping_thread != me:
            raise RuntimeError("LLMEngine.step() was called from a second thread; one thread owns the "
                               "engine's steps (add_request and abort are safe from any thread)")

    @staticmethod
    def _describe(batch: ScheduledBatch, rec: StepRecord) -> None:
        rec.num_rows = len(batch.rows)
        for s, n in batch.rows:
            if s.in_prefill:
                rec.num_prefill_rows += 1
                rec.num_prefill_tokens += n
            else:
                rec.num_decode_rows += 1
                rec.num_decode_tokens += n

    @staticmethod
    def _record_prefill_start(batch: ScheduledBatch, t_ns: int) -> None:
        rows = [(s, n) for s, n in batch.rows if s.in_prefill]
        total = sum(n for _, n in rows)
        for s, n in rows:
            if s.trace.first("prefill_start") is None:
                s.trace.record("prefill_start", t_ns=t_ns, batch_size=len(batch.rows), n_tokens=total,
                               cached_tokens=s.num_cached_tokens)

    def _record_chunk(self, seq: Sequence, n: int, rec: StepRecord, t_end: int) -> None:
        """``prefill_chunk`` per chunk; ``prefill_end`` when the prompt is done, so the TTFT
        breakdown (queue → prefill) still telescopes."""
        seq.trace.record("prefill_chunk", t_ns=t_end, t_start_ns=rec.t_ns[0], tokens=n,
                         step=rec.step, decode_rows=rec.num_decode_rows)
        if not seq.in_prefill:
            seq.trace.record("prefill_end", t_ns=t_end)

    def _fail_batch(self, batch: ScheduledBatch, error: Exception) -> list[StepOutput]:
        """The forward pass failed: end the requests in it with reason "error" (their slots are
        freed) and report it; requests outside this batch are untouched."""
        msg = f"{type(error).__name__}: {error}"
        log.error("step failed for %d request(s): %s", len(batch.rows), msg)
        outs = []
        for seq in batch.seqs:
            seq.error = msg
            self._finish(seq, "error")
            outs.append(StepOutput(seq.request_id, None, "", True, "error"))
        return outs

    def _append_token(self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None,
                      t_ns: int) -> StepOutput:
        seq.output_ids.append(token_id)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        seq.trace.record("token", t_ns=t_ns, index=len(seq.output_ids) - 1, token_id=token_id)
        delta, reason = self.output.append(seq, token_id)
        if reason is not None:
            self._finish(seq, reason)
        return StepOutput(seq.request_id, token_id, delta, reason is not None, reason, logprobs)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        seq.trace.record("finished", reason=reason, n_output=len(seq.output_ids))

    def output_of(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_ids), seq.text,
                             list(seq.output_ids), seq.finish_reason, seq.trace, seq.num_cached_tokens,
                             list(seq.logprobs) if seq.params.logprobs is not None else None)


def generation_config_eos(checkpoint_dir: str | Path | None) -> set[int]:
    """EOS ids a checkpoint's ``generation_config.json`` adds (Llama-3 Instruct ends turns with
    <|eot_id|> there, not in config.json)."""
    if checkpoint_dir is None:
        return set()
    p = Path(checkpoint_dir) / "generation_config.json"
    if not p.is_file():
        return set()
    try:
        eos = json.loads(p.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return set()
    return set(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
