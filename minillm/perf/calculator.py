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
    memory_bytes: float = 0.0     # the GPU's memory (0: unknown)
    kv_bytes: int = 0             # the KV cache this batch and context hold: B·L·k
    max_batch_fit: int = 0        # the largest batch whose weights + KV fit, at this context
    max_context_fit: int = 0      # the longest context that fits, at this batch

    @property
    def needed_bytes(self) -> int:
        """Weights + KV cache. A decode step's activations (B rows of a few hidden-size vectors)
        and the framework's own reservations are left out: a real server needs some headroom."""
        return self.model_bytes + self.kv_bytes

    @property
    def fits(self) -> bool:
        return not self.memory_bytes or self.needed_bytes <= self.memory_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    def memory_line(self) -> str:
        if not self.memory_bytes:
            return "  memory: not in the spec table"
        gib = 2**30
        need = (f"weights {self.model_bytes / gib:.1f} GiB + KV {self.kv_bytes / gib:.1f} GiB "
                f"(batch {self.batch} × {self.context} tokens) = {self.needed_bytes / gib:.1f} GiB "
                f"of {self.memory_bytes / gib:.0f} GiB")
        return f"  memory: {need}" + ("" if self.fits else " — does NOT fit")

    def text(self) -> str:
        if not self.fits:
            if self.model_bytes > self.memory_bytes:
                what = "the weights alone do not fit: a smaller dtype, a smaller model or more GPUs"
            else:
                what = (f"at context {self.context} at most batch {self.max_batch_fit} fits; at batch "
                        f"{self.batch} at most {self.max_context_fit} tokens of context")
            return (f"{self.model} ({self.dtype}) on {self.gpu}: this configuration does not fit, so it has "
                    f"no speed.\n{self.memory_line()}\n  what would fit: {what} (activations and headroom "
                    "not counted)")
        bound = "compute" if self.t_compute_ms > self.t_mem_ms else "bandwidth"
        ckv = "never (KV traffic grows faster than compute)" if self.crossover_kv == float("inf") \
            else f"{self.crossover_kv:.0f}"
        return (f"{self.model} ({self.dtype}, {self.model_bytes / 1e9:.1f} GB) on {self.gpu} "
                f"({self.bandwidth / 1e12:.2f} TB/s, {self.peak_flops / 1e12:.0f} TFLOP/s spec)\n  one "
                f"request: ≤ {self.single_bound_tok_s:.0f} tok/s (BW ÷ model bytes)\n               ≤ "
                f"{self.single_bound_kv_tok_s:.0f} tok/s for the bytes a step reads, W + L·k (input "
                f"embedding: one row; L = {self.context})\n  batch {self.batch}: step ≥ {self.step_ms:.2f} "
                f"ms ({bound}-bound: t_mem {self.t_mem_ms:.2f} ms, t_compute {self.t_compute_ms:.2f} ms) → ≤ "
                f"{self.aggregate_bound_tok_s:.0f} tok/s in total\n  crossover B* ≈ {self.crossover:.0f} (no "
                f"KV); with KV at L={self.context}: {ckv}\n{self.memory_line()}")


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
    W, k = rf.weight_bytes(cfg, nb), cfg.kv_bytes_per_token(nb)
    room = max(0.0, spec.memory - W)                      # bytes left for the KV cache
    return Bounds(spec.name, model, dtype, batch, context, bw, peak, W,
                  rf.bandwidth_bound_tok_s(rf.weight_bytes(cfg, nb), bw),
                  rf.single_request_bound(cfg, nb, context, bw),
                  rf.aggregate_bound(cfg, nb, batch, context, bw, peak),
                  max(tm, tc) * 1e3, tm * 1e3, tc * 1e3,
                  rf.crossover_batch(cfg, nb, bw, peak, 0), rf.crossover_batch(cfg, nb, bw, peak, context),
                  memory_bytes=spec.memory, kv_bytes=batch * context * k,
                  max_batch_fit=int(room // (context * k)) if context else (0 if W > spec.memory else 10**9),
                  max_context_fit=int(room // (batch * k)))


BATCHES = tuple(2 ** i for i in range(10))     # 1 … 512: the crossover lives at the small end


def calculator_widget(gpu: str = "H200 SXM 141GB", model: str = "llama-3.1-8b", dtype: str = "bf16",
                      batch: int = 1, context: int = 512):
    """Dropdowns and sliders over :func:`bounds` (needs ipywidgets and a notebook frontend),
    starting at the given values (print ``bounds(...)`` of the same values beside it for a
    headless run: the two then agree). The batch slider steps in powers of two."""
    import ipywidgets as w
    from IPython.display import display

    if batch not in BATCHES:
        raise ValueError(f"batch must be one of {', '.join(map(str, BATCHES))}, got {batch}")
    gpu = w.Dropdown(options=gpu_names(), value=gpu, description="GPU")
    model = w.Dropdown(options=list(PRESETS), value=model, description="model")
    dtype = w.Dropdown(options=["bf16", "fp16", "fp32"], value=dtype, description="dtype")
    batch = w.SelectionSlider(options=list(BATCHES), value=batch, description="batch")
    context = w.IntSlider(value=context, min=0, max=32768, step=256, description="context")
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
