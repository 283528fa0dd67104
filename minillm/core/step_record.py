"""StepRecord: what one engine step did and where its time went (chapter 10.5's raw data, as
traces are 10.2's). One record per step, kept in a bounded ring buffer (``engine.step_history``,
served as ``GET /v1/steps``).

The phases are consecutive host timestamps, so they add up to the step's wall time:

    start ─schedule─► scheduled ─prepare─► prepared ─forward issue─► issued ─device─► device_done
          ─sample─► sampled ─output─► processed

- *forward issue*: the host walking the model and launching its kernels (on a CPU the kernels
  run as they are issued, so this is the whole forward);
- *device*: waiting for the device to finish (a synchronize; 0 with ``sync_timing=False``, and
  the wait then lands in *sample*, whose host read is the step's one sync);
- ``device_ms``: the forward's device time from CUDA events (None on a CPU: there the
  forward's wall time is ``forward_issue_ms``).
- ``gc_ms``: how long Python's garbage collector held the GIL during the step
  (:mod:`minillm.engine.gc_pauses`), inside whichever phase it interrupted; ``gc_output_ms`` is
  the part after the sampled mark, which delays the *next* token. An upper bound on what the
  collector cost the step: an operator already running in C++ (which releases the GIL) goes on.
"""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

PHASES = ("schedule", "prepare", "forward_issue", "device", "sample", "output")
OUTSIDE_PHASES = ("schedule", "prepare", "sample", "output")     # around the model's forward (10.5)
FORWARD_PHASES = ("forward_issue", "device")
PHASE_LABELS = {"schedule": "schedule", "prepare": "prepare inputs", "forward_issue": "forward issue",
                "device": "device (wait)", "sample": "sample", "output": "output processing"}


@dataclass
class StepRecord:
    step: int
    t_start_ns: int
    t_ns: list[int] = field(default_factory=list)   # end of each phase, in PHASES order
    num_rows: int = 0
    num_decode_rows: int = 0
    num_prefill_rows: int = 0
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    num_sampled: int = 0
    cuda_graph: bool = False       # the forward was a CUDA-graph replay
    bucket: tuple[int, int] | None = None   # (rows, K/V length) of the static decode shape
    device_ms: float | None = None
    compile_ms: float | None = None   # this step compiled its decode bucket first (EngineConfig.compile)
    gc_ms: float = 0.0                # garbage collection during the step (inside its phases)
    gc_output_ms: float = 0.0         # the part of gc_ms after the sampled mark (the output phase)
    error: str | None = None

    def mark(self, t_ns: int) -> None:
        self.t_ns.append(t_ns)

    @property
    def phase_ms(self) -> dict[str, float]:
        ends = self.t_ns
        starts = [self.t_start_ns, *ends[:-1]]
        return {name: (e - s) / 1e6 for name, s, e in zip(PHASES, starts, ends)}

    @property
    def wall_ms(self) -> float:
        return (self.t_ns[-1] - self.t_start_ns) / 1e6 if self.t_ns else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["phase_ms"] = self.phase_ms
        d["wall_ms"] = self.wall_ms
        return d


class StepHistory(deque):
    """The last N StepRecords (a deque with a maximum length)."""

    def __init__(self, maxlen: int):
        super().__init__(maxlen=maxlen)

    def to_records(self, limit: int | None = None) -> list[dict]:
        items = list(self)[-limit:] if limit else list(self)
        return [r.to_dict() for r in items]
