"""``python -m minillm <command>``: roofline (the main job), generate, bench, serve, bench-http, bench-engine, doctor."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


def _add_model_args(p: argparse.ArgumentParser, default_model: str | None = "tiny") -> None:
    p.add_argument("--model", default=default_model,
                   help="a preset (tiny, cpu-small, llama-3.2-1b, llama-3.1-8b, qwen2.5-0.5b, qwen2.5-7b: "
                        "shape twins with random weights), a checkpoint directory, or a hub id")
    p.add_argument("--device", default=None, help="cuda, mps or cpu (default: the first available)")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp16 on MPS, fp32 on CPU)")


# Engine flags are generated from EngineConfig, one per field, spelled as vLLM spells them
# (``--max-num-batched-tokens``, ``--no-enable-prefix-caching``): a new engine option gets its
# flag with no CLI code. These fields have flags of their own, or mean something else here
# (``generate --seed`` seeds the sampling, EngineConfig.seed a shape twin's weights).
def _add_engine_args(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """EngineConfig's flags (``EngineConfig.add_arguments``). minillm.engine imports torch, and a
    broken torch must not stop ``doctor``: then the commands have no engine flags."""
    try:
        from minillm.engine.config import EngineConfig
    except (ImportError, OSError):
        return
    EngineConfig.add_arguments(p, defaults)


_GENERATE_ENGINE = {"max_batch_size": 1}      # one request: one KV slot is all it needs


def cmd_generate(a: argparse.Namespace) -> int:
    from minillm.core.device import dtype_bytes
    from minillm.engine import LLM, RequestError
    from minillm.engine.config import EngineConfig
    from minillm.engine.sampling import SamplingParams
    from minillm.perf.roofline import decode_step_bytes
    try:
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k,
                                top_p=a.top_p, seed=a.seed, stop=a.stop or [], ignore_eos=a.ignore_eos)
        config = EngineConfig.from_args(a, exclude=("seed",), **_GENERATE_ENGINE)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    llm = LLM(config=config)
    if llm.is_shape_twin:
        print(f"[{a.model} is a shape twin: random weights, so the text is gibberish; the timings are real]",
              file=sys.stderr)
    try:
        for delta in llm.stream(a.prompt, params):
            print(delta, end="", flush=True)
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print()
    out = llm.last_output
    m = out.metrics
    cfg = llm.model.config
    ctx = len(out.prompt_token_ids) + len(out.token_ids) // 2
    step_bytes = decode_step_bytes(cfg, dtype_bytes(llm.dtype), 1, ctx)
    from minillm.core.device import dtype_name
    lines = [f"model {a.model} ({dtype_name(llm.dtype)}) on {llm.device} | prompt {m.prompt_tokens} tokens, "
             f"output {m.output_tokens} tokens, finish: {out.finish_reason}",
             f"TTFT {m.ttft_s * 1e3:.1f} ms"]
    if m.tpot_s:
        lines.append(f"TPOT {m.tpot_s * 1e3:.2f} ms → {1 / m.tpot_s:.1f} tok/s decode; achieved bandwidth "
                     f"{step_bytes / m.tpot_s / 1e9:.2f} GB/s ({step_bytes / 1e6:.1f} MB read per step)")
    lines.append(f"E2E {m.e2e_s * 1e3:.1f} ms → {m.output_tokens / m.e2e_s:.1f} tok/s overall")
    print("\n".join(lines), file=sys.stderr)
    return 0


def _write_json(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2))
    print(f"wrote {path}")


def cmd_bench(a: argparse.Namespace) -> int:
    if a.peers:
        from minillm.bench.peers import run_peers
        engines = ("minillm",) + (() if a.no_transformers else ("transformers",)) + ("llama.cpp",)
        rep = run_peers(model=a.model, device=a.device, dtype=a.dtype, prompt_tokens=a.prompt_tokens,
                        new_tokens=a.new_tokens, rounds=a.rounds, engines=engines, compile=a.compile,
                        gguf_path=a.gguf, progress=True)
    else:
        from minillm.bench.decode import run_decode_benchmark
        rep = run_decode_benchmark(model=a.model, device=a.device, dtype=a.dtype, prompt_tokens=a.prompt_tokens,
                                   new_tokens=a.new_tokens, repeats=a.repeats,
                                   compare_transformers=not a.no_transformers, enforce_eager=a.enforce_eager,
                                   compile=a.compile)
    print(rep.table())
    if a.json:
        _write_json(a.json, rep.to_dict())
    return 0


def cmd_roofline(a: argparse.Namespace) -> int:
    import shlex

    from minillm.bench.sweep import default_batches, load_result, parse_batches, run_sweep
    from minillm.plots.figures import figures_dir
    from minillm.plots.roofline import save_roofline_figure
    try:
        batches = parse_batches(a.batches) if a.batches else default_batches(a.max_batch)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:                          # where the figure will go: checked, with --out, before the sweep starts
        figs = figures_dir(a.figures)
    except OSError as e:
        print(f"error: cannot write the figure to {a.figures or 'the default figures directory'}: {e}", file=sys.stderr)
        return 2
    res = run_sweep(model=a.model, device=a.device, dtype=a.dtype, batches=batches, context=a.context,
                    warmup=a.warmup, steps=a.steps, cuda_graphs=not a.no_cuda_graphs,
                    command="python -m minillm " + " ".join(shlex.quote(x) for x in sys.argv[1:]),
                    partial_path=Path(a.out) / "roofline-partial.jsonl", out_dir=a.out, figures_dir=figs)
    print(res.table())
    jp, cp = res.write(a.out)
    refs = [load_result(p) for p in (a.reference or [])]
    figs = save_roofline_figure(res.to_dict(), refs, out_dir=a.figures)
    print(f"data: {jp}  {cp}")
    print(f"figure: {'  '.join(map(str, figs))}")
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from minillm.engine.config import EngineConfig
    from minillm.serving.server import config_from_args, serve
    try:
        cfg = config_from_args(a, EngineConfig.from_args(a))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    serve(cfg, host=a.host, port=a.port)
    return 0


def cmd_bench_http(a: argparse.Namespace) -> int:
    from minillm.loadgen.http_overhead import run_http_overhead
    rep = run_http_overhead(model=a.model, device=a.device, dtype=a.dtype, n_requests=a.requests,
                            prompt_tokens=a.prompt_tokens, max_tokens=a.max_tokens, warmup=a.warmup, mode=a.mode,
                            torch_threads=a.torch_threads)
    print(rep.table())
    if a.json:
        _write_json(a.json, rep.to_dict())
    return 0


def cmd_bench_engine(a: argparse.Namespace) -> int:
    from minillm.bench.engine import run_engine_bench
    parts = tuple(x.strip() for x in a.parts.split(",") if x.strip())
    unknown = set(parts) - {"stall", "prefix", "packed"}
    if unknown or not parts:
        print(f"error: --parts takes stall, prefix, packed (comma-separated), got {a.parts!r}", file=sys.stderr)
        return 2
    rep = run_engine_bench(model=a.model, device=a.device, dtype=a.dtype, n_short=a.n_short,
                           long_prompt=a.long_prompt, chunk=a.chunk, prefix_prompt=a.prefix_prompt,
                           repeats=a.repeats, parts=parts)
    print(rep.table())
    if a.json:
        _write_json(a.json, rep.to_dict())
    return 0


def cmd_bench_server(a: argparse.Namespace) -> int:
    from minillm.loadgen.server_load import run_server_load
    reps = [run_server_load(model=a.model, connections=a.connections, duration_s=a.duration, rounds=a.rounds,
                            trace_store_bytes=b, port=a.port, torch_threads=a.torch_threads)
            for b in a.trace_store_bytes]
    for rep in reps:
        print(rep.table())
    if reps[0].wrk is None:
        print("wrk is not on the PATH (Debian/Ubuntu: apt install wrk): requests/s not measured", file=sys.stderr)
    if a.json:
        _write_json(a.json, {"runs": [r.to_dict() for r in reps]})
    return 0


def cmd_bench_serve(a: argparse.Namespace) -> int:
    import math
    import os

    from minillm.loadgen.bench_serve import BenchConfig, parse_goodput, run_bench
    cfg = BenchConfig(
        base_url=a.base_url, endpoint=a.endpoint, api_key=a.api_key or os.environ.get("OPENAI_API_KEY"), model=a.model, num_prompts=a.num_prompts,
        request_rate=a.request_rate, burstiness=a.burstiness, max_concurrency=a.max_concurrency, seed=a.seed,
        ignore_eos=a.ignore_eos, dataset_name=a.dataset_name, dataset_path=a.dataset_path,
        random_input_len=a.random_input_len, random_output_len=a.random_output_len,
        random_range_ratio=a.random_range_ratio, lognormal_sigma=a.lognormal_sigma, same_prompt=a.same_prompt,
        warmup=a.warmup, timeout_s=a.request_timeout, goodput=parse_goodput(a.goodput),
        percentile_metrics=tuple(x.strip() for x in a.percentile_metrics.split(",") if x.strip()),
        metric_percentiles=tuple(float(x) for x in a.metric_percentiles.split(",") if x.strip()),
        tokenizer=a.tokenizer, sharegpt_output_len=a.sharegpt_output_len, progress=not a.disable_tqdm)
    if a.dataset_name == "lognormal" and a.lognormal_median is not None:
        cfg.random_input_len = a.lognormal_median
    if not (cfg.burstiness > 0 and (math.isinf(cfg.request_rate) or cfg.request_rate > 0)):
        print("error: --request-rate and --burstiness must be > 0", file=sys.stderr)
        return 2
    if a.sweep_rate or a.sweep_concurrency:
        return _bench_serve_sweep(cfg, a)
    res = run_bench(cfg)
    print(res.table())
    if a.save_result:
        print(f"result: {res.save(a.result_dir or '.', a.result_filename)}")
    if a.report:
        from minillm.bench.report import BenchReport, MissingReportFields, fetch_server_info
        rep = BenchReport.from_bench(res, fetch_server_info(cfg), hardware=a.hardware, parallel=a.parallel,
                                     precision=a.precision)
        try:
            print("\n" + rep.render())
        except MissingReportFields as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if a.report_json:
            _write_json(a.report_json, {**rep.to_dict(), "summary": res.summary.to_dict()})
        if a.report_figure:
            from minillm.plots.honest import plot_report, report_data, save
            stamp = f"bench-serve → {cfg.base_url} · {rep.hardware} · {res.started}"
            print("figure: " + ", ".join(str(p) for p in save(plot_report(res, rep), "10-6-report", stamp,
                                                                report_data(res, rep), a.report_figure)))
    return 0


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes a comma-separated list of numbers, got {text!r}") from None


def _bench_serve_sweep(cfg, a: argparse.Namespace) -> int:
    """``--sweep-rate 1,2,4`` / ``--sweep-concurrency 1,4,16``: one run per point, one JSON per
    point (with ``--save-result``), and one combined table (printed, and saved as JSON)."""
    import json
    import time
    from pathlib import Path

    from minillm.loadgen.bench_serve import run_bench, sweep_configs, sweep_row, sweep_table
    rates = _floats(a.sweep_rate, "--sweep-rate") if a.sweep_rate else None
    concs = [int(c) for c in _floats(a.sweep_concurrency, "--sweep-concurrency")] if a.sweep_concurrency else None
    configs = sweep_configs(cfg, rates, concs)
    rows = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i, c in enumerate(configs):
        res = run_bench(c)
        rows.append(sweep_row(res))
        print(f"point {i + 1}/{len(configs)}: rate {c.request_rate:g}, max concurrency {c.max_concurrency or '-'}: "
              f"{res.n_ok} ok, {res.n_failed} failed")
        if a.save_result:
            print(f"  result: {res.save(a.result_dir or '.', f'bench-serve-sweep-{stamp}-point{i}.json')}")
    print(sweep_table(rows))
    if a.save_result:
        d = Path(a.result_dir or ".")
        p = d / (a.result_filename or f"bench-serve-sweep-{stamp}.json")
        p.write_text(json.dumps({"tool": "minillm bench-serve sweep", "points": rows},
                                indent=1, default=lambda x: str(x)), encoding="utf-8")
        print(f"sweep: {p}")
    return 0


def cmd_bench_client(a: argparse.Namespace) -> int:
    from minillm.loadgen.client_overhead import measure_client_overhead
    res = measure_client_overhead(a.num_prompts, a.max_concurrency, a.rounds, a.wrk_duration)
    print(res.table())
    if a.json:
        _write_json(a.json, res.to_dict())
    return 0


def cmd_bench_deceptions(a: argparse.Namespace) -> int:
    from minillm.bench.deceptions import run_benchmark
    out = run_benchmark(a.model, a.num_prompts, a.input_len, a.output_len, a.concurrency, a.rate_fraction,
                        a.base_url, a.api_key)
    hw = out["server"].get("hardware") or "hardware not reported by the server"
    where = (a.base_url or f"minillm serve --model {a.model} (own process)") + f" on {hw}"
    print(f"the four self-deceptions of 10.6, against {where}\n"
          f"service rate {out['service_rate_rps']:.2f} req/s (closed loop); open-loop runs at "
          f"{out['open_loop_rate_rps']:.2f} req/s; {a.num_prompts} requests per run, input {a.input_len}, "
          f"output {a.output_len} tokens\n")
    for p in out["pairs"]:
        print(p.table() + "\n")
    if a.json:
        _write_json(a.json, {**out, "pairs": [p.to_dict() for p in out["pairs"]]})
    return 0


def cmd_doctor(a: argparse.Namespace) -> int:
    from minillm.doctor import main as doctor_main
    return doctor_main([])


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (a bad int, an unknown flag) are one line and exit status 2 too,
    like every other bad input, instead of a screenful of usage."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see: {self.prog} --help)\n")


# ------------------------------------------------------------------ diagnose (10.1–10.5)
def _add_diagnose_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("diagnose", help="where did the slow requests lose their time? starts late (TTFT stages), "
                                        "stutters (ITL gaps holding a prefill), or outside the device")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--base-url", help="a minillm server: GET /v1/traces (every page) and /v1/steps")
    src.add_argument("--traces", metavar="FILE.json",
                     help="saved traces: GET /v1/traces's JSON, a list of its items, or --save's file")
    p.add_argument("--api-key", default=None,
                   help="the key for --base-url (default: $MINILLM_API_KEY, then $OPENAI_API_KEY); the admin "
                        "key reads every caller's traces and the step records")
    p.add_argument("--steps", metavar="FILE.json", help="step records (GET /v1/steps's JSON) to add to --traces")
    p.add_argument("--no-steps", action="store_true", help="do not fetch or use step records")
    p.add_argument("--save", metavar="FILE.json", help="with --base-url: save what was fetched, for --traces later")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.set_defaults(fn=cmd_diagnose)
    return p


def cmd_diagnose(a: argparse.Namespace) -> int:
    import os

    from minillm.core.records import as_steps, load_input
    from minillm.loadgen.server_api import diagnose_server
    from minillm.metrics.diagnose import diagnose
    if a.base_url:
        key = a.api_key or os.environ.get("MINILLM_API_KEY") or os.environ.get("OPENAI_API_KEY")
        d, fetched = diagnose_server(a.base_url, key, steps=not a.no_steps)
        if a.save:
            Path(a.save).write_text(json.dumps(fetched), encoding="utf-8")
            print(f"saved {len(fetched['traces'])} traces and {len(fetched['steps'])} step records to {a.save}",
                  file=sys.stderr)
    else:
        if a.save:
            raise ValueError("--save goes with --base-url (a --traces file is saved already)")
        traces, steps = load_input(a.traces)
        if a.steps:
            steps = as_steps(json.loads(Path(a.steps).read_text(encoding="utf-8")))
        d = diagnose(traces, [] if a.no_steps else steps)
    print(json.dumps(d.to_dict(), indent=1) if a.json else d.text())
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m minillm", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream one completion and print TTFT, TPOT, tok/s, bandwidth")
    g.add_argument("prompt")
    _add_model_args(g)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the model's, or the shipped BPE)")
    _add_engine_args(g, _GENERATE_ENGINE)
    g.set_defaults(fn=cmd_generate)

    b = sub.add_parser("bench", help="batch-1 decode tok/s and achieved bandwidth, minillm vs transformers")
    _add_model_args(b, default_model="cpu-small")
    b.add_argument("--prompt-tokens", type=int, default=32)
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--no-transformers", action="store_true", help="skip the transformers side")
    b.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for minillm's decode (vLLM's name)")
    b.add_argument("--compile", action="store_true",
                   help="minillm decodes through torch.compile (its compile time is reported; eager is the default)")
    b.add_argument("--peers", action="store_true",
                   help="minillm, transformers and llama.cpp (llama-cpp-python + gguf, where installed) on the same "
                        "weights, interleaved round by round: tok/s with its spread, GB/s, %% of read bandwidth")
    b.add_argument("--rounds", type=int, default=5, help="--peers: rounds, each running every engine once")
    b.add_argument("--gguf", default=None, help="--peers: write the converted GGUF here and keep it (default: a temp file)")
    b.add_argument("--json", default=None, help="also write the report as JSON here")
    b.set_defaults(fn=cmd_bench)

    r = sub.add_parser("roofline", help="decode tok/s against batch size beside the bandwidth/compute bounds (10.3)")
    _add_model_args(r, default_model=None)
    r.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,2,4,8,16,32,48,64)")
    r.add_argument("--max-batch", type=int, default=64, help="extend the default list up to this batch (e.g. 512)")
    r.add_argument("--context", type=int, default=None, help="tokens cached per sequence (default 128 CPU, 512 GPU)")
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--steps", type=int, default=10, help="timed decode steps per batch")
    r.add_argument("--no-cuda-graphs", action="store_true")
    r.add_argument("--out", default="runs", help="directory for the JSON and CSV")
    r.add_argument("--figures", default=None, help="directory for the figure (default: runs/figures/ under the working directory, or $MINILLM_FIGURES_DIR; --figures figures/ writes the committed one)")
    r.add_argument("--reference", action="append", help="a reference run's JSON to overlay (repeatable)")
    r.set_defaults(fn=cmd_roofline)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (gateway, SSE streaming, traces)")
    _add_model_args(s)
    s.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the model's, or the shipped BPE)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", action="append", help="an accepted API key (repeatable; also MINILLM_API_KEY)")
    s.add_argument("--requests-per-s", type=float, default=None, help="rate limit per key (token bucket)")
    s.add_argument("--tokens-per-min", type=float, default=None, help="token rate limit per key (prompt + max_tokens)")
    s.add_argument("--max-queue-depth", type=int, default=256, help="requests in flight before 503")
    s.add_argument("--burst", type=float, default=None, help="requests a key may send at once (default: one second's worth)")
    s.add_argument("--admin-key", default=None,
                   help="a key that reads every key's traces and the engine's steps (also MINILLM_ADMIN_KEY)")
    s.add_argument("--trace-history", type=int, default=10_000, help="traces kept for /v1/traces, at most")
    s.add_argument("--trace-store-bytes", type=int, default=64 << 20,
                   help="bytes the kept traces may take (estimated), at most; the oldest go first")
    s.add_argument("--header-timeout-s", type=float, default=10.0,
                   help="a request's headers must arrive within this many seconds of the connection opening "
                        "(or of a next request's first byte), else 408 and the connection is closed")
    s.add_argument("--body-timeout-s", type=float, default=30.0,
                   help="a request's body must arrive within this many seconds after its headers, else 408")
    s.add_argument("--max-connections", type=int, default=1024,
                   help="connections served at once; a request on one more gets 503 (0: no limit)")
    s.add_argument("--keep-alive-timeout-s", type=float, default=5.0,
                   help="close a kept-alive connection idle this long after a response")
    s.add_argument("--max-header-bytes", type=int, default=65536, help="request headers larger than this get 431")
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    s.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default: one per core; on few cores, leave one to HTTP)")
    _add_engine_args(s)
    s.set_defaults(fn=cmd_serve)

    h = sub.add_parser("bench-http", help="HTTP + SSE overhead: TTFT and ITL through `serve` minus in-process (10.1)")
    _add_model_args(h)
    h.add_argument("--requests", type=int, default=50, help="measured requests per side (after the warm-up)")
    h.add_argument("--prompt-tokens", type=int, default=32)
    h.add_argument("--max-tokens", type=int, default=32)
    h.add_argument("--warmup", type=int, default=5)
    h.add_argument("--mode", choices=("subprocess", "thread"), default="subprocess",
                   help="the server in its own process (default, as deployed) or in a thread of this one")
    h.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads on both sides (default: torch's, one per core)")
    h.add_argument("--json", default=None, help="also write the report (with every sample) as JSON here")
    h.set_defaults(fn=cmd_bench_http)

    e = sub.add_parser("bench-engine", help="the stall under prefill-first vs chunked, prefix cache cold vs warm, "
                                            "packed vs padded prefill (10.4, 10.6)")
    _add_model_args(e)
    e.set_defaults(model="cpu-small")
    e.add_argument("--parts", default="stall,prefix,packed", help="which benchmarks (comma-separated)")
    e.add_argument("--n-short", type=int, default=8, help="requests decoding when the long prompt arrives")
    e.add_argument("--long-prompt", type=int, default=2048, help="tokens of the prompt that arrives mid-decode")
    e.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens of the chunked run")
    e.add_argument("--prefix-prompt", type=int, default=1024, help="tokens of the prompt timed cold and warm")
    e.add_argument("--repeats", type=int, default=3)
    e.add_argument("--json", default=None, help="also write the report as JSON here")
    e.set_defaults(fn=cmd_bench_engine)

    v = sub.add_parser("bench-server", help="requests/s that `serve` sustains (wrk, max_tokens=1) and RSS per "
                                            "1,000 requests, with the trace store's byte bound as given")
    v.add_argument("--model", default="tiny")
    v.add_argument("--connections", type=int, default=16)
    v.add_argument("--duration", type=float, default=20, help="seconds of wrk load")
    v.add_argument("--rounds", type=int, default=3, help="rounds of 1,000 requests for the RSS readings")
    v.add_argument("--trace-store-bytes", type=int, nargs="+", default=[1 << 20, 64 << 20],
                   help="one run per bound (default: 1 MiB, reached at once; 64 MiB, the server's default)")
    v.add_argument("--port", type=int, default=8765)
    v.add_argument("--torch-threads", type=int, default=None)
    v.add_argument("--json", default=None)
    v.set_defaults(fn=cmd_bench_server)

    bs = sub.add_parser("bench-serve", help="load-test any OpenAI-compatible server: open-loop arrivals, "
                                            "streamed TTFT/TPOT/ICL/E2E, goodput (vLLM bench serve's flags)")
    bs.add_argument("--base-url", default="http://127.0.0.1:8000")
    bs.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    bs.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    bs.add_argument("--model", default=None, help="default: the first model of GET /v1/models")
    bs.add_argument("--num-prompts", type=int, default=100)
    bs.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    bs.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of the gaps (1: Poisson)")
    bs.add_argument("--max-concurrency", type=int, default=None)
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--ignore-eos", action="store_true")
    bs.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    bs.add_argument("--metric-percentiles", default="50,90,99")
    bs.add_argument("--goodput", nargs="+", default=None, help="SLOs in ms: ttft:MS tpot:MS e2el:MS")
    bs.add_argument("--save-result", action="store_true")
    bs.add_argument("--result-dir", default=None)
    bs.add_argument("--result-filename", default=None)
    bs.add_argument("--warmup", type=int, default=0, help="requests sent first and excluded")
    bs.add_argument("--dataset-name", default="random", choices=("random", "lognormal", "jsonl", "sharegpt"))
    bs.add_argument("--dataset-path", default=None, help='jsonl: {"prompt": ..., "output_len": ...} per line; '
                                                         'sharegpt: a ShareGPT JSON (default: the small file minillm ships)')
    bs.add_argument("--sharegpt-output-len", type=int, default=None, help="override the replies' lengths")
    bs.add_argument("--tokenizer", default=None,
                    help="count tokens with this tokenizer (a directory, 'default', or a cached hub id): exact "
                         "random prompt lengths, ShareGPT reply lengths, and counts when the server sends no usage")
    bs.add_argument("--sweep-rate", default=None, help="comma-separated request rates: one run per rate")
    bs.add_argument("--sweep-concurrency", default=None,
                    help="comma-separated concurrencies: one closed-loop run (rate inf) per value")
    bs.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    bs.add_argument("--random-input-len", type=int, default=128, help="prompt length target (words)")
    bs.add_argument("--random-output-len", type=int, default=64)
    bs.add_argument("--random-range-ratio", type=float, default=0.0)
    bs.add_argument("--lognormal-median", type=int, default=None, help="median prompt length (default: input len)")
    bs.add_argument("--lognormal-sigma", type=float, default=0.5)
    bs.add_argument("--same-prompt", action="store_true", help="one prompt repeated (prefix caching demo)")
    bs.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    bs.add_argument("--report", action="store_true",
                   help="print the complete report (design.md §4); refuses while a required field is missing")
    bs.add_argument("--hardware", default=None, help="the server's hardware, for the report (minillm serve says it itself)")
    bs.add_argument("--parallel", default=None, help="the parallel configuration, e.g. 'tp=2', for the report")
    bs.add_argument("--precision", default=None, help="the model's precision, e.g. bf16, for the report")
    bs.add_argument("--report-json", default=None, help="with --report: also write it as JSON here")
    bs.add_argument("--report-figure", default=None, metavar="DIR",
                    help="with --report: also draw it on one page, DIR/10-6-report.png/.svg (+ data/10-6-report.json)")
    bs.set_defaults(fn=cmd_bench_serve)

    bc = sub.add_parser("bench-client", help="requests/s bench-serve itself can issue, against a stub server "
                                             "that answers instantly (beside wrk against the same stub)")
    bc.add_argument("--num-prompts", type=int, default=2000)
    bc.add_argument("--max-concurrency", type=int, default=64)
    bc.add_argument("--rounds", type=int, default=3)
    bc.add_argument("--wrk-duration", type=float, default=5.0, help="seconds of wrk per round")
    bc.add_argument("--json", default=None)
    bc.set_defaults(fn=cmd_bench_client)

    bd = sub.add_parser("bench-deceptions", help="10.6's four self-deceptions, each beside its honest twin, "
                                                 "against a fresh minillm serve (or --base-url)")
    bd.add_argument("--model", default="cpu-small")
    bd.add_argument("--base-url", default=None, help="a running server instead (cold vs warm then needs it fresh)")
    bd.add_argument("--api-key", default=None)
    bd.add_argument("--num-prompts", type=int, default=40)
    bd.add_argument("--input-len", type=int, default=256)
    bd.add_argument("--output-len", type=int, default=32)
    bd.add_argument("--concurrency", type=int, default=1,
                    help="the closed loop's requests in flight (1: send one, wait, send the next)")
    bd.add_argument("--rate-fraction", type=float, default=0.7, help="open-loop rate, as a fraction of the service rate")
    bd.add_argument("--json", default=None)
    bd.set_defaults(fn=cmd_bench_deceptions)

    _add_diagnose_parser(sub)

    d = sub.add_parser("doctor", help="check dependencies, the torch build and the devices")
    d.set_defaults(fn=cmd_doctor)
    return ap


def main(argv: list[str] | None = None) -> int:
    try:
        a = build_parser().parse_args(argv)
    except SystemExit as e:      # --help (0) or a parse error (2, already reported)
        return e.code if isinstance(e.code, int) else 2
    try:
        return a.fn(a)
    except (ValueError, FileNotFoundError, OverflowError) as e:
        # bad input (a model name, a device, a dtype, a port): one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
