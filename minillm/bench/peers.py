"""Peers side by side (``python -m minillm bench --peers``): batch-1 decode of minillm, ``transformers``
and llama.cpp on the very same weights, interleaved round by round.

Every engine decodes the same prompt greedily for the same number of tokens; a round runs each engine once, in
an order rotated from round to round, so a slow minute of the machine hits every engine alike (chapter 10.6).
Before each timed decode the garbage collector runs, outside the clock: without that, the compile's garbage
was once collected inside a compiled engine's first timed round (148 ms of a 0.9 s decode: 69 tok/s against 85
in the other rounds); what the collector still takes inside the timed decodes is printed. Each engine's tok/s
is reported as the median over the rounds with its min–max and spread, with the achieved bandwidth (bytes a
decode step reads × tok/s: the same bytes for every engine, since the weights and dtype are the same) and its
share of the measured *read* bandwidth, the ceiling of a decode step. A speed is only comparable if the
engines computed the same thing: each engine's greedy continuation is compared with minillm's, and the table
prints how many leading tokens agree (rounding differs between kernels, so two close logits can swap after a
while on random weights; a mismatch at token 1 would mean a wrong model).

- ``transformers`` always runs: ``to_transformers`` hands it minillm's own weights (views, no copy).
- llama.cpp runs through the ``llama-cpp-python`` package (an optional extra: it builds
  llama.cpp from source) on a GGUF file that ``write_gguf`` converts from the same weights with
  the ``gguf`` package (F32, BF16 or F16 as the model is). Where either package is missing, the
  peer is reported as unavailable, with the reason; that is not an error.
"""
from __future__ import annotations

import gc
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minillm.bench.decode import ceiling_lines
from minillm.core.device import dtype_bytes, dtype_name, synchronize
from minillm.core.result import Col, Result, text_table
from minillm.engine.gc_pauses import GC_CLOCK
from minillm.hardware.machine import (
    decode_read_bytes,
    measure_copy_bandwidth,
    measure_read_bandwidth,
    measure_step_read_bandwidth,
)
from minillm.hardware.read_probe import ReadProbe, drift_line
from minillm.perf.roofline import decode_step_bytes


class PeerUnavailable(Exception):
    """A peer that cannot run here (a package is missing, the model is not convertible)."""


# ------------------------------------------------------------------------------ results
@dataclass
class PeerResult:
    name: str
    status: str                                  # "ok" | "unavailable: <why>" | "failed: <why>"
    samples_tok_s: list[float] = field(default_factory=list)   # one per round, in round order
    tok_s: float | None = None                   # median over the rounds
    tok_s_min: float | None = None
    tok_s_max: float | None = None
    spread: float | None = None                  # (max − min) / median
    achieved_bw: float | None = None             # bytes/s at the median
    pct_of_read_bw: float | None = None          # achieved_bw / measured read bandwidth
    note: str = ""                               # what exactly ran (e.g. the GGUF type, threads)
    tokens: list[int] = field(default_factory=list)   # the greedy continuation of the last round
    same_tokens: int | None = None          # leading tokens equal to minillm's (eager) continuation
    gc_ms: float = 0.0                      # Python's garbage collector inside the timed rounds, all together


PEER_COLUMNS = (Col("engine", 22, left=True), Col("tok/s", 8, ".1f"), Col("min–max", 15),
                Col("spread", 8, ".0f", "%"), Col("GB/s", 8, ".1f"), Col("% of read BW", 14, ".0f", "%"),
                Col("same tokens", 13))


@dataclass
class PeerRun(Result):
    """What a peer comparison ran: one model in one dtype on one device, the same prompt and
    number of new tokens for every engine, so many rounds."""
    model: str
    device: str
    dtype: str
    prompt_tokens: int
    new_tokens: int
    rounds: int


