"""CUDA graphs on and off (chapter 10.5): engine decode, eager against graph replay, on a GPU.

At batch 1 a decode step of a small model is hundreds of small kernels, each launched by the
host; when launching takes longer than running, the GPU waits and the step is overhead-bound.
A CUDA graph (``minillm.engine.cuda_graphs``) records the forward once and replays it with one
launch. ``EngineConfig.enforce_eager=True`` turns that off, so the same engine can be measured
both ways.

For each model × batch × mode this measures ``LLMEngine.step()`` on a running batch at a fixed
context (the 10.3 sweep's set-up): tok/s = batch ÷ median step time, the share of the bandwidth
bound (B·BW ÷ (W + B·L·k), with this machine's measured *read* bandwidth: decode reads its
weights and cache, as in 10.3), and, from
``profile_steps``, the device-busy share and the launches per step.

It needs CUDA: on a CPU every operator runs as it is issued and there is nothing to capture. The
notebook then shows what graphs would remove (the launches per step, from the profiler) and the
numbers of a GPU reference run, when one exists; it never guesses a GPU speed-up.
"""
from __future__ import annotations

import platform
import socket
import statistics
import time
from dataclasses import dataclass, field

import torch

from minillm.core.result import Col, Result, text_table

MODES = ("eager", "graphs")


@dataclass
class GraphsRow:
    model: str
    batch: int
    mode: str                              # "eager" or "graphs"
    context: int
    status: str = "ok"                     # "ok", "oom", "error: ..."
    step_ms: list[float] = field(default_factory=list)   # every engine step
    step_ms_median: float | None = None
    tok_s: float | None = None             # batch / median step
    bound_tok_s: float | None = None       # B·BW / (W + B·L·k)
    pct_of_bound: float | None = None
    device_busy: float | None = None       # profile_steps
    launches_per_step: float | None = None
    kernels_per_step: float | None = None
    cuda_graph: bool = False               # the steps really replayed graphs


@dataclass
class GraphsResult(Result):
    row_type = GraphsRow                  # rows read back by Result.from_dict (not a field)
    device: str
    hardware: str
    dtype: str
    bandwidth: float                       # B/s used for the bound
    bandwidth_source: str                  # "measured read", "given" (or "measured copy" in older results)
    context: int
    steps: int
    warmup: int
    rows: list[GraphsRow] = field(default_factory=list)
    host: str = ""
    started: str = ""
    duration_s: float = 0.0
    command: str = ""
    versions: dict[str, str] = field(default_factory=dict)

    def get(self, model: str, batch: int, mode: str) -> GraphsRow | None:
        return next((r for r in self.rows if (r.model, r.batch, r.mode) == (model, batch, mode)), None)

    def table(self) -> str:
        out = [f"engine decode, eager vs CUDA graphs — {self.hardware}, {self.dtype}, context "
               f"{self.context}, bound at {self.bandwidth / 1e12:.2f} TB/s ({self.bandwidth_source})",
               *text_table(GRAPHS_COLUMNS, (_graphs_row(r) for r in self.rows))]
        speed = []
        for m in dict.fromkeys(r.model for r in self.rows):
            for b in sorted({r.batch for r in self.rows if r.model == m}):
                e, g = self.get(m, b, "eager"), self.get(m, b, "graphs")
                if e and g and e.tok_s and g.tok_s:
                    speed.append(f"{m} B={b}: {g.tok_s / e.tok_s:.2f}×")
        if speed:
            out.append("graphs ÷ eager tok/s: " + ", ".join(speed))
        return "\n".join(out)


GRAPHS_COLUMNS = (Col("model", 14, left=True), Col("batch", 6), Col("mode", 8), Col("step ms", 10, ".3f"),
                  Col("tok/s", 10, ".1f"), Col("% bound", 9, ".1f", "%"), Col("busy", 7, ".0f", "%"),
                  Col("launches", 10, ".0f"), Col("kernels", 9, ".0f"))


