"""The GPU reference run of chapter 10.5, and reading it back.

    python -m minillm outside-reference --out DIR            # on a CUDA machine

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
    return {"host": socket.gethostname(), "hardware": describe_hardware(device).summary(),
            "device": str(device),
            "torch": torch.__version__, "cuda": str(torch.version.cuda), "python": platform.python_version(),
            "command": command or " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def write_reference(out_dir: str | Path, kind: str, result: dict, device, command: str = "") -> Path:
    """``{"kind", "provenance", "result"}`` as strict JSON in ``out_dir/<kind>-<gpu>.json``."""
    from minillm.core.result import dumps_strict
    from minillm.hardware.machine import describe_hardware

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9.]+", "-", describe_hardware(device).name).strip("-") or "device"
    path = out / f"{kind}-{name}.json"
    path.write_text(dumps_strict({"kind": kind, "provenance": provenance(device, command), "result": result}))
    return path


def load_outside_references(dirs: list[str | Path] | tuple = REFERENCE_DIRS, root: str | Path | None = None
                    ) -> dict[str, list[tuple[Path, dict]]]:
    """Every ``outside-*.json`` below ``dirs`` (relative to ``root``, default the repository; ``raw``
    archives skipped), by kind: ``{kind: [(path, {"kind", "provenance", "result"}), ...]}``.
    Empty lists when none."""
    from minillm.bench.sweep_result import load_result
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


def run_reference(out: str | Path, models: str = "tiny,llama-3.1-8b", batches: str = "1,8,64",
                  context: int = 512,
                  steps: int = 30, vocabs: str = "8192,128256", sampling_batches: str = "1,2,4,8,16,32,64",
                  only: str = ",".join(k.removeprefix("outside-") for k in KINDS),
                  profile_model: str = "tiny",
                  profile_top: int = 10, allow_cpu: bool = False, command: str = "") -> int:
    """Everything 10.5 measures on a GPU, each part to its JSON (``python -m minillm outside-reference``).
    Returns 2, printing why, when no CUDA device is there and ``allow_cpu`` (a dry run) is off."""
    from types import SimpleNamespace
    a = SimpleNamespace(out=out, models=models, batches=batches, context=context, steps=steps, vocabs=vocabs,
                        sampling_batches=sampling_batches, only=only, profile_model=profile_model,
                        profile_top=profile_top, allow_cpu=allow_cpu)
    from minillm.core.device import pick_device
    dev = pick_device(None)
    if dev.type != "cuda" and not a.allow_cpu:
        print(f"no CUDA device (found {dev}): this is the GPU reference run; --allow-cpu for a dry run",
              file=sys.stderr)
        return 2
    parts = {p.strip() for p in a.only.split(",") if p.strip()}
    models = [m for m in a.models.split(",") if m]
    batches = [int(b) for b in a.batches.split(",") if b]
    cmd = command or "python -m minillm outside-reference"
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
        g = run_graphs_comparison(models, batches, context=a.context, steps=a.steps, command=cmd,
                                  loaded=loaded)
        print(g.table(), flush=True)
        written.append(write_reference(a.out, "outside-graphs", g.to_dict(), dev, cmd))

    if "sampling" in parts:
        from minillm.experiments.outside_sampling import run_sampling_bench
        print("== sampling cost, 8k and 128k vocabularies", flush=True)
        s = run_sampling_bench([int(b) for b in a.sampling_batches.split(",") if b],
                               [int(v) for v in a.vocabs.split(",") if v], repeats=10, budget_s=2.0,
                               command=cmd)
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
                                                                  "context": a.context, "profiles": profs},
                                       dev, cmd))

    if "phases" in parts:
        from minillm.experiments.outside_steps import measure_phase_cases, phase_table
        print("== step phases", flush=True)
        cases = measure_phase_cases(tuple(models), (1, 32), context=a.context, steps=a.steps, loaded=loaded)
        print(phase_table(cases), flush=True)
        written.append(write_reference(a.out, "outside-phases", {"cases": [c.to_dict() for c in cases]}, dev,
                                       cmd))

    for p in written:
        print("wrote", p)
    return 0


