"""Where eager batch-1 decode loses time to the bare matmuls, on this machine (10.5).

Three timings of one decode step of a model (default ``cpu-small``), interleaved round by round:

- **matmuls only**: ``F.linear`` over exactly the step's weights, back to back (the floor: every
  weight read once, nothing else);
- **the whole forward**: ``Transformer.forward_packed`` of one decode token, with its KV cache;
- **everything but the matmuls**: the same forward with every ``nn.Linear`` returning a ready
  tensor (the other operators on warm caches).

Then the cost of the *first* operator after a matmul: a matmul streams megabytes of weights
through the caches, and the next small operator finds its code and data evicted. It prints the
time of a small op (``x + y`` and an RMSNorm) run alone and run right after each matmul.

    python scripts/eager_gap.py [--model cpu-small] [--threads 2] [--rounds 5]

Numbers only mean something on a quiet machine: run nothing beside it.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.engine.attention import AttentionBackend, build_metadata
from minillm.engine.kv_cache import KVCache
from minillm.model.loader import load_model
from minillm.model.transformer import RMSNorm


def median_ms(fn, n: int, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="cpu-small")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--context", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = load_model(a.model, torch.device("cpu"), torch.float32, 0)
    cfg = model.config
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    weights = [m.weight for m in linears]
    inputs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
    cache = KVCache(cfg, 1, a.context + 8, "cpu", torch.float32)
    backend = AttentionBackend(cache, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    for layer in range(cfg.num_layers):
        cache.k[layer][0, :a.context].normal_()
        cache.v[layer][0, :a.context].normal_()
    token, pos, index = torch.tensor([5]), torch.tensor([a.context]), torch.tensor([0])

    def matmuls() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    def forward() -> None:
        backend.begin(build_metadata(cache, [(0, a.context)], [], torch.device("cpu")))
        model.forward_packed(token, pos, backend, index)

    ready = {m: torch.randn(1, m.out_features) * 0.01 for m in linears}

    def forward_without_matmuls() -> None:
        real = nn.Linear.forward
        nn.Linear.forward = lambda self, x: ready[self]       # every Linear returns a ready tensor
        try:
            forward()
        finally:
            nn.Linear.forward = real

    nbytes = sum(w.numel() * w.element_size() for w in weights)
    rows: dict[str, list[float]] = {"matmuls only": [], "whole forward": [], "all but matmuls": []}
    with torch.inference_mode():
        for _ in range(a.rounds):
            rows["matmuls only"].append(median_ms(matmuls, a.steps))
            rows["whole forward"].append(median_ms(forward, a.steps))
            rows["all but matmuls"].append(median_ms(forward_without_matmuls, a.steps))
    print(f"{a.model} fp32, batch 1, {a.context} cached tokens, {a.threads} threads, {a.rounds} rounds × "
          f"median of {a.steps} steps; {nbytes / 1e6:.1f} MB of matmul weights")
    for name, xs in rows.items():
        print(f"  {name:<18}{statistics.median(xs):8.2f} ms  (rounds {min(xs):.2f}–{max(xs):.2f})")
    mm, whole, rest = (statistics.median(rows[k]) for k in rows)
    print(f"  matmul rate {nbytes / mm / 1e6:.1f} GB/s; the forward spends {whole - mm:.2f} ms beyond its "
          f"matmuls, of which {rest:.2f} ms is the other operators on warm caches and "
          f"{whole - mm - rest:.2f} ms is left")

    x, y = torch.randn(1, cfg.hidden_size), torch.randn(1, cfg.hidden_size)
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    for name, op in (("x + y", lambda: x + y), ("RMSNorm", lambda: norm(x))):
        after = []
        with torch.inference_mode():
            alone = median_ms(lambda: [op() for _ in weights], a.steps) / len(weights)
            for _ in range(max(1, a.steps // 4)):
                for w in weights:
                    F.linear(inputs[w.shape[1]], w)
                    t = time.perf_counter()
                    op()
                    after.append(time.perf_counter() - t)
        print(f"  {name:<8} alone {alone * 1e3:6.1f} µs; right after a matmul "
              f"{statistics.median(after) * 1e6:6.1f} µs (× {len(weights)} matmuls a step)")


if __name__ == "__main__":
    main()
