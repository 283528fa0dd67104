"""Sampling: turn each row of logits into one token (chapter 10.5: part of the time outside the
big matmuls). ``SamplingParams`` mirrors vLLM's names and defaults, and is the one place where
sampling values are validated: the HTTP gateway builds one too, so the two never disagree.

The sampler is batched on the device: temperature, top-k and top-p are per-row tensors, the
draw is an exponential race (gpt-fast: ``argmax(p / q)`` with ``q ~ Exp(1)`` picks token i with
probability p_i), and the only host sync of a step is reading the chosen ids (and any logprobs,
in the same read). Unseeded rows draw from the engine's own generator, so nothing touches torch's
global random state; a seeded row draws from its own generator, so it gives the same tokens
alone or in any batch.

Two per-row extras around the draw, both on the device and both free for rows that do not ask:

- ``min_tokens`` (vLLM): until a request has that many output tokens, its EOS and stop token
  ids are masked to -inf before the draw (``ban_tokens``), greedy rows included.
- ``logprobs`` (vLLM/OpenAI): the chosen token's log-probability, its rank and the N most likely
  alternatives, as log_softmax of the model's raw logits in fp32 (``logprobs_on_device``). They
  travel to the host in the same single read as the chosen ids (``read_sampled``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Below this temperature a row is greedy: dividing by 3e-39 overflows to inf and the softmax
# to NaN (vLLM uses the same threshold for the same reason).
SAMPLING_EPS = 1e-5

# Most alternatives a request may ask for per token (OpenAI's top_logprobs cap, vLLM's default).
MAX_LOGPROBS = 20


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
    logprobs: int | None = None       # None: none; 0: the chosen token's; N: also the top N (≤ 20)
    min_tokens: int = 0               # until this many tokens: no EOS, no stop token, no stop string

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
    """A finite number. An integer too large for a float (JSON allows 10**400) is not one:
    ``math.isfinite`` would raise OverflowError on it."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


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
    if p.logprobs is not None and (not _is_int(p.logprobs) or not 0 <= p.logprobs <= MAX_LOGPROBS):
        problems.append(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}] (0: only the chosen "
                        f"token's; N: also the N most likely tokens), got {p.logprobs!r}")
    if not _is_int(p.min_tokens) or p.min_tokens < 0:
        problems.append(f"min_tokens must be an integer ≥ 0, got {p.min_tokens!r}")
    elif _is_int(p.max_tokens) and p.min_tokens > p.max_tokens:
        problems.append(f"min_tokens must be ≤ max_tokens ({p.max_tokens}), got {p.min_tokens!r}")
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
        # On a CPU, argmax over bf16 is not vectorised: [64, 8192] took 935 µs against 254 µs upcast first
        # (1 row: 30.5 against 10.6 µs; AMD EPYC VM, 2 threads). The upcast is exact, so the ids are the same.
        greedy_ids = (logits.float() if logits.device.type == "cpu" else logits).argmax(-1)   # [R]
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
            x = _top_k_top_p_sorted(x, torch.tensor(ks, device=dev), torch.tensor(tops, device=dev), max(ks))
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


def _top_k_top_p_sorted(x: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor, kmax: int) -> torch.Tensor:
    # x: [R, V]. One sort serves both filters: this sort is top-p's cost (10.5). When every row
    # has a top-k, only the kmax largest need sorting (topk), not the whole vocabulary.
    V = x.shape[-1]
    if kmax < V:
        sorted_x, order = torch.topk(x, kmax, dim=-1)                        # [R, kmax], sorted
    else:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)             # [R, V]
    rank = torch.arange(sorted_x.shape[-1], device=x.device)[None, :]        # [1, K]
    sorted_x = sorted_x.masked_fill(rank >= ks[:, None], float("-inf"))      # top-k
    p = sorted_x.softmax(-1)
    before = p.cumsum(-1) - p                                             # mass of the tokens ranked above
    drop = (before >= ps[:, None]) & (ps[:, None] < 1)                    # top-p: keep until top_p is reached
    drop[:, 0] = False                                                    # the most likely token always stays
    # (a row with top_p = 1 drops nothing: its cumulative sum can round to 1 before the tail)
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter_(-1, order, sorted_x)   # the rest: outside top-k


