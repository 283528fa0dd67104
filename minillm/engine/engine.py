"""The engine: ``LLMEngine.step()`` is one forward pass; ``LLM`` is the vLLM-shaped front door.

    add_request ─► tokenize ─► scheduling queue ─► step(): prefill | decode ─► sample ─► detokenize
                                                       ▲                                   │
                                                       └──────── running batch ◄───────────┘

Continuous batching (10.3): the running batch is re-formed every step. A request that
finishes leaves at once and frees its KV slot; a waiting one is prefilled and joins the
decode batch on the next step. Nobody waits for the slowest request of a "batch".
"""
from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from minillm.model.config import ModelConfig
from minillm.measure.hardware import default_dtype, free_memory_bytes, parse_dtype, pick_device, synchronize
from minillm.engine.kv_cache import KVCache, size_kv_cache
from minillm.model.loader import is_shape_twin, load_model, resolve_checkpoint
from minillm.model.transformer import Transformer, build_attn_meta
from minillm.engine.sampling import SamplingParams, make_generator, sample_next
from minillm.engine.scheduler import Batch, Scheduler
from minillm.engine.sequence import Sequence, Status
from minillm.engine.tokenizer import IncrementalDetokenizer, encode_prompt, load_tokenizer
from minillm.measure.trace import Trace, now_ns

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


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    trace: Trace = field(repr=False)

    @property
    def metrics(self):
        from minillm.measure.metrics import request_metrics
        return request_metrics(self.trace)


class LLMEngine:
    def __init__(self, model: Transformer, tokenizer, *, max_batch_size: int = 64,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 kv_memory_fraction: float = 0.5, sync_timing: bool = True):
        self.model, self.tokenizer = model, tokenizer
        self.config: ModelConfig = model.config
        self.device = model.device
        self.sync_timing = sync_timing
        want_len = min(max_model_len or min(self.config.max_position_embeddings, 4096),
                       self.config.max_position_embeddings)
        spec = size_kv_cache(self.config, model.dtype, max_batch_size, want_len,
                             free_bytes=free_memory_bytes(self.device), memory_fraction=kv_memory_fraction)
        self.max_model_len = spec.max_len
        self.cache = KVCache(self.config, spec.num_slots, spec.max_len, self.device, model.dtype)
        self.scheduler = Scheduler(self.cache, max_batch_size,
                                   max_num_batched_tokens or max(2048, self.max_model_len))
        self.eos_ids = self._eos_ids()
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()   # add/abort may come from other threads (the server)

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        eos = self.config.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

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
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids, text = list(prompt), None
        else:
            raise RequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        trace.record("tokenized", n_tokens=len(ids))
        self.validate_prompt_ids(ids)
        seq = Sequence(rid, text, ids, params, trace, eos_ids=self.eos_ids)
        seq.generator = make_generator(params)
        seq.detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=ids)
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
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")

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
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        with self._lock:
            batch = self.scheduler.schedule()
            if batch is None:
                return []
            try:
                logits = self._forward(batch)                               # [B, V]
                token_ids = sample_next(logits, [s.params for s in batch.seqs],
                                        [s.generator for s in batch.seqs]) # host ints: device work is done
            except Exception as e:   # e.g. out of memory: fail this batch, keep the engine alive
                return self._fail_batch(batch, e)
            t = now_ns()
            return [self._append_token(seq, tok, t) for seq, tok in zip(batch.seqs, token_ids)]

    def _forward(self, batch: Batch) -> torch.Tensor:
        seqs = batch.seqs
        slots = [s.slot for s in seqs]
        if batch.is_prefill:
            lens = [s.num_prompt_tokens for s in seqs]
            tokens = torch.zeros(len(seqs), max(lens), dtype=torch.long)   # [B, T] right-padded
            for b, s in enumerate(seqs):
                tokens[b, : lens[b]] = torch.tensor(s.prompt_ids)
            t0 = now_ns()
            for s in seqs:
                s.trace.record("prefill_start", t_ns=t0, batch_size=len(seqs), n_tokens=sum(lens))
            meta = build_attn_meta(slots, [0] * len(seqs), lens, self.cache.scratch_pos, self.device)
            logits = self.model(tokens.to(self.device), self.cache, meta,
                                last_index=torch.tensor(lens, device=self.device) - 1)   # [B, V]
            if self.sync_timing:
                synchronize(self.device)   # stamp when the device finished, not when we launched
            t1 = now_ns()
            for s in seqs:
                s.trace.record("prefill_end", t_ns=t1)
            return logits
        tokens = torch.tensor([[s.last_token] for s in seqs], device=self.device)  # [B, 1]
        meta = build_attn_meta(slots, [s.num_cached for s in seqs], [1] * len(seqs),
                               self.cache.scratch_pos, self.device)
        return self.model(tokens, self.cache, meta)[:, -1]                  # [B, V]

    def _fail_batch(self, batch: Batch, error: Exception) -> list[StepOutput]:
        """The forward pass failed: end the requests in it with reason "error" (their slots are
        freed) and report it; requests outside this batch are untouched."""
        msg = f"{type(error).__name__}: {error}"
        log.error("step failed for %d request(s): %s", len(batch.seqs), msg)
        outs = []
        for seq in batch.seqs:
            seq.error = msg
            self._finish(seq, "error")
            outs.append(StepOutput(seq.request_id, None, "", True, "error"))
        return outs

    def _append_token(self, seq: Sequence, token_id: int, t_ns: int) -> StepOutput:
        seq.output_ids.append(token_id)
        seq.trace.record("token", t_ns=t_ns, index=len(seq.output_ids) - 1, token_id=token_id)
        reason = self._stop_reason(seq, token_id)
        if not (token_id in seq.eos_ids and not seq.params.ignore_eos):   # EOS adds no text
            seq.text += seq.detok.push(token_id)
        if reason is not None:
            seq.text += seq.detok.flush()      # finishing: release anything held back
        reason = self._check_stop_strings(seq) or reason
        delta = self._take_delta(seq, final=reason is not None)
        if reason is not None:
            self._finish(seq, reason)
        return StepOutput(seq.request_id, token_id, delta, reason is not None, reason)

    def _stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token_id in seq.eos_ids:
            return "stop"
        if token_id in p.stop_token_ids:
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _check_stop_strings(seq: Sequence) -> str | None:
        """Cut the text at the first stop string (it is not part of the output, as in vLLM)."""
        if not seq.params.stop:
            return None
        longest = max(map(len, seq.params.stop))
        start = max(0, seq.emitted - longest)
        hits = [i for i in (seq.text.find(s, start) for s in seq.params.stop) if i >= 0]
        if not hits:
            return None
        seq.text = seq.text[: min(hits)]
        return "stop"

    @staticmethod
    def _take_delta(seq: Sequence, final: bool) -> str:
        # While running, hold back a tail that could be the start of a stop string, so the
        # streamed deltas always add up to the final text.
        hold = 0 if final or not seq.params.stop else max(map(len, seq.params.stop)) - 1
        end = max(seq.emitted, len(seq.text) - hold)
        delta = seq.text[seq.emitted : end]
        seq.emitted = end
        if delta:
            seq.trace.record("detokenized", n_chars=len(delta))
        return delta

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        seq.trace.record("finished", reason=reason, n_output=len(seq.output_ids))

    def output_of(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_ids), seq.text,
                             list(seq.output_ids), seq.finish_reason, seq.trace)


