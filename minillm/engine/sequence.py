"""One request inside the engine: its tokens, its slot, its trace (design.md §1)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from minillm.engine.sampling import SamplingParams
from minillm.measure.trace import Trace


class Status(enum.Enum):
    WAITING = "waiting"      # in the scheduling queue
    RUNNING = "running"      # owns a KV slot, decodes one token per step
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    trace: Trace
    eos_ids: frozenset[int] = frozenset()
    status: Status = Status.WAITING
    slot: int | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""                     # detokenized output so far (stop strings removed)
    emitted: int = 0                   # chars of ``text`` already handed out as deltas
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    error: str | None = None           # why, when finish_reason is "error"
    generator: torch.Generator | None = None
    detok: object | None = None        # minillm.engine.tokenizer.IncrementalDetokenizer

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_cached(self) -> int:
        """Tokens whose K/V are in the cache: all but the newest output token, which the next
        decode step feeds in (it was sampled, not yet run through the model)."""
        return self.num_tokens - 1 if self.output_ids else 0

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
