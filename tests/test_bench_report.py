"""The complete report (design.md §4): it refuses to render while a required field is missing,
naming each one, and fills what the run and `minillm serve`'s /v1/server-info know."""
import json

import httpx
import pytest

from minillm.bench.report import REQUIRED, BenchReport, MissingReportFields, fetch_server_info
from minillm.loadgen.bench_serve import BenchConfig, run_bench
from minillm.serving.server import ServerConfig, ServerThread

KEY = "sk-report-0123456789"


def complete() -> BenchReport:
    return BenchReport(model="m", precision="bf16", hardware="H200 SXM", parallel="tp=1",
                       input_lengths="fixed 128", output_lengths="fixed 64", load="4 req/s", warmup=5,
                       prefix_caching=False, n_ok=10, n_failed=0, input_tok_s=1.0, output_tok_s=2.0,
                       requests_s=0.1,
                       latency_ms={m: {"p50": 1.0, "p95": 2.0, "p99": 3.0}
                                   for m in ("ttft", "tpot", "itl", "e2e")})


def test_a_complete_report_renders():
    text = complete().render()
    assert "H200 SXM" in text and "tp=1" in text and "prefix caching off" in text and "p95" in text


@pytest.mark.parametrize("name", ["model", "precision", "hardware", "parallel", "input_lengths",
                                  "output_lengths", "load", "warmup", "prefix_caching"])
def test_each_missing_field_is_refused_by_name(name):
    rep = complete()
    setattr(rep, name, None)
    with pytest.raises(MissingReportFields) as e:
        rep.render()
    assert e.value.missing == [name] and name in str(e.value)


def test_missing_counts_and_percentiles_are_named():
    rep = complete()
    rep.n_failed = None
    del rep.latency_ms["itl"]
    rep.latency_ms["ttft"]["p95"] = float("nan")
    missing = rep.missing()
    assert missing[0] == "requests (ok/failed)"
    assert "ttft p95" in missing[1] and "itl p50" in missing[1] and "itl p99" in missing[1]
    assert len(REQUIRED) == 11


def test_from_a_minillm_run_only_what_the_server_cannot_say_is_missing(capsys, tmp_path):
    srv = ServerThread(ServerConfig(model="tiny", device="cpu", dtype="fp32", port=0, api_keys=[KEY],
                                    max_model_len=256, enable_prefix_caching=False)).start()
    try:
        cfg = BenchConfig(base_url=srv.url, api_key=KEY, num_prompts=6, random_input_len=12,
                          random_output_len=6,
                          ignore_eos=True, request_rate=50, warmup=1, timeout_s=120)
        info = fetch_server_info(cfg)
        assert info["dtype"] == "fp32" and info["prefix_caching"] is False and "CPU" in info["hardware"]
        assert httpx.get(srv.url + "/v1/server-info").status_code == 401          # behind the key
        res = run_bench(cfg)
        rep = BenchReport.from_bench(res, info)
        assert rep.missing() == [] or all(m.startswith("latency") for m in rep.missing())
        assert rep.prefix_caching is False and rep.warmup == 1 and rep.n_ok + rep.n_failed == 6
        assert "50 req/s" in rep.load and "fixed 12" in rep.input_lengths
        bare = BenchReport.from_bench(res, {})                                    # e.g. a vLLM server
        assert {"precision", "hardware", "parallel", "prefix_caching"} <= set(bare.missing())
        stated = BenchReport.from_bench(res, {}, hardware="H200 SXM", parallel="tp=1", precision="bf16",
                                        prefix_caching=True)
        assert not {"precision", "hardware", "parallel", "prefix_caching"} & set(stated.missing())
        from minillm.cli import main  # the CLI prints it, all fields known
        capsys.readouterr()
        rc = main(["bench-serve", "--base-url", srv.url, "--api-key", KEY, "--num-prompts", "4",
                   "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos", "--report",
                   "--report-json", str(tmp_path / "report.json"), "--report-figure", str(tmp_path / "fig"),
                   "--disable-tqdm"])
        out = capsys.readouterr()
        assert rc == 0, out.err
        assert "prefix caching off" in out.out and "parallel tp=1" in out.out and "fp32" in out.out
        saved = json.loads((tmp_path / "report.json").read_text())
        assert saved["missing"] == [] and saved["precision"] == "fp32" and saved["summary"]["n_ok"] >= 1
        assert ((tmp_path / "fig" / "10-6-report.png").exists()
                and (tmp_path / "fig" / "data" / "10-6-report.json").exists())
        # a report that cannot render writes nothing: no JSON, no figure
        bare = BenchReport.from_bench(res, {})
        from minillm.plots.honest import plot_report
        with pytest.raises(MissingReportFields, match="hardware"):
            plot_report(res, bare)
    finally:
        srv.stop()
