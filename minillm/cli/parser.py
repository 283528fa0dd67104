"""The parser of ``python -m minillm <command>``: every command and its flags, in one place. Engine
flags come from :class:`~minillm.engine.config.EngineConfig` itself (one per field)."""
from __future__ import annotations

import argparse

from minillm.cli import commands as c


def _add_model_args(p: argparse.ArgumentParser, default_model: str | None = "tiny") -> None:
    p.add_argument("--model", default=default_model,
                   help="a preset (tiny, cpu-small, llama-3.2-1b, llama-3.1-8b, qwen2.5-0.5b, qwen2.5-7b: "
                        "shape twins with random weights), a checkpoint directory, or a hub id")
    p.add_argument("--device", default=None, help="cuda, mps or cpu (default: the first available)")
    p.add_argument("--dtype", default=None,
                   help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp16 on MPS, fp32 on CPU)")


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


def _add_diagnose_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("diagnose",
                       help="where did the slow requests lose their time? starts late (TTFT stages), "
                            "stutters (ITL gaps holding a prefill), or outside the device")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--base-url", help="a minillm server: GET /v1/traces (every page) and /v1/steps; "
                                        "another server (404 there): its Prometheus /metrics")
    src.add_argument("--traces", metavar="FILE.json",
                     help="saved traces: GET /v1/traces's JSON, a list of its items, or --save's file")
    p.add_argument("--api-key", default=None,
                   help="the key for --base-url (default: $MINILLM_API_KEY, then $OPENAI_API_KEY); the admin "
                        "key reads every caller's traces and the step records")
    p.add_argument("--steps", metavar="FILE.json",
                   help="step records (GET /v1/steps's JSON) to add to --traces")
    p.add_argument("--no-steps", action="store_true", help="do not fetch or use step records")
    p.add_argument("--save", metavar="FILE.json",
                   help="with --base-url: save what was fetched, for --traces later")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.add_argument("--metrics-window", type=float, default=0.0, metavar="S",
                   help="a server without /v1/traces is diagnosed from its /metrics: by default everything "
                        "since it started; with S > 0 the histograms' deltas over the next S seconds")
    p.set_defaults(fn=c.cmd_diagnose)
    return p


