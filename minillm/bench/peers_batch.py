"""Peers at every batch (``python -m minillm bench --peers --batches 1,2,4,8,16,32,64``): aggregate decode
tok/s of minillm, ``transformers`` and llama.cpp on the same weights, B sequences decoding together.

The batch-1 comparison (:mod:`minillm.bench.peers`) says who reads the weights fastest. 10.3's crossover
is a claim about batches: a batch shares that one read, so aggregate tok/s should grow almost ∝ B until
compute catches up. Whether an engine's kernels share the read is what this measures, engine by engine:

- minillm: B requests through the engine, greedy; aggregate = Σ over the requests of (N − 1) ÷ (last
  token − first token) (their decode steps run together, so this is B ÷ the step time). Beside it, from
  the same runs' step records, the rate over the forward alone (``… forward only``): B ÷ the decode
  steps' forward time, the span ``llama-batched-bench`` times for llama.cpp (below);
- ``transformers``: ``generate`` on a [B, T] batch; aggregate = B × (N − 1) ÷ (time of tokens 2…N);
- llama.cpp: its own ``llama-batched-bench`` tool (llama-cpp-python has no API for several sequences)
  on the GGUF converted from the same weights; aggregate = its ``S_TG t/s`` column. That tool times
  a decode call and a synchronize per step, nothing else: it samples and detokenizes nothing (its TG loop
  in ``tools/batched-bench/batched-bench.cpp``, llama-cpp-python 0.3.36's llama.cpp). minillm's engine
  rate pays for both, 0.3–0.4 ms of a 6–7 ms batch-1 bf16 step of ``cpu-small`` (step records, AMD EPYC
  VM), so the like-for-like line against it is minillm's forward-only rate. Found at
  ``--llama-batched-bench``, ``$MINILLM_LLAMA_BATCHED_BENCH`` or on the PATH; built with llama.cpp
  (``scripts/engines/build_llama_server.sh`` builds it beside ``llama-server``);
- vLLM, where its CPU build is installed in a Python of its own (``--vllm-python``,
  ``$MINILLM_VLLM_PYTHON``; ``scripts/engines/setup_vllm_cpu.sh`` makes one): its offline ``LLM.generate``
  on the same weights saved as a Hugging Face checkpoint, run by :mod:`minillm.bench.vllm_worker` in that
  Python; aggregate = Σ over the requests of (N − 1) ÷ (last token − first token), from vLLM's own stamps.

As in the batch-1 comparison, a round runs every engine at every batch once, engines in an order rotated
round by round, the garbage collector run before each timed decode; each cell is the median over the
rounds. The bound beside it: B × read bandwidth ÷ the bytes one step reads at that batch (weights + K/V).
"""
from __future__ import annotations

import gc
import json
import os
import queue
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minillm.bench.decode import TokenClock, forward_tok_s, token_rate
from minillm.bench.peers import PeerRun, PeerUnavailable, TransformersEngine, write_gguf
from minillm.core.device import dtype_bytes, dtype_name, synchronize
from minillm.core.result import Col, text_table
from minillm.hardware.machine import decode_read_bytes, measure_read_bandwidth
from minillm.hardware.read_probe import ReadProbe, drift_line
from minillm.perf.roofline import decode_step_bytes

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class BatchPeerRow:
    engine: str
    batch: int
    status: str = "ok"                          # "ok" | "unavailable: <why>" | "failed: <why>"
    samples_tok_s: list[float] = field(default_factory=list)   # aggregate, one per round
    tok_s: float | None = None                  # aggregate, median over the rounds
    spread: float | None = None                 # (max − min) / median
    pct_of_bound: float | None = None           # tok_s ÷ (B × read BW ÷ bytes per step at B)
    read_now: list[float] = field(default_factory=list)     # B/s read just before and after each round's run
    pct_of_read_now: float | None = None        # median over the rounds of that round's tok/s ÷ its own bound

    @property
    def per_request_tok_s(self) -> float | None:
        return self.tok_s / self.batch if self.tok_s is not None else None


