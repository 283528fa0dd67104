"""The model against transformers (the independent reference), and the KV cache against recompute."""
import pytest
import torch
from hf_reference import LLAMA3_ROPE, make_hf_model

from minillm import load_model
from minillm.engine.attention import AttentionBackend, build_metadata
from minillm.engine.kv_cache import KVCache
from minillm.model.config import PRESETS, ModelConfig

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
        ours.init_rope((1.0 / (500000.0 ** (torch.arange(0, 16, 2).double() / 16))).float())  # unscaled
        b = ours(tokens)
    assert (a - b).abs().max().item() > 1e-3


def _cached_logits(model, seqs, prefill_lens, cache, slots):
    """Packed prefill of every row's first tokens in one forward, then lock-step decodes of
    different lengths: logits [B, 1 + steps, V]."""
    backend = AttentionBackend(cache, model.config.num_heads, model.config.num_kv_heads,
                               model.config.head_dim)
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
    wa, wb, wc = (m.hf_state_dict()["model.layers.0.mlp.up_proj.weight"] for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert sum(p.numel() for p in a.parameters()) == PRESETS["tiny"].num_params


def test_twin_built_on_meta_never_fp32(monkeypatch):
    """A bf16 twin allocates bf16 parameters only: no fp32 copy is ever made."""
    seen = []
    orig = torch.Tensor.normal_
    monkeypatch.setattr(torch.Tensor, "normal_", lambda self, *a,
                        **k: (self.is_meta or seen.append(self.dtype), orig(self, *a, **k))[1])
    m = load_model("tiny", device="cpu", dtype="bf16")
    assert m.dtype == torch.bfloat16 and set(seen) == {torch.bfloat16}


def test_bad_config_and_bad_name_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="preset"):
        load_model("no-such-model", device="cpu")
    with pytest.raises(ValueError, match="must be \\[B, T\\]"):
        load_model("tiny", device="cpu")(torch.tensor([1, 2, 3]))


# ----------------------------------------------------------------------------- fused projections
@pytest.mark.parametrize("kind,kw", CASES, ids=["llama", "llama-tied", "llama3-rope", "qwen2", "qwen2-tied"])
def test_fused_and_unfused_give_the_same_logits_equal_to_transformers(tmp_path, kind, kw):
    """q/k/v load as one weight and gate/up as one (vLLM's QKV / merged column layers); the
    separate projections are the reference. Both equal transformers' logits."""
    hf = make_hf_model(kind, tmp_path, **kw)
    fused = load_model(tmp_path, device="cpu", dtype="fp32")
    unfused = load_model(tmp_path, device="cpu", dtype="fp32", fused=False)
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert hasattr(attn, "qkv_proj") and not hasattr(attn, "q_proj") and hasattr(mlp, "gate_up_proj")
    assert hasattr(unfused.model.layers[0].self_attn, "q_proj")
    c = fused.config
    assert attn.qkv_proj.weight.shape == ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size)
    assert mlp.gate_up_proj.weight.shape == (2 * c.intermediate_size, c.hidden_size)
    # the fused weight's blocks of rows are the checkpoint's tensors
    sd = hf.state_dict()
    q, k, v = (sd[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(fused.model.layers[1].self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    tokens = torch.randint(0, hf.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref, a, b = hf(tokens).logits, fused(tokens), unfused(tokens)
    assert (a - b).abs().max().item() <= 1e-5
    assert (a - ref).abs().max().item() <= 1e-4 and (b - ref).abs().max().item() <= 1e-4


def test_fused_and_unfused_twins_are_the_same_weights_and_decode_alike():
    """A twin gets the same values fused or not (weights are drawn in Hugging Face's order), and
    the packed, cached path (prefill chunks then decodes) gives the same logits."""
    a = load_model("tiny", device="cpu", dtype="fp32", seed=5)
    b = load_model("tiny", device="cpu", dtype="fp32", seed=5, fused=False)
    sa, sb = a.hf_state_dict(), b.hf_state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[n], sb[n]) for n in sa)
    assert sum(p.numel() for p in a.parameters()) == sum(p.numel() for p in b.parameters())
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 8192, (20,), generator=g).tolist() for _ in range(2)]
    out = []
    for m in (a, b):
        cache = KVCache(m.config, num_slots=2, max_len=32, device="cpu", dtype=torch.float32)
        with torch.no_grad():
            out.append(_cached_logits(m, seqs, [4, 9], cache, [1, 0])[0])
    assert (out[0] - out[1]).abs().max().item() <= 1e-5


# ----------------------------------------------------------------------------- the RoPE table
@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_ROPE], ids=["plain", "llama3"])
def test_rope_table_matches_the_formula_at_every_position(rope_scaling):
    """The table is computed once at load; every row must be the formula's cos/sin of that
    position (exactly the per-step fp32 computation, and within fp32 rounding of float64)."""
    import math

    from minillm.model.transformer import rope_cos_sin, rope_inv_freq
    cfg = ModelConfig(name="rope", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=1500, rope_theta=500000.0,
                      rope_scaling=rope_scaling)
    m = load_model(cfg, device="cpu", dtype="fp32")
    P, D = cfg.max_position_embeddings, cfg.head_dim
    assert m.rope_cache.shape == (P, 2, D) and m.rope_cache.dtype == torch.float32
    pos = torch.arange(P)
    cos, sin = rope_cos_sin(rope_inv_freq(cfg), pos, torch.float32)          # [P, D], the formula
    assert torch.equal(m.rope_cache[:, 0], cos) and torch.equal(m.rope_cache[:, 1], sin)
    # independently, in float64: θ_i = base^(-2i/D) (Llama-3 scaling applied by rope_inv_freq)
    theta = rope_inv_freq(cfg).double() if rope_scaling else \
        1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angle = pos.double()[:, None] * torch.cat([theta, theta])[None, :]        # [P, D]
    tol = 3e-7 * angle.abs() + 2e-6                                           # fp32 rounding of the angle
    assert ((m.rope_cache[:, 0].double() - angle.cos()).abs() <= tol).all()
    assert ((m.rope_cache[:, 1].double() - angle.sin()).abs() <= tol).all()
    # the model reads rows by position: packed positions gather exactly those rows
    some = torch.tensor([0, 7, P - 1, 3])
    c, s = m.rope(some)
    assert torch.equal(c, cos[some]) and torch.equal(s, sin[some])
    assert math.isclose(float(m.rope_cache[1, 0, 0]), math.cos(1.0), abs_tol=1e-6)  # θ_0 = 1


def test_rope_table_follows_the_model_dtype():
    m = load_model("tiny", device="cpu", dtype="bf16")
    assert m.rope_cache.dtype == torch.bfloat16 and m.inv_freq.dtype == torch.float32
    assert m.rope_cache.shape == (m.config.max_position_embeddings, 2, m.config.head_dim)