def _ints(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def _add_experiment_parsers(sub) -> None:
    pd = sub.add_parser("prefill-decode",
                        help="10.4's reference run: prefill against decode on one roofline, "
                             "the stall and the chunk trade-off, one JSON with provenance")
    pd.add_argument("--model")
    pd.add_argument("--device")
    pd.add_argument("--dtype")
    pd.add_argument("--lengths", type=_ints, help="prefill prompt lengths, e.g. 16,32,...,8192")
    pd.add_argument("--batches", type=_ints, help="decode batches (default 1,2,4,8,16,32,48,64)")
    pd.add_argument("--context", type=int, help="decode context per sequence (default 128 CPU, 512 GPU)")
    pd.add_argument("--repeats", type=int, default=3)
    pd.add_argument("--steps", type=int, default=10)
    pd.add_argument("--no-cuda-graphs", action="store_true")
    pd.add_argument("--copy-mib", type=int,
                    help="size of the bandwidth copy (default: past the last-level cache)")
    pd.add_argument("--matmul-n", type=int, help="size of the peak matmul (default 8192 CUDA, 2048 CPU)")
    pd.add_argument("--stall-long", type=int,
                    help="the long prompt (default 2048 CPU, 4096 GPU; 0: no stall runs)")
    pd.add_argument("--n-short", type=int, default=8)
    pd.add_argument("--budgets", type=_ints, default=[64, 128, 256, 512, 1024, 2048])
    pd.add_argument("--out", default="runs/prefill-decode", help="folder for the JSON")
    pd.set_defaults(fn=c.cmd_prefill_decode)
    o = sub.add_parser("outside-reference",
                       help="10.5's GPU reference run: eager against CUDA graphs, sampling, "
                            "profile_steps and the step phases, one JSON each")
    o.add_argument("--out", required=True, help="folder for the JSON files")
    o.add_argument("--models", default="tiny,llama-3.1-8b",
                   help="graphs comparison and phases (comma-separated)")
    o.add_argument("--batches", default="1,8,64", help="graphs comparison batches")
    o.add_argument("--context", type=int, default=512)
    o.add_argument("--steps", type=int, default=30)
    o.add_argument("--vocabs", default="8192,128256", help="sampling vocabularies")
    o.add_argument("--sampling-batches", default="1,2,4,8,16,32,64")
    o.add_argument("--only", default="graphs,sampling,profile,phases",
                   help="which parts: graphs,sampling,profile,phases")
    o.add_argument("--profile-model", default="tiny", help="the model profile_steps runs (batch 1)")
    o.add_argument("--profile-top", type=int, default=10, help="rows of the profile's op table")
    o.add_argument("--allow-cpu", action="store_true", help="a dry run on a CPU (skips graphs)")
    o.set_defaults(fn=c.cmd_outside_reference)


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (a bad int, an unknown flag) are one line and exit status 2 too,
    like every other bad input, instead of a screenful of usage."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m minillm",
                 description="minillm: a small inference engine and the measurements of a chapter on the "
                             "lifecycle of an inference request. `python -m minillm roofline` is the main "
                             "job.")
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
    g.add_argument("--tokenizer", default=None,
                   help="a tokenizer directory (default: the model's, or the shipped BPE)")
    _add_engine_args(g, c.GENERATE_ENGINE)
    g.set_defaults(fn=c.cmd_generate)

    b = sub.add_parser("bench", help="batch-1 decode tok/s and achieved bandwidth, minillm vs transformers")
    _add_model_args(b, default_model="cpu-small")
    b.add_argument("--prompt-tokens", type=int, default=32)
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--no-transformers", action="store_true", help="skip the transformers side")
    b.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for minillm's decode (vLLM's name)")
    b.add_argument("--compile", action="store_true",
                   help="minillm decodes through torch.compile (its compile time is reported; eager is the "
                        "default); with --peers --batches, minillm compiled runs beside eager minillm")
    b.add_argument("--peers", action="store_true",
                   help="minillm, transformers and llama.cpp (llama-cpp-python + gguf, where installed) on "
                        "the same weights, interleaved round by round: tok/s with its spread, GB/s, %% of "
                        "read bandwidth")
    b.add_argument("--rounds", type=int, default=5, help="--peers: rounds, each running every engine once")
    b.add_argument("--batches", type=_ints, default=None,
                   help="--peers at these batch sizes (e.g. 1,2,4,8,16,32,64): every engine's aggregate "
                        "decode tok/s at each, beside B × read bandwidth ÷ the bytes a step reads")
    b.add_argument("--llama-batched-bench", default=None, metavar="PATH",
                   help="--peers --batches: llama.cpp's llama-batched-bench (default: "
                        "$MINILLM_LLAMA_BATCHED_BENCH, then the PATH)")
    b.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="--peers --batches: the Python of vLLM's own environment, which adds vLLM as a peer "
                        "(default: $MINILLM_VLLM_PYTHON; scripts/engines/setup_vllm_cpu.sh makes one)")
    b.add_argument("--gguf", default=None,
                   help="--peers: write the converted GGUF here and keep it (default: a temp file)")
    b.add_argument("--json", default=None, help="also write the report as JSON here")
    b.set_defaults(fn=c.cmd_bench)

    r = sub.add_parser("roofline",
                       help="decode tok/s against batch size beside the bandwidth/compute bounds (10.3)")
    _add_model_args(r, default_model=None)
    r.add_argument("--batches", default=None,
                   help="comma-separated batch sizes (default 1,2,4,8,16,32,48,64)")
    r.add_argument("--max-batch", type=int, default=64,
                   help="extend the default list up to this batch (e.g. 512)")
    r.add_argument("--context", type=int, default=None,
                   help="tokens cached per sequence (default 128 CPU, 512 GPU)")
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--steps", type=int, default=10, help="timed decode steps per batch")
    r.add_argument("--rounds", type=int, default=1,
                   help="measure every batch this many times, the batches in turn, each row's median over "
                        "all of them (a machine whose memory changes speed during the run: 10.6)")
    r.add_argument("--no-cuda-graphs", action="store_true")
    r.add_argument("--path", choices=("fastest", "packed", "compiled"), default="fastest",
                   help="the decode that runs: the matmuls chosen on this machine (packed, "
                        "engine/matmul.py), "
                        "the compiled decode (compiled, engine/compiled.py; each batch's first compile is "
                        "timed apart), or at each batch the faster of the two (fastest, the default; "
                        "on a GPU: packed, with CUDA graphs)")
    r.add_argument("--enforce-eager", action="store_true",
                   help="the plain path: torch's own matmuls, nothing compiled, no CUDA graphs")
    r.add_argument("--out", default="runs", help="directory for the JSON and CSV")
    r.add_argument("--figures", default=None,
                   help="directory for the figure (default: runs/figures/ under the working directory, or "
                        "$MINILLM_FIGURES_DIR; --figures figures/ writes the committed one)")
    r.add_argument("--reference", action="append", help="a reference run's JSON to overlay (repeatable)")
    r.add_argument("--redraw", default=None, metavar="FILE.json",
                   help="measure nothing: draw the figure again from a saved sweep (a roofline-*.json or "
                        "figures/data/10-3-decode-roofline.json), with the formula panel, the reference runs "
                        "below figures/reference/ and the published GPU numbers; --figures says where")
    remote = r.add_argument_group(
        "through a server", "--base-url: measure B streams at once through any OpenAI-compatible server "
                            "(vLLM, llama-server, SGLang, minillm serve) instead of the engine in process")
    remote.add_argument("--base-url", default=None, help="the server, e.g. http://127.0.0.1:8000")
    remote.add_argument("--api-key", default=None, help="its key (default: $OPENAI_API_KEY, then "
                                                                   "$MINILLM_API_KEY)")
    remote.add_argument("--config", default=None, metavar="DIR_OR_config.json",
                        help="the served model's config (a checkpoint directory or its config.json), for "
                             "the bound; minillm serve states its own in /v1/server-info")
    remote.add_argument("--hardware", default=None,
                        help="the server's GPU, looked up in the spec table (e.g. 'H100 SXM'); minillm serve "
                             "states its own")
    remote.add_argument("--parallel", default=None, metavar="tp=N",
                        help="tensor parallelism: N GPUs' bandwidth read the weights together")
    remote.add_argument("--bandwidth", type=float, default=None, metavar="GB/s",
                        help="state the bandwidth instead (e.g. a CPU's, as `doctor` measures it)")
    remote.add_argument("--max-tokens", type=int, default=256,
                        help="output tokens per stream (ignore_eos: every stream runs this long)")
    r.set_defaults(fn=c.cmd_roofline)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (gateway, SSE streaming, traces)")
    _add_model_args(s)
    s.add_argument("--tokenizer", default=None,
                   help="a tokenizer directory (default: the model's, or the shipped BPE)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", action="append",
                   help="an accepted API key (repeatable; also MINILLM_API_KEY)")
    s.add_argument("--requests-per-s", type=float, default=None, help="rate limit per key (token bucket)")
    s.add_argument("--tokens-per-min", type=float, default=None,
                   help="token rate limit per key (prompt + max_tokens)")
    s.add_argument("--max-queue-depth", type=int, default=256, help="requests in flight before 503")
    s.add_argument("--burst", type=float, default=None,
                   help="requests a key may send at once (default: one second's worth)")
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
    s.add_argument("--max-header-bytes", type=int, default=65536,
                   help="request headers larger than this get 431")
    s.add_argument("--shutdown-timeout-s", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: stop accepting, let admitted requests finish this long, then "
                        "abort the rest with an error event (exit 0 when all finished)")
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    s.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default: one per core; on few cores, leave one to HTTP)")
    _add_engine_args(s)
    s.set_defaults(fn=c.cmd_serve)

    h = sub.add_parser("bench-http",
                       help="HTTP + SSE overhead: TTFT and ITL through `serve` minus in-process (10.1)")
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
    h.set_defaults(fn=c.cmd_bench_http)

    e = sub.add_parser("bench-engine",
                       help="the stall under prefill-first vs chunked, prefix cache cold vs warm, "
                            "packed vs padded prefill (10.4, 10.6)")
    _add_model_args(e)
    e.set_defaults(model="cpu-small")
    e.add_argument("--parts", default="stall,prefix,packed", help="which benchmarks (comma-separated)")
    e.add_argument("--n-short", type=int, default=8, help="requests decoding when the long prompt arrives")
    e.add_argument("--long-prompt", type=int, default=2048,
                   help="tokens of the prompt that arrives mid-decode")
    e.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens of the chunked run")
    e.add_argument("--prefix-prompt", type=int, default=1024, help="tokens of the prompt timed cold and warm")
    e.add_argument("--repeats", type=int, default=3)
    e.add_argument("--json", default=None, help="also write the report as JSON here")
    e.set_defaults(fn=c.cmd_bench_engine)

    v = sub.add_parser("bench-server",
                       help="requests/s that `serve` sustains (wrk, max_tokens=1) and RSS per "
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
    v.set_defaults(fn=c.cmd_bench_server)

    bs = sub.add_parser("bench-serve", help="load-test any OpenAI-compatible server: open-loop arrivals, "
                                            "streamed TTFT/TPOT/ICL/E2E, goodput (vLLM bench serve's flags)")
    bs.add_argument("--base-url", default="http://127.0.0.1:8000")
    bs.add_argument("--endpoint", default="/v1/completions",
                    choices=("/v1/completions", "/v1/chat/completions"))
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
    bs.add_argument("--dataset-path", default=None, help='jsonl: {"prompt": ..., "output_len": ...} per '
                                                         'line; sharegpt: a ShareGPT JSON (default: the '
                                                         'small file minillm ships)')
    bs.add_argument("--sharegpt-output-len", type=int, default=None, help="override the replies' lengths")
    bs.add_argument("--tokenizer", default=None,
                    help="count tokens with this tokenizer (a directory, 'default', or a cached hub id): "
                         "exact random prompt lengths, ShareGPT reply lengths, and counts when the server "
                         "sends no usage")
    bs.add_argument("--sweep-rate", default=None, help="comma-separated request rates: one run per rate")
    bs.add_argument("--sweep-concurrency", default=None,
                    help="comma-separated concurrencies: one closed-loop run (rate inf) per value")
    bs.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    bs.add_argument("--random-input-len", type=int, default=128, help="prompt length target (words)")
    bs.add_argument("--random-output-len", type=int, default=64)
    bs.add_argument("--random-range-ratio", type=float, default=0.0)
    bs.add_argument("--lognormal-median", type=int, default=None,
                    help="median prompt length (default: input len)")
    bs.add_argument("--lognormal-sigma", type=float, default=0.5)
    bs.add_argument("--same-prompt", action="store_true", help="one prompt repeated (prefix caching demo)")
    bs.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    bs.add_argument("--report", action="store_true",
                   help="print the complete report (design.md §4); refuses while a required field is missing")
    bs.add_argument("--hardware", default=None,
                    help="the server's hardware, for the report (minillm serve says it itself)")
    bs.add_argument("--parallel", default=None,
                    help="the parallel configuration, e.g. 'tp=2', for the report")
    bs.add_argument("--precision", default=None, help="the model's precision, e.g. bf16, for the report")
    bs.add_argument("--report-json", default=None, help="with --report: also write it as JSON here")
    bs.add_argument("--report-figure", default=None, metavar="DIR",
                    help="with --report: also draw it on one page, DIR/10-6-report.png/.svg (+ "
                         "data/10-6-report.json)")
    bs.set_defaults(fn=c.cmd_bench_serve)

    bc = sub.add_parser("bench-client", help="requests/s bench-serve itself can issue, against a stub server "
                                             "that answers instantly (beside wrk against the same stub)")
    bc.add_argument("--num-prompts", type=int, default=2000)
    bc.add_argument("--max-concurrency", type=int, default=64)
    bc.add_argument("--rounds", type=int, default=3)
    bc.add_argument("--wrk-duration", type=float, default=5.0, help="seconds of wrk per round")
    bc.add_argument("--json", default=None)
    bc.set_defaults(fn=c.cmd_bench_client)

    bd = sub.add_parser("bench-deceptions", help="10.6's four self-deceptions, each beside its honest twin, "
                                                 "against a fresh minillm serve (or --base-url)")
    bd.add_argument("--model", default="cpu-small")
    bd.add_argument("--base-url", default=None,
                    help="a running server instead (cold vs warm then needs it fresh)")
    bd.add_argument("--api-key", default=None)
    bd.add_argument("--num-prompts", type=int, default=40)
    bd.add_argument("--input-len", type=int, default=256)
    bd.add_argument("--output-len", type=int, default=32)
    bd.add_argument("--concurrency", type=int, default=1,
                    help="the closed loop's requests in flight (1: send one, wait, send the next)")
    bd.add_argument("--rate-fraction", type=float, default=0.7,
                    help="open-loop rate, as a fraction of the service rate")
    bd.add_argument("--json", default=None)
    bd.set_defaults(fn=c.cmd_bench_deceptions)

    _add_diagnose_parser(sub)
    _add_experiment_parsers(sub)

    d = sub.add_parser("doctor", help="check dependencies, the torch build and the devices")
    d.set_defaults(fn=c.cmd_doctor)
    return ap


