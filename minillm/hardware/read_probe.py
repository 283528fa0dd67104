"""The memory read speed, sampled again between a benchmark's measurements (chapter 10.6).

A decode's bound is bandwidth ÷ bytes per step, and the bandwidth is measured once, at the start of a
run. On a machine that shares its memory with others it does not stay put. On the project's 2-core
AMD EPYC VM the read speed of one and the same 327 MiB buffer (``cpu-small``'s fp32 step) sat at
28–33 GB/s for a while, then at 40–51 GB/s, then back, in stretches of seconds to minutes; two
buffers read in turn moved together, so it is the host's memory traffic, not where a buffer lies
(5 processes × 12 rounds of 2 buffers, 5 passes each: 25–51 GB/s). Two commands that measured the
bound the same way over the same buffer size got 31.9 and 54.3 GB/s minutes apart, for that reason.

So the commands that compare a decode with the bound (``roofline``, ``bench``) keep one buffer of
the bound's size and read it again, a few passes, between their measurements: each row can say what
the memory delivered while it ran, and a run says when the bound moved under it.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from minillm.core.device import host_available_bytes

DRIFT = 1.2          # fastest ÷ slowest sample above which a run says the bound moved
PASSES = 3           # passes per sample: about 25 ms over 327 MiB at 40 GB/s


@dataclass(frozen=True)
class ReadDrift:
    """The read speed samples of one run, in time order (B/s), beside the bound it compares with."""
    samples: tuple[float, ...]
    bound: float | None = None

    @property
    def low(self) -> float | None:
        return min(self.samples) if self.samples else None

    @property
    def high(self) -> float | None:
        return max(self.samples) if self.samples else None

    @property
    def ratio(self) -> float | None:
        """Fastest ÷ slowest sample (1.0: the memory read at one speed throughout)."""
        return self.high / self.low if self.samples and self.low > 0 else None

    @property
    def moved(self) -> bool:
        return self.ratio is not None and self.ratio > DRIFT

    def line(self) -> str:
        """One sentence for a report: the range, and what it means for the % of bound beside it."""
        if not self.samples:
            return "memory read speed not sampled during the run"
        rng = f"{self.low / 1e9:.1f}–{self.high / 1e9:.1f} GB/s over {len(self.samples)} samples"
        bound = f" (the bound's: {self.bound / 1e9:.1f} GB/s)" if self.bound else ""
        if not self.moved:
            return f"memory read speed during the run: {rng}{bound}, steady within ×{DRIFT}"
        return (f"memory read speed MOVED during the run: {rng}, ×{self.ratio:.2f}{bound}. Something outside "
                f"this process shares the memory; a % of the bound is only as good as that, so read each "
                f"row beside the speed measured around it (read_bw_now) and rerun in a steadier hour.")

    def to_dict(self) -> dict:
        return {**asdict(self), "samples": list(self.samples), "low": self.low, "high": self.high,
                "ratio": self.ratio, "moved": self.moved, "drift_limit": DRIFT}


def drift_line(drift: dict) -> str:
    """:meth:`ReadDrift.line` of a drift as a result's JSON keeps it (:meth:`ReadDrift.to_dict`)."""
    return ReadDrift(tuple(drift.get("samples") or ()), drift.get("bound")).line()


class ReadProbe:
    """One buffer of ``nbytes`` (the bound's buffer: ``machine.decode_read_bytes``), held for a run and
    read :data:`PASSES` times a sample, as ``machine.measure_read_bandwidth`` reads it (a sum).

    Only on a CPU: a GPU's memory is its own, and a buffer the size of a large model's step would
    take memory the KV cache needs. Elsewhere, and where the buffer would not fit in an eighth of the
    free memory, :meth:`sample` returns None and the run's :class:`ReadDrift` is empty."""

    def __init__(self, device: torch.device | str, nbytes: int, passes: int = PASSES):
        dev = torch.device(device)
        n = int(nbytes) // 4
        fits = n * 4 <= host_available_bytes() // 8
        self.passes = passes
        self.samples: list[float] = []
        self._buf = torch.ones(n, dtype=torch.float32) if dev.type == "cpu" and n > 0 and fits else None

    @property
    def active(self) -> bool:
        return self._buf is not None

    def sample(self) -> float | None:
        """Read the buffer ``passes`` times; the median pass in B/s (kept in :attr:`samples`)."""
        if self._buf is None:
            return None
        times = []
        for _ in range(self.passes):
            t0 = time.perf_counter()
            self._buf.sum()
            times.append(time.perf_counter() - t0)
        bw = self._buf.numel() * 4 / statistics.median(times)
        self.samples.append(bw)
        return bw

    def drift(self, bound: float | None = None) -> ReadDrift:
        return ReadDrift(tuple(self.samples), bound)

    def close(self) -> None:
        self._buf = None
