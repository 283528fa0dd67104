"""A Llama-family decoder in plain PyTorch (Llama 2/3, Qwen2): one file, one concept.

RMSNorm → attention (RoPE, grouped-query, SDPA) → RMSNorm → SwiGLU MLP, repeated; then the
LM head. Module names match Hugging Face's so a checkpoint's ``state_dict`` loads as is.

Two ways to call it:
- ``model(tokens)`` with no cache: full causal attention, returns ``[B, T, vocab]`` logits;
- ``model.forward_packed(tokens, positions, attn, logits_index)``: one engine step, every
  request's new tokens packed into ``[N]`` (prefill chunks and decode tokens alike). Only
  attention needs to know which token belongs to which request; it goes through ``attn``, the
  engine's attention backend (``minillm.engine.attention``), which owns the KV cache.
  The model itself depends on nothing in the engine.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.model.config import ModelConfig


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
    # positions: [...] ([B, T] or packed [N]) → cos, sin: [..., head_dim] (fp32, like HF, then cast)
    freqs = positions.float()[..., None] * inv_freq                    # [..., d/2]
    emb = torch.cat((freqs, freqs), dim=-1)                            # [..., d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [..., H, D]; cos/sin: [..., D] → broadcast over heads
    return x * cos[..., None, :] + rotate_half(x) * sin[..., None, :]


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn=None) -> torch.Tensor:
        # x: [B, T, hidden] (no cache) or [N, hidden] (packed: the step's tokens, all requests)
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.n_heads, self.head_dim)     # [..., H, D]
        k = self.k_proj(x).view(*lead, self.n_kv, self.head_dim)        # [..., KVH, D]
        v = self.v_proj(x).view(*lead, self.n_kv, self.head_dim)        # [..., KVH, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if attn is None:    # no cache: the whole sequence is here, plain causal attention
            T = x.shape[1]
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=T > 1, enable_gqa=True)  # [B, H, T, D]
            y = y.transpose(1, 2).reshape(*lead, self.n_heads * self.head_dim)  # [B, T, H*D]
        else:               # the backend writes K/V to the cache and reads each row's own positions
            y = attn.attend(self.layer_idx, q, k, v)                    # [N, H*D]
        return self.o_proj(y)                                           # [..., hidden]


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

    def forward(self, x, cos, sin, attn=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The reference path, no cache: tokens [B, T] → logits [B, T, vocab] (full causal
        attention). Tests compare it with `transformers`; the engine uses ``forward_packed``."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        positions = torch.arange(T, device=tokens.device).expand(B, T)  # [B, T]
        x = self.model.embed_tokens(tokens)                              # [B, T, hidden]
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)       # [B, T, D]
        for layer in self.model.layers:
            x = layer(x, cos, sin)                                       # [B, T, hidden]
        return self.lm_head(self.model.norm(x))                          # [B, T, vocab]

    def forward_packed(self, tokens: torch.Tensor, positions: torch.Tensor, attn,
                       logits_index: torch.Tensor) -> torch.Tensor:
        """One engine step. tokens, positions: [N], every request's new tokens packed (no
        padding); ``attn``: the attention backend, which knows each token's request. Returns
        [R, vocab] logits for the packed indices ``logits_index`` only: a prefill chunk needs
        the next token's logits at most once, so the LM head (often the largest single matmul)
        runs on R rows instead of N."""
        x = self.model.embed_tokens(tokens)                              # [N, hidden]
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)       # [N, D]
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn)                                 # [N, hidden]
        x = x[logits_index]                                              # [R, hidden]
        return self.lm_head(self.model.norm(x))                          # [R, vocab]
