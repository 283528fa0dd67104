"""Sampling: turn one row of logits into one token (chapter 10.5: part of the time outside
the big matmuls). ``SamplingParams`` mirrors vLLM's names and defaults."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 → greedy (argmax)
    top_k: int = -1                   # -1 (or 0) → off
    top_p: float = 1.0                # 1 → off
    seed: int | None = None           # per-request generator: reproducible whatever the batch
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False          # benchmarks: generate exactly max_tokens (10.6)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop, self.stop_token_ids = list(self.stop or []), list(self.stop_token_ids or [])
        problems = []

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer ≥ 1, got {self.max_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature <= 100 or self.temperature != self.temperature:
            problems.append(f"temperature must be a number in [0, 100] (0 = greedy), got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            problems.append(f"top_k must be an integer ≥ 1, or -1/0 to disable, got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not is_int(self.seed):
            problems.append(f"seed must be an integer or None, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            problems.append(f"stop must be non-empty strings, got {self.stop!r}")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    # logits: [V] (already divided by temperature) → same shape with excluded tokens at -inf
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)      # [V]
        cum = sorted_logits.softmax(-1).cumsum(-1)                       # [V]
        # drop a token when the tokens *before* it already reach top_p (always keeps the first)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[int]:
    """logits: [B, V] → one token id per row. Greedy rows share one batched argmax; the others
    sample row by row with their own generator (so a seeded request gives the same text
    whether it runs alone or in a batch of 64)."""
    if all(p.greedy for p in params):
        return logits.argmax(-1).tolist()                # one device→host copy for the batch
    out: list[int] = []
    greedy_ids = logits.argmax(-1).tolist()
    for b, (p, g) in enumerate(zip(params, generators)):
        if p.greedy:
            out.append(greedy_ids[b])
            continue
        row = filter_top_k_top_p(logits[b].float() / p.temperature, p.top_k, p.top_p)   # [V]
        probs = row.softmax(-1)
        # the generator lives on the CPU so a seed means the same thing on every device
        out.append(int(torch.multinomial(probs.cpu(), 1, generator=g).item()))
    return out


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device="cpu")
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g
