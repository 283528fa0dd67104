"""``load_model``: a Hugging Face checkpoint (directory or hub id) or a shape twin (design.md §6).

Both paths build the module on the ``meta`` device first (no memory at all), cast it to the
target dtype while still on ``meta``, and only then allocate on the target device. So an 8B
twin in bf16 on a GPU never exists in fp32, nor on the CPU.

Both paths also fill the weights through their Hugging Face names (``Transformer.hf_state_dict``):
q/k/v and gate/up are blocks of rows of the fused weights, so a checkpoint loads into the fused
model as it is, and a twin gets the same values fused or not (``fused=False``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from minillm.core.device import default_dtype, parse_dtype, pick_device
from minillm.model.config import PRESETS, ModelConfig, get_preset
from minillm.model.transformer import Transformer

INIT_STD = 0.02   # GPT-2/Llama-style init: keeps a random twin's activations finite in fp16


def empty_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                fused: bool = True) -> Transformer:
    """Allocate (uninitialised) parameters directly on ``device`` in ``dtype``."""
    with torch.device("meta"):
        model = Transformer(cfg, fused=fused)
    model = model.to(dtype=dtype)                     # still meta: costs nothing
    model.to_empty(device=device)
    model.tie_weights()                               # to_empty may re-create tied tensors
    model.init_rope()                                 # buffers are not parameters: recompute
    return model


def _hf_parameters(model: Transformer) -> dict[str, torch.Tensor]:
    """Every weight once, by its Hugging Face name, in the unfused model's parameter order
    (a tied LM head is the embedding: left out)."""
    out, seen = {}, set()
    for name, t in model.hf_state_dict().items():
        key = (t.data_ptr(), t.shape)
        if key not in seen:
            seen.add(key)
            out[name] = t
    return out


@torch.no_grad()
def init_random_(model: Transformer, seed: int) -> Transformer:
    """Deterministic random weights, generated on the model's device (one generator, weights in
    a fixed order: Hugging Face's, so a fused twin equals the unfused one with the same seed),
    so the same seed gives the same twin on the same device type."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in _hf_parameters(model).items():     # tied weights appear once
        if name.endswith("norm.weight") or "layernorm" in name:
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.normal_(0.0, INIT_STD, generator=gen)
        else:
            p.normal_(0.0, INIT_STD, generator=gen)
    return model


def shape_twin(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0,
               fused: bool = True) -> Transformer:
    return init_random_(empty_model(cfg, device, dtype, fused), seed).eval()


# ------------------------------------------------------------------ Hugging Face checkpoints
def resolve_checkpoint(name_or_path: str | Path) -> Path:
    """A local directory with config.json, or a hub id available locally / from the hub."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} is a directory but has no config.json: not a Hugging Face "
                                    "checkpoint")
        return p
    if p.exists():
        raise ValueError(f"{p} is a file; give the checkpoint *directory* (the one holding config.json)")
    name = str(name_or_path)
    if name.count("/") != 1:
        raise ValueError(f"{name!r} is neither a preset ({', '.join(PRESETS)}), a checkpoint directory, "
                         f"nor a hub id like 'org/model'")
    try:
        from huggingface_hub import snapshot_download
        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
        try:   # a local cache first: no network needed
            return Path(snapshot_download(name, allow_patterns=patterns, local_files_only=True))
        except Exception:
            return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as e:
        raise RuntimeError(f"could not get {name!r} from the Hugging Face hub or its local cache "
                           f"({type(e).__name__}: {e}). Use a local checkpoint directory or a shape-twin "
                           f"preset ({', '.join(PRESETS)}).") from None


def _checkpoint_tensors(ckpt: Path, device: torch.device):
    """Yield (name, tensor) from safetensors (sharded or not) or a pytorch_model.bin."""
    from safetensors import safe_open
    files = sorted(ckpt.glob("*.safetensors"))
    if files:
        for f in files:
            with safe_open(str(f), framework="pt", device=str(device)) as sf:
                for key in sf.keys():
                    yield key, sf.get_tensor(key)
        return
    bins = sorted(ckpt.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {ckpt}")
    for f in bins:
        yield from torch.load(f, map_location=device, weights_only=True).items()


@torch.no_grad()
def load_checkpoint(ckpt: Path, device: torch.device, dtype: torch.dtype, fused: bool = True) -> Transformer:
    cfg = ModelConfig.from_hf(json.loads((ckpt / "config.json").read_text()), name=ckpt.name)
    model = empty_model(cfg, device, dtype, fused)
    params = model.hf_state_dict()          # HF names; q/k/v and gate/up are rows of the fused weights
    seen: set[str] = set()
    for key, tensor in _checkpoint_tensors(ckpt, device):
        if key.endswith("rotary_emb.inv_freq"):
            continue                                     # recomputed from the config
        if key not in params:
            raise ValueError(f"checkpoint tensor {key!r} has no place in a {cfg.model_type} model")
        p = params[key]
        if p.shape != tensor.shape:
            raise ValueError(f"{key}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(p.shape)}")
        p.copy_(tensor.to(dtype))
        seen.add(key)
    if cfg.tie_word_embeddings:
        seen.add("lm_head.weight")
        if "model.embed_tokens.weight" not in seen and "lm_head.weight" in seen:
            seen.add("model.embed_tokens.weight")
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"checkpoint {ckpt} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return model.eval()


def load_model(name_or_path: str | Path = "tiny", device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None, seed: int = 0, fused: bool = True) -> Transformer:
    """A preset name → its shape twin (random weights, seeded); anything else → a checkpoint.
    ``fused=False``: separate q/k/v and gate/up projections (the same weights and logits)."""
    dev = pick_device(device)
    dt = parse_dtype(dtype) if dtype is not None else default_dtype(dev)
    if isinstance(name_or_path, ModelConfig):
        return shape_twin(name_or_path, dev, dt, seed, fused)
    if str(name_or_path) in PRESETS:
        return shape_twin(get_preset(str(name_or_path)), dev, dt, seed, fused)
    return load_checkpoint(resolve_checkpoint(name_or_path), dev, dt, fused)


def is_shape_twin(name_or_path: str | Path | ModelConfig) -> bool:
    return isinstance(name_or_path, ModelConfig) or str(name_or_path) in PRESETS
