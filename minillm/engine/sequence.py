"""One request inside the engine: its tokens, its slot, its progress, its trace (design.md §1, §8).

Progress is *stored*, not derived (nano-vllm's idea): ``num_computed`` counts the tokens whose
K/V are in the cache. A step gives a row ``num_new`` tokens to compute; afterwards
``num_computed += num_new``. When every known token is computed, the row's last logits are
sampled and one token is appended, so a decoding row always has exactly one token to compute.
A prompt longer than the step's budget therefore spreads over several steps (chunked prefill)
without any special case.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from minillm.core.trace import Trace
from minillm.engine.sampling import SamplingParams, TokenLogprobs


class Status(enum.Enum):
    WAITING = "waiting"      # in the scheduling queue, no slot
    RUNNING = "running"      # owns a KV slot: prefilling (maybe in chunks) or decoding
    FINISHED = "finished"


@dataclass(eq=False)         # compared by identity: two requests are never "equal"
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
    logprobs: list[TokenLogprobs] = field(default_factory=list)   # one per output token, if asked
    num_computed: int = 0              # tokens whose K/V are in the cache (stored, see above)
    num_cached_tokens: int = 0         # of the prompt, served by the prefix cache (a hit)
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    error: str | None = None           # why, when finish_reason is "error"
    generator: torch.Generator | None = None   # only for seeded, non-greedy requests
    output: object | None = None       # minillm.engine.output.OutputState: text, detokenizer

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_to_compute(self) -> int:
        """Tokens known but not yet run through the model (1 for a decoding row)."""
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_prompt_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        return (self.prompt_ids[start:] if start < p else []) + self.output_ids[max(0, start - p): end - p]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def below_min_tokens(self) -> bool:
        """Fewer than ``min_tokens`` output tokens: nothing may end the request yet but length."""
        return len(self.output_ids) < self.params.min_tokens

    def banned_ids(self, vocab_size: int) -> list[int]:
        """Ids the next token may not be (vLLM's min_tokens): EOS (unless ignore_eos) and the stop
        token ids while below min_tokens, else none. Ids past the vocabulary cannot be sampled
        anyway, and would be out of range for the mask."""
        if not self.below_min_tokens:
            return []
        p = self.params
        ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids))
        return sorted(t for t in ids if t < vocab_size)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    # Text is kept by the output processor; these keep the old attribute names working.
    @property
    def text(self) -> str:
        return self.output.text if self.output is not None else ""
