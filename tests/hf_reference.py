"""Tiny random Hugging Face checkpoints: the independent reference for the model's logits."""
from __future__ import annotations

from pathlib import Path

import torch

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def make_hf_model(kind: str, path: Path, *, tied: bool = False, rope_scaling: dict | None = None,
                  vocab: int = 512, seed: int = 0, eos: int | None = 1):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tied, eos_token_id=eos, bos_token_id=None, pad_token_id=None)
    if kind == "llama":
        cfg = LlamaConfig(**common, rope_theta=500000.0, rms_norm_eps=1e-5,
                          **({"rope_scaling": rope_scaling} if rope_scaling else {}))
        model = LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = Qwen2Config(**common, rope_theta=1000000.0, rms_norm_eps=1e-6)
        model = Qwen2ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    # Non-trivial norm weights and biases, so a forgotten norm or bias cannot pass unnoticed.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(path)
    return model
