"""What each command does: one ``cmd_*`` function per ``python -m minillm <command>`` (the parser:
``parser.py``)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


GENERATE_ENGINE = {"max_batch_size": 1}      # one request: one KV slot is all it needs


def cmd_generate(a: argparse.Namespace) -> int:
    from minillm.core.device import dtype_bytes
    from minillm.engine import LLM, RequestError
    from minillm.engine.config import EngineConfig
    from minillm.engine.sampling import SamplingParams
    from minillm.perf.roofline import decode_step_bytes
    try:
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k,
                                top_p=a.top_p, seed=a.seed, stop=a.stop or [], ignore_eos=a.ignore_eos)
        config = EngineConfig.from_args(a, exclude=("seed",), **GENERATE_ENGINE)
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
    engines = ("minillm",) + (() if a.no_transformers else ("transformers",)) + ("llama.cpp",)
    if a.peers and a.batches:
        from minillm.bench.peers_batch import run_batch_peers
        rep = run_batch_peers(model=a.model, device=a.device, dtype=a.dtype, batches=a.batches,
                              prompt_tokens=a.prompt_tokens, new_tokens=a.new_tokens, rounds=a.rounds,
                              engines=engines[:1] + (("minillm compiled",) if a.compile else ())
                              + engines[1:] + ("vLLM",),
                              llama_batched_bench=a.llama_batched_bench, vllm_python=a.vllm_python,
                              progress=True)
    elif a.peers:
        from minillm.bench.peers import run_peers
        rep = run_peers(model=a.model, device=a.device, dtype=a.dtype, prompt_tokens=a.prompt_tokens,
                        new_tokens=a.new_tokens, rounds=a.rounds, engines=engines, compile=a.compile,
                        gguf_path=a.gguf, progress=True)
    else:
        from minillm.bench.decode import run_decode_benchmark
        rep = run_decode_benchmark(model=a.model, device=a.device, dtype=a.dtype,
                                   prompt_tokens=a.prompt_tokens,
                                   new_tokens=a.new_tokens, repeats=a.repeats,
                                   compare_transformers=not a.no_transformers, enforce_eager=a.enforce_eager,
                                   compile=a.compile)
    print(rep.table())
    if a.json:
        _write_json(a.json, rep.to_dict())
    return 0


def _redraw_roofline(a: argparse.Namespace) -> int:
    """``roofline --redraw FILE.json``: the figure from saved data, nothing measured (10.3)."""
    from minillm.bench.sweep_result import load_result
    from minillm.experiments.references import load_published_references, load_roofline_references
    from minillm.plots.roofline import redraw_roofline_figure
    if not Path(a.redraw).is_file():
        print(f"error: --redraw: no such file {a.redraw}", file=sys.stderr)
        return 2
    refs = load_roofline_references() + [load_result(p) for p in (a.reference or [])]
    figs = redraw_roofline_figure(a.redraw, a.figures, refs, load_published_references())
    print(f"figure: {'  '.join(map(str, figs))}  (redrawn from {a.redraw}; nothing measured)")
    return 0


def cmd_roofline(a: argparse.Namespace) -> int:
    import shlex

    from minillm.bench.sweep import run_sweep
    from minillm.bench.sweep_result import default_batches, load_result, parse_batches
    from minillm.experiments.references import load_published_references
    from minillm.plots.figures import figures_dir
    from minillm.plots.roofline import save_roofline_figure
    if a.redraw:
        return _redraw_roofline(a)
    if a.base_url:
        return _remote_roofline(a)
    try:
        batches = parse_batches(a.batches) if a.batches else default_batches(a.max_batch)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.rounds < 1:
        print(f"error: --rounds must be ≥ 1, got {a.rounds}", file=sys.stderr)
        return 2
    try:                          # where the figure will go: checked, with --out, before the sweep starts
        figs = figures_dir(a.figures)
    except OSError as e:
        print(f"error: cannot write the figure to {a.figures or 'the default figures directory'}: {e}",
              file=sys.stderr)
        return 2
    res = run_sweep(model=a.model, device=a.device, dtype=a.dtype, batches=batches, context=a.context,
                    warmup=a.warmup, steps=a.steps, cuda_graphs=not a.no_cuda_graphs,
                    command="python -m minillm " + " ".join(shlex.quote(x) for x in sys.argv[1:]),
                    partial_path=Path(a.out) / "roofline-partial.jsonl", out_dir=a.out, figures_dir=figs,
                    enforce_eager=a.enforce_eager, path=a.path, rounds=a.rounds)
    print(res.table())
    jp, cp = res.write(a.out)
    refs = [load_result(p) for p in (a.reference or [])]
    figs = save_roofline_figure(res.to_dict(), refs, out_dir=a.figures, published=load_published_references())
    print(f"data: {jp}  {cp}")
    print(f"figure: {'  '.join(map(str, figs))}")
    return 0


def _remote_roofline(a: argparse.Namespace) -> int:
    """``roofline --base-url URL``: the crossover through any OpenAI-compatible server (10.3)."""
    import os

    from minillm.bench.sweep_result import default_batches, parse_batches
    from minillm.loadgen.remote_roofline import (
        RemoteRooflineConfig,
        parse_parallel,
        run_remote_roofline,
        server_bound,
    )
    from minillm.plots.remote_roofline import save_remote_roofline
    try:
        batches = parse_batches(a.batches) if a.batches else default_batches(a.max_batch)
        tp = parse_parallel(a.parallel)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    key = a.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("MINILLM_API_KEY")
    bound, model_cfg, nbytes, hw = server_bound(a.base_url, key, a.max_tokens, a.config, a.hardware, tp,
                                                a.bandwidth, a.dtype)
    cfg = RemoteRooflineConfig(base_url=a.base_url, batches=batches, api_key=key,
                               model=a.model, max_tokens=a.max_tokens)
    try:
        res = run_remote_roofline(cfg, bound, model_cfg, nbytes, hw, f"tp={tp}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(res.table())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jp = out / "roofline-http.json"
    jp.write_text(json.dumps(res.to_dict(), indent=1), encoding="utf-8")
    figs = save_remote_roofline(res.to_dict(), a.figures)
    print(f"data: {jp}")
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
    return serve(cfg, host=a.host, port=a.port)


def cmd_bench_http(a: argparse.Namespace) -> int:
    from minillm.loadgen.http_overhead import run_http_overhead
    rep = run_http_overhead(model=a.model, device=a.device, dtype=a.dtype, n_requests=a.requests,
                            prompt_tokens=a.prompt_tokens, max_tokens=a.max_tokens, warmup=a.warmup,
                            mode=a.mode,
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
        print(f"error: --parts takes stall, prefix, packed (comma-separated), got {a.parts!r}",
              file=sys.stderr)
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
        print("wrk is not on the PATH (Debian/Ubuntu: apt install wrk): requests/s not measured",
              file=sys.stderr)
    if a.json:
        _write_json(a.json, {"runs": [r.to_dict() for r in reps]})
    return 0


def cmd_bench_serve(a: argparse.Namespace) -> int:
    import math
    import os

    from minillm.loadgen.bench_serve import BenchConfig, parse_goodput, run_bench
    cfg = BenchConfig(
        base_url=a.base_url, endpoint=a.endpoint, api_key=a.api_key or os.environ.get("OPENAI_API_KEY"),
        model=a.model, num_prompts=a.num_prompts,
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

    from minillm.loadgen.bench_serve import run_bench
    from minillm.loadgen.rate_sweep import sweep_configs, sweep_row, sweep_table
    rates = _floats(a.sweep_rate, "--sweep-rate") if a.sweep_rate else None
    concs = [int(c) for c in _floats(a.sweep_concurrency,
                                     "--sweep-concurrency")] if a.sweep_concurrency else None
    configs = sweep_configs(cfg, rates, concs)
    rows = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i, c in enumerate(configs):
        res = run_bench(c)
        rows.append(sweep_row(res))
        print(f"point {i + 1}/{len(configs)}: rate {c.request_rate:g}, max concurrency "
              f"{c.max_concurrency or '-'}: {res.n_ok} ok, {res.n_failed} failed")
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


# ------------------------------------------------------------------ diagnose (10.1–10.5)
def cmd_diagnose(a: argparse.Namespace) -> int:
    import os

    from minillm.core.records import as_steps, load_input
    from minillm.loadgen.server_api import diagnose_server
    from minillm.metrics.diagnose import diagnose
    if a.base_url:
        key = a.api_key or os.environ.get("MINILLM_API_KEY") or os.environ.get("OPENAI_API_KEY")
        d, fetched = diagnose_server(a.base_url, key, steps=not a.no_steps,
                                     metrics_window_s=a.metrics_window)
        if a.save:
            Path(a.save).write_text(json.dumps(fetched), encoding="utf-8")
            print(f"saved {len(fetched['traces'])} traces and {len(fetched['steps'])} step records to "
                  f"{a.save}",
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


def cmd_prefill_decode(a: argparse.Namespace) -> int:
    import sys

    from minillm.experiments.prefill_decode import write_reference
    write_reference(a.out, a.model, a.device, a.dtype, a.lengths, a.batches, a.context, a.repeats, a.steps,
                    cuda_graphs=not a.no_cuda_graphs, copy_bytes=a.copy_mib * 2**20 if a.copy_mib else None,
                    matmul_n=a.matmul_n, stall_long=a.stall_long, n_short=a.n_short, budgets=a.budgets,
                    command="python -m minillm prefill-decode " + " ".join(sys.argv[2:]))
    return 0


def cmd_outside_reference(a: argparse.Namespace) -> int:
    from minillm.experiments.outside_reference import run_reference
    return run_reference(a.out, a.models, a.batches, a.context, a.steps, a.vocabs, a.sampling_batches, a.only,
                         a.profile_model, a.profile_top, a.allow_cpu)
