"""The decode benchmark compares like with like: transformers runs *our* weights."""
import torch

from minillm.bench.decode import run_decode_benchmark, to_transformers
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
    assert rep.read_bw > 0 and rep.copy_bw > 0 and rep.step_read_bw > 0
    text = rep.table()
    assert f"over one step's {rep.bytes_per_step / 1e6:.0f} MB" in text
    assert "% of read BW" in text and "% of copy BW" in text and "measured read bandwidth" in text
    assert "min–max" in text and all(len(r.samples_tok_s) == 1 for r in rep.results)


def test_engine_bench_report_is_well_formed_and_the_stall_is_real():
    """The stall rows come from engine traces: under prefill-first one decoder gap holds the whole
    long prefill, so the max ITL is far above the median; chunking splits it. Counts, not times,
    are what must hold: every row present, positive, and the prefix hit reported."""
    from minillm.bench.engine import run_engine_bench
    rep = run_engine_bench("tiny", device="cpu", dtype="fp32", n_short=3, long_prompt=256, chunk=32,
                           prefix_prompt=96, repeats=1, packed_lengths=[16, 40, 100])
    assert [r.policy for r in rep.stall] == ["prefill-first", "chunked"]
    assert all(r.itl_max_ms >= r.itl_p50_ms > 0 and r.output_tok_s > 0 and r.long_ttft_ms > 0
               for r in rep.stall)
    assert rep.stall[1].budget == 32 and rep.prefix_cached_tokens == 80      # 95 usable → 5 blocks of 16
    assert len(rep.packed_ms) == len(rep.padded_ms) == 1
    text = rep.table()
    assert "chunked/prefill-first" in text and "prefix cache" in text and "packed prefill" in text


def test_cli_bench_engine_refuses_unknown_parts(capsys):
    from minillm.cli import main
    assert main(["bench-engine", "--model", "tiny", "--parts", "stall,nope"]) == 2
    assert "--parts" in capsys.readouterr().err


def test_eager_gap_script_runs_and_accounts_for_the_forward():
    """scripts/eager_gap.py (the measurement of eager's time beyond its matmuls) on tiny."""
    import re
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "scripts" / "eager_gap.py"), "--model", "tiny",
                          "--rounds", "1",
                          "--steps", "3", "--threads", "1"], capture_output=True, text=True, cwd=root,
                         timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    ms = {k: float(v) for k, v in re.findall(r"(matmuls only|whole forward|all but matmuls)\s+([\d.]+) ms",
                                             out.stdout)}
    assert set(ms) == {"matmuls only", "whole forward", "all but matmuls"} and all(v > 0 for v in ms.values())
    assert "right after a matmul" in out.stdout and "RMSNorm" in out.stdout
