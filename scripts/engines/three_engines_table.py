"""The three-engine table from a `three_engines.sh` run directory: client numbers from bench-serve's
JSON (open loop), each engine's own numbers from its /metrics (bench-serve's `server_view`, the
histogram deltas over the timed run; for llama-server, which has no histograms, its counters' deltas
from the raw scrapes). Not run by CI.

    python scripts/engines/three_engines_table.py runs/three-engines/<stamp> [more runs ...]

With several runs: one row per engine and run, grouped by engine.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

NAMES = {"vllm": "vLLM (CPU)", "llamacpp": "llama.cpp llama-server", "minillm": "minillm serve"}


def counters(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]Inf)$", line.strip())
        if m and not m.group(2):
            out[m.group(1)] = float(m.group(3))
    return out


def ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def engine_view(d: Path, res: dict) -> tuple[str, str, str]:
    """(TTFT, TPOT, ITL) as the engine itself reports them over the open-loop run."""
    sv = res.get("server_view") or {}
    st = sv.get("stages") or {}

    def cell(k: str) -> str:
        s = st.get(k)
        if not s or not s.get("count"):
            return "n/a"
        return f"mean {ms(s['mean_s'])}, p50 ≈ {ms(s['p50_s'])}"
    if any(v and v.get("count") for v in st.values()):
        return cell("ttft"), cell("tpot"), cell("itl")
    b, a = (d / "metrics_before.txt"), (d / "metrics_after.txt")
    if b.exists() and a.exists():
        cb, ca = counters(b.read_text()), counters(a.read_text())
        n = ca.get("llamacpp:tokens_predicted_total", 0) - cb.get("llamacpp:tokens_predicted_total", 0)
        key = "llamacpp:tokens_predicted_seconds_total"
        s = ca.get(key, 0) - cb.get(key, 0)
        if n > 0:   # the seconds are summed over slots: per token of one slot, i.e. a mean TPOT
            return ("n/a (no histogram)",
                    f"mean {s / n * 1e3:.1f} (tokens_predicted_seconds / tokens_predicted)",
                    "n/a (no histogram)")
    return "n/a", "n/a", "n/a"


HEAD = ("| engine | run | version | start-up s | service rate (closed loop, 8 in flight) | offered (0.7×) "
        "| ok / failed of N | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 / p99 ms "
        "| input tok/s | output tok/s | engine's TTFT ms | engine's TPOT ms | engine's ITL ms |")


def row(root: Path, e: str) -> str | None:
    """One engine's row of one run, or None where it has no folder in that run."""
    d = root / e
    if not (d / "open.json").exists():
        return f"| {NAMES[e]} | {root.name} | did not run: see {d / 'server.log'} |" + " |" * 13 \
            if d.exists() else None
    o = json.loads((d / "open.json").read_text())
    c = json.loads((d / "closed.json").read_text())
    v = json.loads((d / "versions.json").read_text()) if (d / "versions.json").exists() else {}
    s, p = o["summary"], o["percentiles_ms"]
    n = s["n_ok"] + s["n_failed"]
    fails = ", ".join(f"{k}: {k2}" for k, k2 in o.get("failures", {}).items())

    def pp(k: str) -> str:
        fmt = ".0f" if p[k]["p50"] >= 10 else ".1f"
        return f"{p[k]['p50']:{fmt}} / {p[k]['p99']:{fmt}}"
    t, tp, it = engine_view(d, o)
    return (f"| {NAMES[e]} | {root.name} | {v.get('version', '?')} | {v.get('startup_s', '?')} "
            f"| {c['summary']['requests_s']:.2f} req/s | {o['config']['request_rate']:.2f} req/s "
            f"| {s['n_ok']} / {s['n_failed']} of {n}{' (' + fails + ')' if fails else ''} "
            f"| {pp('ttft')} | {pp('tpot')} | {pp('itl')} | {pp('e2el')} "
            f"| {s['input_tok_s']:.1f} | {s['output_tok_s']:.1f} | {t} | {tp} | {it} |")


def main(runs: list[str]) -> None:
    print(HEAD)
    print("|" + "---|" * HEAD.count(" | ") + "---|")
    for e in ("vllm", "llamacpp", "minillm"):
        for run in runs:
            r = row(Path(run), e)
            if r:
                print(r)


if __name__ == "__main__":
    main(sys.argv[1:])
