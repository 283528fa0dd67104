"""The roofline of a decode step (chapter 10.3; design.md §3), as small functions.

A decode step at batch B, context L per sequence:
    bytes ≈ W + B·L·k          W: every weight once (the embedding only for the B rows it gathers),
                               k: KV-cache bytes per token = 2·layers·kv_heads·head_dim·dtype_bytes
    FLOPs ≈ 2·P·B + 4·B·L·layers·heads·head_dim      P: parameters used in matmuls
    t_mem = bytes / BW,   t_compute = FLOPs / peak,   step time ≥ max(t_mem, t_compute)
    I = FLOPs / bytes  against the ridge point  I* = peak / BW
Batch 1 reads all of W to make one token; batch B makes B tokens from the same read, so
aggregate tok/s grows ~linearly with B until t_compute catches up with t_mem: the crossover B*.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from minillm.model.config import ModelConfig


def weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """All parameters' bytes (the figure a model card quotes: 8B × 2 bytes = 16 GB)."""
    return cfg.num_params * dtype_bytes


def weight_bytes_per_step(cfg: ModelConfig, dtype_bytes: int, batch: int) -> int:
    """W in design.md §3: weights a decode step actually reads. The input embedding is a
    gather (B rows), the LM head a full matmul (counted even when tied to the embedding)."""
    embed_table = cfg.vocab_size * cfg.hidden_size
    others = cfg.num_params - (0 if cfg.tie_word_embeddings else embed_table)   # LM head stays in
    return (others + batch * cfg.hidden_size) * dtype_bytes


def decode_step_bytes(cfg: ModelConfig, dtype_bytes: int, batch: int, context: int) -> int:
    return weight_bytes_per_step(cfg, dtype_bytes, batch) + batch * context * cfg.kv_bytes_per_token(dtype_bytes)


def decode_step_flops(cfg: ModelConfig, batch: int, context: int) -> int:
    attention = 4 * batch * context * cfg.num_layers * cfg.num_heads * cfg.head_dim   # QKᵀ and PV
    return 2 * cfg.matmul_params * batch + attention


def t_mem(bytes_: float, bandwidth: float) -> float:
    return bytes_ / bandwidth


def t_compute(flops: float, peak_flops: float) -> float:
    return flops / peak_flops


def arithmetic_intensity(flops: float, bytes_: float) -> float:
    return flops / bytes_


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """I* (FLOP per byte): below it a kernel is bandwidth-bound, above it compute-bound."""
    return peak_flops / bandwidth


def predicted_step_time(cfg: ModelConfig, dtype_bytes: int, batch: int, context: int,
                        bandwidth: float, peak_flops: float) -> float:
    return max(t_mem(decode_step_bytes(cfg, dtype_bytes, batch, context), bandwidth),
               t_compute(decode_step_flops(cfg, batch, context), peak_flops))


def bandwidth_bound_tok_s(model_bytes: float, bandwidth: float) -> float:
    """The chapter's headline bound for one request: BW ÷ model bytes (16 GB at 2 TB/s → 125 tok/s)."""
    return bandwidth / model_bytes


def single_request_bound(cfg: ModelConfig, dtype_bytes: int, context: int, bandwidth: float) -> float:
    """tok/s ≤ BW / (W + L·k): the KV-corrected bound for batch 1."""
    return bandwidth / decode_step_bytes(cfg, dtype_bytes, 1, context)


def aggregate_bound(cfg: ModelConfig, dtype_bytes: int, batch: int, context: int,
                    bandwidth: float, peak_flops: float) -> float:
    """Aggregate tok/s ≤ min(B·BW/(W + B·L·k), peak / FLOPs-per-token)."""
    mem = batch * bandwidth / decode_step_bytes(cfg, dtype_bytes, batch, context)
    compute = peak_flops / (decode_step_flops(cfg, batch, context) / batch)
    return min(mem, compute)


def crossover_batch(cfg: ModelConfig, dtype_bytes: int, bandwidth: float, peak_flops: float,
                    context: int = 0) -> float:
    """B* where t_compute = t_mem. With context 0 (no KV) this is ≈ I* for bf16 weights, since
    W ≈ 2·P bytes: B* = W·peak / (2·P·BW). With KV, both sides grow with B; if the KV traffic
    grows faster than the compute, the step never turns compute-bound: returns inf."""
    W = weight_bytes_per_step(cfg, dtype_bytes, 0)
    per_seq_flops = 2 * cfg.matmul_params + 4 * context * cfg.num_layers * cfg.num_heads * cfg.head_dim
    per_seq_bytes = cfg.hidden_size * dtype_bytes + context * cfg.kv_bytes_per_token(dtype_bytes)
    i_star = ridge_point(peak_flops, bandwidth)
    denom = per_seq_flops - i_star * per_seq_bytes
    return math.inf if denom <= 0 else i_star * W / denom


def measured_knee(batches: list[int], step_times: list[float]) -> float | None:
    """THE definition of the measured knee, used everywhere: fit the roofline's own shape
    t(B) = max(a, b·B) (a flat bandwidth-bound part, then a compute-bound line) to the measured
    step times by least squares in log space; the knee is where the two fitted parts meet, a/b.
    None when the best fit has fewer than two points on the rising line (no knee in the range)."""
    pts = sorted((b, t) for b, t in zip(batches, step_times) if t and t > 0 and math.isfinite(t))
    if len(pts) < 3:
        return None
    logs = [(math.log(b), math.log(t)) for b, t in pts]
    best = (math.inf, None)
    for i in range(1, len(pts) - 1):           # pts[:i] flat, pts[i:] on the line (≥ 2 points)
        log_a = sum(lt for _, lt in logs[:i]) / i
        log_b = sum(lt - lb for lb, lt in logs[i:]) / (len(pts) - i)
        err = sum((lt - max(log_a, log_b + lb)) ** 2 for lb, lt in logs)
        if err < best[0]:
            best = (err, math.exp(log_a - log_b))
    flat_err = sum((lt - sum(x for _, x in logs) / len(logs)) ** 2 for _, lt in logs)
    if best[1] is None or flat_err <= best[0]:
        return None
    return best[1]


@dataclass(frozen=True)
class RooflinePoint:
    batch: int
    context: int
    bytes: int
    flops: int
    t_mem_s: float
    t_compute_s: float
    intensity: float
    bound_tok_s: float        # aggregate tok/s bound at this batch

    def to_dict(self) -> dict:
        return asdict(self)


def roofline_point(cfg: ModelConfig, dtype_bytes: int, batch: int, context: int,
                   bandwidth: float, peak_flops: float) -> RooflinePoint:
    by, fl = decode_step_bytes(cfg, dtype_bytes, batch, context), decode_step_flops(cfg, batch, context)
    return RooflinePoint(batch, context, by, fl, t_mem(by, bandwidth), t_compute(fl, peak_flops),
                         arithmetic_intensity(fl, by),
                         aggregate_bound(cfg, dtype_bytes, batch, context, bandwidth, peak_flops))
