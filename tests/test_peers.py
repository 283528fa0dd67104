"""`bench --peers`: minillm, transformers and (where installed) llama.cpp on the same weights,
interleaved. No peer is required: a missing one is reported as unavailable, never an error."""
import sys

import pytest
import torch

from minillm.bench import peers


def test_without_llama_cpp_the_peer_is_unavailable_not_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)          # as if llama-cpp-python were not installed
    assert "llama-cpp-python" in peers.llama_cpp_unavailable()
    collections = []
    real_gc = peers.gc

    class CountingGc:                                             # peers' own `gc`, not the process's
        @staticmethod
        def collect(*args, **kwargs):
            collections.append(1)
            return real_gc.collect(*args, **kwargs)
    monkeypatch.setattr(peers, "gc", CountingGc)
    rep = peers.run_peers("tiny", device="cpu", dtype="fp32", prompt_tokens=8, new_tokens=4, rounds=2,
                          copy_bytes=8 * 2**20)
    assert len(collections) >= 2 * 2                              # before each timed decode of each engine
    assert [p.name for p in rep.peers] == ["minillm", "transformers", "llama.cpp"]
    mini, hf, lc = rep.peers
    assert lc.status.startswith("unavailable: ") and "llama-cpp-python" in lc.status and not lc.samples_tok_s
    for p in (mini, hf):
        assert p.status == "ok" and len(p.samples_tok_s) == 2
        assert p.tok_s_min <= p.tok_s <= p.tok_s_max and p.spread >= 0
        assert p.achieved_bw == pytest.approx(p.tok_s * rep.bytes_per_step)
        assert p.pct_of_read_bw == pytest.approx(p.achieved_bw / rep.read_bw)
    assert rep.read_bw > 0 and rep.copy_bw > 0 and rep.step_read_bw > 0
    # the same weights, greedy: transformers continues the prompt exactly as minillm does
    assert len(mini.tokens) == len(hf.tokens) == 4 and mini.same_tokens == 4
    assert hf.tokens == mini.tokens and hf.same_tokens == 4 and lc.same_tokens is None
    text = rep.table()
    assert "unavailable: llama-cpp-python" in text and "% of read BW" in text and "min–max" in text
    assert "measured read bandwidth" in text and "copy bandwidth" in text and "minillm / transformers" in text
    assert "same tokens" in text and "4/4" in text
    assert f"over one step's {rep.bytes_per_step / 1e6:.0f} MB" in text
    assert "garbage collected before every timed decode" in text and f"transformers {hf.gc_ms:.1f} ms" in text
    # the bound's buffer read again before each round: two samples, named beside the table
    assert len(rep.read_drift["samples"]) == 2 and rep.read_drift["bound"] == rep.read_bw
    assert "memory read speed" in text and "over 2 samples" in text


def test_leading_agreement_counts_until_the_first_difference():
    assert peers.leading_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert peers.leading_agreement([5, 6], [5, 6, 7]) == 2
    assert peers.leading_agreement([1], [2]) == 0


