"""The KV cache tensors: preallocated, one *slot* per running request (chapter 10.3/10.4).

Layout per layer: ``k[layer]`` and ``v[layer]`` are ``[num_slots + 1, max_len, kv_heads, head_dim]``.
A request owns one slot from admission to finish; which slot, and what a free slot still
remembers for the prefix cache, is decided elsewhere (``minillm.engine.prefix_cache``): this
file only holds tensors, written by location and read per row.

The extra slot at the end is reserved and never given to a request:
- position 0 is the **zero row**: never written, always zeros. A batched decode that must read
  rows of different lengths gathers it in place of the positions a row does not have, so a
  row never sees another request's stale K/V (an inf or NaN left behind by a previous owner
  would otherwise turn its logits into NaN, even behind a mask: 0 · NaN = NaN);
- position 1 is the **trash row**: padding tokens (CUDA-graph buckets) write there, so padding
  can never overwrite a real key. No branches, no boolean indexing: the same code replays in
  a CUDA graph.

Why preallocate? Allocation during decode would put the allocator on the critical path of
every step; a fixed pool also makes "how many requests fit" a number you can print. The pool
is created empty (not zero-filled): nothing reads a position before its owner wrote it, so on
a CPU the memory is only committed as requests use it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.model.config import ModelConfig


class CacheFullError(RuntimeError):
    """No free slot: the scheduler must keep the request waiting."""


@dataclass(frozen=True)
class KVCacheSpec:
    num_slots: int
    max_len: int
    bytes_total: int


def kv_cache_bytes(cfg: ModelConfig, num_slots: int, max_len: int, dtype_bytes: int) -> int:
    return (num_slots + 1) * max_len * cfg.kv_bytes_per_token(dtype_bytes)


def size_kv_cache(cfg: ModelConfig, dtype: torch.dtype, num_slots: int, max_len: int | None,
                  free_bytes: int | None = None, memory_fraction: float = 0.5,
                  default_len: int = 4096) -> KVCacheSpec:
    """Fit ``num_slots × max_len`` into ``memory_fraction`` of ``free_bytes``.

    ``max_len`` given: it fits or we refuse with the numbers (vLLM does the same), never a
    silent shrink. ``max_len`` None: the model's context, at most ``default_len``, shrunk to fit
    (never below 16 tokens; then we refuse).
    """
    if num_slots < 1 or (max_len is not None and max_len < 2):
        raise ValueError(f"num_slots must be ≥ 1 and max_len ≥ 2 (got {num_slots}, {max_len})")
    dbytes = torch.empty((), dtype=dtype).element_size()
    per_token = cfg.kv_bytes_per_token(dbytes)
    want = max_len if max_len is not None else min(cfg.max_position_embeddings, default_len)
    if free_bytes is not None:
        budget = int(free_bytes * memory_fraction)
        fit_len = budget // ((num_slots + 1) * per_token)
        if max_len is not None and fit_len < max_len:
            raise MemoryError(
                f"max_model_len={max_len} does not fit: {num_slots} slots × {max_len} tokens × "
                f"{per_token / 1024:.1f} KiB/token = "
                f"{kv_cache_bytes(cfg, num_slots, max_len, dbytes) / 2**30:.2f} GiB, but "
                f"{memory_fraction:.0%} of free memory is {budget / 2**30:.2f} GiB. The largest that fits is "
                f"{fit_len}; lower max_model_len or max_batch_size, or raise kv_memory_fraction.")
        if fit_len < 16:
            need = kv_cache_bytes(cfg, num_slots, 16, dbytes)
            raise MemoryError(
                f"KV cache for {num_slots} slots does not fit: even 16 tokens per slot need "
                f"{need / 2**20:.1f} MiB, but {memory_fraction:.0%} of free memory is {budget / 2**20:.1f} "
                "MiB. Lower max_batch_size or use a smaller model.")
        want = min(want, fit_len)
    return KVCacheSpec(num_slots, want, kv_cache_bytes(cfg, num_slots, want, dbytes))


class KVCache:
    ZERO_POS, TRASH_POS = 0, 1          # positions inside the reserved slot (see the module docstring)

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.cfg, self.num_slots, self.max_len = cfg, num_slots, max_len
        self.device, self.dtype = torch.device(device), dtype
        shape = (num_slots + 1, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = [torch.empty(shape, device=self.device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.empty(shape, device=self.device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.reserved_slot = num_slots
        for t in self.k + self.v:
            t[self.reserved_slot].zero_()
        # flat views: one row per (slot, position), addressed by slot * max_len + position
        self.k_flat = [t.view(-1, cfg.num_kv_heads, cfg.head_dim) for t in self.k]
        self.v_flat = [t.view(-1, cfg.num_kv_heads, cfg.head_dim) for t in self.v]

    @property
    def zero_loc(self) -> int:
        return self.reserved_slot * self.max_len + self.ZERO_POS

    @property
    def trash_loc(self) -> int:
        return self.reserved_slot * self.max_len + self.TRASH_POS

    def loc(self, slot: int, pos: int) -> int:
        return slot * self.max_len + pos

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    # ---- tensor access (called by the attention backend, layer by layer) ---------------
    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # loc: [N] flat locations (padding → trash row); k, v: [N, kv_heads, head_dim]
        self.k_flat[layer].index_copy_(0, loc, k)
        self.v_flat[layer].index_copy_(0, loc, v)

    def row(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's positions ``[0, length)``: views, no copy. ``[L, KVH, D]`` each."""
        return self.k[layer][slot, :length], self.v[layer][slot, :length]

    def rows(self, layer: int, slots: torch.Tensor | tuple[int, int], length: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of equal length: a view when the slots are a range ``(a, b)``, else a gather.
        ``[B, L, KVH, D]`` each."""
        if isinstance(slots, tuple):
            a, b = slots
            return self.k[layer][a:b, :length], self.v[layer][a:b, :length]
        return self.k[layer][slots, :length], self.v[layer][slots, :length]

    def gather(self, layer: int, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of different lengths: ``locs`` [B, L] flat locations, the zero row where a row
        has no position. A copy: ``[B, L, KVH, D]`` each."""
        return self.k_flat[layer][locs], self.v_flat[layer][locs]
