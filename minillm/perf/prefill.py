"""Prefill in formulas (chapter 10.4): FLOPs and bytes of a prompt, or of one chunk of it, the
intensity against the ridge point, how a budget cuts a prompt into chunks, and what moving a
prompt's K/V over a link costs (prefill/decode disaggregation). Definitions: the module docstring
of :mod:`minillm.experiments.prefill_decode`; the decode side is :mod:`minillm.perf.roofline`."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import minillm.perf.roofline as rf
from minillm.model.config import ModelConfig

# ----------------------------------------------------------------------------- formulas

def lm_head_params(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.hidden_size


def attention_pairs(tokens: int, start: int = 0) -> int:
    """(query, key) pairs of causal attention for ``tokens`` new queries after ``start`` cached
    positions: query i (0-based) sees ``start + i + 1`` keys."""
    return tokens * start + tokens * (tokens + 1) // 2


def prefill_flops(cfg: ModelConfig, tokens: int, start: int = 0, sampled_rows: int = 1) -> int:
    """FLOPs of one prefill chunk (see the module docstring). ``sampled_rows``: rows that go
    through the LM head (1 for a prompt's last chunk, 0 for the chunks before it)."""
    if tokens < 1 or start < 0:
        raise ValueError(f"a prefill chunk needs tokens ≥ 1 and start ≥ 0, got {tokens}, {start}")
    body = cfg.matmul_params - lm_head_params(cfg)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * attention_pairs(tokens, start)
    return 2 * body * tokens + 2 * lm_head_params(cfg) * sampled_rows + attention


def prefill_bytes(cfg: ModelConfig, dtype_bytes_: int, tokens: int, start: int = 0) -> int:
    """Bytes one prefill chunk moves at least: W(n) + n·k written + (start + n)·k read."""
    if tokens < 1 or start < 0:
        raise ValueError(f"a prefill chunk needs tokens ≥ 1 and start ≥ 0, got {tokens}, {start}")
    k = cfg.kv_bytes_per_token(dtype_bytes_)
    return rf.weight_bytes_per_step(cfg, dtype_bytes_, tokens) + tokens * k + (start + tokens) * k


def prefill_intensity(cfg: ModelConfig, dtype_bytes_: int, tokens: int, start: int = 0) -> float:
    return rf.arithmetic_intensity(prefill_flops(cfg, tokens, start),
                                   prefill_bytes(cfg, dtype_bytes_, tokens, start))


def prefill_ridge_length(cfg: ModelConfig, dtype_bytes_: int, ridge: float,
                         max_tokens: int = 1 << 20) -> int | None:
    """The shortest prompt whose prefill intensity reaches the ridge point I* (the formula's
    answer to "when does prefill become compute-bound?"). None if not within max_tokens."""
    if prefill_intensity(cfg, dtype_bytes_, max_tokens) < ridge:
        return None
    lo, hi = 1, max_tokens                       # intensity grows with T: bisect
    while lo < hi:
        mid = (lo + hi) // 2
        if prefill_intensity(cfg, dtype_bytes_, mid) >= ridge:
            hi = mid
        else:
            lo = mid + 1
    return lo


def chunk_sizes(tokens: int, budget: int, decode_rows: int = 0) -> list[int]:
    """How the chunked policy splits a prompt of ``tokens`` when ``decode_rows`` decodes take one
    token each of a ``budget``-token step first (as long as they all keep decoding)."""
    per = budget - decode_rows
    if per < 1:
        raise ValueError(f"a budget of {budget} leaves no room for prefill next to {decode_rows} decodes")
    return [per] * (tokens // per) + ([tokens % per] if tokens % per else [])


def chunked_prefill_flops(cfg: ModelConfig, chunks: Sequence[int]) -> int:
    start, total = 0, 0
    for i, n in enumerate(chunks):
        total += prefill_flops(cfg, n, start, sampled_rows=int(i == len(chunks) - 1))
        start += n
    return total


def chunked_prefill_bytes(cfg: ModelConfig, dtype_bytes_: int, chunks: Sequence[int]) -> int:
    """Bytes of a prompt prefilled chunk by chunk, counted for the prompt alone: every chunk reads
    W again and the K/V of the prompt so far. (When decodes share the step, they share that
    weight read: this is the prompt's own traffic, not the step's.)"""
    start, total = 0, 0
    for n in chunks:
        total += prefill_bytes(cfg, dtype_bytes_, n, start)
        start += n
    return total


# ----------------------------------------------------------------------------- links (PD disaggregation)

@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float            # bytes/s, one direction, spec (not measured)
    source: str


G = 1e9
LINKS: dict[str, Link] = {
    # PCI-SIG PCIe 4.0 / 5.0 base specifications: 16 / 32 GT/s per lane, 128b/130b encoding, x16 link
    "PCIe 4.0 x16": Link("PCIe 4.0 x16", 16e9 * 16 * 128 / 130 / 8,
                         "PCI-SIG PCIe 4.0: 16 GT/s/lane, x16, 128b/130b"),
    "PCIe 5.0 x16": Link("PCIe 5.0 x16", 32e9 * 16 * 128 / 130 / 8,
                         "PCI-SIG PCIe 5.0: 32 GT/s/lane, x16, 128b/130b"),
    # NVIDIA H100 / H200 datasheets: "NVLink: 900 GB/s" (both directions together) for the SXM boards
    "NVLink 4 (H100/H200 SXM)": Link("NVLink 4 (H100/H200 SXM)", 450 * G,
                                     "NVIDIA H100/H200 datasheet: 900 GB/s bidirectional per GPU"),
    # NVIDIA ConnectX-7 / Quantum-2: InfiniBand NDR, 400 Gb/s per port
    "InfiniBand NDR 400G": Link("InfiniBand NDR 400G", 400e9 / 8, "NVIDIA ConnectX-7: 400 Gb/s per port"),
}


def kv_transfer_bytes(cfg: ModelConfig, dtype_bytes_: int, tokens: int) -> int:
    """The KV cache a prefill leaves behind: tokens × k (what PD disaggregation must move)."""
    return tokens * cfg.kv_bytes_per_token(dtype_bytes_)


def bandwidth_words(c: dict) -> str:
    """The ceilings' bandwidth in words: read (the bound) and copy beside it, or an older file's copy."""
    if c.get("bandwidth_kind") == "read":
        out = f"read {c['bandwidth'] / 1e9:.1f} GB/s (the bound)"
        if c.get("copy_bandwidth"):
            out += f", copy {c['copy_bandwidth'] / 1e9:.1f} GB/s (read + write)"
        return out
    return f"copy {c['bandwidth'] / 1e9:.1f} GB/s (read + write)"


def kv_transfer_s(cfg: ModelConfig, dtype_bytes_: int, tokens: int, link_bandwidth: float) -> float:
    return kv_transfer_bytes(cfg, dtype_bytes_, tokens) / link_bandwidth


def cost_ratio(result) -> dict | None:
    """How many prefill tokens cost as much time as one decode token: decode ms/token at batch 1
    (and at the largest batch) ÷ prefill ms/token at the longest measured prompt. ``result``: a
    PrefillDecodeResult (experiments/prefill_decode.py) or its dict."""
    d = result if isinstance(result, dict) else result.to_dict()
    pre = [r for r in d["prefill"] if r["status"] == "ok"]
    dec = [r for r in d["decode"] if r["status"] == "ok"]
    if not pre or not dec:
        return None
    p, d1, dm = pre[-1], dec[0], dec[-1]
    return {"prefill_tokens": p["tokens"], "prefill_ms_per_token": p["ms_per_token"],
            "decode_b1_ms_per_token": d1["ms_per_token"], "batch": dm["batch"],
            "decode_bmax_ms_per_token": dm["ms_per_token"],
            "decode_b1_over_prefill": d1["ms_per_token"] / p["ms_per_token"],
            "decode_bmax_over_prefill": dm["ms_per_token"] / p["ms_per_token"]}
