"""What a diagnosis is made of: its verdict words, its ratio thresholds (never absolute
milliseconds, so the same rules hold on a laptop CPU and on an H200), one check's finding, and the
formatting every check uses. :mod:`minillm.metrics.diagnose` runs the checks."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# Import light on purpose: the CLI builds this command's parser for every command (`doctor` too), so
# nothing here may import torch at module level; 10.5's phase names are the step record's.
CHAPTER_OUTSIDE_SHARE = 0.30   # the chapter's "about 30 %" of a step spent outside the forward (10.5)

START_LATE, STUTTERS, OUTSIDE = "starts late", "stutters", "outside the device"
HEALTHY, NO_DATA = "healthy", "no data"
PREFILL_CAUSE = "another request's prefill"
NO_PREFILL_CAUSE = "pauses without a prefill inside"
GC_CAUSE = "Python's garbage collector"
# Stages in which the request waits rather than being worked on (10.1): what a burst inflates.
WAIT_STAGES = ("queue",)
# Stages before the engine sees the request and after it is done with it: the server's own time.
FRONT_STAGES = ("gateway", "body", "tokenize")
STAGE_HINT = {
    "queue": "it waited for a place in the running batch: a burst, or too little capacity "
             "(max_batch_size, replicas); admission control or chunked prefill shorten the wait (10.1, 10.4)",
    "prefill": "its own prompt's forward pass: a long prompt, or a prefill step shared with long prompts; "
               "prefix caching helps repeated prefixes, chunked prefill protects the others, not this one "
               "(10.4)",
    "gateway": "the server's front end before the engine: auth, rate limits, admission (10.1)",
    "body": "receiving and parsing the request body (10.1, 10.5)",
    "tokenize": "tokenizing the prompt on the host (10.5)",
    "first_token": "sampling the first token and copying it to the host after the prefill, and decoding "
                   "on until a token carries text (10.5)",
}


@dataclass(frozen=True)
class Thresholds:
    """The rules, as ratios. Why these values:

    * ``tail_ratio`` 3: a p99 three times the p50 is a tail, not noise around the median; the same
      ratio for TTFT and ITL (10.2: read p99 against p50, never the mean alone).
    * ``wait_share`` 0.5 and ``wait_steps`` 5: a burst delays *every* request, so TTFT p99/p50 can
      stay below 3 while the queue is the whole story. The tail also starts late when at least half
      its TTFT was queueing and that wait is at least 5 decode steps (ITL p50) long: a request that
      arrives during a step waits for that one step, not for five (10.1).
    * ``long_gap_ratio`` 3: a gap three times the typical one is a stall a reader notices (10.4).
    * ``prefill_share`` 0.5: when most long gaps hold another request's prefill, that is their cause.
    * ``gc_share`` 0.5: when garbage collection fills at least half of the long gaps' excess over
      the p50 gap, the collector is their cause.
    * ``outside_share`` 0.30: the chapter's line for time outside the forward (10.5).
    """
    tail_ratio: float = 3.0
    wait_share: float = 0.5
    wait_steps: float = 5.0
    long_gap_ratio: float = 3.0
    prefill_share: float = 0.5
    gc_share: float = 0.5
    outside_share: float = CHAPTER_OUTSIDE_SHARE


@dataclass
class Finding:
    """One of the three checks. ``lost_s`` is the time the requests lost to it beyond the typical
    (Σ of excess over the p50), the common currency that ranks the two symptoms."""
    check: str                     # START_LATE | STUTTERS | OUTSIDE
    fired: bool
    cause: str | None              # a stage, PREFILL_CAUSE, "host phases", ... (None: nothing to name)
    headline: str                  # the verdict line, if this finding wins
    lost_s: float = 0.0
    evidence: list[str] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Formatting
def fmt_time(seconds: float | None) -> str:
    """A duration the way a person reads it: 812.3 ms, 1.84 s."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    return f"{seconds:.2f} s" if abs(seconds) >= 1 else f"{seconds * 1e3:.1f} ms"


def fmt_pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def ratio_or_inf(a: float, b: float) -> float:
    return a / b if b > 0 else (math.inf if a > 0 else 1.0)


def json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def slo_crossing(budgets: Sequence[float], values: Sequence[float], slo: float) -> float | None:
    """Where a curve (values against budgets) first crosses ``slo`` from below, interpolated on
    log2(budget). None when it never does (all within, or all over, the SLO)."""
    pts = sorted(zip(budgets, values))
    for (b0, v0), (b1, v1) in zip(pts, pts[1:]):
        if v0 <= slo < v1:
            f = (slo - v0) / (v1 - v0)
            return 2 ** (math.log2(b0) + f * (math.log2(b1) - math.log2(b0)))
    return None
