"""The chapter's diagnosis: "add up the device time and compare it with the wall time"
(chapter 10.5), with ``torch.profiler`` over N engine steps.

:func:`profile_steps` runs ``n_steps`` of an engine under the profiler and returns

- **device busy**: the device's working time ÷ the wall time of those steps. On a GPU the
  working time is the union of the intervals of its kernels, copies and memsets, as CUPTI
  recorded them. On a CPU there is no separate device: it is the self time of the operators that
  compute, ATen's and the project's own kernels (what the profiler reports for each op, minus the
  ops that only make views, reshape, allocate or dispatch to another op: ``NON_COMPUTE_OPS``). The
  rest of the wall is Python, the engine's host work and the per-operator dispatch overhead;
- **launches per step**: on a GPU the kernel (and graph) launch calls the host made; on a CPU
  the operators called from Python (each one a trip through the dispatcher);
- **the top ops**: where the device time went, per step.

A device busy far below 100 % means the step is overhead-bound: a faster accelerator would not
shorten it. That is the case CUDA graphs address (one launch per step instead of hundreds).

The profiler slows the host down (it records every op), so the profiled wall time is longer
than a plain step's: the report gives both, and device busy is against the profiled wall, the
only one measured over the same steps.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch

from minillm.core.device import synchronize

# ATen ops whose own (self) time is not computation: views and reshapes (metadata only),
# allocation, and composite ops that only dispatch to other ops (their children are counted).
NON_COMPUTE_OPS = frozenset(f"aten::{n}" for n in (
    "view", "view_as", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "slice", "select",
    "narrow", "transpose", "t", "permute", "expand", "expand_as", "unsqueeze", "squeeze", "split",
    "split_with_sizes", "unbind", "chunk", "flatten", "unflatten", "movedim", "swapaxes", "alias",
    "detach", "detach_", "lift_fresh", "resolve_conj", "resolve_neg", "result_type",
    "empty", "empty_strided", "empty_like", "resize_",
    "linear", "matmul", "to", "_to_copy", "type_as", "contiguous", "clone", "item", "dropout",
    "scaled_dot_product_attention", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like",
    "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full",
    "_has_compatible_shallow_copy_type", "is_nonzero",
))
# The operators whose self time can be computation: ATen's, and the project's own kernels (the tiled
# decode matmul and decode attention, `engine/tiled_kernel.py` and `attention_kernel.py`), which the
# engine chooses on a CPU where they are faster: left out, a `cpu-small` step whose matmuls they run
# read as 5.5 % busy instead of most of its wall.
OP_NAMESPACES = ("aten::", "minillm::")
# Host API calls that start work on a GPU (CUDA runtime / driver names as the profiler shows them).
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel", "cudaGraphLaunch")


@dataclass
class OpRow:
    name: str
    calls_per_step: float
    ms_per_step: float
    share_of_wall: float
    counted: bool                 # counted as device (compute) time


@dataclass
class StepProfile:
    device: str                   # "cpu" or "cuda:0"
    device_work: str              # what "device time" is on this device, in words
    launch_kind: str              # what a "launch" is on this device
    n_steps: int
    rows: int                     # requests in the running batch
    wall_ms: float                # the profiled steps, all together
    device_ms: float
    launches_per_step: float
    kernels_per_step: float | None          # GPU: kernels that ran per step (with graphs ≫ launches)
    plain_step_ms: float | None             # median step wall without the profiler (StepRecords)
    cuda_graph: bool                        # the profiled steps replayed CUDA graphs
    ops: list[OpRow] = field(default_factory=list)   # the top ops by time

    @property
    def device_busy(self) -> float:
        """Device time ÷ wall time of the profiled steps, in [0, 1]."""
        return min(1.0, max(0.0, self.device_ms / self.wall_ms)) if self.wall_ms > 0 else 0.0

    @property
    def profiled_step_ms(self) -> float:
        return self.wall_ms / self.n_steps

    def summary(self) -> str:
        plain = f" (plain steps {self.plain_step_ms:.3f} ms; the profiler's own cost is the difference)" \
            if self.plain_step_ms is not None else ""
        kern = (f"; {self.kernels_per_step:.0f} kernels ran per step" if self.kernels_per_step is not None
                else "")
        return (f"device busy {100 * self.device_busy:.1f} % of wall: {self.device_ms / self.n_steps:.3f} ms "
                f"of {self.device_work} in a {self.profiled_step_ms:.3f} ms profiled "
                f"step{plain}\n{self.launches_per_step:.0f} {self.launch_kind} per "
                f"step{kern}{'; CUDA graphs replayed' if self.cuda_graph else ''}")

    def op_table(self, n: int | None = None) -> str:
        rows = self.ops[:n] if n else self.ops
        width = max([len(r.name[:70]) for r in rows] + [10])
        out = [f"{'op':<{width}} {'calls/step':>10} {'ms/step':>9} {'of wall':>8}  counted"]
        for r in rows:
            out.append(f"{r.name[:70]:<{width}} {r.calls_per_step:>10.1f} {r.ms_per_step:>9.4f} "
                       f"{100 * r.share_of_wall:>7.1f}%  {'yes' if r.counted else 'no'}")
        return "\n".join(out)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(device_busy=self.device_busy, profiled_step_ms=self.profiled_step_ms)
        return d


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _is_device_event(e) -> bool:
    from torch.autograd import DeviceType
    return e.device_type in (DeviceType.CUDA, getattr(DeviceType, "PrivateUse1", DeviceType.CUDA))


def analyse_events(events, n_steps: int, wall_ms: float, on_gpu: bool, top: int = 15
                   ) -> tuple[float, float, float | None, list[OpRow]]:
    """From the profiler's events: (device ms, launches per step, kernels per step or None, top ops)."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])   # name → [calls, µs]
    if on_gpu:
        dev = [e for e in events if _is_device_event(e)]
        device_us = _union_us([(e.time_range.start, e.time_range.end) for e in dev])
        for e in dev:
            by_name[e.name][0] += 1
            by_name[e.name][1] += e.time_range.end - e.time_range.start
        launches = sum(1 for e in events if not _is_device_event(e) and e.name in LAUNCH_CALLS)
        kernels = sum(1 for e in dev if not e.name.startswith(("Memcpy", "Memset")))
        counted = {n: True for n in by_name}
        kernels_per_step: float | None = kernels / n_steps
    else:
        aten = [e for e in events if e.name.startswith(OP_NAMESPACES)]
        for e in aten:
            by_name[e.name][0] += 1
            by_name[e.name][1] += e.self_cpu_time_total
        counted = {n: n not in NON_COMPUTE_OPS for n in by_name}
        device_us = sum(us for n, (_, us) in by_name.items() if counted[n])
        # called from Python: an op whose caller is not another op
        launches = sum(1 for e in aten
                       if not (e.cpu_parent is not None and e.cpu_parent.name.startswith(OP_NAMESPACES)))
        kernels_per_step = None
    ops = [OpRow(n, c / n_steps, us / 1e3 / n_steps, us / 1e3 / wall_ms, counted[n])
           for n, (c, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]]
    return device_us / 1e3, launches / n_steps, kernels_per_step, ops


