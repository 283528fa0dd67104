"""A decode sweep's result files: the batch grid, the file names, one row per batch and the whole
run (with its provenance), strict JSON in and out, and reading a run back in words (its knee, its
noisy rows). ``python -m minillm roofline`` writes them (:mod:`minillm.bench.sweep`); notebooks 03
and 07 and the figures read them."""
from __future__ import annotations

import json
import os
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

import minillm.perf.roofline as rf
from minillm.core.device import free_memory_bytes
from minillm.core.result import dumps_strict, restore_nonfinite
from minillm.hardware.provenance import RunProvenance
from minillm.hardware.quiet import NOISY_SPREAD, too_wide
from minillm.hardware.read_probe import ReadDrift, drift_line
from minillm.model.config import PRESETS

DEFAULT_BATCHES = [1, 2, 4, 8, 16, 32, 48, 64]


def default_batches(max_batch: int = 64) -> list[int]:
    """1, 2, 4, … 64 as in the chapter; beyond 64 continue in powers of two up to max_batch."""
    out = [b for b in DEFAULT_BATCHES if b <= max_batch]
    b = 128
    while b <= max_batch:
        out.append(b)
        b *= 2
    if max_batch not in out:
        out.append(max_batch)
    return sorted(set(out))


def parse_batches(text: str) -> list[int]:
    try:
        vals = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--batches must be comma-separated integers like 1,2,4,8, got {text!r}") from None
    if not vals or vals[0] < 1:
        raise ValueError(f"batch sizes must be ≥ 1, got {text!r}")
    return vals


def default_model_for(device: torch.device) -> str:
    """CPU: cpu-small. A big GPU: the llama-3.1-8b twin. A smaller GPU: the largest twin whose
    bf16 weights take at most 60 % of its memory (room for the KV cache of batch 64)."""
    if device.type == "cpu":
        return "cpu-small"
    mem = free_memory_bytes(device)
    for name in ("llama-3.1-8b", "qwen2.5-7b", "llama-3.2-1b", "qwen2.5-0.5b"):
        if PRESETS[name].num_params * 2 <= 0.6 * mem:
            return name
    return "cpu-small"


def model_slug(model: str | Path) -> str:
    """A safe piece of a file name for a model: a preset as it is, a checkpoint directory by its
    own name, a hub id ``org/name`` as ``org--name`` (the Hugging Face cache's spelling); any
    other character outside ``[A-Za-z0-9._-]`` becomes ``-``."""
    text = str(model).strip()
    if text in PRESETS:
        return text
    p = Path(text).expanduser()
    if p.is_dir() or p.is_absolute() or text.startswith((".", "~")) or text.endswith(("/", os.sep)):
        text = p.resolve().name                      # a path: the checkpoint directory's own name
    else:
        text = text.replace("/", "--")               # a hub id
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip(".-") or "model"


def output_stem(model: str | Path, dtype: str, device: str) -> str:
    """``roofline-<model slug>-<dtype>-<device type>``: the JSON's and the CSV's name."""
    return f"roofline-{model_slug(model)}-{dtype}-{str(device).split(':')[0]}"


def check_writable(*dirs: str | Path | None) -> None:
    """Create each directory and write a probe file in it, so a sweep that could not save its
    results says so before it starts (ValueError, one line), not after minutes of measuring."""
    for d in dirs:
        if d is None:
            continue
        d = Path(d)
        probe = d / f".minillm-write-probe-{os.getpid()}"
        try:
            d.mkdir(parents=True, exist_ok=True)
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"cannot write results to {d} ({type(e).__name__}: {e.strerror or e}); "
                             f"choose another directory (--out / --figures)") from None


