"""The GPU reference run of chapter 10.5, and reading it back.

    python -m minillm.experiments.outside_reference --out DIR            # on a CUDA machine

writes, each with its provenance (host, hardware, versions, command, every sample):

- ``outside-graphs-<gpu>.json``: engine decode eager vs CUDA graphs, tiny and the llama-3.1-8b
  twin at batch 1, 8, 64 (tok/s, % of the bandwidth bound, device busy, launches per step);
- ``outside-sampling-<gpu>.json``: sampling cost per step at vocabularies 8k and 128k, batch
  1 … 64, batched sampler and the per-row loop before it;
- ``outside-profile-<gpu>.json``: ``profile_steps`` on tiny at batch 1, eager and with graphs;
- ``outside-phases-<gpu>.json``: the step phases of tiny and the 8B twin at batch 1 and 32.

Commit them under ``figures/reference/``: notebook 05 draws them beside the learner's own run.
Only real runs: nothing in those files is typed in.
"""
from __future__ import annotations

import argparse
import platform
import re
import shlex
import socket
import sys
import time
from pathlib import Path

REFERENCE_DIRS = ("figures/reference", "runs/reference")
KINDS = ("outside-graphs", "outside-sampling", "outside-profile", "outside-phases")


def provenance(device, command: str = "") -> dict:
    import torch

    from minillm.hardware.machine import describe_hardware
    return {"host": socket.gethostname(), "hardware": describe_hardware(device).summary(), "device": str(device),
            "torch": torch.__version__, "cuda": str(torch.version.cuda), "python": platform.python_version(),
            "command": command or " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def write_reference(out_dir: str | Path, kind: str, result: dict, device, command: str = "") -> Path:
    """``{"kind", "provenance", "result"}`` as strict JSON in ``out_dir/<kind>-<gpu>.json``."""
    from minillm.bench.sweep import dumps_strict
    from minillm.hardware.machine import describe_hardware

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9.]+", "-", describe_hardware(device).name).strip("-") or "device"
    path = out / f"{kind}-{name}.json"
    path.write_text(dumps_strict({"kind": kind, "provenance": provenance(device, command), "result": result}))
    return path


def load_references(dirs: list[str | Path] | tuple = REFERENCE_DIRS, root: str | Path | None = None
                    ) -> dict[str, list[tuple[Path, dict]]]:
    """Every ``outside-*.json`` below ``dirs`` (relative to ``root``, default the repository; ``raw``
    archives skipped), by kind: ``{kind: [(path, {"kind", "provenance", "result"}), ...]}``.
    Empty lists when none."""
    from minillm.bench.sweep import load_result
    from minillm.experiments.references import reference_paths

    found: dict[str, list[tuple[Path, dict]]] = {k: [] for k in KINDS}
    for p in reference_paths("outside-*.json", tuple(dirs), root):
        try:
            doc = load_result(p)
        except (OSError, ValueError):
            continue
        if doc.get("kind") in found:
            found[doc["kind"]].append((p, doc))
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minillm.experiments.outside_reference", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the JSON files")
    ap.add_argument("--models", default="tiny,llama-3.1-8b", help="graphs comparison and phases (comma-separated)")
    ap.add_argument("--batches", default="1,8,64", help="graphs comparison batches")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--vocabs", default="8192,128256", help="sampling vocabularies")
    ap.add_argument("--sampling-batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--only", default=",".join(k.removeprefix("outside-") for k in KINDS),
                    help="which parts: graphs,sampling,profile,phases")
    ap.add_argument("--profile-model", default="tiny", help="the model profile_steps runs (batch 1)")
    ap.add_argument("--profile-top", type=int, default=10, help="rows of the profile's op table")
    ap.add_argument("--allow-cpu", action="store_true", help="a dry run on a CPU (skips graphs)")
    a = ap.parse_args(argv)

    from minillm.core.device import pick_device
    dev = pick_device(None)
    if dev.type != "cuda" and not a.allow_cpu:
        print(f"no CUDA device (found {dev}): this is the GPU reference run; --allow-cpu for a dry run",
              file=sys.stderr)
        return 2
    parts = {p.strip() for p in a.only.split(",") if p.strip()}
    models = [m for m in a.models.split(",") if m]
    batches = [int(b) for b in a.batches.split(",") if b]
    cmd = " ".join(shlex.quote(x) for x in ["python", "-m", "minillm.experiments.outside_reference", *(argv or sys.argv[1:])])
    written = []
    loaded: dict = {}          # each twin built once, shared by the graphs comparison and the phases
    if parts & {"graphs", "phases"}:
        from minillm.core.device import default_dtype
        from minillm.model.loader import load_model
        for m in models:
            loaded[m] = load_model(m, dev, default_dtype(dev), 0)

    if "graphs" in parts and dev.type == "cuda":
        from minillm.experiments.outside_graphs import run_graphs_comparison
        print("== engine decode, eager vs CUDA graphs", flush=True)
        g = run_graphs_comparison(models, batches, context=a.context, steps=a.steps, command=cmd, loaded=loaded)
        print(g.table(), flush=True)
        written.append(write_reference(a.out, "outside-graphs", g.to_dict(), dev, cmd))

    if "sampling" in parts:
        from minillm.experiments.outside_sampling import run_sampling_bench
        print("== sampling cost, 8k and 128k vocabularies", flush=True)
        s = run_sampling_bench([int(b) for b in a.sampling_batches.split(",") if b],
                               [int(v) for v in a.vocabs.split(",") if v], repeats=10, budget_s=2.0, command=cmd)
        print(s.table(), "\n", s.speedup_table(), flush=True)
        written.append(write_reference(a.out, "outside-sampling", s.to_dict(), dev, cmd))

    if "profile" in parts:
        from minillm.experiments.outside_profile import profile_decode
        print(f"== profile_steps: {a.profile_model}, batch 1, eager and with graphs", flush=True)
        profs = {}
        for mode in (("eager", "graphs") if dev.type == "cuda" else ("eager",)):
            p = profile_decode(a.profile_model, batch=1, context=a.context, n_steps=20,
                               enforce_eager=mode == "eager", top=a.profile_top)
            print(mode, p.summary(), p.op_table(a.profile_top), sep="\n", flush=True)
            profs[mode] = p.to_dict()
        written.append(write_reference(a.out, "outside-profile", {"model": a.profile_model, "batch": 1,
                                                                  "context": a.context, "profiles": profs}, dev, cmd))

    if "phases" in parts:
        from minillm.experiments.outside_steps import measure_phase_cases, phase_table
        print("== step phases", flush=True)
        cases = measure_phase_cases(tuple(models), (1, 32), context=a.context, steps=a.steps, loaded=loaded)
        print(phase_table(cases), flush=True)
        written.append(write_reference(a.out, "outside-phases", {"cases": [c.to_dict() for c in cases]}, dev, cmd))

    for p in written:
        print("wrote", p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
