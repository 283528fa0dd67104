"""How the decode matmul choice (engine/matmul.py, whose docstring says why) times and checks a kernel:
one weight shape over a stack of copies past the CPU's cache, each result against ``F.linear``; and the
two ways of decode attention for a bf16 model."""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from minillm.engine.matmul_kernels import one_row_reduction

# copies of a weight timed in turn: twice the 32 MiB cache of the VM it was tuned on
STACK_BYTES = 64 * 2**20
MAX_COPIES = 64
ATTENTION_CONTEXT = 256                 # cached tokens per row when timing decode attention


def pass_ms(forward: Callable, held: list, x: torch.Tensor, bias) -> float:
    """ms per weight over one pass through the stack of copies."""
    t0 = time.perf_counter()
    for h in held:
        forward(x, h, bias)
    return (time.perf_counter() - t0) * 1e3 / len(held)


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return (2e-2, 2e-2) if dtype in (torch.bfloat16, torch.float16) else (1e-4, 1e-4)


def weight_stack(out_features: int, in_features: int, bias: bool, dtype: torch.dtype, stack_bytes: int,
                 g: torch.Generator):
    """Copies of one weight shape (together past the CPU's cache, so each pass reads memory), a bias, a
    probe of 3 rows and F.linear's answer for it."""
    w_bytes = out_features * in_features * torch.empty((), dtype=dtype).element_size()
    copies = max(1, min(MAX_COPIES, -(-stack_bytes // w_bytes)))
    weights = [torch.randn(out_features, in_features, generator=g).div_(in_features ** 0.5).to(dtype)
               for _ in range(copies)]
    b = torch.randn(out_features, generator=g).to(dtype) if bias else None
    probe = torch.randn(3, in_features, generator=g).to(dtype)
    return weights, b, probe, F.linear(probe, weights[0], b).float()


def disagreement(compute: Callable[[], torch.Tensor], want: torch.Tensor,
                 errors: tuple[type[BaseException], ...] = (RuntimeError,)) -> str | None:
    """Why a kernel is not a choice (it failed, or its result is not F.linear's, fp32 tolerance), or None."""
    try:
        got = compute().float()
    except errors as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        return f"differs from F.linear by {(got - want).abs().max().item():.3g}"
    return None


def compiled_one_row_reduction(w: torch.Tensor, probe: torch.Tensor, b: torch.Tensor | None,
                               want: torch.Tensor) -> tuple[Callable | None, str | None]:
    """``one_row_reduction`` compiled for this shape (the weight an input, as each copy of the stack is),
    if torch.compile runs here and it gives F.linear's result; else (None, why)."""
    from minillm.engine.compiled import compile_unavailable, raise_recompile_limit
    why = compile_unavailable("cpu")
    if why is not None:
        return None, why
    raise_recompile_limit(64)              # one graph per weight shape, and a model has a handful
    fn = torch.compile(one_row_reduction, dynamic=False)
    why = disagreement(lambda: fn(probe[:1], w, b), want[:1], errors=(Exception,))   # a compiler failure too
    return (None, why) if why else (fn, None)


def choose_decode_attention(heads: tuple[int, int, int], dtype: torch.dtype, rows: tuple[int, ...],
                            context: int = ATTENTION_CONTEXT, repeats: int = 5) -> tuple[str, dict]:
    """For a bf16/fp16 model: decode attention in the model's dtype, or upcast to fp32 around it.
    Measured on the project's VM (AMD EPYC, torch 2.13.0+cpu, 2 threads), 12 heads over 4 K/V heads
    of 64, 128 cached tokens: torch's CPU attention kernel took 101 µs at 1 row and 406 µs at 4 in
    bf16, but 58 and 159 µs with q, K and V cast to fp32 first, so in bf16 it, not the weights, made
    a step grow with the batch. Returns (the faster way that agrees with fp32, {way: {rows: µs}})."""
    from minillm.engine.attention import decode_attention
    H, KVH, D = heads
    g = torch.Generator().manual_seed(0)
    ways = {"native": lambda q, k, v, m: decode_attention(q, k, v, m),
            "fp32": lambda q, k, v, m: decode_attention(q.float(), k.float(), v.float(), m).to(dtype)}
    us: dict[str, dict[str, float]] = {w: {} for w in ways}
    rtol, atol = tolerance(dtype)
    for r in rows:
        q = torch.randn(r, H, D, generator=g).to(dtype)
        k, v = (torch.randn(r, context, KVH, D, generator=g).to(dtype) for _ in range(2))
        mask = torch.ones(r, 1, 1, context, dtype=torch.bool)
        want = ways["fp32"](q, k, v, mask).float()
        if not torch.allclose(ways["native"](q, k, v, mask).float(), want, rtol=rtol, atol=atol):
            return "fp32", {}
        samples: dict[str, list[float]] = {w: [] for w in ways}
        for i in range(repeats + 1):
            for w, fn in ways.items():
                t0 = time.perf_counter()
                fn(q, k, v, mask)
                if i:
                    samples[w].append((time.perf_counter() - t0) * 1e6)
        for w in ways:
            us[w][str(r)] = statistics.median(samples[w])
    score = {w: math.prod(us[w][str(r)] / min(us[x][str(r)] for x in ways) for r in rows) for w in ways}
    return min(score, key=score.get), us
