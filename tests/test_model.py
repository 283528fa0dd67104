"""The model against transformers (the independent reference), and the KV cache against recompute."""
import pytest
import torch

from minillm import load_model
from minillm.model.config import ModelConfig, PRESETS
from minillm.engine.kv_cache import KVCache
from minillm.engine.attention import AttentionBackend, build_metadata

from hf_reference import LLAMA3_ROPE, make_hf_model

CASES = [
    ("llama", dict()),
    ("llama", dict(tied=True)),
    ("llama", dict(rope_scaling=LLAMA3_ROPE)),
    ("qwen2", dict()),
    ("qwen2", dict(tied=True)),
]


@pytest.mark.parametrize("kind,kw", CASES, ids=["llama", "llama-tied", "llama3-rope", "qwen2", "qwen2-tied"])
def test_logits_match_transformers(tmp_path, kind, kw):
    hf = make_hf_model(kind, tmp_path, **kw)
    ours = load_model(tmp_path, device="cpu", dtype="fp32")
    assert ours.config.tie_word_embeddings == kw.get("tied", False)
    assert (ours.config.rope_scaling is not None) == ("rope_scaling" in kw)
    torch.manual_seed(1)
    tokens = torch.randint(0, hf.config.vocab_size, (3, 70))     # 70 > original context 32: scaling matters
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens)
    assert got.shape == (3, 70, hf.config.vocab_size)
    assert (got - ref).abs().max().item() <= 1e-4


def test_llama3_rope_scaling_changes_logits(tmp_path):
    """Guards the test above: with scaling ignored, the logits would differ measurably."""
    make_hf_model("llama", tmp_path, rope_scaling=LLAMA3_ROPE)
    ours = load_model(tmp_path, device="cpu", dtype="fp32")
    tokens = torch.randint(0, 512, (1, 70))
    with torch.no_grad():
        a = ours(tokens)
        ours.inv_freq = (1.0 / (500000.0 ** (torch.arange(0, 16, 2).double() / 16))).float()  # unscaled
        b = ours(tokens)
    assert (a - b).abs().max().item() > 1e-3


def _cached_logits(model, seqs, prefill_lens, cache, slots):
    """Packed prefill of every row's first tokens in one forward, then lock-step decodes of
    different lengths: logits [B, 1 + steps, V]."""
    backend = AttentionBackend(cache, model.config.num_heads, model.config.num_kv_heads, model.config.head_dim)
    cpu = torch.device("cpu")
    toks = [t for s, n in zip(seqs, prefill_lens) for t in s[:n]]
    pos = [p for n in prefill_lens for p in range(n)]
    last = torch.tensor(prefill_lens).cumsum(0) - 1                           # each row's last token
    backend.begin(build_metadata(cache, [], [(sl, 0, n) for sl, n in zip(slots, prefill_lens)], cpu))
    out = [model.forward_packed(torch.tensor(toks), torch.tensor(pos), backend, last)]   # [B, V]
    cur, steps = list(prefill_lens), 6
    for _ in range(steps):
        backend.begin(build_metadata(cache, [(sl, p) for sl, p in zip(slots, cur)], [], cpu))
        tok = torch.tensor([s[p] for s, p in zip(seqs, cur)])
        out.append(model.forward_packed(tok, torch.tensor(cur), backend, torch.arange(len(seqs))))
        cur = [p + 1 for p in cur]
    return torch.stack(out, 1), steps


@pytest.mark.parametrize("preset", ["tiny"])
def test_kv_cache_decode_equals_recompute(preset):
    model = load_model(preset, device="cpu", dtype="fp32", seed=3)
    cache = KVCache(model.config, num_slots=4, max_len=64, device="cpu", dtype=torch.float32)
    slots = [3, 1, 2]                  # not 0..B-1, not in order: the decode reads gather
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 8192, (30,), generator=g).tolist() for _ in range(3)]
    prefill_lens = [5, 12, 9]          # different lengths packed in one prefill
    with torch.no_grad():
        got, steps = _cached_logits(model, seqs, prefill_lens, cache, slots)
    with torch.no_grad():
        for b, s in enumerate(seqs):
            full = model(torch.tensor([s]))[0]                        # [T, V] recomputed without cache
            n = prefill_lens[b]
            # rows decode in lock-step from their own lengths; compare each row to its own positions
            want = torch.stack([full[n - 1]] + [full[n + i] for i in range(steps)])
            assert (got[b] - want).abs().max().item() <= 1e-4


def test_shape_twin_is_deterministic_and_has_real_shapes():
    a, b = load_model("tiny", device="cpu", seed=7), load_model("tiny", device="cpu", seed=7)
    c = load_model("tiny", device="cpu", seed=8)
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert sum(p.numel() for p in a.parameters()) == PRESETS["tiny"].num_params


def test_twin_built_on_meta_never_fp32(monkeypatch):
    """A bf16 twin allocates bf16 parameters only: no fp32 copy is ever made."""
    seen = []
    orig = torch.Tensor.normal_
    monkeypatch.setattr(torch.Tensor, "normal_", lambda self, *a, **k: (self.is_meta or seen.append(self.dtype), orig(self, *a, **k))[1])
    m = load_model("tiny", device="cpu", dtype="bf16")
    assert m.dtype == torch.bfloat16 and set(seen) == {torch.bfloat16}


def test_bad_config_and_bad_name_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="preset"):
        load_model("no-such-model", device="cpu")
    with pytest.raises(ValueError, match="must be \\[B, T\\]"):
        load_model("tiny", device="cpu")(torch.tensor([1, 2, 3]))
