"""The complete benchmark report (chapter 10.6, design.md §4): a number without its conditions
cannot be compared, so the report refuses to render while a required field is missing, and says
which.

Required: the model, its precision, the hardware, the parallel configuration, the input and output
length distributions, the load (arrival rate and burstiness, or concurrency), the warm-up, whether
prefix caching was on, how many requests succeeded and failed, and p50/p95/p99 of TTFT, TPOT, ITL
and E2E. ``from_bench`` fills what a ``bench-serve`` run knows and what the server says about
itself (``GET /v1/server-info`` on ``minillm serve``); the user states the rest (``--hardware``,
``--parallel``, ...) for a server that does not say, such as a vLLM deployment.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

REQUIRED = ("model", "precision", "hardware", "parallel", "input_lengths", "output_lengths", "load",
            "warmup", "prefix_caching", "requests", "latency")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
LATENCY_PERCENTILES = ("p50", "p95", "p99")


class MissingReportFields(ValueError):
    def __init__(self, missing: list[str]):
        self.missing = missing
        super().__init__("the report is incomplete, so its numbers cannot be compared with anyone's: missing "
                         + ", ".join(missing)
                         + " (state them, e.g. --hardware 'H200 SXM', --parallel 'tp=1')")


@dataclass
class BenchReport:
    model: str | None = None
    precision: str | None = None
    hardware: str | None = None
    parallel: str | None = None
    input_lengths: str | None = None
    output_lengths: str | None = None
    load: str | None = None
    warmup: int | None = None
    prefix_caching: bool | None = None
    n_ok: int | None = None
    n_failed: int | None = None
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)   # metric → {"p50": ms, ...}
    input_tok_s: float | None = None
    output_tok_s: float | None = None
    requests_s: float | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def missing(self) -> list[str]:
        out = []
        for name in REQUIRED:
            if name == "requests":
                if self.n_ok is None or self.n_failed is None:
                    out.append("requests (ok/failed)")
            elif name == "latency":
                gaps = [f"{m} {p}" for m in LATENCY_METRICS for p in LATENCY_PERCENTILES
                        if not _number(self.latency_ms.get(m, {}).get(p))]
                if gaps:
                    out.append("latency percentiles (" + ", ".join(gaps) + ")")
            elif getattr(self, name) in (None, ""):
                out.append(name)
        return out

    def render(self) -> str:
        """The report as text; raises MissingReportFields (naming them) while any is missing."""
        missing = self.missing()
        if missing:
            raise MissingReportFields(missing)
        lines = [f"model {self.model} ({self.precision}) on {self.hardware}, parallel {self.parallel}",
                 f"input lengths {self.input_lengths}; output lengths {self.output_lengths}",
                 f"load {self.load}; warm-up {self.warmup} requests; prefix caching "
                 f"{'on' if self.prefix_caching else 'off'}",
                 f"requests {self.n_ok} ok / {self.n_failed} failed; throughput in {self.input_tok_s:.1f} "
                 f"tok/s, out {self.output_tok_s:.1f} tok/s, {self.requests_s:.2f} req/s",
                 f"{'(ms)':<6}" + "".join(f"{p:>10}" for p in LATENCY_PERCENTILES)]
        for m in LATENCY_METRICS:
            lines.append(f"{m:<6}" + "".join(f"{self.latency_ms[m][p]:>10.2f}" for p in LATENCY_PERCENTILES))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["missing"] = self.missing()
        return d

    @classmethod
    def from_bench(cls, result, server_info: dict | None = None, **stated: Any) -> "BenchReport":
        """From a ``bench_serve.BenchResult``, the server's own description (``/v1/server-info``),
        and fields the user states (which win over both)."""
        c, s = result.config, result.summary
        info = server_info or {}
        rep = cls(model=result.model, precision=info.get("dtype"), hardware=info.get("hardware"),
                  parallel=info.get("parallel"), prefix_caching=info.get("prefix_caching"),
                  input_lengths=_lengths(c, "input"), output_lengths=_lengths(c, "output"),
                  load=_load(c), warmup=c.warmup, n_ok=s.n_ok, n_failed=s.n_failed,
                  input_tok_s=s.input_tok_s, output_tok_s=s.output_tok_s, requests_s=s.requests_s,
                  latency_ms={m: {p: getattr(getattr(s, m), p) * 1e3 for p in LATENCY_PERCENTILES}
                              for m in LATENCY_METRICS},
                  notes={"endpoint": c.endpoint, "same_prompt": c.same_prompt, "client_side": True})
        for k, v in stated.items():
            if v is not None:
                setattr(rep, k, v)
        return rep


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _lengths(c, which: str) -> str:
    """How the run drew its lengths, in the unit it drew them in (tokens with a tokenizer or for
    outputs, whose max_tokens the server counts; else words, a target)."""
    if c.dataset_name in ("jsonl", "sharegpt"):
        return f"from {c.dataset_path or 'the ShareGPT file minillm ships'} ({c.dataset_name})"
    n = c.random_input_len if which == "input" else c.random_output_len
    unit = "tokens" if which == "output" or c.tokenizer else "words"
    if which == "output":
        unit += " (max_tokens" + (", EOS ignored)" if c.ignore_eos else ")")
    if c.dataset_name == "lognormal":
        return f"lognormal, median {n} {unit}, sigma {c.lognormal_sigma}"
    if c.random_range_ratio:
        return f"uniform {n} ± {c.random_range_ratio:.0%} {unit}"
    return f"fixed {n} {unit}"


def _load(c) -> str:
    parts = []
    if math.isinf(c.request_rate):
        parts.append("all at once")
    else:
        parts.append(f"{c.request_rate:g} req/s, burstiness {c.burstiness:g}"
                     + (" (Poisson)" if c.burstiness == 1 else " (Gamma)"))
    if c.max_concurrency:
        parts.append(f"max concurrency {c.max_concurrency}")
    return ", ".join(parts) + f", {c.num_prompts} requests"


def fetch_server_info(config) -> dict:
    """``GET /v1/server-info`` of the benchmarked server, or {} when it has none (vLLM, SGLang)."""
    import httpx
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    try:
        r = httpx.get(config.base_url.rstrip("/") + "/v1/server-info", headers=headers, timeout=10)
        return r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}