@dataclass
class BatchResult:
    batch: int
    status: str                               # "ok" | "oom" | "error: ..."
    context: int
    forward_ms: list[float] = field(default_factory=list)   # every sample
    engine_ms: list[float] = field(default_factory=list)
    forward_ms_median: float | None = None
    engine_ms_median: float | None = None
    forward_ms_p10: float | None = None
    forward_ms_p90: float | None = None
    per_request_tok_s: float | None = None    # 1 / forward step time
    aggregate_tok_s: float | None = None      # B / forward step time
    engine_aggregate_tok_s: float | None = None
    bytes_per_step: int | None = None
    flops_per_step: int | None = None
    achieved_bw: float | None = None          # bytes/s
    achieved_flops: float | None = None       # FLOP/s
    mbu: float | None = None                  # achieved_bw / measured read bandwidth (the bound's)
    mfu: float | None = None                  # achieved_flops / measured matmul peak
    bound_tok_s: float | None = None          # aggregate bound at this batch (measured ceilings)
    pct_of_bound: float | None = None
    # "served": engine.step() with lengths drawn around the context and scattered slots
    served_ms: list[float] = field(default_factory=list)
    served_ms_median: float | None = None
    served_max_context: int | None = None
    served_aggregate_tok_s: float | None = None
    served_bytes_per_step: int | None = None  # W + 3·B·max(L)·k: gather read + copy write + attention read
    served_gap: float | None = None           # served step time / ideal engine step time
    path: str = ""                            # "plain" | "packed" | "compiled" (bench/sweep.resolve_path)
    compile_s: float | None = None            # the compiled path's first step (compile + run), never timed
    alternatives: dict = field(default_factory=dict)   # path "fastest": each path's timings at this batch
    read_bw_now: list[float] = field(default_factory=list)  # B/s, the memory's read speed sampled just
    #                                         before and after this row (hardware/read_probe.py)
    rounds: int = 1                           # how many times the batch was measured (run_sweep's rounds)

    def timings(self) -> dict:
        """This row's medians, as ``alternatives`` keeps them for each path tried."""
        return {"forward_ms_median": self.forward_ms_median, "engine_ms_median": self.engine_ms_median,
                "served_ms_median": self.served_ms_median, "compile_s": self.compile_s}


