"""Published GPU measurements (figures/reference/published/): each file names its source (URL,
engine, hardware) and quotes its numbers verbatim; figure 10-3's formula panel draws them, with this
project's H200 run, and its data JSON records which were drawn (chapter 10.3)."""
from __future__ import annotations

import json

import pytest

from minillm.core.result import restore_nonfinite
from minillm.experiments.references import (
    check_published,
    load_published_references,
    load_roofline_references,
    repository_root,
)

PUBLISHED = repository_root() / "figures" / "reference" / "published"
FIGURE_DATA = repository_root() / "figures" / "data" / "10-3-decode-roofline.json"


def _read(path) -> dict:
    return json.loads(path.read_text(), object_hook=restore_nonfinite)


def test_every_published_file_names_its_source_and_quotes_its_numbers():
    files = sorted(PUBLISHED.glob("*.json"))
    assert len(files) >= 2
    for path in files:
        doc = json.loads(path.read_text())
        assert check_published(doc) == [], path.name
        assert doc["url"].startswith("https://") and doc["gpus"] == 1, path.name
        for pt in doc["points"]:
            assert pt["tok_s"] > 0 and pt["batch"] >= 1 and pt["dtype"] in ("bf16", "fp16"), path.name
            assert pt["metric"] == "per_request" or pt["batch"] > 1, path.name


def test_the_check_refuses_a_file_without_a_url_or_with_a_number_not_in_its_quote():
    good = {"source": "s", "url": "https://x", "engine": "e", "hardware": "h",
            "points": [{"model": "m", "dtype": "bf16", "batch": 1, "metric": "per_request",
                        "tok_s": 104.9, "gb_s": 1397.31, "quote": "| Llama | Base | 104.9 | 1397.31 |"}]}
    assert check_published(good) == []
    assert check_published({**good, "url": ""}) == ["no url"]
    typed = {**good, "points": [{**good["points"][0], "tok_s": 105.0}]}
    assert check_published(typed) == ["point 0: tok_s 105 is not in its quote"]
    unnamed = {**good, "points": [{**good["points"][0], "metric": "total"}]}
    assert "not per_request or aggregate" in check_published(unnamed)[0]


def test_the_published_loader_has_the_reference_loaders_shape(tmp_path):
    published, runs = load_published_references(), load_roofline_references()
    assert published and runs
    for d in published + runs:
        assert isinstance(d, dict) and d["_path"].endswith(".json")
    (tmp_path / "figures" / "reference" / "published").mkdir(parents=True)
    (tmp_path / "figures" / "reference" / "published" / "bad.json").write_text('{"url": "https://x"}')
    with pytest.raises(ValueError, match="no engine"):
        load_published_references(base=tmp_path)
    assert load_published_references(base=tmp_path / "nowhere") == []


def test_gpt_fast_batch_one_numbers_are_the_readmes():
    doc = json.loads((PUBLISHED / "gpt-fast-a100.json").read_text())
    pts = {p["model"]: p for p in doc["points"]}
    assert pts["Llama-3.1-8B"]["tok_s"] == 93.89 and pts["Llama-3.1-8B"]["gb_s"] == 1410.76
    assert pts["Llama-2-7B"]["tok_s"] == 104.9 and "330W" in doc["hardware_quote"]


def test_the_committed_figure_data_keeps_the_measurement_and_records_the_formula_panel():
    d = _read(FIGURE_DATA)
    assert d["model"] == "cpu-small" and [b["batch"] for b in d["batches"]][:3] == [1, 2, 4]
    panel = d["formula_panel"]
    assert panel["kind"].startswith("formula, datasheet numbers") and panel["batches"][-1] == 512
    cards = {c["gpu"]: c for c in panel["cards"]}
    assert cards["H100 PCIe 80GB"]["bandwidth"] == 2.0e12 and "H200 SXM 141GB" in cards
    h100 = cards["H100 PCIe 80GB"]["weights_only"]["per_request_tok_s"]
    assert h100[0] == pytest.approx(h100[6], rel=1e-3)        # flat to 64: far below B* ≈ 378
    assert h100[-1] < h100[0]                                      # past B*: the step turns compute-bound
    drawn = {(r["kind"], r["path"]) for r in d["references_drawn"]}
    assert ("published", "figures/reference/published/gpt-fast-a100.json") in drawn
    h200 = "figures/reference/h200/roofline-llama-3.1-8b-bf16-cuda.json"
    assert ("measured run of this engine", h200) in drawn
    files = {f"figures/reference/published/{p.name}" for p in PUBLISHED.glob("*.json")}
    assert files <= {p for _, p in drawn}


def test_redraw_from_the_data_file_measures_nothing_and_keeps_the_measurement(tmp_path):
    import matplotlib
    matplotlib.use("Agg")

    from minillm.cli import main
    rc = main(["roofline", "--redraw", str(FIGURE_DATA), "--figures", str(tmp_path)])
    assert rc == 0 and (tmp_path / "10-3-decode-roofline.png").stat().st_size > 1000
    before, after = _read(FIGURE_DATA), _read(tmp_path / "data" / "10-3-decode-roofline.json")
    measurement = [k for k in before if k not in ("formula_panel", "references_drawn")]
    assert all(after[k] == before[k] for k in measurement)
    assert len(after["references_drawn"]) == len(before["references_drawn"])
    assert main(["roofline", "--redraw", str(tmp_path / "missing.json"), "--figures", str(tmp_path)]) == 2


def test_a_reference_loaded_without_its_path_records_no_folder_in_its_place(tmp_path, monkeypatch):
    from minillm.plots.roofline import references_drawn
    monkeypatch.chdir(tmp_path)                   # a notebook runs from notebooks/: its cwd is not the file
    ref = {"batches": [], "hardware": {"summary": "a GPU"}, "device": "cuda", "model": "llama-3.1-8b",
           "dtype": "bf16"}
    assert references_drawn([ref], None)[0]["path"] == ""
    ref["_path"] = str(FIGURE_DATA)
    assert references_drawn([ref], None)[0]["path"] == "figures/data/10-3-decode-roofline.json"