@dataclass
class BatchPeerReport(PeerRun):
    threads: int
    read_bw: float                              # measured, bytes/s: the bound's bandwidth
    batches: list[int]
    bytes_per_step: dict[str, int]              # batch (as a string: JSON keys) → bytes one step reads
    rows: list[BatchPeerRow]
    notes: dict[str, str] = field(default_factory=dict)
    read_drift: dict = field(default_factory=dict)  # the read speed sampled before every batch of every round
    row_type = BatchPeerRow

    def get(self, engine: str, batch: int) -> BatchPeerRow | None:
        return next((r for r in self.rows if (r.engine, r.batch) == (engine, batch)), None)

    def engines(self) -> list[str]:
        return list(dict.fromkeys(r.engine for r in self.rows))

    def _ran(self, engine: str) -> bool:
        return any(r.status == "ok" for r in self.rows if r.engine == engine)

    def ours_tok_s(self, which: str, batch: int) -> float | None:
        """minillm's aggregate at ``batch`` on one path, or ("minillm, faster path") the faster of
        its eager and compiled decode there, as ``roofline --path fastest`` keeps."""
        names = ("minillm", "minillm compiled") if which == "minillm, faster path" else (which,)
        got = [r.tok_s for r in (self.get(n, batch) for n in names) if r is not None and r.status == "ok"]
        return max(got) if got else None

    def _ratios_now(self, ours: str, theirs: str) -> str:
        """ours ÷ theirs at each batch, each engine's rate taken as a share of the read measured around
        its own runs: on a machine whose memory speed moves in stretches of seconds, two engines' turns
        of a round can meet different speeds, and the plain ratio then measures the memory as much as them."""
        cells = []
        for b in self.batches:
            a, t = self.get(ours, b), self.get(theirs, b)
            ok = a and t and a.status == t.status == "ok" and a.pct_of_read_now and t.pct_of_read_now
            cells.append(f"{a.pct_of_read_now / t.pct_of_read_now:.2f}×" if ok else "-")
        return ", ".join(cells)

    def bound(self, batch: int) -> float:
        return batch * self.read_bw / self.bytes_per_step[str(batch)]

    def _grid(self, value, bound=None) -> list[str]:
        cols = [Col("engine", 30, left=True), *(Col(f"B={b}", 9) for b in self.batches)]
        rows = []
        for e in self.engines():
            cells = []
            for b in self.batches:
                r = self.get(e, b)
                cells.append(value(r) if r is not None and r.status == "ok" else
                             ("n/a" if r is None or r.status.startswith("unavailable") else "failed"))
            rows.append([e, *cells])
        if bound is not None:
            rows.append(["bound (BW ÷ bytes a step)", *(bound(b) for b in self.batches)])
        return text_table(cols, rows)

    def table(self) -> str:
        lines = [f"model {self.model} ({self.dtype}) on {self.device}; prompt {self.prompt_tokens} tokens, "
                 f"{self.new_tokens} new tokens per sequence; {self.rounds} rounds, engines interleaved; "
                 f"{self.threads} threads each; read bandwidth {self.read_bw / 1e9:.1f} GB/s",
                 "aggregate decode tok/s (median over the rounds):",
                 *self._grid(lambda r: f"{r.tok_s:.0f}", lambda b: f"{self.bound(b):.0f}"),
                 "per-request tok/s (aggregate ÷ B):",
                 *self._grid(lambda r: f"{r.per_request_tok_s:.1f}", lambda b: f"{self.bound(b) / b:.1f}"),
                 "% of the bound:",
                 *self._grid(lambda r: f"{100 * r.pct_of_bound:.0f}%")]
        if any(r.pct_of_read_now for r in self.rows):
            lines += ["% of the read measured around each run (that moment's bound; median over the rounds):",
                      *self._grid(lambda r: f"{100 * r.pct_of_read_now:.0f}%" if r.pct_of_read_now else "-")]
        ours = [m for m in ("minillm", "minillm compiled") if self._ran(m)]
        if len(ours) == 2:
            ours.append("minillm, faster path")
        path = "minillm compiled" if "minillm compiled" in ours else "minillm"
        read_lines = (path, path + FORWARD_ONLY)        # each taken against the read around its runs too
        for e in self.engines():
            if e.startswith("minillm") or not self._ran(e):
                continue
            like = [m + FORWARD_ONLY for m in ("minillm", "minillm compiled")
                    if e == "llama.cpp" and self._ran(m + FORWARD_ONLY)]
            for m in ours + like:           # llama-batched-bench times its forwards alone: so do ours
                ratios = [f"{a / b.tok_s:.2f}×" if a and b and b.status == "ok" else "-"
                          for a, b in ((self.ours_tok_s(m, n), self.get(e, n)) for n in self.batches)]
                lines.append(f"{m} ÷ {e} at B = {', '.join(map(str, self.batches))}: {', '.join(ratios)}")
                if m in read_lines:
                    lines.append(f"  the same, each as a share of the read around its runs: "
                                 f"{self._ratios_now(m, e)}")
        for e, note in self.notes.items():
            lines.append(f"  {e}: {note}")
        if any(self._ran(e) for e in self.engines() if e.endswith(FORWARD_ONLY)):
            lines.append(f"  …{FORWARD_ONLY}: the same runs, B ÷ their decode steps' forward time (step "
                         "records), no scheduling, sampling or detokenizing: llama-batched-bench's span")
        if self.read_drift.get("samples"):
            lines.append(drift_line(self.read_drift))
        for e in self.engines():
            if e.endswith(FORWARD_ONLY):
                continue                                 # its status is its engine's, told once
            down = next((r.status for r in self.rows if r.engine == e and r.status != "ok"), None)
            if down:
                lines.append(f"  {e}: {down}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------ the engines
class _BatchEngine:
    name = "engine"
    note = ""

    def setup(self) -> None: ...

    def aggregate_tok_s(self, prompts: list[list[int]], new_tokens: int) -> float:
        raise NotImplementedError

    def close(self) -> None: ...


FORWARD_ONLY = " forward only"      # the companion row of a minillm path: its forward's time alone


class MinillmBatch(_BatchEngine):
    name = "minillm"

    def __init__(self, llm):
        self.llm = llm
        self.last_forward_tok_s: float | None = None     # the last run's rate over its forwards alone

    @property
    def note(self) -> str:
        from minillm.bench.decode import matmul_line
        return matmul_line(self.llm.engine.runner)

    def aggregate_tok_s(self, prompts, new_tokens):
        from minillm.engine.sampling import SamplingParams
        history = self.llm.engine.step_history
        since = history[-1].step if history else -1
        outs = self.llm.generate(prompts,
                                 SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
        self.last_forward_tok_s = forward_tok_s(history, since, len(prompts))
        return sum(token_rate(o.metrics) for o in outs)


class MinillmCompiledBatch(MinillmBatch):
    """minillm with its compiled decode (engine/compiled.py): its graphs (one per row bucket, or two where
    every matmul is the tiled kernel) compiled in ``setup`` by a short generate at every batch, so no timed
    round pays a compile. Its own model,
    loaded with the same seed (the same weights): compiling swaps the packed matmuls back to plain ones,
    which the eager side keeps."""
    name = "minillm compiled"

    def __init__(self, make_llm, device: torch.device, batches: list[int], prompts: list[list[int]]):
        self.make_llm, self.device, self.batches, self.prompts = make_llm, device, batches, prompts
        self.llm, self.last_forward_tok_s = None, None

    def setup(self):
        from minillm.engine.compiled import compile_unavailable
        from minillm.engine.sampling import SamplingParams
        why = compile_unavailable(self.device)
        if why:
            raise PeerUnavailable(why)
        self.llm = self.make_llm()
        for b in self.batches:
            self.llm.generate(self.prompts[:b], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))

    @property
    def note(self) -> str:
        if self.llm is None:
            return ""
        runner = self.llm.engine.runner
        took = runner.compile_s.values()
        graphs = ("one graph for 1 row, one for every bucket from 2 rows up" if runner.rows_dynamic
                  else "one graph per row bucket")
        return (f"torch.compile, weights frozen, {graphs}; {len(took)} graphs compiled in "
                f"{sum(took):.0f} s before the rounds, not timed")


class TransformersBatch(TransformersEngine):
    """The batch-1 peer's set-up (minillm's weights, shared), timed on a [B, T] batch."""

    def setup(self):
        super().setup()
        self.note = self.note.replace("generate()", "generate() on a [B, T] batch")

    @torch.inference_mode()
    def aggregate_tok_s(self, prompts, new_tokens):
        x = torch.tensor(prompts, device=self.model.device)          # [B, T]: equal lengths, no padding
        clock = TokenClock()
        synchronize(self.model.device)
        self.hf.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=0, streamer=clock)
        ts = clock.stamps
        if len(ts) < 2:
            raise RuntimeError(f"generate produced {len(ts)} steps; decode needs at least 2")
        return len(prompts) * (len(ts) - 1) / max(ts[-1] - ts[0], 1e-9)