# ---------------------------------------------------------------------------- min_tokens
def ban_tokens(logits: torch.Tensor, banned: list[list[int]]) -> torch.Tensor:
    """logits: [R, V]; ``banned[r]``: ids row r may not sample this step (min_tokens). Returns
    logits with those entries at -inf; the same tensor when nothing is banned. Out of place:
    the raw logits stay untouched for the logprobs (and for a CUDA graph's output buffer)."""
    rows = [r for r, ids in enumerate(banned) for _ in ids]
    cols = [t for ids in banned for t in ids]
    if not cols:
        return logits
    where = _to_device(torch.tensor([rows, cols], dtype=torch.long), logits.device)   # [2, n]
    out = logits.clone()                                                            # [R, V]
    out.index_put_((where[0], where[1]), torch.tensor(float("-inf"), dtype=out.dtype, device=out.device))
    return out


# ---------------------------------------------------------------------------- logprobs
@dataclass
class TokenLogprobs:
    """One output token's log-probabilities: vLLM's default "raw" logprobs, log_softmax of the
    model's logits in fp32, before temperature, top-k/top-p and the min_tokens mask."""
    token_id: int                      # the token chosen
    logprob: float                     # its log-probability
    rank: int                          # 1 + how many tokens are more likely (1: the argmax)
    top: list[tuple[int, float]]       # the N most likely (token id, logprob), best first; [] for N = 0


def logprobs_on_device(logits: torch.Tensor, ids: torch.Tensor, rows: list[int], k: int) -> torch.Tensor:
    """logits: [R, V] (raw), ids: [R] chosen; for the rows ``rows`` (those that asked) →
    [L, 2 + 2k]: chosen logprob, rank, k top ids, k top logprobs (ids as floats: see read_sampled)."""
    idx = _to_device(torch.tensor(rows, dtype=torch.long), logits.device)         # [L]
    lp = logits.index_select(0, idx).float().log_softmax(-1)                       # [L, V] fp32
    chosen = lp.gather(-1, ids.index_select(0, idx)[:, None])                      # [L, 1]
    rank = (lp > chosen).sum(-1, keepdim=True) + 1                                 # [L, 1]
    top = lp.topk(k, dim=-1)                                                       # [L, k] each
    return torch.cat([chosen, rank.float(), top.indices.float(), top.values], dim=-1)


def read_sampled(ids: torch.Tensor, logprobs: torch.Tensor | None,
                 vocab_size: int) -> tuple[list[int], list[list[float]]]:
    """ids: [R], logprobs: [L, W] or None → (R ids, L rows of W values) in ONE host read: both
    are packed into one float tensor. fp32 holds the integers below 2**24 exactly (any real
    vocabulary's ids and ranks), and MPS has no fp64; a larger vocabulary would take fp64."""
    if logprobs is None:
        return ids.tolist(), []
    dtype = torch.float32 if vocab_size < 2**24 else torch.float64
    packed = torch.cat([ids.to(dtype), logprobs.to(dtype).flatten()]).tolist()    # the one host sync
    R, W = ids.shape[0], logprobs.shape[1]
    rows = [packed[R + i * W: R + (i + 1) * W] for i in range(logprobs.shape[0])]
    return [int(t) for t in packed[:R]], rows


def unpack_logprobs(token_id: int, values: list[float], k: int, n: int) -> TokenLogprobs:
    """One row of ``logprobs_on_device`` (computed with ``k`` top entries, read on the host) →
    TokenLogprobs keeping the ``n`` alternatives this request asked for."""
    chosen, rank, top_ids, top_lps = values[0], values[1], values[2: 2 + k], values[2 + k: 2 + 2 * k]
    return TokenLogprobs(token_id, chosen, int(rank), [(int(t), v) for t, v in zip(top_ids[:n], top_lps[:n])])


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host → device copy that does not wait for the queued forward (pinned on CUDA)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