@dataclass
class PeerReport(PeerRun):
    read_bw: float                               # measured, bytes/s (a sum reduction): the bound
    copy_bw: float                               # measured, bytes/s (read + write): shown, not the bound
    bytes_per_step: int
    threads: int
    peers: list[PeerResult]
    step_read_bw: float = 0.0                    # over a buffer of bytes_per_step, re-read (0: not measured)
    read_drift: dict = field(default_factory=dict)  # the read speed sampled before every round (read_probe)

    def get(self, name: str) -> PeerResult:
        return next(p for p in self.peers if p.name == name)

    def _row(self, p: PeerResult) -> list:
        if p.status != "ok":
            return [p.name, p.status]
        same = "—" if p.same_tokens is None else f"{p.same_tokens}/{self.new_tokens}"
        return [p.name, p.tok_s, f"{p.tok_s_min:.1f}–{p.tok_s_max:.1f}", 100 * p.spread, p.achieved_bw / 1e9,
                100 * p.pct_of_read_bw, same]

    def table(self) -> str:
        lines = [f"model {self.model} ({self.dtype}) on {self.device}; batch 1, prompt {self.prompt_tokens} "
                 f"tokens, {self.new_tokens} new tokens; {self.rounds} rounds, the engines interleaved "
                 f"(order rotated each round); {self.threads} threads each",
                 *ceiling_lines(self.bytes_per_step, self.read_bw, self.copy_bw, self.step_read_bw),
                 *text_table(PEER_COLUMNS, (self._row(p) for p in self.peers))]
        for p in self.peers:
            if p.note and p.status == "ok":
                lines.append(f"  {p.name}: {p.note}")
        if self.read_drift.get("samples"):
            lines.append(drift_line(self.read_drift))
        timed = [p for p in self.peers if p.status == "ok"]
        if timed:
            lines.append("garbage collected before every timed decode; inside them, over all rounds: "
                         + ", ".join(f"{p.name} {p.gc_ms:.1f} ms" for p in timed))
        ok = {p.name: p for p in self.peers if p.status == "ok"}
        ours = [p for n, p in ok.items() if n.startswith("minillm")]
        for i, base in enumerate(ours):    # each minillm variant against every engine after it
            for name, p in ok.items():
                if not any(p is q for q in ours[:i + 1]):
                    lines.append(f"{base.name} / {name} = {base.tok_s / p.tok_s:.2f}× (medians)")
        return "\n".join(lines)


def _finish(p: PeerResult, bytes_step: int, read_bw: float) -> PeerResult:
    if p.status == "ok" and p.samples_tok_s:
        xs = p.samples_tok_s
        p.tok_s, p.tok_s_min, p.tok_s_max = statistics.median(xs), min(xs), max(xs)
        p.spread = (p.tok_s_max - p.tok_s_min) / p.tok_s
        p.achieved_bw = p.tok_s * bytes_step
        p.pct_of_read_bw = p.achieved_bw / read_bw if read_bw else None
    return p


def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two continuations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ------------------------------------------------------------------------------ the engines
class _Engine:
    """``decode_tok_s`` times one greedy decode and leaves the generated ids in ``tokens``."""
    name = "engine"
    note = ""
    tokens: list[int] = []

    def setup(self) -> None: ...

    def decode_tok_s(self, prompt: list[int], new_tokens: int) -> float:
        raise NotImplementedError

    def close(self) -> None: ...


class MinillmEngine(_Engine):
    """minillm's engine, batch 1: decode tok/s = 1 / TPOT from the request's trace."""

    def __init__(self, llm, name: str = "minillm"):
        self.llm, self.name = llm, name

    @property
    def note(self) -> str:
        from minillm.bench.decode import matmul_line
        runner = self.llm.engine.runner
        if not runner.compile:
            return matmul_line(runner)
        return (f"torch.compile: {sum(runner.compile_s.values()):.1f} s for {len(runner.compile_s)} decode "
                f"bucket(s), paid in the warm-up before the timed rounds")

    def decode_tok_s(self, prompt, new_tokens):
        from minillm.bench.decode import _minillm_decode_tok_s
        tok_s, self.tokens = _minillm_decode_tok_s(self.llm, prompt, new_tokens, with_tokens=True)
        return tok_s


class TransformersEngine(_Engine):
    """``transformers``' ``generate`` on minillm's weights: (N − 1) / (time(N) − time(1))."""
    name = "transformers"

    def __init__(self, model):
        self.model, self.hf = model, None

    def setup(self):
        import transformers

        from minillm.bench.decode import to_transformers
        self.hf = to_transformers(self.model)
        self.note = f"transformers {transformers.__version__}, generate(), greedy, the same weights (shared)"

    def decode_tok_s(self, prompt, new_tokens):
        from minillm.bench.decode import _transformers_decode_tok_s
        tok_s, self.tokens = _transformers_decode_tok_s(self.hf, prompt, new_tokens, self.model.device,
                                                        with_tokens=True)
        return tok_s

    def close(self):
        self.hf = None


