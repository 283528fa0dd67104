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


def test_a_configuration_that_does_not_fit_has_no_speed():
    """By hand: llama-3.1-8b keeps 2·32 layers·8 K/V heads·128·2 bytes = 131,072 bytes of KV per
    token in bf16. On a 24 GiB L4: batch 64 × 14,336 tokens holds 120.3 GB of KV: no fit."""
    from minillm.perf.calculator import bounds
    b = bounds("L4", "llama-3.1-8b", "bf16", batch=64, context=14336)
    assert b.kv_bytes == 64 * 14336 * 131072 and b.memory_bytes == 24 * 2**30
    assert not b.fits
    room = 24 * 2**30 - b.model_bytes
    assert b.max_batch_fit == room // (14336 * 131072) == 5
    assert b.max_context_fit == room // (64 * 131072) == 1157
    text = b.text()
    assert "does not fit" in text and "tok/s" not in text and "at most batch 5" in text
    small = bounds("L4", "llama-3.1-8b", "bf16", batch=1, context=512)
    assert small.fits and small.needed_bytes == small.model_bytes + 512 * 131072 and "tok/s" in small.text()


def test_weights_alone_too_big_says_so():
    from minillm.perf.calculator import bounds
    b = bounds("T4", "llama-3.1-8b", "fp32", batch=1, context=512)     # 32 GB of fp32 weights on 16 GiB
    assert not b.fits and "the weights alone do not fit" in b.text()


def test_every_gpu_in_the_table_has_its_memory():
    from minillm.hardware.machine import GPU_SPECS
    assert all(spec.memory >= 16 * 2**30 for _, spec in GPU_SPECS)
