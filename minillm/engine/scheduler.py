"""The scheduling queue (chapter 10.1) and continuous batching.

Every step the scheduler decides what the one forward pass will hold:
- if requests wait and KV slots are free: a **prefill** step for as many waiting requests
  as fit in the slots, the batch size and the per-step token budget (first come, first served);
- otherwise a **decode** step: one token for every running request.

Prefill first is nano-vllm's and early vLLM's policy. It gives new requests a short TTFT, and
it is exactly why "a long prefill stalls every decoding request" (10.4): during that step
nobody decodes, which shows up as one long inter-token gap in the ITL distribution (10.2).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from minillm.engine.kv_cache import KVCache
from minillm.engine.sequence import Sequence, Status


@dataclass
class Batch:
    seqs: list[Sequence]
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        return sum(s.num_prompt_tokens for s in self.seqs) if self.is_prefill else len(self.seqs)


class Scheduler:
    def __init__(self, cache: KVCache, max_batch_size: int, max_num_batched_tokens: int):
        if max_batch_size < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_batch_size and max_num_batched_tokens must be ≥ 1")
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)
        seq.trace.record("enqueued", queue_depth=len(self.waiting))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        prefill = self._admit_waiting()
        if prefill:
            return Batch(prefill, is_prefill=True)
        if self.running:
            return Batch(list(self.running), is_prefill=False)
        return None

    def _admit_waiting(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        tokens, longest = 0, 0
        while self.waiting and self.cache.num_free and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            # The prefill batch is padded to its longest prompt, so the budget counts padded
            # tokens (rows × longest): one 1000-token prompt must not turn three short ones into
            # 4000 tokens of work. A prompt longer than the whole budget still runs, alone.
            padded = (len(admitted) + 1) * max(longest, seq.num_prompt_tokens)
            if admitted and padded > self.max_num_batched_tokens:
                break
            longest = max(longest, seq.num_prompt_tokens)
            self.waiting.popleft()
            seq.slot = self.cache.allocate(seq.request_id)
            seq.status = Status.RUNNING
            self.running.append(seq)
            seq.trace.record("scheduled", slot=seq.slot, queue_depth=len(self.waiting))
            admitted.append(seq)
            tokens = len(admitted) * longest
            if tokens >= self.max_num_batched_tokens:
                break
        return admitted

    def finish(self, seq: Sequence, reason: str) -> None:
        """Leave the batch and give the slot back (finished, stopped or aborted)."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        if seq.slot is not None:
            self.cache.free(seq.slot)
            seq.slot = None
        seq.status = Status.FINISHED
        seq.finish_reason = reason