def _first_executable(*candidates: str | None) -> str | None:
    return next((str(c) for c in candidates if c and Path(c).is_file() and os.access(c, os.X_OK)), None)


def find_llama_batched_bench(path: str | None = None) -> str | None:
    """The ``llama-batched-bench`` binary: the given path, ``$MINILLM_LLAMA_BATCHED_BENCH``, or the PATH."""
    return _first_executable(path, os.environ.get("MINILLM_LLAMA_BATCHED_BENCH"),
                             shutil.which("llama-batched-bench"))


_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 7)


def parse_batched_bench(text: str) -> dict[int, float]:
    """``llama-batched-bench``'s table → {B: S_TG t/s}. Its columns: PP | TG | B | N_KV | T_PP s | S_PP t/s |
    T_TG s | S_TG t/s | T s | S t/s; S_TG is the aggregate text-generation speed of the B sequences."""
    out = {}
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if m:
            out[int(m.group(3))] = float(m.group(8))
    return out


class LlamaCppBatch(_BatchEngine):
    name = "llama.cpp"

    def __init__(self, model, tokenizer, threads: int, binary: str | None, n_ctx: int):
        self.model, self.tokenizer, self.threads, self.n_ctx = model, tokenizer, threads, n_ctx
        self.binary, self._tmp, self.gguf = find_llama_batched_bench(binary), None, None

    def setup(self):
        if self.binary is None:
            raise PeerUnavailable("llama-batched-bench not found (give --llama-batched-bench PATH or set "
                                  "$MINILLM_LLAMA_BATCHED_BENCH; it is built with llama.cpp)")
        try:
            import gguf  # noqa: F401
        except Exception as e:
            raise PeerUnavailable(f"the gguf package, which converts the weights, is not importable "
                                  f"({type(e).__name__})") from None
        self._tmp = tempfile.TemporaryDirectory(prefix="minillm-gguf-")
        self.gguf = Path(self._tmp.name) / "model.gguf"
        kind = write_gguf(self.model, self.gguf, self.tokenizer)
        self.note = (f"{Path(self.binary).name}, GGUF {kind} converted from the same weights, "
                     f"{self.threads} threads")

    def aggregate_tok_s(self, prompts, new_tokens):
        b = len(prompts)
        cmd = [self.binary, "-m", str(self.gguf), "-c", str(self.n_ctx * b), "-b", "2048", "-ub", "512",
               "-npp", str(len(prompts[0])), "-ntg", str(new_tokens), "-npl", str(b), "-t", str(self.threads)]
        for _ in range(3):
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            speeds = parse_batched_bench(run.stdout + run.stderr)
            # llama.cpp logs from a thread of its own, and its last line (our row) is now and then lost
            # at exit: seen 2 times in 42 runs, with exit status 0; the run is repeated
            if run.returncode != 0 or b in speeds:
                break
        if run.returncode != 0 or b not in speeds:
            raise RuntimeError(f"llama-batched-bench exited {run.returncode} without a row for B={b}: "
                               f"{(run.stderr or run.stdout)[-300:]}")
        return speeds[b]

    def close(self):
        if self._tmp is not None:
            self._tmp.cleanup()


