"""The scheduling queue (chapter 10.1) and what one step holds (10.3 continuous batching, 10.4).

Policy only: every step the scheduler returns rows ``(sequence, num_new_tokens)`` within two
limits, ``max_batch_size`` rows (vLLM's max_num_seqs; one KV slot each) and
``max_num_batched_tokens`` tokens. It asks the slot allocator for capacity; it owns no tensors.

Two policies:

- ``"prefill-first"`` (nano-vllm's and early vLLM's): if requests wait and slots are free, the
  step is a prefill of as many whole prompts as fit; otherwise it is a decode of every running
  request. New requests get a short TTFT, and this is exactly why "a long prefill stalls every
  decoding request" (10.4): during that step nobody decodes, one long inter-token gap.
- ``"chunked"`` (Sarathi-Serve; vLLM V1's default): every running decode gets its one token
  first, then the rest of the budget goes to prefill chunks, oldest request first. A long
  prompt spreads over several steps; a decode row and a chunk share one forward, so decoders
  never wait for a whole prompt.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minillm.engine.prefix_cache import SlotAllocator
from minillm.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """The rows of one step: decode rows first, then prefill chunks (the packed order)."""
    rows: list[tuple[Sequence, int]] = field(default_factory=list)

    @property
    def seqs(self) -> list[Sequence]:
        return [s for s, _ in self.rows]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.rows)


class Scheduler:
    def __init__(self, allocator: SlotAllocator, max_batch_size: int, max_num_batched_tokens: int,
                 policy: str = "chunked"):
        if max_batch_size < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_batch_size and max_num_batched_tokens must be ≥ 1")
        if policy not in ("chunked", "prefill-first"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.allocator = allocator
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []      # admission order

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)
        seq.trace.record("enqueued", queue_depth=len(self.waiting))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        batch = self._chunked() if self.policy == "chunked" else self._prefill_first()
        return batch if batch.rows else None

    # ---------------------------------------------------------------- the two policies
    def _prefill_first(self) -> ScheduledBatch:
        batch, budget = ScheduledBatch(), self.max_num_batched_tokens
        while self.waiting and self.allocator.num_free and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            _, hit = self.allocator.match(seq.prompt_ids)
            need = seq.num_prompt_tokens - hit
            # whole prompts only; one longer than the whole budget still runs, alone
            if batch.rows and need > budget:
                break
            self._admit(seq)
            batch.rows.append((seq, seq.num_to_compute))
            budget -= seq.num_to_compute
            if budget <= 0:
                break
        if batch.rows:
            return batch
        return ScheduledBatch([(s, 1) for s in self.running])

    def _chunked(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        decodes = [s for s in self.running if not s.in_prefill]
        prefills = [s for s in self.running if s.in_prefill]      # prompts already started
        batch = ScheduledBatch([(s, 1) for s in decodes[:budget]])
        budget -= len(batch.rows)
        for seq in prefills:
            if budget <= 0:
                break
            n = min(seq.num_to_compute, budget)
            batch.rows.append((seq, n))
            budget -= n
        while (budget > 0 and self.waiting and self.allocator.num_free
               and len(self.running) < self.max_batch_size):
            seq = self.waiting[0]
            self._admit(seq)
            n = min(seq.num_to_compute, budget)
            batch.rows.append((seq, n))
            budget -= n
        return batch

    def _admit(self, seq: Sequence) -> None:
        self.waiting.popleft()
        seq.slot, seq.num_cached_tokens = self.allocator.allocate(seq.request_id, seq.prompt_ids)
        seq.num_computed = seq.num_cached_tokens
        seq.status = Status.RUNNING
        self.running.append(seq)
        seq.trace.record("scheduled", slot=seq.slot, queue_depth=len(self.waiting),
                         cached_tokens=seq.num_cached_tokens)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Leave the batch and give the slot back (finished, stopped or aborted). The slot
        remembers the tokens whose K/V it holds, for the prefix cache."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        if seq.slot is not None:
            keep = seq.all_token_ids[:seq.num_computed] if reason != "error" else []
            self.allocator.free(seq.slot, keep)
            seq.slot = None
        seq.status = Status.FINISHED
        seq.finish_reason = reason
