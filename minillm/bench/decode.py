"""Batch-1 decode benchmark: minillm vs transformers' ``generate``.

gpt-fast style: the measurement sits next to the result. We print decode tok/s with the
achieved bandwidth (bytes a decode step reads × steps per second, design.md §3) and its ratio
to this machine's *measured* read bandwidth — the only honest ceiling for "how close are we":
a decode step reads its weights and writes almost nothing. The copy bandwidth (read + write,
lower on most machines) is measured and shown beside it, labelled, never used as the bound.
``peers.py`` runs the same measurement against other engines, round by round.
"""
from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minillm.core.device import dtype_bytes, dtype_name, synchronize
from minillm.core.result import Col, Result, text_table
from minillm.core.step_record import FORWARD_PHASES, PHASES
from minillm.hardware.machine import (
    decode_read_bytes,
    measure_copy_bandwidth,
    measure_read_bandwidth,
    measure_step_read_bandwidth,
)
from minillm.perf.roofline import decode_step_bytes


@dataclass
class DecodeResult:
    name: str
    tok_s: float                     # decode tokens per second (batch 1, after the first token): the median
    step_ms: float
    achieved_bw: float               # bytes/s
    samples_tok_s: list[float] = field(default_factory=list)

    @property
    def spread(self) -> tuple[float, float]:
        """(min, max) of the samples: the median's company, always printed beside it."""
        xs = self.samples_tok_s or [self.tok_s]
        return min(xs), max(xs)


def ceiling_lines(bytes_per_step: int, read_bw: float | None, copy_bw: float | None,
                  step_read_bw: float | None = None) -> list[str]:
    """The bandwidths, labelled: read (the bound), read over a buffer of one step's size, and copy
    (read + write)."""
    out = [f"bytes read per decode step ≈ {bytes_per_step / 1e6:.1f} MB"]
    if read_bw:
        out.append(f"measured read bandwidth {read_bw / 1e9:.1f} GB/s (a sum reduction: what decode does) "
                   f"→ bound {read_bw / bytes_per_step:.1f} tok/s")
    if step_read_bw:
        above = bool(read_bw) and step_read_bw > 1.1 * read_bw
        out.append(f"measured read bandwidth over one step's {bytes_per_step / 1e6:.0f} MB, read again and "
                   f"again: {step_read_bw / 1e9:.1f} GB/s → {step_read_bw / bytes_per_step:.1f} tok/s"
                   + (" (above the bound: part of the weights stays in the caches from one step to the next, "
                      "so a decode can pass the bound)" if above else ""))
    if copy_bw:
        out.append(f"measured copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write; not the bound)")
    return out


DECODE_COLUMNS = (Col("engine", 14, left=True), Col("tok/s", 9, ".1f"), Col("min–max", 15),
                  Col("step ms", 10, ".2f"), Col("GB/s", 9, ".1f"), Col("% of read BW", 14),
                  Col("% of copy BW", 14))


@dataclass
class DecodeReport(Result):
    model: str
    device: str
    dtype: str
    prompt_tokens: int
    new_tokens: int
    repeats: int
    copy_bw: float                   # measured, bytes/s (read + write): shown, labelled, not the bound
    bytes_per_step: int
    results: list[DecodeResult]
    read_bw: float = 0.0            # measured, bytes/s (bytes read): the bound
    step_read_bw: float = 0.0       # over a buffer of bytes_per_step, re-read (0: not measured; see hardware)
    compile_s: float | None = None  # minillm with compile=True: its decode buckets' compile time
    matmul: str = ""                # minillm's decode matmuls: chosen on this machine, or plain

    def table(self) -> str:
        lines = [f"model {self.model} ({self.dtype}) on {self.device}; prompt {self.prompt_tokens} tokens, "
                 f"{self.new_tokens} new tokens, median of {self.repeats} runs (min–max beside it)",
                 *ceiling_lines(self.bytes_per_step, self.read_bw, self.copy_bw, self.step_read_bw),
                 *text_table(DECODE_COLUMNS, ([r.name, r.tok_s, "{:.1f}–{:.1f}".format(*r.spread), r.step_ms,
                                               r.achieved_bw / 1e9, _pct(r.achieved_bw, self.read_bw),
                                               _pct(r.achieved_bw, self.copy_bw)] for r in self.results))]
        if len(self.results) == 2:
            a, b = self.results
            lines.append(f"{a.name} / {b.name} = {a.tok_s / b.tok_s:.2f}×")
        if self.compile_s is not None:
            lines.append(f"torch.compile of minillm's decode: {self.compile_s:.1f} s (before the timed runs)")
        if self.matmul:
            lines.append(f"minillm's {self.matmul}")
        return "\n".join(lines)


