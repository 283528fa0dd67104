"""Model configuration: one dataclass for the whole Llama family (Llama 2/3, Qwen2).

It reads a Hugging Face ``config.json`` (``ModelConfig.from_hf``) and names the presets:
the tiny models used by tests and CI, and *shape twins* of real models (their exact
hyper-parameters, random weights; design.md §6). Speed depends on shapes and dtype, not on
weight values, so a twin is all the roofline (chapter 10.3) needs.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

# The project's own offline tokenizer (minillm/assets/tokenizer) has this many tokens;
# the small presets use exactly it so their text round-trips.
DEFAULT_VOCAB = 8192


@dataclass(frozen=True)
class ModelConfig:
    name: str = "custom"
    model_type: str = "llama"           # "llama" or "qwen2"
    vocab_size: int = DEFAULT_VOCAB
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None         # None: hidden_size // num_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None   # e.g. Llama-3's {"rope_type": "llama3", ...}
    attention_bias: bool = False        # Qwen2 puts a bias on q, k and v
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.model_type not in ("llama", "qwen2"):
            problems.append(f"model_type must be 'llama' or 'qwen2', got {self.model_type!r}")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads"):
            if getattr(self, f) <= 0:
                problems.append(f"{f} must be positive, got {getattr(self, f)}")
        if self.num_heads > 0 and self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                            f"({self.num_kv_heads})")
        if self.head_dim is None and self.num_heads > 0 and self.hidden_size % self.num_heads:
            problems.append(f"hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads})")
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    # ---- sizes used by the roofline (design.md §3) -------------------------------------
    @property
    def matmul_params(self) -> int:
        """Parameters that take part in matmuls in one decode step (P in 2·P·B FLOPs):
        q/k/v/o, the MLP, and the LM head. The input embedding is a gather, not a matmul."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d + 2 * h * self.num_kv_heads * d + self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size
        return self.num_layers * (attn + mlp) + self.vocab_size * h

    @property
    def num_params(self) -> int:
        """All parameters (embedding counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        bias = (self.num_heads + 2 * self.num_kv_heads) * d if self.attention_bias else 0
        norms = self.num_layers * 2 * h + h
        embed = self.vocab_size * h
        return self.matmul_params + bias + norms + (0 if self.tie_word_embeddings else embed)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """k in design.md §3: 2 (K and V) · layers · kv_heads · head_dim · dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ---- Hugging Face interop --------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any] | Any, name: str = "custom") -> "ModelConfig":
        """Build from a Hugging Face config (a dict, a ``config.json`` path, or a
        ``transformers.PretrainedConfig``)."""
        if isinstance(hf, (str, Path)):
            hf = json.loads(Path(hf).read_text())
        elif not isinstance(hf, dict):
            hf = hf.to_dict()
        mt = hf.get("model_type", "llama")
        if mt not in ("llama", "qwen2"):
            raise ValueError(f"unsupported model_type {mt!r}: minillm implements 'llama' and 'qwen2'")
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        # transformers >= 5 may move rope settings into "rope_parameters".
        rp = hf.get("rope_parameters")
        if isinstance(rp, dict):
            rope_theta = rope_theta or rp.get("rope_theta")
            if rp.get("rope_type", "default") != "default" and not rope_scaling:
                rope_scaling = rp
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        return cls(
            name=name,
            model_type=mt,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            attention_bias=bool(hf.get("attention_bias", mt == "qwen2")),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
        )


_LLAMA3_ROPE_8K = {"rope_type": "llama3", "original_max_position_embeddings": 8192,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0}

# Hyper-parameters of the twins are those of the models' published config.json files.
PRESETS: dict[str, ModelConfig] = {
    # Tests and CI: ~2M parameters, the project's own 8192-token vocabulary.
    "tiny": ModelConfig(name="tiny", hidden_size=128, intermediate_size=384, num_layers=4,
                        num_heads=4, num_kv_heads=2, max_position_embeddings=2048,
                        tie_word_embeddings=True, eos_token_id=0, bos_token_id=None),
    # ~93M parameters: ~370 MB in fp32, far beyond any CPU cache, still quick on a laptop.
    "cpu-small": ModelConfig(name="cpu-small", hidden_size=768, intermediate_size=2048, num_layers=12,
                             num_heads=12, num_kv_heads=4, max_position_embeddings=4096,
                             tie_word_embeddings=False, eos_token_id=0),
    "llama-3.2-1b": ModelConfig(name="llama-3.2-1b", vocab_size=128256, hidden_size=2048,
                                intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                                head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
                                rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE_8K, "factor": 32.0},
                                tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001),
    "llama-3.1-8b": ModelConfig(name="llama-3.1-8b", vocab_size=128256, hidden_size=4096,
                                intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                                head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
                                rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE_8K, "factor": 8.0},
                                tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
    "qwen2.5-0.5b": ModelConfig(name="qwen2.5-0.5b", model_type="qwen2", vocab_size=151936,
                                hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                                num_kv_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
                                rope_theta=1000000.0, attention_bias=True, tie_word_embeddings=True,
                                bos_token_id=151643, eos_token_id=151643),
    "qwen2.5-7b": ModelConfig(name="qwen2.5-7b", model_type="qwen2", vocab_size=152064,
                              hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                              num_kv_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                              rope_theta=1000000.0, attention_bias=True, tie_word_embeddings=False,
                              bos_token_id=151643, eos_token_id=151643),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}") from None


def with_overrides(cfg: ModelConfig, **kw: Any) -> ModelConfig:
    return replace(cfg, **kw)
