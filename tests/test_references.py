"""The shipped reference runs: found by name below figures/reference/, archives skipped, and the
H200 run's files hold what its README says they hold (real provenance, the measured rows)."""
from __future__ import annotations

import json

from minillm.bench.sweep_result import describe_run, load_result
from minillm.experiments import prefill_decode as pd
from minillm.experiments.outside_reference import load_outside_references
from minillm.experiments.references import reference_paths, repository_root

H200 = repository_root() / "figures" / "reference" / "h200"


def test_reference_paths_match_names_in_any_folder_and_skip_archives(tmp_path):
    (tmp_path / "figures" / "reference" / "gpu" / "raw" / "run1").mkdir(parents=True)
    (tmp_path / "runs" / "reference").mkdir(parents=True)
    keep = tmp_path / "figures" / "reference" / "gpu" / "roofline-a.json"
    mine = tmp_path / "runs" / "reference" / "roofline-b.json"
    for p in (keep, mine, tmp_path / "figures" / "reference" / "gpu" / "raw" / "run1" / "roofline-a.json",
              tmp_path / "figures" / "reference" / "gpu" / "outside-graphs-x.json"):
        p.write_text("{}")
    assert reference_paths("roofline-*.json", base=tmp_path) == [keep, mine]
    assert reference_paths("roofline-*.json", roots=("nowhere",), base=tmp_path) == []


def test_the_h200_roofline_reference_is_a_real_gpu_run():
    paths = reference_paths("roofline-*.json")
    assert H200 / "roofline-llama-3.1-8b-bf16-cuda.json" in paths
    assert not any("raw" in p.relative_to(repository_root()).parts for p in paths)
    r = load_result(H200 / "roofline-llama-3.1-8b-bf16-cuda.json")
    assert r["hardware"]["name"] == "NVIDIA H200" and r["torch_version"].startswith("2.11.0+cu")
    assert r["cuda_graphs"] and r["model"] == "llama-3.1-8b" and r["dtype"] == "bf16"
    ok = {b["batch"]: b for b in r["batches"] if b["status"] == "ok"}
    assert sorted(ok) == [1, 2, 4, 8, 16, 32, 48, 64, 128, 256]
    # what the README and notebooks quote: 163.6 tok/s = 60 % of the bound at batch 1, no knee
    assert round(ok[1]["per_request_tok_s"], 1) == 163.6 and round(100 * ok[1]["pct_of_bound"]) == 60
    assert r["measured_knee"] is None
    assert all(ok[a]["aggregate_tok_s"] < ok[b]["aggregate_tok_s"]
               for a, b in zip(sorted(ok), sorted(ok)[1:]))
    assert describe_run(r)


def test_the_h200_prefill_decode_and_outside_references_load():
    refs = [r for r in pd.load_prefill_decode_references() if "h200" in r["_path"]]
    assert len(refs) == 1 and refs[0]["roofline"]["model"] == "llama-3.1-8b"
    pre = {p["tokens"]: p for p in refs[0]["roofline"]["prefill"]}
    assert 4096 in pre and 8192 in pre
    found = load_outside_references()
    for kind in ("outside-graphs", "outside-sampling", "outside-phases"):
        (path, doc), = [(p, d) for p, d in found[kind] if p.parent == H200]
        assert "NVIDIA H200" in doc["provenance"]["hardware"], kind
    assert not [p for p, _ in found["outside-profile"] if p.parent == H200]   # only in raw/: README says why


def test_the_h200_readme_names_every_drawn_file_and_its_run():
    text = (H200 / "README.md").read_text()
    drawn = sorted(p.name for p in H200.iterdir() if p.is_file() and p.suffix in (".json", ".csv", ".png"))
    assert drawn and all(name.removesuffix(".csv").removesuffix(".json") in text or name in text
                         for name in drawn)
    for run in sorted((H200 / "raw").iterdir()):
        assert run.name in text and (run / "provenance.txt").exists() and (run / "gpu-check.log").exists()
        assert "NVIDIA H200" in (run / "provenance.txt").read_text()
    bench = json.loads((H200 / "bench-graphs.json").read_text())
    assert bench["device"] == "cuda" and bench["results"][0]["name"] == "minillm"
