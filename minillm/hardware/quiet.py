"""Is this machine quiet enough to measure? (design.md §9; chapter 10.6)

A timing taken while something else runs is slow *and* noisy, and nothing in the number says so.
Two signs give it away, and every measuring notebook checks both:

- **the load**: the 1-minute load average, taken before we start, against the cores this process
  may use (:func:`machine_busy`);
- **noisy rows**: repeats of one measurement that spread widely, p90/p10 above
  :data:`NOISY_SPREAD` (:func:`noisy_rows`, :func:`noisy_warning`).

And one remedy on a CPU: leave a core free for everything that is not torch (the notebook's own
thread, the OS, a browser), exactly as ``python -m minillm serve`` does:
:func:`measurement_threads` sets torch to ``cores − 1`` threads through the same function
(:func:`minillm.core.device.default_server_threads`). Measured on a 2-core machine while
another job ran: a ``cpu-small`` decode step took 181–904 ms with 2 torch threads and 31–68 ms
with 1 (torch's threads wait for each other when one of them loses its core).
"""
from __future__ import annotations

import os
import textwrap
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

NOISY_SPREAD = 1.5        # p90 / p10 of a row's repeats above which it is flagged
LOAD_THRESHOLD = 0.5      # busy: 1-minute load average above this × the cores we may use


def _cores() -> int:
    from minillm.core.device import cpu_cores
    return cpu_cores()


def load_average() -> float | None:
    """The 1-minute load average, or None where the OS has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


@dataclass(frozen=True)
class LoadCheck:
    """The load before a measurement. ``bool(check)`` is True when the machine is busy."""
    load1: float | None
    cores: int
    threshold: float = LOAD_THRESHOLD

    @property
    def busy(self) -> bool:
        return self.load1 is not None and self.load1 > self.threshold * self.cores

    def __bool__(self) -> bool:
        return self.busy

    @property
    def warning(self) -> str | None:
        if not self.busy:
            return None
        return (f"this machine is busy: 1-minute load average {self.load1:.2f} on {self.cores} cores (above "
                f"{self.threshold:g} × cores). Other programs compete for the CPU, so the numbers below will "
                "be slower and noisier than this machine can do. Close what you can and rerun before "
                "trusting them.")

    def line(self) -> str:
        """One line for a notebook: the warning, or why the machine looks quiet."""
        if self.load1 is None:
            return "load average not available on this OS: watch for noisy rows instead"
        return self.warning or (f"machine looks quiet: 1-minute load average {self.load1:.2f} on "
                                f"{self.cores} cores (below {self.threshold:g} × cores)")


def machine_busy(threshold: float = LOAD_THRESHOLD, load1: float | None = None,
                 cores: int | None = None) -> LoadCheck:
    """Check the load *before* measuring: a benchmark's own threads raise it too. ``load1`` and
    ``cores`` default to this machine's (given, they make the check testable)."""
    return LoadCheck(load_average() if load1 is None else float(load1), cores or _cores(), threshold)


def busy_and_total_ticks(path: str = "/proc/stat") -> tuple[int, int]:
    """All CPUs' busy and total clock ticks since boot, from the first line of /proc/stat."""
    with open(path) as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]   # user nice system idle iowait irq softirq steal
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def cpu_busy_fraction(window_s: float = 0.25) -> float | None:
    """The share of all CPUs' time spent busy during a short window in which this process sleeps:
    what other programs use right now (Linux's /proc/stat, a VM's stolen time included; None
    elsewhere). Unlike the load average it does not remember the last minute of our own work: right
    after a 3-minute benchmark the load average still read 1.9 on an idle 2-core machine."""
    try:
        b0, t0 = busy_and_total_ticks()
        time.sleep(window_s)
        b1, t1 = busy_and_total_ticks()
    except (OSError, ValueError):
        return None
    return (b1 - b0) / (t1 - t0) if t1 > t0 else None


def busy_now(share: float = 0.25, window_s: float = 0.25) -> LoadCheck:
    """Is another program using the CPU right now? Busy when more than ``share`` of all cores' time
    was busy during a short idle window (:func:`cpu_busy_fraction`); where that cannot be read, the
    load average (:func:`machine_busy`). ``load1`` holds the busy cores."""
    frac = cpu_busy_fraction(window_s)
    if frac is None:
        return machine_busy()
    return LoadCheck(frac * _cores(), _cores(), share)