def _pct(x: float, of: float | None) -> str:
    return f"{100 * x / of:.0f}%" if of else "-"


def _after_collecting(run: Callable[[], float], repeats: int) -> list[float]:
    """``run()`` ``repeats`` times, each after a garbage collection outside its timing, so that
    the garbage of what ran before is not collected inside it (as ``bench --peers`` does)."""
    out = []
    for _ in range(repeats):
        gc.collect()
        out.append(run())
    return out


def token_rate(metrics) -> float:
    """Decode tokens/s of one request from its token gaps: (N − 1) / (last token − first token).
    Not 1 / TPOT: TPOT starts at the first token that renders text, and a random-weight model in
    bf16 can emit only partial UTF-8 until its last token (TPOT 0 s, seen at batch 64)."""
    gaps = metrics.itl_s
    if not gaps or sum(gaps) <= 0:
        raise RuntimeError(f"request {metrics.request_id} has {len(gaps)} token gaps: no decode rate")
    return len(gaps) / sum(gaps)


def forward_tok_s(records, since_step: int, batch: int) -> float | None:
    """Aggregate tok/s over the forward alone: the decode steps after ``since_step`` that ran all
    ``batch`` rows and nothing else, their rows ÷ their forward time (forward issue + device wait; on a
    CPU the issue is the whole forward). None where no such step was recorded."""
    steps = [r for r in records if r.step > since_step and r.error is None and r.num_prefill_rows == 0
             and r.num_decode_rows == batch and r.compile_ms is None and len(r.t_ns) == len(PHASES)]
    seconds = sum(r.phase_ms[p] for r in steps for p in FORWARD_PHASES) / 1e3
    return sum(r.num_decode_rows for r in steps) / seconds if steps and seconds > 0 else None


def _minillm_decode_tok_s(llm, prompt_ids: list[int], new_tokens: int,
                          with_tokens: bool = False) -> float | tuple[float, list[int]]:
    from minillm.engine.sampling import SamplingParams
    out = llm.generate([prompt_ids], SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))[0]
    tok_s = token_rate(out.metrics)
    return (tok_s, out.token_ids) if with_tokens else tok_s