@torch.inference_mode()
def profile_steps(engine, n_steps: int = 20, warmup: int = 3, top: int = 15,
                  plain: bool = True) -> StepProfile:
    """Profile ``n_steps`` steps of ``engine`` (an ``LLMEngine`` or an ``LLM``; its running batch
    must already hold requests that last that long: ``outside_steps.decode_engine`` builds one).
    ``warmup`` plain steps first; with ``plain``, ``n_steps`` more without the profiler, for the
    plain step time. Returns the module docstring's numbers."""
    from torch.profiler import ProfilerActivity, profile

    from minillm.experiments.outside_steps import run_decode_steps

    engine = getattr(engine, "engine", engine)
    dev = engine.device
    on_gpu = dev.type == "cuda"
    rows = engine.num_running
    recs = run_decode_steps(engine, n_steps if plain else 0, warmup)
    plain_ms = statistics.median(r.wall_ms for r in recs) if recs else None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    synchronize(dev)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        recs = run_decode_steps(engine, n_steps)
        synchronize(dev)
        wall_ms = (time.perf_counter() - t0) * 1e3
    device_ms, launches, kernels, ops = analyse_events(prof.events(), n_steps, wall_ms, on_gpu, top)
    return StepProfile(
        device=str(dev),
        device_work="CUDA kernels, copies and memsets (union of their intervals)" if on_gpu else
        "compute ops, ATen's and the project's kernels (self CPU time, views/allocations/dispatch-only "
        "ops left out)",
        launch_kind="kernel/graph launch calls" if on_gpu else "ops called from Python",
        n_steps=n_steps, rows=rows, wall_ms=wall_ms, device_ms=device_ms, launches_per_step=launches,
        kernels_per_step=kernels, plain_step_ms=plain_ms, cuda_graph=any(r.cuda_graph for r in recs), ops=ops)


def profile_decode(model: str = "tiny", batch: int = 1, context: int = 128, n_steps: int = 20,
                   warmup: int = 3,
                   device: str | None = None, dtype: str | None = None, enforce_eager: bool = False,
                   seed: int = 0, top: int = 15, loaded=None) -> StepProfile:
    """:func:`profile_steps` on a fresh engine decoding ``batch`` rows at ``context`` tokens."""
    from minillm.core.device import default_dtype, parse_dtype, pick_device
    from minillm.engine.tokenizer import load_tokenizer
    from minillm.experiments.outside_steps import decode_engine
    from minillm.model.loader import load_model

    dev = pick_device(device)
    dt = parse_dtype(dtype) if dtype else default_dtype(dev)
    m = loaded if loaded is not None else load_model(model, dev, dt, seed)
    engine = decode_engine(m, load_tokenizer(None), batch, context, 2 * n_steps, warmup, enforce_eager)
    return profile_steps(engine, n_steps, warmup, top)
