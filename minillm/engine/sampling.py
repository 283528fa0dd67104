"""Sampling: turn each row of logits into one token (chapter 10.5: part of the time outside the
big matmuls). ``SamplingParams`` mirrors vLLM's names and defaults, and is the one place where
sampling values are validated: the HTTP gateway builds one too, so the two never disagree.

The sampler is batched on the device: temperature, top-k and top-p are per-row tensors, the
draw is an exponential race (gpt-fast: ``argmax(p / q)`` with ``q ~ Exp(1)`` picks token i with
probability p_i), and the only host sync of a step is reading the chosen ids. Unseeded rows draw
from the engine's own generator, so nothing touches torch's global random state; a seeded row
draws from its own generator, so it gives the same tokens alone or in any batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Below this temperature a row is greedy: dividing by 3e-39 overflows to inf and the softmax
# to NaN (vLLM uses the same threshold for the same reason).
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 (or < 1e-5) → greedy (argmax)
    top_k: int = -1                   # -1 (or 0) → off
    top_p: float = 1.0                # 1 → off
    seed: int | None = None           # per-request generator: reproducible whatever the batch
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False          # benchmarks: generate exactly max_tokens (10.6)
    include_stop_str_in_output: bool = False   # vLLM's: keep the matched stop string / stop token's text

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        problems = sampling_problems(self)
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def sampling_problems(p: SamplingParams) -> list[str]:
    """Every reason ``p`` is invalid (empty when it is fine). The one validation of sampling values."""
    problems = []
    if not _is_int(p.max_tokens) or p.max_tokens < 1:
        problems.append(f"max_tokens must be an integer ≥ 1, got {p.max_tokens!r}")
    if not _is_num(p.temperature) or not 0 <= p.temperature <= 100:
        problems.append(f"temperature must be a number in [0, 100] (0 = greedy), got {p.temperature!r}")
    if not _is_int(p.top_k) or p.top_k < -1:
        problems.append(f"top_k must be an integer ≥ 1, or -1/0 to disable, got {p.top_k!r}")
    if not _is_num(p.top_p) or not 0 < p.top_p <= 1:
        problems.append(f"top_p must be in (0, 1], got {p.top_p!r}")
    if p.seed is not None and (not _is_int(p.seed) or not -2**63 <= p.seed < 2**64):
        problems.append(f"seed must be an integer (64-bit) or None, got {p.seed!r}")
    if not isinstance(p.stop, list) or not all(isinstance(s, str) and s for s in p.stop):
        problems.append(f"stop must be non-empty strings, got {p.stop!r}")
    if not isinstance(p.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in p.stop_token_ids):
        problems.append(f"stop_token_ids must be non-negative integers, got {p.stop_token_ids!r}")
    for name in ("ignore_eos", "include_stop_str_in_output"):
        if not isinstance(getattr(p, name), bool):
            problems.append(f"{name} must be true or false, got {getattr(p, name)!r}")
    return problems


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """Only seeded, non-greedy requests get a generator of their own."""
    if params.greedy or params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed % 2**64)
    return g


class Sampler:
    """One batched draw per step. ``generator`` serves every unseeded row."""

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
        """logits: [R, V] → token ids [R] (on the device; the caller reads them once)."""
        greedy_ids = logits.argmax(-1)                                       # [R]
        if all(p.greedy for p in params):
            return greedy_ids
        x = logits.float()
        R, V = x.shape
        dev = x.device
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)
        x = x / temps[:, None]                                               # [R, V]
        ks = [p.top_k if 0 < p.top_k < V else V for p in params]
        tops = [p.top_p for p in params]
        if any(t < 1 for t in tops):
            x = _top_k_top_p_sorted(x, torch.tensor(ks, device=dev), torch.tensor(tops, device=dev))
        elif any(k < V for k in ks):
            x = _top_k(x, ks)
        probs = x.softmax(-1)                                                # [R, V]
        q = torch.empty_like(probs).exponential_(generator=self.generator)   # [R, V]
        for b, g in enumerate(generators):
            if g is not None:
                q[b].exponential_(generator=g)                               # a seeded row's own draw
        sampled = (probs / q).argmax(-1)                                     # [R]
        greedy = torch.tensor([p.greedy for p in params], device=dev)
        # a row whose logits are not finite (a broken request) falls back to argmax: it can
        # never turn another row's draw into an error
        ok = torch.isfinite(probs).all(-1)
        return torch.where(greedy | ~ok, greedy_ids, sampled)


def _top_k(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    # x: [R, V]; keep each row's k largest (ties at the k-th value are kept too)
    top = torch.topk(x, max(ks), dim=-1).values                              # [R, kmax]
    kth = top.gather(-1, torch.tensor(ks, device=x.device)[:, None] - 1)     # [R, 1]
    return x.masked_fill(x < kth, float("-inf"))


def _top_k_top_p_sorted(x: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    # x: [R, V]. One sort serves both filters: this sort is top-p's cost (10.5).
    sorted_x, order = torch.sort(x, dim=-1, descending=True)                 # [R, V]
    rank = torch.arange(x.shape[-1], device=x.device)[None, :]               # [1, V]
    sorted_x = sorted_x.masked_fill(rank >= ks[:, None], float("-inf"))      # top-k
    p = sorted_x.softmax(-1)
    before = p.cumsum(-1) - p                                                # mass of the tokens ranked above
    drop = (before >= ps[:, None]) & (ps[:, None] < 1)                       # top-p: keep until top_p is reached
    drop[:, 0] = False                                                       # the most likely token always stays
    # (a row with top_p = 1 drops nothing: its cumulative sum can round to 1 before the tail)
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)

