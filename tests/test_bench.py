"""The decode benchmark compares like with like: transformers runs *our* weights."""
import torch

from minillm.measure.bench import run_decode_benchmark, to_transformers
from minillm.model.loader import load_model


def test_to_transformers_has_the_same_logits():
    m = load_model("tiny", device="cpu", dtype="fp32", seed=3)
    hf = to_transformers(m)
    x = torch.randint(0, m.config.vocab_size, (2, 9))                      # [B, T]
    with torch.no_grad():
        assert torch.allclose(m(x), hf(x).logits, atol=1e-4)


def test_benchmark_report_is_well_formed():
    rep = run_decode_benchmark("tiny", device="cpu", dtype="fp32", prompt_tokens=8, new_tokens=6, repeats=1,
                               copy_bytes=16 * 2**20)
    assert [r.name for r in rep.results] == ["minillm", "transformers"]
    for r in rep.results:
        assert r.tok_s > 0 and abs(r.step_ms - 1e3 / r.tok_s) < 1e-9
        assert abs(r.achieved_bw - r.tok_s * rep.bytes_per_step) < 1e-3 * r.achieved_bw
    assert "% of copy BW" in rep.table() and rep.copy_bw > 0
