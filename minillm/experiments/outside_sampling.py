"""What sampling costs per step (chapter 10.5): greedy, temperature, top-k, top-p and
top-k + top-p, against the batch and the vocabulary size.

The logits are random (``torch.randn``): that is the honest part. The cost of turning a row of
logits into a token depends on the row's length (the vocabulary) and on the method, not on the
values a trained model would put there. Two vocabularies matter: the default tokenizer's 8192
tokens (the tiny and cpu-small presets) and Llama-3's 128256 (the llama-3.x twins).

What to look for: greedy is one argmax per row. Any temperature > 0 adds a softmax and a random
draw over the whole vocabulary. Top-k adds a partial sort (``topk``). Top-p needs the
probabilities in order, so it adds a **full sort** of every row: that sort is top-p's cost and
grows with V·log V, per row.

Two implementations at the same settings:

- **batched** — the engine's :class:`~minillm.engine.sampling.Sampler`: one set of tensor ops
  for the whole batch on the device, an exponential race for the draw, one host read;
- **per-row** — the loop it replaced (``per_row_sample`` below, reproduced from the engine as it
  was before, for this comparison only): per row a filter, a softmax, a copy to the host and
  ``torch.multinomial`` with the row's own CPU generator.

Both are timed from logits on the device to token ids on the host (the read is part of the cost).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from minillm.core.device import synchronize
from minillm.core.result import Result
from minillm.engine.sampling import Sampler, SamplingParams

# The methods compared. Temperature 0.8, top-k 50, top-p 0.9: common chat settings.
METHODS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top-k": SamplingParams(temperature=0.8, top_k=50),
    "top-p": SamplingParams(temperature=0.8, top_p=0.9),
    "top-k+top-p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
}
DEFAULT_VOCAB = 8192          # the shipped tokenizer (tiny, cpu-small)
LLAMA3_VOCAB = 128256         # the llama-3.x twins
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
IMPLS = ("batched", "per-row")


# ---------------------------------------------------------------------------------------------
# BEFORE: the per-row sampling loop the engine used until its batched Sampler (git 3e64f7c,
# minillm/sampling.py). Kept here only as the baseline of this comparison; the engine does not
# use it.
# ---------------------------------------------------------------------------------------------

def per_row_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """BEFORE (per row). logits: [V] (already divided by temperature) → same shape with the
    excluded tokens at -inf."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)      # [V]
        cum = sorted_logits.softmax(-1).cumsum(-1)                       # [V]
        # drop a token when the tokens *before* it already reach top_p (always keeps the first)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted),
                                    float("-inf"))
    return logits


def per_row_sample(logits: torch.Tensor, params: list[SamplingParams],
                   generators: list[torch.Generator | None]) -> list[int]:
    """BEFORE: logits [B, V] → one token id per row. Greedy rows share one batched argmax; the
    others sample row by row, each with its own CPU generator (``torch.multinomial``)."""
    if all(p.greedy for p in params):
        return logits.argmax(-1).tolist()                # one device→host copy for the batch
    out: list[int] = []
    greedy_ids = logits.argmax(-1).tolist()
    for b, (p, g) in enumerate(zip(params, generators)):
        if p.greedy:
            out.append(greedy_ids[b])
            continue
        row = per_row_filter(logits[b].float() / p.temperature, p.top_k, p.top_p)   # [V]
        probs = row.softmax(-1)
        # the generator lives on the CPU so a seed means the same thing on every device
        out.append(int(torch.multinomial(probs.cpu(), 1, generator=g).item()))
    return out


def per_row_generators(params: list[SamplingParams], seed: int = 0) -> list[torch.Generator | None]:
    """BEFORE: every non-greedy row had a CPU generator of its own (seeded here per row, so a
    run is reproducible)."""
    out: list[torch.Generator | None] = []
    for i, p in enumerate(params):
        if p.greedy:
            out.append(None)
        else:
            out.append(torch.Generator(device="cpu").manual_seed(seed + i))
    return out


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------

@dataclass
class SamplingRow:
    """One (impl, method, batch, vocab): milliseconds per sampling call (= per engine step)."""
    impl: str                     # "batched" (the engine's Sampler) or "per-row" (the loop before it)
    method: str
    batch: int
    vocab: int
    ms: list[float]               # every sample
    ms_median: float = 0.0
    ms_p10: float = 0.0
    ms_p90: float = 0.0
    us_per_row: float = 0.0       # ms_median × 1000 / batch

    def __post_init__(self) -> None:
        if self.ms and not self.ms_median:
            self.ms_median = statistics.median(self.ms)
            q = (statistics.quantiles(self.ms, n=10, method="inclusive") if len(self.ms) > 1
                 else [self.ms[0]] * 9)
            self.ms_p10, self.ms_p90 = q[0], q[-1]
            self.us_per_row = self.ms_median * 1e3 / self.batch