def test_permutation_for_gguf_pairs_the_rotated_halves():
    """Hugging Face rotates halves of a head (i, i + D/2); llama.cpp's llama rotates pairs (2i, 2i+1)."""
    H, D = 2, 8
    w = torch.arange(H * D, dtype=torch.float32)[:, None].repeat(1, 3)      # row r holds r
    p = peers.permute_for_gguf(w, H)
    assert p.shape == w.shape
    assert p[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gguf_holds_the_same_weights(tmp_path, dtype):
    gguf = pytest.importorskip("gguf", reason="the gguf package is an optional extra (bench --peers)")
    import numpy as np

    from minillm.model.loader import load_model
    m = load_model("tiny", device="cpu", dtype=dtype, seed=3)
    kind = peers.write_gguf(m, tmp_path / "tiny.gguf")
    assert kind == {"fp32": "F32", "bf16": "BF16"}[dtype]
    r = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    t = {x.name: x for x in r.tensors}
    assert "output.weight" not in t                                  # tiny ties its embeddings
    sd, cfg = m.hf_state_dict(), m.config

    def back(name):
        x = t[name]
        a = np.asarray(x.data)
        if x.tensor_type == gguf.GGMLQuantizationType.BF16:
            a = gguf.quants.dequantize(a, x.tensor_type)
        return torch.from_numpy(np.array(a, dtype=np.float32)).reshape(*reversed([int(n) for n in x.shape]))
    assert torch.equal(back("token_embd.weight"), sd["model.embed_tokens.weight"].float())
    assert torch.equal(back("blk.1.attn_v.weight"), sd["model.layers.1.self_attn.v_proj.weight"].float())
    assert torch.equal(back("blk.1.attn_k.weight"),
                       peers.permute_for_gguf(sd["model.layers.1.self_attn.k_proj.weight"].float(),
                                              cfg.num_kv_heads))
    assert t["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert len(r.fields["tokenizer.ggml.tokens"].data) == cfg.vocab_size


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_transformers_reads_our_gguf_back_as_the_same_weights(tmp_path, kind):
    """An independent reader: transformers' GGUF loader undoes llama.cpp's q/k permutation and
    maps the names back; every tensor must come back exactly."""
    pytest.importorskip("gguf", reason="the gguf package is an optional extra (bench --peers)")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from minillm.bench.decode import to_transformers
    from minillm.model.config import PRESETS, with_overrides
    from minillm.model.loader import load_model
    cfg = with_overrides(PRESETS["tiny"], tie_word_embeddings=False, model_type=kind,
                         attention_bias=kind == "qwen2")
    m = load_model(cfg, device="cpu", dtype="fp32", seed=4)
    peers.write_gguf(m, tmp_path / "m.gguf")
    out = load_gguf_checkpoint(str(tmp_path / "m.gguf"), return_tensors=True,
                               model_to_load=to_transformers(m))
    assert out["config"]["model_type"] == kind and out["config"]["num_key_value_heads"] == cfg.num_kv_heads
    sd = m.hf_state_dict()
    assert set(out["tensors"]) == set(sd)
    assert all(torch.equal(torch.as_tensor(out["tensors"][k]), sd[k]) for k in sd)


def test_every_peer_continues_a_checkpoint_with_the_same_greedy_tokens(tmp_path):
    """An independent check of the GGUF converter and of the comparison itself: a tiny random
    Llama saved by transformers, decoded by all three engines. The logits are made peaked (greedy
    never hinges on a rounding tie) and attention sharp (q, k ×6, v ×4): with the weights as
    drawn, attention barely moves the argmax, and a converter that forgot llama.cpp's q/k
    permutation still gave the same tokens; with these it diverges at token 6."""
    pytest.importorskip("gguf", reason="the gguf package is an optional extra (bench --peers)")
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra (bench --peers)")
    from hf_reference import make_hf_model

    from minillm.engine.tokenizer import load_tokenizer
    model = make_hf_model("llama", tmp_path, vocab=512, seed=3, eos=None)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
        for layer in model.model.layers:
            for proj, scale in (("q_proj", 6), ("k_proj", 6), ("v_proj", 4)):
                getattr(layer.self_attn, proj).weight.mul_(scale)
    model.save_pretrained(tmp_path)
    load_tokenizer(None).save_pretrained(str(tmp_path))
    rep = peers.run_peers(str(tmp_path), device="cpu", dtype="fp32", prompt_tokens=8, new_tokens=12, rounds=1,
                          copy_bytes=8 * 2**20)
    mini, hf, lc = rep.peers
    assert all(p.status == "ok" for p in rep.peers), [p.status for p in rep.peers]
    assert len(mini.tokens) == 12 and len(set(mini.tokens)) > 1        # not a single repeated token
    assert hf.same_tokens == 12 and lc.same_tokens == 12, (mini.tokens, hf.tokens, lc.tokens)