def to_transformers(model) -> torch.nn.Module:
    """The same weights in transformers' own implementation (module names are the same)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    c = model.config
    kw = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
              num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
              num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
              max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
              rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
              eos_token_id=None, bos_token_id=None, pad_token_id=0)
    if c.rope_scaling:
        kw["rope_scaling"] = c.rope_scaling
    if c.model_type == "qwen2":
        hf_cfg, cls = Qwen2Config(**kw), Qwen2ForCausalLM
    else:
        hf_cfg, cls = LlamaConfig(**kw, attention_bias=c.attention_bias), LlamaForCausalLM
    with torch.device("meta"):
        hf = cls(hf_cfg)
    # hf_state_dict: Hugging Face's names; the fused q/k/v and gate/up weights as views of their rows
    res = hf.load_state_dict(model.hf_state_dict(), strict=False, assign=True)
    missing = [k for k in res.missing_keys
               if "rotary_emb" not in k and not (c.tie_word_embeddings and k == "lm_head.weight")]
    if missing or res.unexpected_keys:   # a renamed key would stay on the meta device and fail later
        raise ValueError(f"weights do not map onto transformers' model: missing {missing[:3]}, "
                         f"unexpected {res.unexpected_keys[:3]}")
    hf.tie_weights()
    # buffers are not in the state dict: rebuild the rotary embedding (its inv_freq) for real
    rot = hf.model.rotary_emb
    with torch.device(model.device):
        hf.model.rotary_emb = type(rot)(config=hf_cfg)
    return hf.eval()


class TokenClock:
    """A ``generate`` streamer that stamps the host clock as each new token arrives (transformers
    hands a streamer the prompt first, then every new token: a host copy, so the token is done)."""

    def __init__(self):
        self.stamps: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.stamps.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


@torch.inference_mode()
def _transformers_decode_tok_s(hf, prompt_ids: list[int], new_tokens: int, device,
                               with_tokens: bool = False) -> float | tuple[float, list[int]]:
    """Decode rate of ``generate``, measured as minillm's TPOT is: from the first new token to the
    last, (N − 1) steps. (Subtracting a 1-token run from an N-token run, as this did before, can
    come out ≤ 0 on a busy machine with a small model.)"""
    x = torch.tensor([prompt_ids], device=device)
    clock = TokenClock()
    synchronize(device)
    out = hf.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                      pad_token_id=0,
                      streamer=clock)
    ts = clock.stamps
    if len(ts) < 2:
        raise RuntimeError(f"generate produced {len(ts)} tokens; decode needs at least 2")
    tok_s = (len(ts) - 1) / max(ts[-1] - ts[0], 1e-9)
    return (tok_s, out[0, len(prompt_ids):].tolist()) if with_tokens else tok_s


def summarise(name: str, samples: list[float], bytes_step: int) -> DecodeResult:
    tok_s = statistics.median(samples)
    return DecodeResult(name, tok_s, 1e3 / tok_s, tok_s * bytes_step, list(samples))


def run_decode_benchmark(model: str = "cpu-small", device: str | None = None, dtype: str | None = None,
                         prompt_tokens: int = 32, new_tokens: int = 64, repeats: int = 3,
                         compare_transformers: bool = True, copy_bytes: int | None = None,
                         enforce_eager: bool = False, compile: bool = False,
                         read_bytes: int | None = None) -> DecodeReport:
    """``enforce_eager``: the engine's plain path (no CUDA graphs, torch's own matmuls instead of the
    ones chosen on this machine).
    ``compile``: minillm decodes through ``torch.compile`` (its compile time is reported, and
    paid in the warm-up, before anything is timed). ``read_bytes``: the read-bandwidth buffer
    (default: ``copy_bytes`` when given, else twice the last-level cache)."""
    from minillm.engine.llm import LLM
    llm = LLM(model=model, device=device, dtype=dtype, max_batch_size=1, enforce_eager=enforce_eager,
              compile=compile)
    dev, dt = llm.device, llm.dtype
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, llm.model.config.vocab_size, (prompt_tokens,), generator=g).tolist()
    cfg, nbytes = llm.model.config, dtype_bytes(dt)
    bytes_step = decode_step_bytes(cfg, nbytes, 1, prompt_tokens + new_tokens // 2)   # mean context
    # the decode bound, as every command measures it: a read over one step's bytes
    read_nbytes = read_bytes or copy_bytes or decode_read_bytes(dev, bytes_step)
    read_bw = measure_read_bandwidth(dev, nbytes=read_nbytes).value
    step_read = measure_step_read_bandwidth(dev, bytes_step)
    copy_bw = measure_copy_bandwidth(dev, nbytes=copy_bytes).value

    _minillm_decode_tok_s(llm, prompt, new_tokens if compile else 8)     # warmup (compiles every bucket used)
    ours = _after_collecting(lambda: _minillm_decode_tok_s(llm, prompt, new_tokens), repeats)
    results = [summarise("minillm" + (" (compiled)" if compile else ""), ours, bytes_step)]
    if compare_transformers:
        hf = to_transformers(llm.model)
        _transformers_decode_tok_s(hf, prompt, 4, dev)                   # warmup
        theirs = _after_collecting(lambda: _transformers_decode_tok_s(hf, prompt, new_tokens, dev), repeats)
        results.append(summarise("transformers", theirs, bytes_step))
    compile_s = sum(llm.engine.runner.compile_s.values()) if compile else None
    return DecodeReport(str(model), str(dev), dtype_name(dt), prompt_tokens, new_tokens, repeats,
                       copy_bw, bytes_step, results, read_bw=read_bw,
                       step_read_bw=step_read.value if step_read else 0.0,
                       compile_s=compile_s, matmul=matmul_line(llm.engine.runner))


def matmul_line(runner) -> str:
    """What minillm's decode matmuls were: the choice made on this machine, or the plain path."""
    ch = runner.matmul_choice
    if ch is not None:
        pages = getattr(runner, "weight_pages", None)
        return ch.summary() + (f"; {pages.line()}" if pages is not None else "")
    if runner.compile and runner.device.type == "cpu":
        return "decode matmuls: laid out by Inductor's freezing (MKL's packed sgemm in fp32, oneDNN in bf16)"
    return "decode matmuls: torch's F.linear (the plain path)"
