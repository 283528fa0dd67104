"""The memory read speed, sampled again between a benchmark's measurements (chapter 10.6).

A decode's bound is bandwidth ÷ bytes per step, and the bandwidth is measured once, at the start of a
run. On a machine that shares its memory with others it does not stay put. On the project's 2-core
AMD EPYC VM the read speed of one and the same 327 MiB buffer (``cpu-small``'s fp32 step) sat at
25–35 GB/s for a while, then at 39–51 GB/s, then back, in stretches of seconds to minutes; two
buffers read in turn moved together, so it is mostly the host's memory traffic (5 processes × 12
rounds of 2 buffers, 5 passes each: 25–51 GB/s). Two commands that measured the bound the same way
over the same buffer size got 31.9 and 54.3 GB/s minutes apart, for that reason.

So the commands that compare a decode with the bound (``roofline``, ``bench``) measure it again, the
same way with fewer passes, between their measurements: each row can say what the memory delivered
around it, and a run says when the bound moved under it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from minillm.core.device import host_available_bytes
from minillm.hardware.machine import measure_read_bandwidth

DRIFT = 1.2          # fastest ÷ slowest sample above which a run says the bound moved
PASSES = 3           # timed passes per sample, after one untimed (the bound's measurement takes 10)


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
                f"this process shares the memory, so every % of the bound is off by up to that much; what "
                f"was measured interleaved (engines, paths) still compares. Rerun in a steadier hour.")

    def to_dict(self) -> dict:
        return {**asdict(self), "samples": list(self.samples), "low": self.low, "high": self.high,
                "ratio": self.ratio, "moved": self.moved, "drift_limit": DRIFT}


def drift_line(drift: dict) -> str:
    """:meth:`ReadDrift.line` of a drift as a result's JSON keeps it (:meth:`ReadDrift.to_dict`)."""
    return ReadDrift(tuple(drift.get("samples") or ()), drift.get("bound")).line()


class ReadProbe:
    """The bound's measurement (``machine.measure_read_bandwidth`` over ``nbytes``, the bound's buffer:
    ``machine.decode_read_bytes``), repeated with fewer passes between a run's measurements.

    Each sample reads a freshly allocated buffer, as the bound's measurement does, so that the two are
    comparable. Where a buffer lies does matter a little: a buffer allocated minutes earlier read 26–28
    GB/s while fresh ones read 27–33 in the same seconds (the AMD EPYC VM, four rounds), so a buffer held
    for the run would read below the bound on a steady machine and flag it.

    Only on a CPU: a GPU's memory is its own, and a buffer the size of a large model's step would take
    memory the KV cache holds. Elsewhere, and where the buffer would not fit in an eighth of the free
    memory, :meth:`sample` returns None and the run's :class:`ReadDrift` is empty."""

    def __init__(self, device: torch.device | str, nbytes: int, passes: int = PASSES):
        self.device = torch.device(device)
        self.nbytes = int(nbytes)
        self.passes = passes
        self.samples: list[float] = []
        self._on = (self.device.type == "cpu" and self.nbytes >= 2**20
                    and self.nbytes <= host_available_bytes() // 8)

    @property
    def active(self) -> bool:
        return self._on

    def sample(self) -> float | None:
        """One read-bandwidth measurement (one untimed pass, ``passes`` timed), in B/s, kept in
        :attr:`samples`."""
        if not self._on:
            return None
        bw = measure_read_bandwidth(self.device, nbytes=self.nbytes, repeats=self.passes, warmup=1,
                                    name_pages=False).value
        self.samples.append(bw)
        return bw

    def drift(self, bound: float | None = None) -> ReadDrift:
        return ReadDrift(tuple(self.samples), bound)

    def close(self) -> None:
        self._on = False
