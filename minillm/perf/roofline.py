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
    kv = batch * context * cfg.kv_bytes_per_token(dtype_bytes)
    return weight_bytes_per_step(cfg, dtype_bytes, batch) + kv


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


# What "the data has a knee" means: the roofline's own shape, t(B) = max(a, b·B), must describe
# the points. A flat part (time barely grows with B: the weight read is the cost), then a rising
# part that grows about as fast as the batch (the step is compute-bound). Step times that grow
# from batch 1 at a rate in between (a CPU whose skinny matmuls run far below its peak, a step
# whose KV traffic grows with B) have no knee, and a fit that forced one would invent it.
KNEE_MAX_FLAT_SLOPE = 0.25     # log-log slope of the points before the knee: at most this
KNEE_MIN_RISING_SLOPE = 0.7    # log-log slope of the points after it: at least this (∝ B is 1)
KNEE_MAX_RMS = 0.12            # rms of the log residuals of the fitted shape (≈ 12 %)


def _slope(logs: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log t against log B; None for fewer than two points."""
    if len(logs) < 2:
        return None
    mx = sum(x for x, _ in logs) / len(logs)
    my = sum(y for _, y in logs) / len(logs)
    sxx = sum((x - mx) ** 2 for x, _ in logs)
    return None if sxx == 0 else sum((x - mx) * (y - my) for x, y in logs) / sxx


@dataclass(frozen=True)
class KneeFit:
    """The fit behind :func:`measured_knee`, with what it found and why it accepted or refused it."""
    knee: float | None              # a/b when the points have the roofline's shape, else None
    candidate: float | None         # the best fit's a/b, accepted or not (None: no fit tried or flat wins)
    n_points: int
    flat_points: int                # points on the flat part of the best fit
    flat_slope: float | None        # log-log slope of those points (None: fewer than two)
    rising_slope: float | None      # log-log slope of the points on the rising part
    overall_slope: float | None     # log-log slope of all points
    rms_log_residual: float | None  # how far the fitted max(a, b·B) is from the points
    reason: str                     # one sentence, printed beside the plot

    def to_dict(self) -> dict:
        return asdict(self)


def knee_fit(batches: list[int], step_times: list[float]) -> KneeFit:
    """Fit the roofline's shape t(B) = max(a, b·B) to measured step times by least squares in log
    space (for each split of the sorted points into a flat part and a rising part of ≥ 2 points),
    then check that the points have that shape: the flat part flat (slope ≤ KNEE_MAX_FLAT_SLOPE),
    the rising part ∝ B (slope ≥ KNEE_MIN_RISING_SLOPE), the fit close (rms ≤ KNEE_MAX_RMS) and
    better than one flat line. ``knee`` is a/b only when every check passes; ``reason`` says
    which failed."""
    pts = sorted((b, t) for b, t in zip(batches, step_times) if t and t > 0 and math.isfinite(t))
    n = len(pts)
    if n < 3:
        return KneeFit(None, None, n, 0, None, None, None, None,
                       f"no knee: {n} point{'s' if n != 1 else ''} measured, a knee needs at least 3")
    logs = [(math.log(b), math.log(t)) for b, t in pts]
    overall = _slope(logs)
    best = (math.inf, None, 0)
    for i in range(1, n - 1):           # pts[:i] flat, pts[i:] on the line (≥ 2 points)
        log_a = sum(lt for _, lt in logs[:i]) / i
        log_b = sum(lt - lb for lb, lt in logs[i:]) / (n - i)
        err = sum((lt - max(log_a, log_b + lb)) ** 2 for lb, lt in logs)
        if err < best[0]:
            best = (err, math.exp(log_a - log_b), i)
    mean = sum(x for _, x in logs) / n
    flat_err = sum((lt - mean) ** 2 for _, lt in logs)
    grow = f"step time grows as B^{overall:.2f} over batches {pts[0][0]}–{pts[-1][0]}"
    flat_range = (f"no knee in this range: {grow}, nearly flat; the step stays bandwidth-bound up to "
                  f"the largest batch")
    if best[1] is None or flat_err <= best[0]:
        return KneeFit(None, None, n, n, overall, None, overall, math.sqrt(flat_err / n), flat_range)
    err, cand, _ = best
    # the points the fitted shape puts on each side of the candidate knee
    flat = [lg for lg in logs if math.exp(lg[0]) <= cand] or logs[:1]
    rising = [lg for lg in logs if math.exp(lg[0]) > cand]
    fs, rs, rms = _slope(flat), _slope(rising), math.sqrt(err / n)
    if overall <= KNEE_MAX_FLAT_SLOPE and (rs is None or rs < KNEE_MIN_RISING_SLOPE):
        return KneeFit(None, cand, n, len(flat), fs, rs, overall, rms, flat_range)
    problems = []
    if fs is not None and fs > KNEE_MAX_FLAT_SLOPE:
        problems.append(f"there is no flat part: below B ≈ {cand:.0f} the step time already grows as "
                        f"B^{fs:.2f}")
    if rs is None:              # one point past the candidate: no slope to read there
        problems.append(f"past B ≈ {cand:.0f} one point only ({pts[-1][0]}), too few to tell a "
                        f"compute-bound rise from noise")
    elif rs < KNEE_MIN_RISING_SLOPE:
        problems.append(f"past B ≈ {cand:.0f} it grows as B^{rs:.2f}, not ∝ B as a compute-bound step would")
    if rms > KNEE_MAX_RMS:
        problems.append(f"the shape max(a, b·B) misses the points by {100 * rms:.0f} % (rms)")
    if problems:
        return KneeFit(None, cand, n, len(flat), fs, rs, overall, rms,
                       "no knee: " + "; ".join(problems) + f" ({grow}). These points do not have the "
                       "roofline's shape, so no knee is read from them")
    flat_txt = "flat" if fs is None else f"flat (B^{fs:.2f})"
    return KneeFit(cand, cand, n, len(flat), fs, rs, overall, rms,
                   f"knee at B ≈ {cand:.1f}: step time {flat_txt} up to it, then ∝ B^{rs:.2f} "
                   f"(fit within {100 * rms:.0f} % rms)")


def measured_knee(batches: list[int], step_times: list[float]) -> float | None:
    """THE definition of the measured knee, used everywhere (:func:`knee_fit`): where the fitted
    roofline shape max(a, b·B) turns, a/b, when the step times have that shape; None when they do
    not, or when the best fit has fewer than two points on the rising line (no knee in range)."""
    return knee_fit(batches, step_times).knee


def flat_until(cfg: ModelConfig, dtype_bytes: int, bandwidth: float, peak_flops: float, context: int,
               batches: list[int], tol: float = 0.10) -> int:
    """The largest batch in ``batches`` (sorted) up to which the *predicted* step time stays within
    ``tol`` of batch 1's, every batch before it included: the range where, by the formulas, each
    request of a batch decodes about as fast as one alone."""
    bs = sorted(batches)
    t1 = predicted_step_time(cfg, dtype_bytes, bs[0], context, bandwidth, peak_flops)
    last = bs[0]
    for b in bs[1:]:
        if predicted_step_time(cfg, dtype_bytes, b, context, bandwidth, peak_flops) > (1 + tol) * t1:
            break
        last = b
    return last


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


def ceilings_line(c: dict) -> str:
    """One line naming each ceiling and which one the bound uses (older runs measured only a
    copy, and drew their bound with it: they are labelled so)."""
    bw = c.get("bandwidth")
    if c.get("source") != "measured":
        return (f"ceilings ({c.get('source', 'unknown')}): bandwidth "
                f"{bw / 1e9:.1f} GB/s" if bw else f"ceilings: {c.get('source', 'unknown')}")
    peak = c.get("peak_flops")
    kind = c.get("bandwidth_kind", "copy")
    parts = [f"read {c['read_bandwidth'] / 1e9:.1f} GB/s" + (" (the bound's)" if kind == "read" else "")
             ] if c.get("read_bandwidth") else []
    copy = c.get("copy_bandwidth") or (bw if kind == "copy" else None)
    if copy:
        bound = ", the bound's" if kind == "copy" else ""
        parts.append(f"copy {copy / 1e9:.1f} GB/s (read + write{bound})")
    if peak:
        how = c.get("peak_method")
        square = c.get("square_matmul_flops")
        beside = f"; torch's square matmul {square / 1e12:.2f}" if square and square < peak else ""
        parts.append(f"matmul {peak / 1e12:.2f} TFLOP/s" + (f" ({how}{beside})" if how else ""))
    return "ceilings (measured): " + ", ".join(parts)


def path_line(matmul: dict | None, cuda_graphs: bool = False, batches: list[dict] | None = None) -> str:
    """Which decode path a sweep ran, in one line, from its ``matmul`` record and its rows: the plain
    one (torch's F.linear), the matmuls chosen on the machine (engine/matmul.py), the compiled decode
    (engine/compiled.py), or the fastest of the last two at each batch (bench/sweep.resolve_path); and
    where the weights were held (engine/weight_pages.py), where the run recorded it."""
    pages = (matmul or {}).get("weight_pages")
    return _path(matmul, cuda_graphs, batches) + (f"; {pages['line']}" if pages else "")


def _path(matmul: dict | None, cuda_graphs: bool, batches: list[dict] | None) -> str:
    m = matmul or {}
    if not m:
        return "path: not recorded (a run from before the matmul choice)"
    rows = [b for b in batches or [] if b.get("status") == "ok"]
    compiled = [b for b in rows if b.get("path") == "compiled"]
    if m.get("path") == "compiled":
        return ("path: compiled decode (torch.compile, weights frozen"
                f"{_compile_times(compiled)})")
    if m.get("mode") != "auto" or not m.get("choice"):
        return f"path: plain (torch's F.linear{', CUDA graphs' if cuda_graphs else ''}){m.get('why', '')}"
    picks = [r["chosen"] for r in m["choice"]["rows"]]
    kinds = ", ".join(f"{k} ×{picks.count(k)}" for k in dict.fromkeys(picks))
    how = "cached" if m["choice"].get("cached") else f"chosen in {m.get('choose_s', 0):.1f} s, not timed"
    packed = f"decode matmuls chosen on this machine ({kinds} weight shapes; {how})"
    if m.get("path") != "fastest":
        return f"path: {packed}{m.get('why', '')}"
    if not compiled:
        return (f"path: fastest per batch: {packed} at every batch (the compiled decode was slower)"
                f"{m.get('why', '')}")
    at = ", ".join(str(b["batch"]) for b in compiled)
    rest = ", ".join(str(b["batch"]) for b in rows if b.get("path") != "compiled")
    return (f"path: fastest per batch: compiled decode at B = {at} (torch.compile, weights frozen"
            f"{_compile_times(compiled)}); "
            + (f"{packed} at B = {rest}" if rest else f"faster there than the {packed}"))


def _compile_times(rows: list[dict]) -> str:
    s = [b["compile_s"] for b in rows if b.get("compile_s")]
    if not s:
        return ""
    span = f"{min(s):.0f}–{max(s):.0f} s" if round(min(s)) != round(max(s)) else f"{s[0]:.0f} s"
    return f"; first steps {span} per batch, a compile included where one ran, not timed"
