"""A batch that does not fit is reported as such, and the sweep goes on."""
import torch

from minillm.bench import sweep, sweep_result


def test_oom_batch_is_reported_and_sweep_continues(monkeypatch):
    real = sweep.measure_batch

    def fake(engine, batch, *a, **k):
        if batch == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if batch == 3:
            raise RuntimeError("something else broke")
        return real(engine, batch, *a, **k)

    monkeypatch.setattr(sweep, "measure_batch", fake)
    res = sweep.run_sweep(model="tiny", device="cpu", dtype="fp32", batches=[1, 2, 3, 4], steps=2, warmup=1,
                          copy_bytes=16 * 2**20, matmul_n=128, progress=False)
    status = {b.batch: b.status for b in res.batches}
    assert status[1] == status[4] == "ok" and status[2] == "oom"
    assert status[3].startswith("error: RuntimeError")
    assert "oom" in res.table()


def test_noisy_rows_are_flagged():
    res = sweep.run_sweep(model="tiny", device="cpu", dtype="fp32", batches=[1], steps=3, warmup=1,
                          copy_bytes=16 * 2**20, matmul_n=128, progress=False)
    assert "noisy" not in res.table() or res.batches[0].forward_ms_p90 / res.batches[0].forward_ms_p10 > 1.5
    b = res.batches[0]
    b.forward_ms_p10, b.forward_ms_p90 = 1.0, 5.0           # as if another job had run mid-sweep
    assert "1.00 *" not in res.table() and " *" in res.table() and "noisy" in res.table()


def test_partial_rows_and_strict_json(tmp_path):
    import json
    import math
    part = tmp_path / "partial.jsonl"
    res = sweep.run_sweep(model="tiny", device="cpu", dtype="fp32", batches=[1, 2], steps=2, warmup=1,
                          copy_bytes=16 * 2**20, matmul_n=128, progress=False, partial_path=part)
    rows = [json.loads(line) for line in part.read_text().splitlines()]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["status"] == "ok" for r in rows)
    res.predicted_crossover_kv = math.inf                   # B* can be infinite (KV outgrows compute)
    jp, _ = res.write(tmp_path)
    assert "Infinity" not in jp.read_text()                 # strict JSON for any consumer
    assert math.isinf(sweep_result.load_result(jp)["predicted_crossover_kv"])


def test_a_kv_cache_too_small_for_the_sweep_is_oom(monkeypatch):
    """If the KV cache shrank to fit memory, writing past it would be a device assert on CUDA."""
    from minillm.engine import engine as eng_mod
    real = eng_mod.LLMEngine.__init__

    def small(self, *a, **k):
        real(self, *a, **k)
        self.max_model_len = 8                               # as if memory allowed only 8 tokens
    monkeypatch.setattr(eng_mod.LLMEngine, "__init__", small)
    res = sweep.run_sweep(model="tiny", device="cpu", dtype="fp32", batches=[1], steps=2, warmup=1,
                          copy_bytes=16 * 2**20, matmul_n=128, progress=False)
    assert res.batches[0].status == "oom"