def llama_cpp_unavailable() -> str | None:
    """Why the llama.cpp peer cannot run here, or None."""
    missing = []
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:          # not installed, or a build that does not load
        missing.append(f"llama-cpp-python is not importable ({type(e).__name__}: {e})")
    try:
        import gguf  # noqa: F401
    except Exception as e:
        missing.append(f"the gguf package, which converts the weights, is not importable "
                       f"({type(e).__name__})")
    if not missing:
        return None
    return ("; ".join(missing) + ". Install both with `pip install -e \".[peers]\"` "
            "(llama-cpp-python builds llama.cpp from source: minutes)")


class LlamaCppEngine(_Engine):
    """llama.cpp through llama-cpp-python on a GGUF converted from the same weights. Greedy
    sampling inside llama.cpp; decode tok/s = (N − 1) / (time of tokens 2…N)."""
    name = "llama.cpp"

    def __init__(self, model, tokenizer, n_ctx: int, threads: int, gguf_path: str | Path | None = None):
        self.model, self.tokenizer, self.n_ctx, self.threads = model, tokenizer, n_ctx, threads
        self.gguf_path = Path(gguf_path) if gguf_path else None
        self._tmp = None
        self.llm = None

    def setup(self):
        why = llama_cpp_unavailable()
        if why:
            raise PeerUnavailable(why)
        if self.model.device.type not in ("cpu", "cuda"):
            raise PeerUnavailable(f"llama.cpp is compared on cpu or cuda, not {self.model.device.type}")
        from llama_cpp import Llama
        if self.gguf_path is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="minillm-gguf-")
            self.gguf_path = Path(self._tmp.name) / "model.gguf"
        t0 = time.perf_counter()
        kind = write_gguf(self.model, self.gguf_path, self.tokenizer)
        convert_s = time.perf_counter() - t0
        gpu = self.model.device.type == "cuda"
        self.llm = Llama(model_path=str(self.gguf_path), n_ctx=self.n_ctx, n_batch=min(512, self.n_ctx),
                         n_threads=self.threads, n_threads_batch=self.threads, n_gpu_layers=-1 if gpu else 0,
                         seed=0, logits_all=False, verbose=False)
        import llama_cpp
        self.note = (f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}, GGUF {kind} converted from "
                     f"the same weights in {convert_s:.1f} s, {self.threads} threads"
                     + (", all layers on the GPU" if gpu else ""))

    def decode_tok_s(self, prompt, new_tokens):
        llm = self.llm
        llm.reset()                                  # no prefix reuse between rounds: a fresh prefill
        gen = llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)
        try:
            tokens = [next(gen)]                     # prefill + the first token
            t0 = time.perf_counter()
            for _ in range(new_tokens - 1):
                tokens.append(next(gen))             # one decode step each
            dt = time.perf_counter() - t0
        finally:
            gen.close()
        self.tokens = [int(t) for t in tokens]
        return (new_tokens - 1) / max(dt, 1e-9)

    def close(self):
        if self.llm is not None:
            try:
                self.llm.close()
            except Exception:
                pass
            self.llm = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