def spread(samples: Sequence[float]) -> float | None:
    """p90 / p10 of the repeats (numpy's linear interpolation); None for fewer than two
    positive finite samples."""
    xs = np.asarray([x for x in samples if x is not None], dtype=float)
    xs = xs[np.isfinite(xs)]
    if xs.size < 2:
        return None
    p10, p90 = np.percentile(xs, [10, 90])
    if p10 <= 0:
        return None
    return float(p90 / p10)


def too_wide(p10: float | None, p90: float | None, rel_spread: float = NOISY_SPREAD) -> bool:
    """True when repeats summarized as p10 and p90 spread more than ``rel_spread`` (p90/p10): the
    one test of "something else ran while we measured" every result, table and figure applies."""
    return bool(p10 and p90 and p10 > 0 and p90 / p10 > rel_spread)


def median_p10_p90(xs: Sequence[float]) -> tuple[float, float, float]:
    """The median and the 10th and 90th percentiles of repeats (statistics' inclusive method);
    one sample is all three."""
    import statistics
    xs = list(xs)
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=10, method="inclusive")
    return statistics.median(xs), q[0], q[-1]


def noisy_rows(samples: Mapping[Hashable, Sequence[float]], rel_spread: float = NOISY_SPREAD) -> dict:
    """``{row: spread}`` for the rows whose repeats spread more than ``rel_spread`` (p90/p10),
    in the order given. A row is one measurement repeated (a batch size, a prompt length…)."""
    out = {}
    for key, xs in samples.items():
        s = spread(list(xs))
        if s is not None and too_wide(1.0, s, rel_spread):
            out[key] = s
    return out


def noisy_warning(samples: Mapping[Hashable, Sequence[float]], rel_spread: float = NOISY_SPREAD,
                  max_named: int = 6) -> str | None:
    """A warning naming the noisy rows (the first ``max_named``), else None."""
    bad = noisy_rows(samples, rel_spread)
    if not bad:
        return None
    named = [f"{k} (×{s:.1f})" for k, s in list(bad.items())[:max_named]]
    more = f" and {len(bad) - max_named} more" if len(bad) > max_named else ""
    return (f"noisy measurements (p90/p10 of the repeats above {rel_spread:g}): {', '.join(named)}{more}. "
            f"Something else used the machine while they ran; rerun before reading those rows closely.")


def warnings_for(load: LoadCheck | None = None, samples: Mapping[Hashable, Sequence[float]] | None = None,
                 rel_spread: float = NOISY_SPREAD) -> list[str]:
    """Every busy-machine warning that applies: the load before, the noisy rows after."""
    out = []
    if load is not None and load.warning:
        out.append(load.warning)
    if samples:
        w = noisy_warning(samples, rel_spread)
        if w:
            out.append(w)
    return out


def format_warning(message: str, width: int = 100) -> str:
    """A warning that cannot be missed in a notebook's output."""
    bar = "!" * width
    body = "\n".join(textwrap.wrap("WARNING: " + message, width))
    return f"{bar}\n{body}\n{bar}"


def report(load: LoadCheck | None = None, samples: Mapping[Hashable, Sequence[float]] | None = None,
           rel_spread: float = NOISY_SPREAD, quiet_line: str | None = None) -> None:
    """Print every warning that applies, framed (or ``quiet_line`` when none does). Returns
    nothing, so it can end a notebook cell; :func:`warnings_for` gives the messages."""
    msgs = warnings_for(load, samples, rel_spread)
    for m in msgs:
        print(format_warning(m))
    if not msgs and quiet_line:
        print(quiet_line)


def measurement_threads(device=None, apply: bool = True) -> int | None:
    """torch threads for measuring on ``device``: ``cores − 1`` on a CPU (at least 1), None (torch's
    default) on an accelerator, from the very function ``serve`` uses. With ``apply``, set them."""
    from minillm.core.device import default_server_threads
    n = default_server_threads(None if device is None else str(device))
    if apply and n:
        import torch
        torch.set_num_threads(n)
    return n
