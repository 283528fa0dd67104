"""The notebook 10.3 calculator: pick a GPU, a model and a dtype; see the bounds and B*.

The arithmetic is a plain function (tested in tests/test_calculator.py); the ipywidgets UI is
a thin layer over it, so the notebook also runs headless.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import minillm.perf.roofline as rf
from minillm.core.device import dtype_bytes
from minillm.hardware.machine import GPU_SPECS, GPUSpec
from minillm.model.config import PRESETS


def gpu_names() -> list[str]:
    return [spec.name for _, spec in GPU_SPECS]


def gpu_spec(name: str) -> GPUSpec:
    for _, spec in GPU_SPECS:
        if spec.name == name:
            return spec
    raise ValueError(f"unknown GPU {name!r}; choose one of: {', '.join(gpu_names())}")


@dataclass(frozen=True)
class Bounds:
    gpu: str
    model: str
    dtype: str
    batch: int
    context: int
    bandwidth: float              # B/s, spec
    peak_flops: float             # FLOP/s, spec, dense
    model_bytes: int              # all weights (the model-card figure)
    single_bound_tok_s: float     # BW / model bytes: the chapter's headline bound
    single_bound_kv_tok_s: float  # BW / (W + L·k)
    aggregate_bound_tok_s: float  # min(B·BW/(W + B·L·k), peak / FLOPs per token)
    step_ms: float                # predicted step time at this batch: max(t_mem, t_compute)
    t_mem_ms: float
    t_compute_ms: float
    crossover: float              # B* without KV
    crossover_kv: float           # B* with KV at this context (inf: never compute-bound)

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        bound = "compute" if self.t_compute_ms > self.t_mem_ms else "bandwidth"
        ckv = "never (KV traffic grows faster than compute)" if self.crossover_kv == float("inf") \
            else f"{self.crossover_kv:.0f}"
        return (f"{self.model} ({self.dtype}, {self.model_bytes / 1e9:.1f} GB) on {self.gpu} "
                f"({self.bandwidth / 1e12:.2f} TB/s, {self.peak_flops / 1e12:.0f} TFLOP/s spec)\n"
                f"  one request: ≤ {self.single_bound_tok_s:.0f} tok/s (BW ÷ model bytes)\n"
                f"               ≤ {self.single_bound_kv_tok_s:.0f} tok/s for the bytes a step reads, W + L·k "
                f"(input embedding: one row; L = {self.context})\n"
                f"  batch {self.batch}: step ≥ {self.step_ms:.2f} ms ({bound}-bound: t_mem {self.t_mem_ms:.2f} ms, "
                f"t_compute {self.t_compute_ms:.2f} ms) → ≤ {self.aggregate_bound_tok_s:.0f} tok/s in total\n"
                f"  crossover B* ≈ {self.crossover:.0f} (no KV); with KV at L={self.context}: {ckv}")


def bounds(gpu: str, model: str, dtype: str = "bf16", batch: int = 1, context: int = 512) -> Bounds:
    spec = gpu_spec(gpu)
    if model not in PRESETS:
        raise ValueError(f"unknown model {model!r}; choose one of: {', '.join(PRESETS)}")
    if dtype not in spec.flops:
        raise ValueError(f"{spec.name} has no {dtype} figure in the spec table "
                         f"(it lists {', '.join(spec.flops)})")
    if batch < 1 or context < 0:
        raise ValueError("batch must be ≥ 1 and context ≥ 0")
    cfg, nb = PRESETS[model], dtype_bytes(dtype)
    bw, peak = spec.bandwidth, spec.flops[dtype]
    by, fl = rf.decode_step_bytes(cfg, nb, batch, context), rf.decode_step_flops(cfg, batch, context)
    tm, tc = rf.t_mem(by, bw), rf.t_compute(fl, peak)
    return Bounds(spec.name, model, dtype, batch, context, bw, peak, rf.weight_bytes(cfg, nb),
                  rf.bandwidth_bound_tok_s(rf.weight_bytes(cfg, nb), bw),
                  rf.single_request_bound(cfg, nb, context, bw),
                  rf.aggregate_bound(cfg, nb, batch, context, bw, peak),
                  max(tm, tc) * 1e3, tm * 1e3, tc * 1e3,
                  rf.crossover_batch(cfg, nb, bw, peak, 0), rf.crossover_batch(cfg, nb, bw, peak, context))


def calculator_widget():
    """Dropdowns and sliders over :func:`bounds` (needs ipywidgets and a notebook frontend)."""
    import ipywidgets as w
    from IPython.display import display

    gpu = w.Dropdown(options=gpu_names(), value="H200 SXM 141GB", description="GPU")
    model = w.Dropdown(options=list(PRESETS), value="llama-3.1-8b", description="model")
    dtype = w.Dropdown(options=["bf16", "fp16", "fp32"], value="bf16", description="dtype")
    batch = w.IntSlider(value=1, min=1, max=512, description="batch")
    context = w.IntSlider(value=512, min=0, max=32768, step=256, description="context")
    out = w.Output()

    def update(*_):
        out.clear_output()
        with out:
            try:
                print(bounds(gpu.value, model.value, dtype.value, batch.value, context.value).text())
            except ValueError as e:          # e.g. bf16 on a T4: say why, don't crash
                print(f"not available: {e}")

    for c in (gpu, model, dtype, batch, context):
        c.observe(update, names="value")
    update()
    display(w.VBox([w.HBox([gpu, model, dtype]), w.HBox([batch, context]), out]))