class LLM:
    """``LLM(model="tiny")`` then ``generate`` / ``stream`` (the API mirrors vLLM's).

    ``model``: a preset (a shape twin with random weights: its text is gibberish, its speed is
    real), a Hugging Face checkpoint directory, or a hub id available on this machine.
    """
    def __init__(self, model: str = "tiny", tokenizer: str | None = None, device: str | None = None,
                 dtype: str | torch.dtype | None = None, seed: int = 0, max_batch_size: int = 64,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 kv_memory_fraction: float = 0.5, sync_timing: bool = True):
        self.device = pick_device(device)
        self.dtype = parse_dtype(dtype) if dtype is not None else default_dtype(self.device)
        self.model_name = str(model)
        self.is_shape_twin = is_shape_twin(model)
        if tokenizer is None and not self.is_shape_twin:
            tokenizer = str(resolve_checkpoint(model))
        self.tokenizer = load_tokenizer(tokenizer)
        self.model = load_model(model, self.device, self.dtype, seed)
        self.engine = LLMEngine(self.model, self.tokenizer, max_batch_size=max_batch_size,
                                max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                kv_memory_fraction=kv_memory_fraction, sync_timing=sync_timing)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
        seqs = [self.engine.prepare(p, sp) for p, sp in zip(prompts, params_list)]  # all validated first
        for s in seqs:
            self.engine.enqueue(s)
        bar = _progress(len(seqs)) if use_tqdm else None
        while any(not s.finished for s in seqs):
            for o in self.engine.step():
                if o.finished and bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [self.engine.output_of(self.engine.pop_finished(s.request_id)) for s in seqs]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas as they are produced. Closing the iterator early aborts the request."""
        rid = self.engine.add_request(prompt, params)
        seq = self.engine.get(rid)
        try:
            while not seq.finished:
                for o in self.engine.step():
                    if o.request_id == rid and o.delta:
                        yield o.delta
            if seq.finish_reason == "error":
                raise RuntimeError(f"request {rid} failed: {seq.error}")
        finally:
            if not seq.finished:
                self.engine.abort(rid)
            self.last_output = self.engine.output_of(self.engine.pop_finished(rid))


def _progress(total: int):
    from tqdm.auto import tqdm
    return tqdm(total=total, unit="req")