@dataclass
class SamplingBench(Result):
    row_type = SamplingRow                  # rows read back by Result.from_dict (not a field)
    device: str
    logits_dtype: str
    hardware: str
    torch_threads: int
    repeats: int
    methods: dict[str, dict]      # method → its SamplingParams' sampling fields
    rows: list[SamplingRow] = field(default_factory=list)
    started: str = ""
    duration_s: float = 0.0
    command: str = ""
    versions: dict[str, str] = field(default_factory=dict)

    def get(self, method: str, batch: int, vocab: int, impl: str = "batched") -> SamplingRow | None:
        return next((r for r in self.rows
                     if (r.impl, r.method, r.batch, r.vocab) == (impl, method, batch, vocab)),
                    None)

    @property
    def vocabs(self) -> list[int]:
        return sorted({r.vocab for r in self.rows})

    @property
    def batches(self) -> list[int]:
        return sorted({r.batch for r in self.rows})

    @property
    def method_names(self) -> list[str]:
        return list(dict.fromkeys(r.method for r in self.rows))

    def impls(self) -> list[str]:
        return list(dict.fromkeys(r.impl for r in self.rows))

    def table(self, impl: str = "batched") -> str:
        """ms per step (median) for ``impl``: one block per vocabulary, methods as columns."""
        def cell(m: str, B: int, V: int) -> str:
            r = self.get(m, B, V, impl)
            return f"{r.ms_median:>14.3f}" if r else f"{'-':>14}"
        title = (f"sampling cost per step ({impl}), ms (median of {self.repeats}); logits "
                 f"{self.logits_dtype} on {self.hardware}")
        return self._grid(title, self.method_names, cell)

    def speedup_table(self) -> str:
        """per-row ÷ batched at every setting both measured."""
        def cell(m: str, B: int, V: int) -> str:
            a, b = self.get(m, B, V, "per-row"), self.get(m, B, V, "batched")
            return f"{a.ms_median / b.ms_median:>13.1f}×" if a and b and b.ms_median > 0 else f"{'-':>14}"
        title = "the per-row loop (before) ÷ the batched sampler (the engine's), same settings"
        return self._grid(title, [m for m in self.method_names if m != "greedy"], cell)

    def summary(self) -> str:
        """Both tables, batched ms per step and per-row ÷ batched, and how long the run took."""
        return f"{self.table()}\n\n{self.speedup_table()}\n\n(measured in {self.duration_s:.1f} s)"

    def _grid(self, title: str, methods: list[str], cell) -> str:
        """One block per vocabulary: a row per batch, a column per method."""
        out = [title]
        for V in self.vocabs:
            out.append(f"\nvocabulary {V}")
            out.append(f"{'batch':>6}" + "".join(f"{m:>14}" for m in methods))
            out.extend(f"{B:>6}" + "".join(cell(m, B, V) for m in methods) for B in self.batches)
        return "\n".join(out)


def time_ms(fn, device: torch.device, repeats: int, warmup: int = 1,
            budget_s: float | None = None) -> list[float]:
    """Wall ms of ``fn()`` (device drained after each), ``repeats`` times after ``warmup``; with
    ``budget_s``, stop early (after at least 3 samples) once that much time is spent."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples: list[float] = []
    t_end = time.perf_counter() + budget_s if budget_s else None
    for i in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        samples.append((time.perf_counter() - t0) * 1e3)
        if t_end is not None and i >= 2 and time.perf_counter() > t_end:
            break
    return samples


def _sampling_fields(p: SamplingParams) -> dict:
    return {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p}


@torch.inference_mode()
def run_sampling_bench(batches: tuple[int, ...] | list[int] = DEFAULT_BATCHES,
                       vocabs: tuple[int, ...] | list[int] = (DEFAULT_VOCAB, LLAMA3_VOCAB),
                       methods: tuple[str, ...] | list[str] | None = None,
                       impls: tuple[str, ...] | list[str] = IMPLS, repeats: int = 5, warmup: int = 1,
                       device: str | None = None, dtype: str | None = None, seed: int = 0,
                       budget_s: float | None = None, command: str = "") -> SamplingBench:
    """Time every (impl, method, batch, vocab): one :class:`SamplingRow` each (module docstring).
    ``dtype``: the logits' dtype (None: the model dtype this device would use: bf16 on CUDA,
    fp32 on a CPU). ``budget_s``: stop repeating a setting once it has taken that long."""
    import platform

    from minillm.core.device import default_dtype, dtype_name, parse_dtype, pick_device
    from minillm.hardware.machine import describe_hardware

    names = list(methods or METHODS)
    unknown = [m for m in names if m not in METHODS]
    bad_impl = [i for i in impls if i not in IMPLS]
    if unknown or bad_impl:
        raise ValueError(f"unknown methods {unknown} or impls {bad_impl}; methods: {list(METHODS)}, impls: "
                         f"{IMPLS}")
    dev = pick_device(device)
    dt = parse_dtype(dtype) if dtype else default_dtype(dev)
    t_start = time.time()
    sampler = Sampler(dev, seed)
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows: list[SamplingRow] = []
    for V in vocabs:
        for B in batches:
            logits = torch.randn(B, V, generator=g).to(device=dev, dtype=dt)        # [B, V]
            for m in names:
                params = [METHODS[m]] * B
                for impl in impls:
                    if impl == "batched":
                        gens = [None] * B                      # unseeded rows: the engine's generator

                        def fn(logits=logits, params=params, gens=gens):
                            return sampler(logits, params, gens).tolist()   # the step's one host read
                    else:
                        gens = per_row_generators(params, seed)

                        def fn(logits=logits, params=params, gens=gens):
                            return per_row_sample(logits, params, gens)
                    rows.append(SamplingRow(impl, m, B, V, time_ms(fn, dev, repeats, warmup, budget_s)))
            del logits
    return SamplingBench(device=str(dev), logits_dtype=dtype_name(dt),
                         hardware=describe_hardware(dev).summary(),
                         torch_threads=torch.get_num_threads(), repeats=repeats,
                         methods={m: _sampling_fields(METHODS[m]) for m in names}, rows=rows,
                         started=time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t_start)),
                         duration_s=time.time() - t_start, command=command or "run_sampling_bench(...)",
                         versions={"python": platform.python_version(), "torch": torch.__version__})