def find_vllm_python(path: str | None = None) -> str | None:
    """The Python of vLLM's own virtual environment: the given path, then ``$MINILLM_VLLM_PYTHON``. vLLM pins
    its own torch, so it never shares minillm's environment."""
    return _first_executable(path, os.environ.get("MINILLM_VLLM_PYTHON"))


VLLM_WORKER = Path(__file__).with_name("vllm_worker.py")


class VllmBatch(_BatchEngine):
    """vLLM's CPU build, offline, in its own Python: one worker process (:mod:`minillm.bench.vllm_worker`)
    started in ``setup`` and kept for every round, so its start (about 45 s on the 2-core VM, most of it
    vLLM compiling its model) is never timed. The weights are minillm's, saved as a Hugging Face
    checkpoint; the warm-up's greedy tokens are compared with minillm's, which says the two decode the
    same model (fp32 on the Xeon VM: 64 of 64 equal; bf16 rounds differently in each engine)."""
    name = "vLLM"
    start_timeout_s = 900.0
    call_timeout_s = 900.0

    def __init__(self, llm, threads: int, python: str | None):
        self.llm, self.threads, self.python = llm, threads, find_vllm_python(python)
        self._tmp = self._proc = self._log = None
        self._lines: queue.Queue = queue.Queue()
        self.checked = False

    def setup(self):
        if self.python is None:
            raise PeerUnavailable("no Python with vLLM given (--vllm-python PATH or $MINILLM_VLLM_PYTHON; "
                                  "scripts/engines/setup_vllm_cpu.sh makes one)")
        from minillm.bench.decode import to_transformers
        self._tmp = tempfile.TemporaryDirectory(prefix="minillm-vllm-")
        ckpt = Path(self._tmp.name) / "checkpoint"
        hf = to_transformers(self.llm.model)
        # minillm's fused q/k/v and gate/up weights reach transformers as views of their rows, which
        # safetensors cannot write in place (a model with few heads gives non-contiguous ones)
        hf.save_pretrained(ckpt, state_dict={k: v.contiguous() for k, v in hf.state_dict().items()})
        cfg = self.llm.config
        setup = {"model": str(ckpt), "dtype": str(self.llm.dtype).removeprefix("torch."),   # "bfloat16"
                 "max_batch": cfg.max_batch_size, "max_len": cfg.max_model_len, "threads": self.threads}
        self._log = open(Path(self._tmp.name) / "vllm.log", "w+")
        self._proc = subprocess.Popen([self.python, str(VLLM_WORKER), json.dumps(setup)], text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log)
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._reply(self.start_timeout_s)
        if "error" in ready:
            raise PeerUnavailable(f"vLLM did not start: {ready['error']}")
        self.note = (f"vLLM {ready.get('vllm')} (torch {ready.get('torch')}, {ready.get('threads')} "
                     f"threads), offline LLM.generate in its own Python on the same weights; its own "
                     f"token stamps")

    def _read(self):
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)                          # the worker has exited

    def _reply(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"vLLM's worker gave no answer in {timeout:.0f} s") from None
        if line is None:
            self._log.seek(0)
            tail = self._log.read()[-300:]
            raise RuntimeError(f"vLLM's worker exited ({self._proc.wait()}): {tail}")
        return json.loads(line)

    def aggregate_tok_s(self, prompts, new_tokens):
        try:
            self._proc.stdin.write(json.dumps({"prompts": prompts, "new_tokens": new_tokens}) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass                                       # it has exited: _reply says how, from its log
        reply = self._reply(self.call_timeout_s)
        if "error" in reply:
            raise RuntimeError(f"vLLM: {reply['error']}")
        if not self.checked:                           # the warm-up: the same model, token for token?
            self.checked = True
            self.note += f"; {self._agreement(prompts, new_tokens, reply['tokens'])}"
        return float(reply["tok_s"])

    def _agreement(self, prompts, new_tokens, theirs: list[list[int]]) -> str:
        from minillm.engine.sampling import SamplingParams
        ours = self.llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0,
                                                         ignore_eos=True))
        same = sum(a == b for o, t in zip(ours, theirs) for a, b in zip(o.token_ids, t))
        return f"greedy tokens in the warm-up: {same} of {sum(len(o.token_ids) for o in ours)} as minillm's"

    def close(self):
        if self._proc is not None:
            try:
                self._proc.stdin.close()               # the worker ends at the end of its input
            except BrokenPipeError:
                pass
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()
        if self._tmp is not None:
            self._tmp.cleanup()