# ------------------------------------------------------------------------------ GGUF
_GGUF_TENSORS = {           # Hugging Face name (inside a layer) → llama.cpp's
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def permute_for_gguf(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Hugging Face's Llama rotates the two *halves* of each head (``rotate_half``); llama.cpp's
    "llama" architecture rotates adjacent *pairs*. Reorder each head's rows so the pairs line
    up (llama.cpp's convert_hf_to_gguf.py does the same). Qwen2 rotates halves in llama.cpp
    too, so it needs no permutation."""
    # w: [n_head · head_dim, ...] → the same shape, rows (h, half, i) reordered to (h, i, half)
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _llama3_rope_factors(cfg) -> torch.Tensor | None:
    """Llama-3's frequency-dependent RoPE scaling, as llama.cpp reads it: one factor per
    frequency (``rope_freqs.weight``)."""
    rs = cfg.rope_scaling
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind != "llama3":
        raise PeerUnavailable(f"rope scaling {kind!r} is not converted to GGUF by minillm (llama3 only)")
    d = cfg.head_dim
    freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old = rs.get("original_max_position_embeddings", 8192)
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def _gguf_vocab(tokenizer, vocab_size: int):
    """(tokens, token types, merges) for llama.cpp's BPE ("gpt2") vocabulary. The benchmark feeds
    token ids, so the vocabulary only has to load; ids the tokenizer lacks (a twin of a
    128k-vocabulary model with the 8192-token default tokenizer) are padded as ``[PAD<i>]``."""
    import json

    import gguf
    vocab, merges, special = {}, [], set()
    try:
        d = json.loads(tokenizer.backend_tokenizer.to_str())
        if d["model"]["type"] == "BPE":
            vocab = d["model"]["vocab"]
            merges = [m if isinstance(m, str) else " ".join(m) for m in d["model"]["merges"]]
        for t in d.get("added_tokens", []):
            vocab.setdefault(t["content"], t["id"])
            special.add(t["id"])
    except Exception:               # not a fast BPE tokenizer: placeholders load as well
        vocab, merges = {}, []
    by_id = {i: t for t, i in vocab.items() if i < vocab_size}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    return tokens, types, merges


@torch.no_grad()
def write_gguf(model, path: str | Path, tokenizer=None) -> str:
    """Write ``model`` (a Llama-family ``Transformer``: llama or qwen2) as a GGUF file llama.cpp
    loads, in the model's dtype (F32, BF16 or F16; the norms in F32, as llama.cpp wants them).
    Returns the GGUF type written ("F32", "BF16" or "F16")."""
    import gguf
    import numpy as np
    cfg = model.config
    arch = {"llama": "llama", "qwen2": "qwen2"}.get(cfg.model_type)
    if arch is None:
        raise PeerUnavailable(f"model_type {cfg.model_type!r} has no GGUF conversion in minillm")
    kind, qtype, ftype = {
        torch.float32: ("F32", gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
        torch.bfloat16: ("BF16", gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
        torch.float16: ("F16", gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    }[model.dtype]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    # the model's shape, in llama.cpp's key names (gguf's GGUFWriter.add_<key>)
    header = {"name": cfg.name, "context_length": cfg.max_position_embeddings,
              "embedding_length": cfg.hidden_size, "block_count": cfg.num_layers,
              "feed_forward_length": cfg.intermediate_size, "head_count": cfg.num_heads,
              "head_count_kv": cfg.num_kv_heads, "key_length": cfg.head_dim, "value_length": cfg.head_dim,
              "rope_dimension_count": cfg.head_dim, "rope_freq_base": cfg.rope_theta,
              "layer_norm_rms_eps": cfg.rms_norm_eps, "vocab_size": cfg.vocab_size, "file_type": ftype}
    for key, value in header.items():
        getattr(w, f"add_{key}")(value)
    if tokenizer is None:
        from minillm.engine.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(None)
    tokens, types, merges = _gguf_vocab(tokenizer, cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
    if eos is not None:
        w.add_eos_token_id(int(eos))
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(int(cfg.bos_token_id))
    w.add_add_bos_token(False)

    def put(name: str, t: torch.Tensor) -> None:
        a = t.detach().float().cpu().numpy()
        if a.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a.astype(np.float32))           # norms, biases, rope factors: F32
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)   # bf16 values: exact

    factors = _llama3_rope_factors(cfg) if arch == "llama" else None
    if cfg.rope_scaling and arch != "llama":
        raise PeerUnavailable(f"rope scaling on {arch} is not converted to GGUF by minillm")
    if factors is not None:
        put("rope_freqs.weight", factors)
    sd = model.hf_state_dict()
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_layers):
        for hf, gg in _GGUF_TENSORS.items():
            key = f"model.layers.{i}.{hf}"
            if key not in sd:
                continue                                         # no bias on llama
            t = sd[key]
            if arch == "llama" and "q_proj" in hf:
                t = permute_for_gguf(t, cfg.num_heads)
            elif arch == "llama" and "k_proj" in hf:
                t = permute_for_gguf(t, cfg.num_kv_heads)
            put(f"blk.{i}.{gg}", t)
    put("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])              # tied: llama.cpp reuses token_embd
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return kind


# ------------------------------------------------------------------------------ the run
def run_peers(model: str = "cpu-small", device: str | None = None, dtype: str | None = None,
              prompt_tokens: int = 32, new_tokens: int = 64, rounds: int = 5,
              engines: tuple[str, ...] = ("minillm", "transformers", "llama.cpp"), compile: bool = False,
              read_bytes: int | None = None, copy_bytes: int | None = None,
              gguf_path: str | Path | None = None, progress: bool = False) -> PeerReport:
    """Batch-1 decode of each engine on the same weights and prompt, ``rounds`` rounds, engines
    interleaved (see the module docstring). ``compile``: add minillm with ``torch.compile``'d
    decode as one more engine. A peer that cannot run is reported, never raised."""
    import sys

    from minillm.engine.llm import LLM
    llm = LLM(model=model, device=device, dtype=dtype, max_batch_size=1)
    dev, dt = llm.device, llm.dtype
    cfg = llm.model.config
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, cfg.vocab_size, (prompt_tokens,), generator=g).tolist()
    bytes_step = decode_step_bytes(cfg, dtype_bytes(dt), 1, prompt_tokens + new_tokens // 2)   # mean context
    # the decode bound, as every command measures it: a read over one step's bytes
    read_nbytes = read_bytes or copy_bytes or decode_read_bytes(dev, bytes_step)
    read_bw = measure_read_bandwidth(dev, nbytes=read_nbytes).value
    step_read = measure_step_read_bandwidth(dev, bytes_step)
    copy_bw = measure_copy_bandwidth(dev, nbytes=copy_bytes).value
    threads = torch.get_num_threads()
    probe = ReadProbe(dev, read_nbytes)      # measured again before each round: the bound can move (10.6)

    candidates: list[_Engine] = []
    for name in engines:
        if name == "minillm":
            candidates.append(MinillmEngine(llm))
            if compile:
                comp = LLM(model=model, device=device, dtype=dtype, max_batch_size=1, compile=True)
                candidates.append(MinillmEngine(comp, "minillm (compiled)"))
        elif name == "transformers":
            candidates.append(TransformersEngine(llm.model))
        elif name == "llama.cpp":
            candidates.append(LlamaCppEngine(llm.model, llm.tokenizer, prompt_tokens + new_tokens + 16,
                                             threads,
                                             gguf_path))
        else:
            raise ValueError(f"unknown engine {name!r}: minillm, transformers, llama.cpp")
    results = {e.name: PeerResult(e.name, "ok") for e in candidates}
    live: list[_Engine] = []
    for e in candidates:                                   # set up and warm up (compiles, page-ins)
        try:
            e.setup()
            e.decode_tok_s(prompt, new_tokens)
            live.append(e)
        except PeerUnavailable as why:
            results[e.name].status = f"unavailable: {why}"
        except Exception as ex:
            results[e.name].status = f"failed: {type(ex).__name__}: {ex}"
    try:
        for r in range(rounds):
            order = live[r % len(live):] + live[:r % len(live)] if live else []
            probe.sample()
            for e in order:
                res = results[e.name]
                if res.status != "ok":
                    continue
                try:
                    gc.collect()         # the garbage of what ran before, not inside this engine's timing
                    synchronize(dev)
                    gc_before = GC_CLOCK.spent_ns()
                    res.samples_tok_s.append(e.decode_tok_s(prompt, new_tokens))
                    res.gc_ms += (GC_CLOCK.spent_ns() - gc_before) / 1e6
                except Exception as ex:
                    res.status = f"failed in round {r + 1}: {type(ex).__name__}: {ex}"
            if progress:
                print(f"round {r + 1}/{rounds}: " + ", ".join(
                    f"{n} {p.samples_tok_s[-1]:.1f}" for n, p in results.items()
                    if p.status == "ok" and p.samples_tok_s),
                      file=sys.stderr)
    finally:
        for e in candidates:
            results[e.name].note = e.note
            results[e.name].tokens = list(e.tokens)
            e.close()
        probe.close()
    peers = [_finish(results[e.name], bytes_step, read_bw) for e in candidates]
    reference = results["minillm"].tokens if "minillm" in results else []
    for p in peers:
        if p.status == "ok" and reference and p.tokens:
            p.same_tokens = leading_agreement(reference, p.tokens)
    return PeerReport(str(model), str(dev), dtype_name(dt), prompt_tokens, new_tokens, rounds, read_bw,
                      copy_bw,
                      bytes_step, threads, peers, step_read.value if step_read else 0.0,
                      probe.drift(read_bw).to_dict() if probe.samples else {})