def _graphs_row(r: GraphsRow) -> list:
    if r.status != "ok":
        return [r.model, r.batch, r.mode, f"  {r.status}"]
    busy = 100 * r.device_busy if r.device_busy is not None else None
    return [r.model, r.batch, r.mode, r.step_ms_median, r.tok_s, 100 * r.pct_of_bound, busy,
            r.launches_per_step, r.kernels_per_step]


@torch.inference_mode()
def run_graphs_comparison(models: tuple[str, ...] | list[str] = ("tiny", "llama-3.1-8b"),
                          batches: tuple[int, ...] | list[int] = (1, 8, 64), context: int = 512,
                          steps: int = 30,
                          warmup: int = 5, profile_n: int = 10, device: str | None = None,
                          dtype: str | None = None,
                          bandwidth: float | None = None, seed: int = 0, command: str = "",
                          progress: bool = True, loaded: dict | None = None) -> GraphsResult:
    """Engine decode eager vs graphs for every model × batch (module docstring). CUDA only.
    ``loaded``: {preset: model already built on this device} (a twin of 8B takes a while to build)."""
    from minillm.core.device import default_dtype, dtype_bytes, dtype_name, parse_dtype, pick_device
    from minillm.engine.tokenizer import load_tokenizer
    from minillm.experiments.outside_profile import profile_steps
    from minillm.experiments.outside_steps import decode_engine, run_decode_steps
    from minillm.hardware.machine import describe_hardware, measure_read_bandwidth
    from minillm.model.loader import load_model
    from minillm.perf import roofline as rf

    dev = pick_device(device)
    if dev.type != "cuda":
        raise RuntimeError(f"CUDA graphs need a CUDA device, this is {dev}: on a CPU every operator runs as "
                           "it is issued, so there is nothing to capture (the notebook shows the launches "
                           "per step instead, and a GPU reference run when there is one)")
    t_start = time.time()
    dt = parse_dtype(dtype) if dtype else default_dtype(dev)
    bw = bandwidth or measure_read_bandwidth(dev).value
    tok = load_tokenizer(None)
    rows: list[GraphsRow] = []
    for name in models:
        m = (loaded or {}).get(name)
        m = m if m is not None else load_model(name, dev, dt, seed)
        cfg, nb = m.config, dtype_bytes(m.dtype)
        for B in batches:
            for mode in MODES:
                row = GraphsRow(name, B, mode, context)
                engine = None
                try:
                    engine = decode_engine(m, tok, B, context, steps + profile_n, warmup,
                                           enforce_eager=mode == "eager")
                    recs = run_decode_steps(engine, steps, warmup)
                    row.step_ms = [r.wall_ms for r in recs]
                    row.step_ms_median = statistics.median(row.step_ms)
                    row.cuda_graph = all(r.cuda_graph for r in recs)
                    row.tok_s = B / (row.step_ms_median / 1e3)
                    row.bound_tok_s = B * bw / rf.decode_step_bytes(cfg, nb, B, context)
                    row.pct_of_bound = row.tok_s / row.bound_tok_s
                    if profile_n:
                        p = profile_steps(engine, profile_n, warmup=0, plain=False)
                        row.device_busy, row.launches_per_step = p.device_busy, p.launches_per_step
                        row.kernels_per_step = p.kernels_per_step
                except Exception as e:            # one case failing must not end the run
                    oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
                    row.status = "oom" if oom else f"error: {type(e).__name__}: {e}"
                finally:
                    del engine
                    torch.cuda.empty_cache()
                rows.append(row)
                if progress:
                    print(f"  {name} B={B} {mode}: "
                          + (f"{row.tok_s:.1f} tok/s" if row.status == "ok" else row.status),
                          flush=True)
        del m
        torch.cuda.empty_cache()
    return GraphsResult(device=str(dev), hardware=describe_hardware(dev).summary(), dtype=dtype_name(dt),
                        bandwidth=bw,
                        bandwidth_source="given" if bandwidth else "measured read", context=context,
                        steps=steps,
                        warmup=warmup, rows=rows, host=socket.gethostname(),
                        started=time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t_start)),
                        duration_s=time.time() - t_start, command=command or "run_graphs_comparison(...)",
                        versions={"python": platform.python_version(), "torch": torch.__version__,
                                  "cuda": str(torch.version.cuda)})