@dataclass
class SweepResult(RunProvenance):
    context: int
    warmup: int
    steps: int
    cuda_graphs: bool
    ceilings: dict                     # measured + spec: bandwidth (B/s: read; copy beside it), peak (FLOP/s)
    model_bytes: int
    config: dict
    predicted_crossover: float                # B* (no KV)
    predicted_crossover_kv: float             # B* with KV at this context
    measured_knee: float | None
    batches: list[BatchResult]
    started: str = ""
    duration_s: float = 0.0
    knee_note: str = ""                       # what the knee fit found, or why there is no knee
    matmul: dict = field(default_factory=dict)  # the path that ran: mode, each shape's candidate, choice time
    read_drift: dict = field(default_factory=dict)  # the read speed sampled through the run (ReadDrift)
    rounds: int = 1                           # each batch measured this many times, the batches in turn
    # B* again at the slowest and the fastest read the probe met during the run (crossover_at_reads)
    crossover_at_reads: dict = field(default_factory=dict)

    def path_line(self) -> str:
        return rf.path_line(self.matmul, self.cuda_graphs,
                            [{"batch": b.batch, "status": b.status, "path": b.path, "compile_s": b.compile_s}
                             for b in self.batches])

    def write(self, out_dir: str | Path, stem: str | None = None) -> tuple[Path, Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = stem or output_stem(self.model, self.dtype, self.device)
        jp, cp = out / f"{stem}.json", out / f"{stem}.csv"
        jp.write_text(dumps_strict(self.to_dict()))
        cols = ["batch", "status", "context", "forward_ms_median", "engine_ms_median", "served_ms_median",
                "served_max_context", "served_gap", "per_request_tok_s",
                "aggregate_tok_s", "engine_aggregate_tok_s", "achieved_bw", "mbu", "mfu", "bound_tok_s",
                "pct_of_bound"]
        lines = [",".join(cols)] + [",".join("" if getattr(b, c) is None else str(getattr(b, c))
                                             for c in cols)
                                    for b in self.batches]
        cp.write_text("\n".join(lines) + "\n")
        return jp, cp

    def ceilings_line(self) -> str:
        return rf.ceilings_line(self.ceilings)

    def summary(self) -> str:
        """What this run shows, in sentences built from its numbers (:func:`describe`)."""
        return describe(self.to_dict())

    def _repr_pretty_(self, p, cycle: bool) -> None:
        """A notebook cell that ends with a sweep (or ``display(res)``) shows its :meth:`table`."""
        p.text("SweepResult(...)" if cycle else self.table())

    def table(self) -> str:
        hdr = (f"{'batch':>5} {'step ms':>9} {'engine ms':>10} {'served ms':>10} {'tok/s/req':>10} "
               f"{'tok/s agg':>10} {'% bound':>8} {'MBU':>6} {'MFU':>6}")
        by_path = self.matmul.get("path") == "fastest"       # the path each row ran, when they differ
        hdr += "  path" if by_path else ""
        rows, noisy = [self.ceilings_line(), self.path_line(), hdr], []
        if self.rounds > 1:
            rows.insert(2, f"each batch measured in {self.rounds} rounds, the batches in turn: a row's "
                           f"median spans the whole run")
        for b in self.batches:
            if b.status != "ok":
                rows.append(f"{b.batch:>5} {b.status}")
                continue
            # a wide spread means something else ran on the machine: the median may be off (10.6)
            flag = " *" if too_wide(b.forward_ms_p10, b.forward_ms_p90) else ""
            if flag:
                noisy.append(b.batch)
            flag += " †" if read_moved(b.read_bw_now, self.ceilings) else ""
            served = f"{b.served_ms_median:>10.2f}" if b.served_ms_median else f"{'-':>10}"
            rows.append(f"{b.batch:>5} {b.forward_ms_median:>9.2f} {b.engine_ms_median:>10.2f} {served} "
                        f"{b.per_request_tok_s:>10.1f} {b.aggregate_tok_s:>10.1f} "
                        f"{100 * b.pct_of_bound:>7.0f}% {100 * b.mbu:>5.0f}% {100 * b.mfu:>5.1f}%"
                        + (f"  {b.path}" if by_path else "") + flag)
        if noisy:
            rows.append(f"* noisy: p90/p10 of the step time > {NOISY_SPREAD} at batch "
                        f"{', '.join(map(str, noisy))}; something else was using the machine, rerun before "
                        "trusting these rows")
        moved = [b.batch for b in self.batches
                 if b.status == "ok" and read_moved(b.read_bw_now, self.ceilings)]
        if self.read_drift.get("samples"):
            rows.append(drift_line(self.read_drift))
        if moved:
            rows.append(f"† the memory read {self._now_words(moved)} during batch "
                        f"{', '.join(map(str, moved))}: those rows' % of bound and MBU are off by that much")
        knee = "none" if self.measured_knee is None else f"{self.measured_knee:.1f}"
        rows.append(f"predicted crossover B* = {self.predicted_crossover:.1f} (KV-aware at L={self.context}: "
                    f"{self.predicted_crossover_kv:.1f}); measured knee: {knee}")
        if self.knee_note:
            rows.append(f"  {self.knee_note}")
        if self.crossover_at_reads.get("moved"):
            slow, fast = self.crossover_at_reads["slowest"], self.crossover_at_reads["fastest"]
            rows.append(f"  B* moves with the memory: {fast['b_star']:.1f} at the run's fastest read "
                        f"({fast['read'] / 1e9:.1f} GB/s), {slow['b_star']:.1f} at its slowest "
                        f"({slow['read'] / 1e9:.1f} GB/s); a batch measured while the memory ran fast meets "
                        f"the arithmetic sooner")
        return "\n".join(rows)

    def _now_words(self, batches: list[int]) -> str:
        now = [statistics.median(b.read_bw_now) for b in self.batches if b.batch in batches]   # never empty
        bound = self.ceilings.get("bandwidth") or 0
        speed = (f"{min(now) / 1e9:.1f}" if f"{min(now) / 1e9:.1f}" == f"{max(now) / 1e9:.1f}"
                 else f"{min(now) / 1e9:.1f}–{max(now) / 1e9:.1f}")
        return f"at {speed} GB/s, not the bound's {bound / 1e9:.1f},"


def read_moved(samples: list[float], ceilings: dict) -> bool:
    """Whether the memory read more than ×read_probe.DRIFT faster or slower around a row than when the
    bound was measured (only for a measured read bound: a spec sheet's is not comparable)."""
    bound = ceilings.get("bandwidth") if ceilings.get("bandwidth_kind") == "read" else None
    if not samples or not bound:
        return False
    return ReadDrift((statistics.median(samples), bound)).moved


def load_result(path: str | Path) -> dict:
    return json.loads(Path(path).read_text(), object_hook=restore_nonfinite)


# ---------------------------------------------------------------------------- reading a run

def noisy_batches(result: dict, rel_spread: float = NOISY_SPREAD) -> dict[int, float]:
    """``{batch: p90/p10}`` for the rows whose forward step times spread more than ``rel_spread``
    (something else used the machine while they ran: :mod:`minillm.hardware.quiet`)."""
    from minillm.hardware.quiet import noisy_rows
    return noisy_rows({b["batch"]: b["forward_ms"] for b in result["batches"]
                       if b["status"] == "ok" and b.get("forward_ms")}, rel_spread)


def describe_run(result: dict, tol: float = 0.10) -> list[str]:
    """What a sweep's data shows, in sentences built from its numbers (never typed in): how the
    per-request speed moves with the batch, how the aggregate grows, what one more row costs
    against the measured matmul peak, the knee (or why there is none) and B*."""
    from minillm.model.config import ModelConfig
    ok = sorted((b for b in result["batches"] if b["status"] == "ok"), key=lambda b: b["batch"])
    if not ok:
        return ["no batch was measured"]
    b1, last = ok[0], ok[-1]
    r1 = b1["per_request_tok_s"]
    out = []
    flat = b1
    for b in ok[1:]:
        if b["per_request_tok_s"] < (1 - tol) * r1:
            break
        flat = b
    path = ", ".join(f"{b['per_request_tok_s']:.1f} at {b['batch']}" for b in ok)
    if flat is last and len(ok) > 1:
        out.append(f"Per-request tok/s stays within {100 * tol:.0f} % of batch {b1['batch']}'s {r1:.1f} up "
                   f"to batch {last['batch']} ({last['per_request_tok_s']:.1f}): every row gets its token "
                   "from the same weight read.")
    elif flat is not b1:
        nxt = ok[ok.index(flat) + 1]
        then = "" if nxt is last else f"{nxt['per_request_tok_s']:.1f} at batch {nxt['batch']}, "
        out.append(f"Per-request tok/s stays within {100 * tol:.0f} % of batch {b1['batch']}'s {r1:.1f} up "
                   f"to batch {flat['batch']}, then falls: {then}{last['per_request_tok_s']:.1f} at batch "
                   f"{last['batch']} (×{last['per_request_tok_s'] / r1:.2f}).")
    elif len(ok) > 1:
        nxt = ok[1]
        out.append(f"Per-request tok/s is not flat here: it falls from the first step up, {r1:.1f} at batch "
                   f"{b1['batch']} → {nxt['per_request_tok_s']:.1f} at batch {nxt['batch']} "
                   f"(×{nxt['per_request_tok_s'] / r1:.2f}) → {last['per_request_tok_s']:.1f} at batch "
                   f"{last['batch']} (×{last['per_request_tok_s'] / r1:.2f}). All points: {path}.")
    if len(ok) > 1:
        g = last["aggregate_tok_s"] / b1["aggregate_tok_s"]
        out.append(f"Aggregate tok/s: {b1['aggregate_tok_s']:.1f} at batch {b1['batch']} → "
                   f"{last['aggregate_tok_s']:.1f} at batch {last['batch']}: ×{g:.1f} for "
                   f"×{last['batch'] / b1['batch']:.0f} the requests.")
        # what one more row costs, against what its arithmetic would cost at the measured peak
        small = [b for b in ok[1:] if b["batch"] <= 4] or ok[1:2]
        b_s = small[-1]
        per_row_ms = (b_s["forward_ms_median"] - b1["forward_ms_median"]) / (b_s["batch"] - b1["batch"])
        cfg = ModelConfig(**result["config"]) if result.get("config") else None
        peak = result.get("ceilings", {}).get("peak_flops")
        if cfg is not None and peak:
            L = result["context"]
            row_flops = ((rf.decode_step_flops(cfg, b_s["batch"], L)
                          - rf.decode_step_flops(cfg, b1["batch"], L))
                         / (b_s["batch"] - b1["batch"]))
            pred_ms = row_flops / peak * 1e3
            if per_row_ms <= 0:
                out.append(f"Between batch {b1['batch']} and {b_s['batch']} the step did not get longer "
                           f"({b1['forward_ms_median']:.2f} → {b_s['forward_ms_median']:.2f} ms): the extra "
                           "rows rode on the same weight read.")
            else:
                ratio = per_row_ms / pred_ms
                out.append(f"Each extra row between batch {b1['batch']} and {b_s['batch']} added "
                           f"{per_row_ms:.2f} ms to a {b1['forward_ms_median']:.2f} ms step; its arithmetic "
                           f"at the measured matmul peak would take {pred_ms:.3f} ms" + (
                               f": the extra rows cost ×{ratio:.1f} what their arithmetic would. Matmuls "
                               "with a few rows run far below the peak (and the arithmetic overlaps the "
                               "weight read only in part), so the roofline's max(t_mem, t_compute) "
                               "underestimates them."
                               if ratio > 1.5 else ", as the roofline predicts."))
    fit = rf.knee_fit([b["batch"] for b in ok], [b["forward_ms_median"] for b in ok])
    out.append(f"Knee fit: {fit.reason}.")
    bstar = result.get("predicted_crossover")
    if bstar is not None:
        where = "inside" if ok[0]["batch"] <= bstar <= last["batch"] else "outside"
        out.append(f"Predicted crossover B* = {bstar:.1f} (from the measured ceilings), {where} the measured "
                   f"batches {b1['batch']}–{last['batch']}.")
    drift = result.get("read_drift") or {}
    if drift.get("moved"):
        out.append(drift_line(drift))
    noisy = noisy_batches(result)
    if noisy:
        out.append("Noisy rows (marked on the figure): "
                   + ", ".join(f"batch {b} ×{s:.1f}" for b, s in noisy.items())
                   + ": rerun before reading them closely.")
    return out


def describe(result: dict, source: str | None = None) -> str:
    """A sweep in words, to read at once: a header (``source``, the hardware, the model), then
    :func:`describe_run`'s sentences and how near batch 1 came to its bound, one per line."""
    hw = (result.get("hardware") or {}).get("summary") or result.get("device", "")
    head = f"{source} ({hw}, {result['model']} {result['dtype']}):" if source else \
        f"{hw}, model {result['model']} {result['dtype']}:"
    lines = describe_run(result)
    ok = sorted((b for b in result["batches"] if b["status"] == "ok"), key=lambda b: b["batch"])
    b1 = ok[0] if ok else {}
    if all(b1.get(k) is not None for k in ("pct_of_bound", "per_request_tok_s", "mbu", "mfu")):
        lines.append(f"Batch {b1['batch']} reached {100 * b1['pct_of_bound']:.0f} % of its bound "
                     f"({b1['per_request_tok_s']:.1f} tok/s, MBU {100 * b1['mbu']:.0f} %) and used "
                     f"{100 * b1['mfu']:.1f} % of the measured arithmetic peak (MFU).")
    return "\n".join([head] + [f" - {line}" for line in lines])
