"""Where a decode step's time goes, phase by phase (chapter 10.5, from the engine's StepRecords).

Every ``LLMEngine.step()`` leaves a :class:`~minillm.core.step_record.StepRecord` whose phases
are consecutive host timestamps, so they add up to the step's wall time::

    schedule ─► prepare inputs ─► forward issue ─► device ─► sample ─► output processing

Here a running batch of ``batch`` requests is set up at a fixed context (no prefill: the rows
start as if their prompts were cached, as in the 10.3 sweep), the engine steps, and the phases
are read back from ``engine.step_history``. Nothing is timed with a separate clock.

*Outside the forward* means schedule + prepare + sample + output: the work around the model
that a faster accelerator does not speed up. The chapter's rule of thumb is that it can reach
**about 30 %** of a step (``CHAPTER_OUTSIDE_SHARE``). Which case reaches it depends on the model
and the batch, and on the machine: :meth:`PhaseCase.reaches` says it for a measured case.

The forward phases hide overhead of their own (Python walking the model, one launch per
operator): on a CPU *forward issue* is the whole forward, launches and compute together. The
profiler (``outside_profile.profile_steps``) separates those two.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

import torch

from minillm.core.step_record import OUTSIDE_PHASES, PHASE_LABELS, PHASES, StepRecord
from minillm.engine.sampling import SamplingParams, make_generator
from minillm.hardware.quiet import NOISY_SPREAD  # p90/p10 above which a case is flagged
from minillm.metrics.findings import CHAPTER_OUTSIDE_SHARE


@dataclass
class PhaseCase:
    """The phases of ``steps`` decode steps at one (model, batch). Every sample is kept."""
    model: str
    batch: int
    context: int
    device: str
    dtype: str
    sampling: str                                   # how the rows sample, in words
    steps: int
    warmup: int
    cuda_graph: bool                                # the forwards were CUDA-graph replays
    phase_ms: dict[str, list[float]] = field(default_factory=dict)   # phase → one value per step
    wall_ms: list[float] = field(default_factory=list)
    device_ms: list[float] | None = None            # CUDA events (None on a CPU)

    @property
    def label(self) -> str:
        return f"{self.model}, batch {self.batch}"

    @property
    def mean_phase_ms(self) -> dict[str, float]:
        return {p: statistics.fmean(self.phase_ms[p]) for p in PHASES}

    @property
    def mean_wall_ms(self) -> float:
        return statistics.fmean(self.wall_ms)

    @property
    def median_wall_ms(self) -> float:
        return statistics.median(self.wall_ms)

    @property
    def shares(self) -> dict[str, float]:
        """Each phase's share of the step: mean phase time ÷ mean wall time. Means, not medians,
        so the shares add up to 1 exactly as the phases add up to the wall time."""
        wall = self.mean_wall_ms
        return {p: v / wall for p, v in self.mean_phase_ms.items()}

    @property
    def outside_share(self) -> float:
        s = self.shares
        return sum(s[p] for p in OUTSIDE_PHASES)

    def reaches(self, share: float = CHAPTER_OUTSIDE_SHARE) -> bool:
        return self.outside_share >= share

    @property
    def spread(self) -> float:
        """p90 / p10 of the step walls (1 = perfectly steady)."""
        if len(self.wall_ms) < 2:
            return 1.0
        q = statistics.quantiles(self.wall_ms, n=10, method="inclusive")
        return q[-1] / q[0] if q[0] > 0 else float("inf")

    @property
    def noisy(self) -> bool:
        return self.spread > NOISY_SPREAD

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(label=self.label, shares=self.shares, outside_share=self.outside_share,
                 mean_wall_ms=self.mean_wall_ms, median_wall_ms=self.median_wall_ms, spread=self.spread)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PhaseCase:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


def phase_table(cases: list[PhaseCase]) -> str:
    """One line per case: mean ms of each phase, the wall, and the share outside the forward."""
    head = f"{'case':<22}" + "".join(f"{PHASE_LABELS[p][:13]:>14}" for p in PHASES) + \
        f"{'wall ms':>10}{'outside':>9}"
    lines = [head, f"{'(mean ms per step)':<22}"]
    for c in cases:
        m = c.mean_phase_ms
        flag = " *" if c.noisy else ""
        lines.append(f"{c.label:<22}" + "".join(f"{m[p]:>14.3f}" for p in PHASES) +
                     f"{c.mean_wall_ms:>10.3f}{100 * c.outside_share:>8.1f}%{flag}")
    if any(c.noisy for c in cases):
        lines.append(f"* noisy: p90/p10 of the step wall > {NOISY_SPREAD}; something else used the machine")
    lines.append(f"outside = {' + '.join(OUTSIDE_PHASES)} (the chapter: about "
                 f"{100 * CHAPTER_OUTSIDE_SHARE:.0f} %)")
    return "\n".join(lines)


def reach_table(cases: list[PhaseCase], share: float = CHAPTER_OUTSIDE_SHARE) -> str:
    """The chapter's line against one metric, in a few lines: each case's share of a step outside
    the forward, whether it reaches ``share``, and which cases do on this machine."""
    lines = [f"the chapter's line, about {100 * share:.0f} %, against one metric: the share of a step's "
             "wall time outside the forward (StepRecord phases)"]
    lines += [f"  {c.label:<20} {100 * c.outside_share:5.1f} %  "
              f"{'reaches it' if c.reaches(share) else 'below it'}" for c in cases]
    reached = [c.label for c in cases if c.reaches(share)]
    how = {c.sampling for c in cases}
    how_text = f"{how.pop()} sampling" if len(how) == 1 else "these samplers"
    verdict = (f"{', '.join(reached)} reach{'es' if len(reached) == 1 else ''} it" if reached
               else f"no case reaches it on this metric with {how_text}")
    lines.append(f"on this machine: {verdict} (section 7 of notebook 05 measures the chapter's own: "
                 "device time against wall time)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Running the engine
# ---------------------------------------------------------------------------------------------

def run_decode_steps(engine, steps: int, warmup: int = 0) -> list[StepRecord]:
    """Step ``engine`` (whose running batch is already filled) ``warmup`` + ``steps`` times and
    return the StepRecords of the last ``steps``. A step that fails, or that does not decode
    every running row, raises: a failed step is fast and must never be timed as a good one."""
    rows = engine.num_running
    if rows == 0:
        raise RuntimeError("the engine has no running requests: fill its batch first (fill_running_batch)")
    records = []
    for i in range(warmup + steps):
        outs = engine.step()
        rec = engine.step_history[-1]
        if rec.error or len(outs) != rows or any(o.finish_reason == "error" for o in outs):
            raise RuntimeError(f"step {rec.step} failed or lost rows: "
                               f"{rec.error or f'{len(outs)} of {rows} rows'}")
        if i >= warmup:
            records.append(rec)
    return records


def decode_engine(model, tokenizer, batch: int, context: int, steps: int, warmup: int,
                  enforce_eager: bool = False, params: SamplingParams | None = None, extra_tokens: int = 8):
    """An ``LLMEngine`` over ``model`` whose running batch holds ``batch`` requests at ``context``
    tokens each (greedy unless ``params`` says otherwise), with room for the steps to come."""
    from minillm.bench.sweep import fill_running_batch
    from minillm.engine.engine import LLMEngine

    engine = LLMEngine(model, tokenizer, max_batch_size=batch, enforce_eager=enforce_eager,
                       max_model_len=context + warmup + steps + extra_tokens, kv_memory_fraction=0.9,
                       enable_prefix_caching=False)
    seqs = fill_running_batch(engine, batch, context)
    fill_cached_kv(engine, seqs)
    if params is not None:
        p = SamplingParams(**{**asdict(params), "max_tokens": 10**9, "ignore_eos": True})
        for s in seqs:
            s.params = p
            s.generator = make_generator(p, engine.device)
    return engine


def fill_cached_kv(engine, seqs, seed: int = 0) -> None:
    """Give the rows' cached positions ordinary values (N(0, 1)). ``fill_running_batch`` skips
    the prefills and leaves that memory as the allocator found it (``torch.empty``): leftover
    bytes may read as NaN or as denormals, and on many CPUs arithmetic on denormals is far
    slower than on normal numbers. The values change no shape and no amount of work; filling
    them only keeps the arithmetic in the normal range, as a real cache would be."""
    g = torch.Generator(device=engine.device).manual_seed(seed)
    cache = engine.cache
    for s in seqs:
        for t in cache.k + cache.v:
            t[s.slot, : s.num_computed].normal_(generator=g)


def describe_sampling(params: SamplingParams | None) -> str:
    if params is None or params.greedy:
        return "greedy"
    parts = [f"temperature {params.temperature:g}"]
    if 0 < params.top_k:
        parts.append(f"top-k {params.top_k}")
    if params.top_p < 1:
        parts.append(f"top-p {params.top_p:g}")
    return ", ".join(parts)


@torch.inference_mode()
def measure_step_phases(model: str = "tiny", batch: int = 1, context: int = 128, steps: int = 20,
                        warmup: int = 3, device: str | None = None, dtype: str | None = None, seed: int = 0,
                        params: SamplingParams | None = None, enforce_eager: bool = False,
                        loaded=None, tokenizer=None) -> PhaseCase:
    """Decode ``steps`` steps at ``batch`` rows and return their phases (module docstring).
    ``loaded``: an already built model (the same ``model`` preset) to skip building it again."""
    from minillm.core.device import default_dtype, dtype_name, parse_dtype, pick_device
    from minillm.engine.tokenizer import load_tokenizer
    from minillm.model.loader import load_model

    dev = pick_device(device)
    dt = parse_dtype(dtype) if dtype else default_dtype(dev)
    m = loaded if loaded is not None else load_model(model, dev, dt, seed)
    tok = tokenizer if tokenizer is not None else load_tokenizer(None)
    engine = decode_engine(m, tok, batch, context, steps, warmup, enforce_eager, params)
    recs = run_decode_steps(engine, steps, warmup)
    dms = [r.device_ms for r in recs]
    return PhaseCase(model=str(model), batch=batch, context=context, device=str(m.device),
                     dtype=dtype_name(m.dtype), sampling=describe_sampling(params), steps=steps,
                     warmup=warmup,
                     cuda_graph=any(r.cuda_graph for r in recs),
                     phase_ms={p: [r.phase_ms[p] for r in recs] for p in PHASES},
                     wall_ms=[r.wall_ms for r in recs],
                     device_ms=None if any(d is None for d in dms) else dms)


def measure_phase_cases(models: tuple[str, ...] = ("tiny", "cpu-small"), batches: tuple[int, ...] = (1, 32),
                        context: int = 128, steps: int = 20, warmup: int = 3, device: str | None = None,
                        dtype: str | None = None, seed: int = 0, params: SamplingParams | None = None,
                        enforce_eager: bool = False, loaded: dict | None = None) -> list[PhaseCase]:
    """:func:`measure_step_phases` for every (model, batch); each model is built once (or taken
    from ``loaded``: {preset: model already built on this device})."""
    from minillm.core.device import default_dtype, parse_dtype, pick_device
    from minillm.engine.tokenizer import load_tokenizer
    from minillm.model.loader import load_model

    dev = pick_device(device)
    dt = parse_dtype(dtype) if dtype else default_dtype(dev)
    tok = load_tokenizer(None)
    cases = []
    for name in models:
        m = (loaded or {}).get(name)
        m = m if m is not None else load_model(name, dev, dt, seed)
        for b in batches:
            cases.append(measure_step_phases(name, b, context, steps, warmup, str(dev), dtype, seed, params,
                                             enforce_eager, loaded=m, tokenizer=tok))
        del m
    return cases


# ---------------------------------------------------------------------------------------------
# Is the machine quiet enough to measure?
# ---------------------------------------------------------------------------------------------

def load_warning(threshold: float = 0.5) -> str | None:
    """A warning when the 1-minute load average is above ``threshold`` × the cores, else None
    (:func:`minillm.hardware.quiet.machine_busy`). Call it before measuring: a benchmark's own
    threads raise the load too."""
    from minillm.hardware.quiet import machine_busy
    w = machine_busy(threshold).warning
    return None if w is None else "WARNING: " + w


def phase_noise_warning(samples: dict[str, list[float]], spread: float = NOISY_SPREAD,
                        max_named: int = 6) -> str | None:
    """A warning naming the series whose p90/p10 exceeds ``spread`` (the first ``max_named``), else
    None, prefixed "WARNING: " (:func:`minillm.hardware.quiet.noisy_warning`)."""
    from minillm.hardware.quiet import noisy_warning as _noisy
    w = _noisy(samples, spread, max_named)
    return None if w is None else "WARNING: " + w
