"""A Llama-family decoder in plain PyTorch (Llama 2/3, Qwen2): one file, one concept.

RMSNorm → attention (RoPE, grouped-query, SDPA) → RMSNorm → SwiGLU MLP, repeated; then the
LM head. Module names match Hugging Face's, except two fused projections (vLLM's
``QKVParallelLinear`` and ``MergedColumnParallelLinear`` idea):

- ``self_attn.qkv_proj`` holds q_proj, k_proj and v_proj stacked by rows ``[q | k | v]``;
- ``mlp.gate_up_proj`` holds gate_proj and up_proj stacked by rows ``[gate | up]``.

Why: at decode, every matmul reads its whole weight to make one row of output, so the step is
bandwidth-bound either way; the fused weight reads the same bytes in one kernel instead of three
(or two), with fewer launches and less Python per layer. ``hf_state_dict()`` gives every weight
under its Hugging Face name (a fused weight's parts as views of its rows), which is how
checkpoints load, twins are initialised and ``transformers`` gets the same weights.
``Transformer(cfg, fused=False)`` keeps the separate projections (the tests pin both).

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


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula, for any positions (the model itself reads ``rope_table``'s rows instead)."""
    # positions: [...] ([B, T] or packed [N]) → cos, sin: [..., head_dim] (fp32, like HF, then cast)
    freqs = positions.float()[..., None] * inv_freq                    # [..., d/2]
    emb = torch.cat((freqs, freqs), dim=-1)                            # [..., d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_table(inv_freq: torch.Tensor, num_positions: int, dtype: torch.dtype) -> torch.Tensor:
    """cos and sin of every position in ``[0, num_positions)``, computed once: ``[P, 2, head_dim]``
    (row p holds cos(p·θ) and sin(p·θ)). A step then gathers one row per token instead of
    computing float → multiply → cat → cos → sin → cast for every token of every step (vLLM's
    ``cos_sin_cache``). Computed in fp32 and cast, as Hugging Face does, so the values are the
    formula's exactly."""
    positions = torch.arange(num_positions, device=inv_freq.device)    # [P]
    cos, sin = rope_cos_sin(inv_freq, positions, dtype)                # [P, D] each
    return torch.stack((cos, sin), dim=1)                              # [P, 2, D]


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
    def __init__(self, cfg: ModelConfig, layer_idx: int, fused: bool = True):
        super().__init__()
        self.layer_idx, self.fused = layer_idx, fused
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        if fused:   # one weight [q_size + 2·kv_size, hidden], rows [q | k | v]: one matmul, not three
            self.qkv_proj = nn.Linear(h, q_size + 2 * kv_size, bias=bias)
        else:
            self.q_proj = nn.Linear(h, q_size, bias=bias)
            self.k_proj = nn.Linear(h, kv_size, bias=bias)
            self.v_proj = nn.Linear(h, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn=None) -> torch.Tensor:
        # x: [B, T, hidden] (no cache) or [N, hidden] (packed: the step's tokens, all requests)
        lead = x.shape[:-1]
        H, KVH, D = self.n_heads, self.n_kv, self.head_dim
        if self.fused:
            qkv = self.qkv_proj(x)                                       # [..., (H + 2·KVH)·D]
            # q and k heads sit side by side in the output: RoPE rotates both in one pass
            qk = apply_rope(qkv[..., :(H + KVH) * D].view(*lead, H + KVH, D), cos, sin)  # [..., H + KVH, D]
            q, k = qk.split((H, KVH), dim=-2)                            # [..., H, D], [..., KVH, D] (views)
            v = qkv[..., (H + KVH) * D:].view(*lead, KVH, D)             # [..., KVH, D] (a view)
        else:
            q = self.q_proj(x).view(*lead, H, D)                         # [..., H, D]
            k = self.k_proj(x).view(*lead, KVH, D)                       # [..., KVH, D]
            v = self.v_proj(x).view(*lead, KVH, D)                       # [..., KVH, D]
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
    def __init__(self, cfg: ModelConfig, fused: bool = True):
        super().__init__()
        self.fused = fused
        if fused:   # one weight [2·intermediate, hidden], rows [gate | up]: one matmul, not two
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        else:
            self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
            self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden]
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)             # [..., I] each (views)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)                # [..., I] each
        return self.down_proj(F.silu(gate) * up)                         # [..., hidden]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, fused: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, fused)

    def forward(self, x, cos, sin, attn=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Hugging Face calls this part ``model``: embeddings, layers, final norm."""
    def __init__(self, cfg: ModelConfig, fused: bool = True):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, fused) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# Hugging Face projection → (its fused module, its block of rows): vLLM's stacked_params_mapping.
FUSED_SHARDS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool = True):
        super().__init__()
        self.config, self.fused = cfg, fused
        self.model = Backbone(cfg, fused)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        # RoPE is derived from the config, not learned: buffers that checkpoints omit. The table
        # covers every position the model has (max_position_embeddings ≥ any engine's
        # max_model_len), so it is built once and never reallocated under a captured CUDA graph;
        # it costs max_position_embeddings × 2 × head_dim values (64 MiB for Llama-3.1-8B in bf16).
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)             # [D/2] fp32
        self.register_buffer("rope_cache", rope_table(self.inv_freq, cfg.max_position_embeddings,
                                                      torch.float32), persistent=False)  # [P, 2, D]

    def init_rope(self, inv_freq: torch.Tensor | None = None) -> None:
        """(Re)compute the RoPE buffers on the model's device: fp32 frequencies, and the cos/sin
        table in the model's dtype (``to(dtype)`` would have cast the frequencies too)."""
        inv = (rope_inv_freq(self.config) if inv_freq is None else inv_freq).float().to(self.device)
        self.inv_freq = inv                                                                 # [D/2]
        self.rope_cache = rope_table(inv, self.config.max_position_embeddings, self.dtype)  # [P, 2, D]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] → cos, sin [..., D]: rows of the table (one gather, no arithmetic)."""
        cs = self.rope_cache[positions]                                  # [..., 2, D]
        return cs[..., 0, :], cs[..., 1, :]                              # [..., D] each (views)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight under its Hugging Face name, tied ones under both names. A fused weight
        appears as its parts, views of its rows: writing into a part writes into the fused
        weight (how checkpoints load), and ``transformers`` can use them as they are."""
        out: dict[str, torch.Tensor] = {}
        sd = self.state_dict()                           # detached tensors, sharing storage
        for name, t in sd.items():
            mod, _, leaf = name.rpartition(".")
            parent, _, proj = mod.rpartition(".")
            parts = [k for k, (f, _) in FUSED_SHARDS.items() if f == proj]
            if not parts:
                out[name] = t
            elif leaf == "weight":                       # a fused bias goes out with its weight
                sizes = self._shard_sizes(proj)
                bias = sd.get(f"{mod}.bias")
                biases = bias.split(sizes) if bias is not None else [None] * len(parts)
                # rows [q | k | v] or [gate | up]; emitted in the unfused model's order
                for hf_proj, w, b in zip(parts, t.split(sizes), biases):
                    out[f"{parent}.{hf_proj}.weight"] = w
                    if b is not None:
                        out[f"{parent}.{hf_proj}.bias"] = b
        return out

    def _shard_sizes(self, fused_name: str) -> list[int]:
        c = self.config
        if fused_name == "qkv_proj":
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        return [c.intermediate_size, c.intermediate_size]

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device     # always a plain tensor (the engine may pack lm_head)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The reference path, no cache: tokens [B, T] → logits [B, T, vocab] (full causal
        attention). Tests compare it with `transformers`; the engine uses ``forward_packed``."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        B, T = tokens.shape
        if T > self.rope_cache.shape[0]:
            raise ValueError(f"{T} tokens exceed the model's {self.rope_cache.shape[0]} positions")
        x = self.model.embed_tokens(tokens)                              # [B, T, hidden]
        cs = self.rope_cache[:T]                                         # [T, 2, D]: positions 0..T-1, a view
        cos, sin = cs[:, 0], cs[:, 1]                                    # [T, D] each, broadcast over B
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
        cos, sin = self.rope(positions)                                  # [N, D] each: rows of the table
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn)                                 # [N, hidden]
        x = x[logits_index]                                              # [R, hidden]
        return self.lm_head(self.model.norm(x))                          # [R, vocab]
