"""The KV cache: preallocated, one *slot* per running request (chapter 10.3/10.4).

Layout per layer: ``k[layer]`` and ``v[layer]`` are ``[num_slots, max_len + 1, kv_heads, head_dim]``.
A request owns one slot from admission to finish/abort. Position ``max_len`` is a scratch row:
padded tokens of a batched prefill write there and it is never read, so padding can never
overwrite a real key (no branches, no boolean indexing: the same code runs in a CUDA graph).

Why preallocate? Allocation during decode would put the allocator on the critical path of
every step; a fixed pool also makes "how many requests fit" a number you can print.
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
    return num_slots * (max_len + 1) * cfg.kv_bytes_per_token(dtype_bytes)


def size_kv_cache(cfg: ModelConfig, dtype: torch.dtype, num_slots: int, max_len: int,
                  free_bytes: int | None = None, memory_fraction: float = 0.5) -> KVCacheSpec:
    """Fit ``num_slots × max_len`` into ``memory_fraction`` of ``free_bytes``.

    When it does not fit, ``max_len`` shrinks first (a request rarely needs the model's full
    context in a lecture demo), never below 16 tokens; then we refuse with a clear message.
    """
    if num_slots < 1 or max_len < 1:
        raise ValueError(f"num_slots and max_len must be ≥ 1 (got {num_slots}, {max_len})")
    dbytes = torch.empty((), dtype=dtype).element_size()
    per_token = cfg.kv_bytes_per_token(dbytes)
    if free_bytes is not None:
        budget = int(free_bytes * memory_fraction)
        fit_len = budget // (num_slots * per_token) - 1
        if fit_len < 16:
            need = kv_cache_bytes(cfg, num_slots, 16, dbytes)
            raise MemoryError(
                f"KV cache for {num_slots} slots does not fit: even 16 tokens per slot need "
                f"{need / 2**20:.1f} MiB, but {memory_fraction:.0%} of free memory is {budget / 2**20:.1f} MiB. "
                f"Lower max_batch_size or use a smaller model.")
        max_len = min(max_len, fit_len)
    return KVCacheSpec(num_slots, max_len, kv_cache_bytes(cfg, num_slots, max_len, dbytes))


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.cfg, self.num_slots, self.max_len = cfg, num_slots, max_len
        self.device, self.dtype = torch.device(device), dtype
        shape = (num_slots, max_len + 1, cfg.num_kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(cfg.num_layers)]
        self._free: list[int] = list(range(num_slots))   # kept sorted: lowest slot first
        self._owner: dict[int, str] = {}

    # ---- slot bookkeeping -----------------------------------------------------------
    @property
    def scratch_pos(self) -> int:
        return self.max_len

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> dict[int, str]:
        return dict(self._owner)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def allocate(self, owner: str) -> int:
        if not self._free:
            raise CacheFullError(f"all {self.num_slots} KV slots are in use")
        slot = self._free.pop(0)
        self._owner[slot] = owner
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._owner:
            raise ValueError(f"KV slot {slot} is not allocated")
        del self._owner[slot]
        self._free.append(slot)
        self._free.sort()

    # ---- tensor access (called by every attention layer) -------------------------------
    def write(self, layer: int, slots_bt: torch.Tensor, pos_bt: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        # slots_bt, pos_bt: [B, T] (padded tokens point at the scratch row); k, v: [B, T, kv_heads, head_dim]
        self.k[layer][slots_bt, pos_bt] = k
        self.v[layer][slots_bt, pos_bt] = v

    def read(self, layer: int, slots: torch.Tensor, kv_len: int,
             slot_range: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of positions ``[0, kv_len)`` only (attention never reads empty rows).
        Returns two ``[B, kv_heads, kv_len, head_dim]`` tensors. When the batch's slots are a
        contiguous range we slice (a view, no copy); otherwise gather."""
        if slot_range is not None:
            a, b = slot_range
            k = self.k[layer][a:b, :kv_len]            # [B, L, KVH, D] view
            v = self.v[layer][a:b, :kv_len]
        else:
            k = self.k[layer][slots, :kv_len]          # [B, L, KVH, D] gathered copy
            v = self.v[layer][slots, :kv_len]
        return k.transpose(1, 2), v.transpose(1, 2)    # [B, KVH, L, D]