# ------------------------------------------------------------------------------ the run
def _companion(engine: _BatchEngine) -> tuple[str, ...]:
    """The forward-only row a minillm path keeps beside its own (none for a peer)."""
    return (engine.name + FORWARD_ONLY,) if isinstance(engine, MinillmBatch) else ()


def _finish(row: BatchPeerRow, bound: float, read_bw: float) -> BatchPeerRow:
    if row.status == "ok" and row.samples_tok_s:
        row.tok_s = statistics.median(row.samples_tok_s)
        row.spread = (max(row.samples_tok_s) - min(row.samples_tok_s)) / row.tok_s
        row.pct_of_bound = row.tok_s / bound
        if len(row.read_now) == len(row.samples_tok_s):     # the bound scaled to the read around each run
            row.pct_of_read_now = statistics.median(
                x / (bound * now / read_bw) for x, now in zip(row.samples_tok_s, row.read_now))
    elif row.status == "ok":
        row.status = "failed: no round finished"
    return row


def run_batch_peers(model: str = "cpu-small", device: str | None = None, dtype: str | None = None,
                    batches: tuple[int, ...] | list[int] = DEFAULT_BATCHES, prompt_tokens: int = 32,
                    new_tokens: int = 32, rounds: int = 3,
                    engines: tuple[str, ...] = ("minillm", "transformers", "llama.cpp"),
                    llama_batched_bench: str | None = None, vllm_python: str | None = None,
                    progress: bool = False) -> BatchPeerReport:
    """Aggregate decode tok/s of each engine at each batch, on the same weights and prompts (see the
    module docstring). A peer that cannot run is reported as unavailable, never raised. ``minillm
    compiled`` among ``engines`` adds minillm's compiled decode beside its eager one."""
    import sys

    from minillm.engine.llm import LLM
    batches = sorted(set(int(b) for b in batches))
    llm = LLM(model=model, device=device, dtype=dtype, max_batch_size=max(batches),
              max_model_len=prompt_tokens + new_tokens + 16)
    dev, dt, cfg = llm.device, llm.dtype, llm.model.config
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, cfg.vocab_size, (max(batches), prompt_tokens), generator=g).tolist()
    mean_context = prompt_tokens + new_tokens // 2
    step_bytes = {str(b): decode_step_bytes(cfg, dtype_bytes(dt), b, mean_context) for b in batches}
    read_nbytes = decode_read_bytes(dev, step_bytes[str(batches[0])])
    read_bw = measure_read_bandwidth(dev, nbytes=read_nbytes).value
    probe = ReadProbe(dev, read_nbytes)      # measured again before each batch: the bound can move (10.6)
    threads = torch.get_num_threads()

    made = {"minillm": lambda: MinillmBatch(llm),
            "minillm compiled": lambda: MinillmCompiledBatch(
                lambda: LLM(model=model, device=device, dtype=dtype, max_batch_size=max(batches),
                            max_model_len=prompt_tokens + new_tokens + 16, compile=True),
                dev, batches, prompts),
            "transformers": lambda: TransformersBatch(llm.model),
            "llama.cpp": lambda: LlamaCppBatch(llm.model, llm.tokenizer, threads, llama_batched_bench,
                                               prompt_tokens + new_tokens + 16),
            "vLLM": lambda: VllmBatch(llm, threads, vllm_python)}
    unknown = [e for e in engines if e not in made]
    if unknown:
        raise ValueError(f"unknown engine(s) {unknown}: {', '.join(made)}")
    candidates = [made[e]() for e in engines]
    names = [n for e in candidates for n in (e.name, *_companion(e))]
    rows = {(n, b): BatchPeerRow(n, b) for n in names for b in batches}
    live = []
    for e in candidates:                               # set up and warm up at the smallest batch
        try:
            e.setup()
            e.aggregate_tok_s(prompts[:batches[0]], new_tokens)
            live.append(e)
        except PeerUnavailable as why:
            for n in (e.name, *_companion(e)):
                for b in batches:
                    rows[(n, b)].status = f"unavailable: {why}"
        except Exception as ex:
            for n in (e.name, *_companion(e)):
                for b in batches:
                    rows[(n, b)].status = f"failed: {type(ex).__name__}: {ex}"
    try:
        for r in range(rounds):
            order = live[r % len(live):] + live[:r % len(live)] if live else []
            for b in batches:
                before = probe.sample()            # and between two engines' runs, one sample serves both
                for e in order:
                    row = rows[(e.name, b)]
                    if row.status != "ok":
                        continue
                    try:
                        gc.collect()
                        synchronize(dev)
                        row.samples_tok_s.append(e.aggregate_tok_s(prompts[:b], new_tokens))
                    except Exception as ex:
                        row.status = f"failed in round {r + 1}: {type(ex).__name__}: {ex}"
                        continue
                    done = [row]
                    for n in _companion(e):         # the same run, its forwards' time alone
                        if e.last_forward_tok_s is not None and rows[(n, b)].status == "ok":
                            rows[(n, b)].samples_tok_s.append(e.last_forward_tok_s)
                            done.append(rows[(n, b)])
                    after = probe.sample()
                    if before is not None and after is not None:
                        for d in done:
                            d.read_now.append((before + after) / 2)
                    before = after
            if progress:
                print(f"round {r + 1}/{rounds} done ({time.strftime('%H:%M:%S')})", file=sys.stderr)
    finally:
        notes = {e.name: e.note for e in candidates if e.note}
        for e in candidates:
            e.close()
        probe.close()
    report_rows = [_finish(rows[(n, b)], b * read_bw / step_bytes[str(b)], read_bw)
                   for n in names for b in batches]
    return BatchPeerReport(str(model), str(dev), dtype_name(dt), prompt_tokens, new_tokens, rounds, threads,
                           read_bw, batches, step_bytes, report_rows, notes,
                           probe.drift(read_bw).to_dict() if probe.samples else {})
