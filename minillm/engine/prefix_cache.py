"""KV slot allocation and the prefix cache (design.md §8; chapter 10.6's fourth self-deception).

This is the *allocation* side of the KV cache: which slot a request gets, and what a free slot
still remembers. The tensors live in ``minillm.engine.kv_cache``; nothing here touches them.

Prefix caching: when a request finishes, its slot goes back to the free list but keeps its
K/V and remembers the tokens they belong to. K/V at position i depend only on tokens 0..i
(causal attention), so a new request whose prompt starts with those tokens can take that slot
and start its prefill at the first token it does not share. The hit is data: it goes on the
``scheduled`` event and into ``usage.prompt_tokens_details.cached_tokens``.

Granularity: hits count in whole blocks of ``BLOCK`` = 16 tokens, as vLLM's, so the numbers mean
the same thing in both (vLLM's unit is its 16-token KV block; ours is a slot, so finer matching
would be possible, but a shared BOS token is not a "hit" worth reporting). At least one prompt
token is always recomputed: its logits give the first output token.

Eviction: a slot with no remembered tokens is used first, then the least recently freed (LRU).
A slot is one contiguous sequence, so a hit *takes over* the slot: its tokens after the shared
prefix are overwritten by the new owner, and the slot remembers them only once it is freed again.
"""
from __future__ import annotations

from collections import OrderedDict

from minillm.engine.kv_cache import CacheFullError

BLOCK = 16


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (block-wise compares in C, then token by token)."""
    n = min(len(a), len(b))
    i = 0
    while i + BLOCK <= n and a[i:i + BLOCK] == b[i:i + BLOCK]:
        i += BLOCK
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotAllocator:
    def __init__(self, num_slots: int, enable_prefix_caching: bool = True):
        self.num_slots = num_slots
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, list[int]] = OrderedDict((s, []) for s in range(num_slots))  # LRU first
        self._owner: dict[int, str] = {}
        self.hits = 0            # requests that reused at least one block
        self.hit_tokens = 0      # prompt tokens served from the cache
        self.queries = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> dict[int, str]:
        return dict(self._owner)

    def cached_tokens(self, slot: int) -> list[int]:
        """What a free slot remembers (empty for a used slot)."""
        return list(self._free.get(slot, []))

    def match(self, prompt_ids: list[int]) -> tuple[int | None, int]:
        """The free slot sharing the longest prefix with ``prompt_ids``, and how many tokens of
        it count as cached (whole blocks, at most len(prompt) - 1)."""
        if not self.enable_prefix_caching or not prompt_ids:
            return None, 0
        best, best_len = None, 0
        first = prompt_ids[0]
        for slot, toks in self._free.items():
            if toks and toks[0] == first:
                n = common_prefix_len(toks, prompt_ids)
                if n >= best_len:           # ties: the most recently freed (later in the LRU order)
                    best, best_len = slot, n
        usable = min(best_len, len(prompt_ids) - 1) // BLOCK * BLOCK
        return (best, usable) if usable > 0 else (None, 0)

    def allocate(self, owner: str, prompt_ids: list[int] | None = None) -> tuple[int, int]:
        """A slot for ``owner`` and the number of prompt tokens already in it (a prefix hit)."""
        if not self._free:
            raise CacheFullError(f"all {self.num_slots} KV slots are in use")
        self.queries += 1
        slot, cached = self.match(prompt_ids or [])
        if slot is None:
            empty = [s for s, toks in self._free.items() if not toks]
            slot = min(empty) if empty else next(iter(self._free))   # lowest empty slot, else LRU
        else:
            self.hits += 1
            self.hit_tokens += cached
        del self._free[slot]
        self._owner[slot] = owner
        return slot, cached

    def free(self, slot: int, computed_tokens: list[int] | None = None) -> None:
        """Give ``slot`` back; with prefix caching it remembers ``computed_tokens`` (the tokens
        whose K/V it holds, positions 0..n-1) until it is needed again."""
        if slot not in self._owner:
            raise ValueError(f"KV slot {slot} is not allocated")
        del self._owner[slot]
        self._free[slot] = list(computed_tokens or []) if self.enable_prefix_caching else []
        self._free.move_to_end(slot)

    def forget(self) -> None:
        """Drop every remembered prefix (a cold cache: benchmarks' "cold" runs, 10.6)."""
        for s in self._free:
            self._free[s] = []
