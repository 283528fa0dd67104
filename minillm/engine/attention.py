"""The attention backend: the one seam between the model and the KV cache (mini-sglang's idea).

A step's tokens are *packed*: ``[N]`` tokens, decode rows first (one token each), then prefill
chunks. Every matmul in the model sees ``[N, hidden]`` with no padding rows. Attention is the
only part that needs to know which token belongs to which request, and it is the only part
that reads the cache, so it lives here, behind two calls:

- ``begin(meta)`` once per forward: derive what every layer shares (the decode gather indices);
- ``attend(layer, q, k, v)`` per layer: write this step's K/V, then attend.

What each row reads (state it, the roofline counts bytes):
- a prefill chunk of row r reads its own positions ``[0, start + n)``: a view, no copy;
- decode rows of equal length read ``[0, L)`` each: a view when their slots are a contiguous
  range (the "ideal" sweep), otherwise a gather copy of B·L positions;
- decode rows of different lengths read B·max(L) positions through one gather, the zero row
  standing in for the positions a row does not have, with a length mask. Σ L would be the
  minimum; a paged kernel (chapter 11) reads only that, this one pays for max(L) and the copy.
- the static (CUDA-graph) decode does the same as the last case with B and max(L) rounded up
  to buckets and the lengths held in tensors, so one captured graph serves every step of that
  shape.
- on a CPU, beside the chosen decode matmuls, every decode row instead reads exactly its own
  positions [0, L) from its slot, no copy, no mask, through ``attention_kernel.py`` (Σ L read):
  SDPA above stays the plain path's and the reference.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from minillm.engine import attention_kernel
from minillm.engine.kv_cache import KVCache


@dataclass
class PrefillChunk:
    slot: int
    start: int          # tokens of this row already in the cache
    num_new: int        # tokens of this row in this step
    offset: int         # where they sit in the packed [N] tokens


@dataclass
class AttentionMetadata:
    write_loc: torch.Tensor                 # [N] flat cache location of every token (padding → trash row)
    num_decode: int = 0                     # decode rows: packed tokens [0, num_decode)
    # every token is a decode row (the static decode): then the row count is never read, so a compiled
    # step does not specialise on it and one graph serves every row bucket
    all_decode: bool = False
    decode_len: int = 0                     # max K/V length among decode rows (sets the read width)
    decode_slots: torch.Tensor | tuple[int, int] | None = None   # [B] or a contiguous range (a, b)
    decode_lens: torch.Tensor | None = None  # [B] per-row K/V length; None = all equal to decode_len
    # [decode_len] positions 0..L-1 held in a buffer (the static decode): the read width is then a
    # tensor's size, which a compiled step can treat as dynamic instead of compiling every L
    decode_pos: torch.Tensor | None = None
    prefill: list[PrefillChunk] = field(default_factory=list)
    # derived by AttentionBackend.begin (shared by every layer):
    decode_locs: torch.Tensor | None = None   # [B, decode_len] flat locations, zero row where absent
    decode_mask: torch.Tensor | None = None   # [B, 1, 1, decode_len] True = may attend
    kernel_slots: torch.Tensor | None = None  # [B] each decode row's slot (the decode attention kernel)
    kernel_lens: torch.Tensor | None = None   # [B] each decode row's K/V length (the decode attention kernel)


def build_metadata(cache: KVCache, decode: list[tuple[int, int]], prefill: list[tuple[int, int, int]],
                   device: torch.device) -> AttentionMetadata:
    """``decode``: (slot, cached length) per decode row; ``prefill``: (slot, start, num_new) per
    chunk. Row order = packed order. Host lists → one small device copy per tensor."""
    loc: list[int] = [cache.loc(slot, L) for slot, L in decode]
    chunks, offset = [], len(decode)
    for slot, start, n in prefill:
        base = cache.loc(slot, start)
        loc.extend(range(base, base + n))
        chunks.append(PrefillChunk(slot, start, n, offset))
        offset += n
    meta = AttentionMetadata(write_loc=_to(loc, device), num_decode=len(decode), prefill=chunks)
    if decode:
        lens = [L + 1 for _, L in decode]                 # the new token's K/V is read too
        slots = [s for s, _ in decode]
        meta.decode_len = max(lens)
        if all(n == meta.decode_len for n in lens):
            contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
            meta.decode_slots = (slots[0], slots[0] + len(slots)) if contiguous else _to(slots, device)
        else:
            meta.decode_slots, meta.decode_lens = _to(slots, device), _to(lens, device)
    return meta


def _to(xs: list[int], device: torch.device) -> torch.Tensor:
    t = torch.tensor(xs, dtype=torch.long)
    if device.type == "cuda":     # pinned host memory: the copy can overlap (nano-vllm)
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def avoid_per_shape_attention_plans(device: torch.device) -> bool:
    """On CUDA, take cuDNN out of ``scaled_dot_product_attention``'s backend order (flash,
    memory-efficient and math remain). Returns whether it did.

    Why (10.5, time outside the useful work): torch 2.11 tries cuDNN's attention first on a
    Hopper GPU, and cuDNN builds an execution plan for every new shape, and an engine's attention
    shapes change every step (the K/V length grows by one per decode step; every prefill chunk
    has its own). Measured on an H200 (torch 2.11.0+cu130, cuDNN 9.19) with cuDNN in the order:
    an eager decode step of ``tiny`` took 51 ms, of which the GPU was busy 0.2 ms; one step of a
    chunked 4096-token prefill (``llama-3.1-8b`` twin, budget 256) took 916 ms against 132 ms for
    the whole prompt in one step. A CUDA graph hides this (its shapes are fixed), eager decode and
    prefill do not. The switch is process-wide, so ``transformers`` beside the engine gets the
    same kernels. A CUDA-graph capture is the exception: :func:`attention_for_capture`."""
    if device.type != "cuda":
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def attention_for_capture():
    """The backend order while a CUDA graph is captured: cuDNN first again. A captured decode
    bucket has one shape for all its replays, so cuDNN's plan is built once, and the static
    decode's attention carries a length mask with grouped K/V heads, which without cuDNN falls
    to the math path (K/V heads copied out to every query head, the mask materialised).
    Measured on the H200, ``llama-3.1-8b`` twin, batch 64 at context 512, a replayed step took
    13.9 ms with cuDNN and 71.2 ms without."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True)


def decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                     mask: torch.Tensor | None) -> torch.Tensor:
    """One new query per row against its cached keys. q: [B, H, D]; kc, vc: [B, L, KVH, D];
    mask: [B, 1, 1, L] or None → [B, H, D]."""
    y = F.scaled_dot_product_attention(q[:, :, None], kc.transpose(1, 2), vc.transpose(1, 2),
                                       attn_mask=mask, enable_gqa=True)                   # [B, H, 1, D]
    return y[:, :, 0]


def decode_attention_by_reduction(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                                  mask: torch.Tensor | None) -> torch.Tensor:
    """The same as :func:`decode_attention`, written as products and sums for Inductor to fuse.

    Under ``torch.compile`` on a CPU, ``kc`` and ``vc`` can be the K/V cache indexed by each
    row's locations (``cache.k_flat[layer][locs]``): Inductor reads the cache through the indices
    inside its loops, where :func:`decode_attention` first copies every row's K/V out (the gather)
    for the attention kernel to read again. Each query head is paired with its K/V head (GQA) by a
    broadcast, not a copy. Sums in fp32. Measured in the compiled fp32 decode of ``cpu-small``
    (the 2-core Xeon VM, 128 cached tokens, 2 threads, alternating fresh processes, median of 60
    steps): at 1 row 12.73, 12.40, 12.82, 12.80 ms against 13.12, 13.75, 13.10, 12.79 with the
    gather and the attention kernel; at 8 rows 21.82, 23.07, 21.67, 22.42, 21.73 against 25.24,
    24.17, 23.19, 23.08, 24.71 (the step without any attention: 19.23). It costs compile time
    (15 s at 8 rows against 12.5, once Inductor's tiling heuristics are off: compiled.py) and gains
    nothing in bf16 (6.81/7.31 against 6.92/6.54 ms at 1 row, 9.62/9.90 against 9.48/9.92 at 8), so
    only the compiled fp32 decode uses it.
    Written with the sequence innermost instead (scores ``[B, KVH, G, L]``), the 8-row step took
    34.7 ms. q: [B, H, D]; kc, vc: [B, L, KVH, D]; mask: [B, 1, 1, L] or None → [B, H, D]."""
    B, H, D = q.shape
    L, KVH = kc.shape[1], kc.shape[2]
    qg = q.view(B, 1, KVH, H // KVH, D).float()                                # [B, 1, KVH, G, D]
    scores = (qg * kc[:, :, :, None, :].float()).sum(-1) * D ** -0.5           # [B, L, KVH, G]
    if mask is not None:
        scores = scores.masked_fill(~mask.view(B, L, 1, 1), float("-inf"))
    p = scores.softmax(1)                                                      # over the L positions
    out = (p[..., None] * vc[:, :, :, None, :].float()).sum(1)                 # [B, KVH, G, D]
    return out.reshape(B, H, D).to(q.dtype)


def decode_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each decode row's slot and K/V length as [B] tensors, whichever way the metadata holds them."""
    slots = meta.decode_slots
    if isinstance(slots, tuple):
        slots = torch.arange(*slots, device=meta.write_loc.device)
    lens = meta.decode_lens
    if lens is None:
        lens = torch.full_like(slots, meta.decode_len)
    return slots, lens


class AttentionBackend:
    def __init__(self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int):
        self.cache = cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.meta: AttentionMetadata | None = None
        # decode attention in fp32 for a bf16/fp16 model, when measured faster on this CPU (engine/matmul.py)
        self.decode_upcast = False
        # decode attention as sums Inductor fuses with the K/V gather: in a compiled step only
        # (the compiled fp32 CPU decode); an eager step keeps the attention kernel
        self.decode_by_reduction = False
        # decode attention read straight from each row's cache slot (engine/attention_kernel.py); first
        # of the three where it is on: the runner turns it on where it is built (CPU, fp32 or bf16)
        self.decode_kernel = False

    # ---- once per forward -----------------------------------------------------------
    def begin(self, meta: AttentionMetadata) -> None:
        """Derive what every layer's decode attention shares: each row's slot and length for the
        decode attention kernel, else the gather indices of rows of different lengths. Device ops
        only, no host sync: inside a CUDA graph this is captured and replayed with the step's data."""
        by_reduction = self.decode_by_reduction and torch.compiler.is_compiling()
        if self.decode_kernel and not by_reduction and (meta.all_decode or meta.num_decode):
            meta.kernel_slots, meta.kernel_lens = decode_rows(meta)
            self.meta = meta
            return
        meta.kernel_slots = meta.kernel_lens = None
        if meta.decode_lens is not None:
            c = self.cache
            pos = meta.decode_pos if meta.decode_pos is not None else torch.arange(
                meta.decode_len, device=meta.decode_lens.device)                          # [L]
            valid = pos[None, :] < meta.decode_lens[:, None]                              # [B, L]
            locs = meta.decode_slots[:, None] * c.max_len + pos[None, :]                  # [B, L]
            meta.decode_locs = torch.where(valid, locs, torch.full_like(locs, c.zero_loc))
            meta.decode_mask = valid[:, None, None, :]                                    # [B, 1, 1, L]
        self.meta = meta

    # ---- every layer ----------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [N, H, D]; k, v: [N, KVH, D] → [N, H*D]
        meta = self.meta
        self.cache.write(layer, meta.write_loc, k, v)
        parts = []
        if meta.all_decode:
            parts.append(self._decode(layer, q))
        elif meta.num_decode:
            parts.append(self._decode(layer, q[:meta.num_decode]))
        for c in meta.prefill:
            parts.append(self._prefill_chunk(layer, q[c.offset:c.offset + c.num_new], c))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)                         # [N, H, D]
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        if meta.kernel_slots is not None:
            c = self.cache
            return attention_kernel.forward(q, c.k_flat[layer], c.v_flat[layer], meta.kernel_slots,
                                            meta.kernel_lens, c.max_len)                          # [B, H, D]
        if meta.decode_lens is None:
            kc, vc = self.cache.rows(layer, meta.decode_slots, meta.decode_len)           # [B, L, KVH, D]
            mask = None
        else:
            kc, vc = self.cache.gather(layer, meta.decode_locs)                           # [B, L, KVH, D]
            mask = meta.decode_mask
        if self.decode_by_reduction and torch.compiler.is_compiling():
            return decode_attention_by_reduction(q, kc, vc, mask)
        if self.decode_upcast:
            return decode_attention(q.float(), kc.float(), vc.float(), mask).to(q.dtype)
        return decode_attention(q, kc, vc, mask)                                          # [B, H, D]

    def _prefill_chunk(self, layer: int, q: torch.Tensor, c: PrefillChunk) -> torch.Tensor:
        L = c.start + c.num_new
        kc, vc = self.cache.row(layer, c.slot, L)                                         # [L, KVH, D] views
        qh = q.transpose(0, 1)[None]                                                      # [1, H, n, D]
        kh, vh = kc.transpose(0, 1)[None], vc.transpose(0, 1)[None]                       # [1, KVH, L, D]
        if c.start == 0:
            # From position 0, plain causal attention (query i sees keys ≤ i): no mask tensor,
            # so SDPA can pick a fused kernel; a mask with GQA forces the slow math path on CUDA.
            y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=c.num_new > 1, enable_gqa=True)
        else:
            # A later chunk (or a prefix-cache hit): query i sits at position start + i and may see
            # keys ≤ start + i. SDPA's is_causal aligns top-left, so this needs a mask.
            i = torch.arange(c.num_new, device=q.device)[:, None]
            j = torch.arange(L, device=q.device)[None, :]
            y = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=j <= c.start + i, enable_gqa=True)
        return y[0].transpose(0, 1)                                                       # [n, H, D]
