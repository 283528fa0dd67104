"""A Llama-family decoder in plain PyTorch (Llama 2/3, Qwen2): one file, one concept.

RMSNorm → attention (RoPE, grouped-query, SDPA) → RMSNorm → SwiGLU MLP, repeated; then the
LM head. Module names match Hugging Face's so a checkpoint's ``state_dict`` loads as is.

Two ways to call it:
- ``model(tokens)`` with no cache: full causal attention, returns ``[B, T, vocab]`` logits;
- ``model(tokens, cache=kv, meta=AttnMeta(...))``: prefill or decode against the slot cache
  (``minillm.engine.kv_cache``); ``meta`` says where each row's tokens go and how much to read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.model.config import ModelConfig
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the model only calls cache.write/read; it does not depend on the engine
    from minillm.engine.kv_cache import KVCache


# ---------------------------------------------------------------------------- RoPE
def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies θ_i = base^(-2i/d), with Llama-3's frequency-dependent scaling:
    long wavelengths are stretched by ``factor``, short ones kept, the band between blended."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))  # [d/2]
    rs = cfg.rope_scaling
    if not rs:
        return inv_freq.float()
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return (inv_freq / rs["factor"]).float()
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r} is not implemented (minillm supports 'linear' and 'llama3')")
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_ctx = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq                                   # [d/2]
    scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)                      # 0 at the long end, 1 at the short end
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return torch.where(medium, blended, scaled).float()


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # positions: [B, T] → cos, sin: [B, T, head_dim] (computed in fp32, like HF, then cast)
    freqs = positions.float()[..., None] * inv_freq                    # [B, T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)                            # [B, T, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, T, H, D]; cos/sin: [B, T, D] → broadcast over heads
    return x * cos[:, :, None] + rotate_half(x) * sin[:, :, None]


# ---------------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 for stability, as the reference implementations do
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


@dataclass
class AttnMeta:
    """Where this step's tokens live in the cache. Built once per step on the host, shared by
    every layer. B rows (requests), T tokens per row (T=1 in decode; padded in prefill)."""
    slots_bt: torch.Tensor      # [B, T] slot of each token (row's slot, repeated)
    write_pos: torch.Tensor     # [B, T] cache position to write; padded tokens → scratch row
    positions: torch.Tensor     # [B, T] RoPE position of each token
    mask: torch.Tensor | None   # [B, 1, T, kv_len] bool, True = may attend; None = attend to all
    slots: torch.Tensor         # [B]
    kv_len: int                 # read cache positions [0, kv_len)
    slot_range: tuple[int, int] | None = None   # set when slots are a contiguous range
    causal: bool = False        # a prefill from position 0: plain causal attention, no mask tensor


def build_attn_meta(slots: list[int], start_pos: list[int], num_new: list[int], scratch_pos: int,
                    device: torch.device) -> AttnMeta:
    """Row b has ``start_pos[b]`` tokens cached and brings ``num_new[b]`` new ones."""
    B, T = len(slots), max(num_new)
    kv_len = max(s + n for s, n in zip(start_pos, num_new))
    t = torch.arange(T)                                                 # [T]
    positions = torch.tensor(start_pos)[:, None] + t                    # [B, T]
    valid = t[None, :] < torch.tensor(num_new)[:, None]                 # [B, T]
    write_pos = torch.where(valid, positions, torch.full_like(positions, scratch_pos))
    slots_t = torch.tensor(slots)
    mask = None
    uniform = all(s + n == kv_len for s, n in zip(start_pos, num_new))
    # A prefill from position 0 needs only causal attention (kv_len == T): padded queries read
    # garbage but their logits are dropped, and real ones never see past themselves. No mask
    # tensor lets SDPA pick a fused kernel; a mask with GQA forces the slow math path on CUDA.
    causal = T > 1 and all(s == 0 for s in start_pos)
    if not (T == 1 and uniform) and not causal:   # decode with equal lengths needs no mask either
        key = torch.arange(kv_len)
        mask = (key[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, kv_len]
    contiguous = slots == list(range(slots[0], slots[0] + B))
    return AttnMeta(
        slots_bt=slots_t[:, None].expand(B, T).to(device), write_pos=write_pos.to(device),
        positions=positions.to(device), mask=None if mask is None else mask.to(device),
        slots=slots_t.to(device), kv_len=kv_len,
        slot_range=(slots[0], slots[0] + B) if contiguous else None, causal=causal)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None, meta: AttnMeta | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)      # [B, T, H, D]
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)         # [B, T, KVH, D]
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)         # [B, T, KVH, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q = q.transpose(1, 2)                                           # [B, H, T, D]
        if cache is None:   # no cache: the whole sequence is here, plain causal attention
            y = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=T > 1, enable_gqa=True)
        else:
            cache.write(self.layer_idx, meta.slots_bt, meta.write_pos, k, v)
            kc, vc = cache.read(self.layer_idx, meta.slots, meta.kv_len, meta.slot_range)  # [B, KVH, L, D]
            y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=meta.mask, is_causal=meta.causal,
                                               enable_gqa=True)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # [B, T, H*D]
        return self.o_proj(y)                                           # [B, T, hidden]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [B, T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Hugging Face calls this part ``model``: embeddings, layers, final norm."""
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # RoPE frequencies are derived from the config, not learned: a buffer that checkpoints omit.
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, meta: AttnMeta | None = None,
                last_index: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: [B, T]. Returns [B, T, vocab] logits, or [B, vocab] when ``last_index`` ([B],
        the index of each row's last real token) is given: prefill only needs the next token's
        logits, so the LM head (often the largest single matmul) runs on B rows instead of B·T."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        if cache is not None and meta is None:
            raise ValueError("a cache needs AttnMeta (where to write and what to read)")
        positions = meta.positions if meta is not None else torch.arange(T, device=tokens.device).expand(B, T)
        x = self.model.embed_tokens(tokens)                              # [B, T, hidden]
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)       # [B, T, D]
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache, meta)                          # [B, T, hidden]
        if last_index is not None:
            x = x[torch.arange(B, device=x.device), last_index]          # [B, hidden]
        return self.lm_head(self.model.norm(x))                          # [B, (T,) vocab]
