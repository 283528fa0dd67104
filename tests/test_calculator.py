import math

import pytest

from minillm.perf.calculator import bounds, gpu_names


def test_chapter_example_on_a_2tb_card():
    """8B in bf16 ≈ 16 GB; the A100 80GB's 2.039 TB/s gives ≈ 2.039e12 / 16.06e9 ≈ 127 tok/s."""
    b = bounds("A100 SXM 80GB", "llama-3.1-8b", "bf16", batch=1, context=0)
    assert b.model_bytes == 8_030_261_248 * 2
    assert b.single_bound_tok_s == pytest.approx(2039e9 / (8_030_261_248 * 2))
    assert b.t_mem_ms > b.t_compute_ms                         # batch 1 is bandwidth-bound


def test_large_batch_turns_compute_bound_and_aggregate_grows():
    small = bounds("H200 SXM 141GB", "llama-3.1-8b", "bf16", batch=1, context=0)
    big = bounds("H200 SXM 141GB", "llama-3.1-8b", "bf16", batch=512, context=0)
    assert big.aggregate_bound_tok_s > 100 * small.aggregate_bound_tok_s
    assert big.t_compute_ms > big.t_mem_ms and 1 < small.crossover < 512


def test_kv_pushes_the_crossover_out():
    b = bounds("H200 SXM 141GB", "llama-3.1-8b", "bf16", batch=64, context=4096)
    assert b.crossover_kv > b.crossover or math.isinf(b.crossover_kv)
    assert "crossover" in b.text()


def test_errors_name_the_choices():
    with pytest.raises(ValueError, match="H200"):
        bounds("H300", "llama-3.1-8b")
    with pytest.raises(ValueError, match="tiny"):
        bounds(gpu_names()[0], "gpt-5")
    with pytest.raises(ValueError, match="no bf16"):
        bounds("T4", "tiny", "bf16")
