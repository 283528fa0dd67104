"""Batch-1 decode benchmark (issue: engine core): minillm vs transformers' ``generate``.

gpt-fast style: the measurement sits next to the result. We print decode tok/s with the
achieved bandwidth (bytes a decode step reads × steps per second, design.md §3) and its ratio
to this machine's *measured* copy bandwidth — the only honest ceiling for "how close are we".
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from minillm.measure.hardware import dtype_bytes, dtype_name, measure_copy_bandwidth, synchronize
from minillm.measure.roofline import decode_step_bytes


@dataclass
class DecodeResult:
    name: str
    tok_s: float                     # decode tokens per second (batch 1, after the first token)
    step_ms: float
    achieved_bw: float               # bytes/s
    samples_tok_s: list[float] = field(default_factory=list)


@dataclass
class BenchReport:
    model: str
    device: str
    dtype: str
    prompt_tokens: int
    new_tokens: int
    repeats: int
    copy_bw: float                   # measured, bytes/s (read + write)
    bytes_per_step: int
    results: list[DecodeResult]

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        lines = [f"model {self.model} ({self.dtype}) on {self.device}; prompt {self.prompt_tokens} tokens, "
                 f"{self.new_tokens} new tokens, median of {self.repeats} runs",
                 f"bytes read per decode step ≈ {self.bytes_per_step / 1e6:.1f} MB; "
                 f"measured copy bandwidth {self.copy_bw / 1e9:.1f} GB/s "
                 f"→ bound {self.copy_bw / self.bytes_per_step:.1f} tok/s",
                 f"{'engine':<14}{'tok/s':>9}{'step ms':>10}{'GB/s':>9}{'% of copy BW':>14}"]
        for r in self.results:
            lines.append(f"{r.name:<14}{r.tok_s:>9.1f}{r.step_ms:>10.2f}{r.achieved_bw / 1e9:>9.1f}"
                         f"{100 * r.achieved_bw / self.copy_bw:>13.0f}%")
        if len(self.results) == 2:
            a, b = self.results
            lines.append(f"{a.name} / {b.name} = {a.tok_s / b.tok_s:.2f}×")
        return "\n".join(lines)


def _minillm_decode_tok_s(llm, prompt_ids: list[int], new_tokens: int) -> float:
    from minillm.engine.sampling import SamplingParams
    out = llm.generate([prompt_ids], SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))[0]
    m = out.metrics
    return 1.0 / m.tpot_s


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
    res = hf.load_state_dict(model.state_dict(), strict=False, assign=True)
    missing = [k for k in res.missing_keys if "rotary_emb" not in k and not (c.tie_word_embeddings and k == "lm_head.weight")]
    if missing or res.unexpected_keys:   # a renamed key would stay on the meta device and fail later
        raise ValueError(f"weights do not map onto transformers' model: missing {missing[:3]}, "
                         f"unexpected {res.unexpected_keys[:3]}")
    hf.tie_weights()
    # buffers are not in the state dict: rebuild the rotary embedding (its inv_freq) for real
    rot = hf.model.rotary_emb
    with torch.device(model.device):
        hf.model.rotary_emb = type(rot)(config=hf_cfg)
    return hf.eval()


@torch.inference_mode()
def _transformers_decode_tok_s(hf, prompt_ids: list[int], new_tokens: int, device) -> float:
    """Decode rate of ``generate``: time(N new tokens) − time(1 new token) covers N−1 decode steps."""
    x = torch.tensor([prompt_ids], device=device)

    def run(n: int) -> float:
        synchronize(device)
        t = time.perf_counter()
        hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        synchronize(device)
        return time.perf_counter() - t

    t1, tn = run(1), run(new_tokens)
    return (new_tokens - 1) / max(tn - t1, 1e-9)


def run_decode_benchmark(model: str = "cpu-small", device: str | None = None, dtype: str | None = None,
                         prompt_tokens: int = 32, new_tokens: int = 64, repeats: int = 3,
                         compare_transformers: bool = True, copy_bytes: int | None = None,
                         enforce_eager: bool = False) -> BenchReport:
    """``enforce_eager``: no CUDA graphs for the engine's decode (on a CPU nothing changes)."""
    from minillm.engine.llm import LLM
    llm = LLM(model=model, device=device, dtype=dtype, max_batch_size=1, enforce_eager=enforce_eager)
    dev, dt = llm.device, llm.dtype
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, llm.model.config.vocab_size, (prompt_tokens,), generator=g).tolist()
    cfg, nbytes = llm.model.config, dtype_bytes(dt)
    bytes_step = decode_step_bytes(cfg, nbytes, 1, prompt_tokens + new_tokens // 2)   # mean context
    copy_bw = measure_copy_bandwidth(dev, nbytes=copy_bytes).value

    def summarise(name: str, samples: list[float]) -> DecodeResult:
        tok_s = statistics.median(samples)
        return DecodeResult(name, tok_s, 1e3 / tok_s, tok_s * bytes_step, samples)

    _minillm_decode_tok_s(llm, prompt, 8)                                # warmup
    ours = [_minillm_decode_tok_s(llm, prompt, new_tokens) for _ in range(repeats)]
    results = [summarise("minillm", ours)]
    if compare_transformers:
        hf = to_transformers(llm.model)
        _transformers_decode_tok_s(hf, prompt, 4, dev)                   # warmup
        theirs = [_transformers_decode_tok_s(hf, prompt, new_tokens, dev) for _ in range(repeats)]
        results.append(summarise("transformers", theirs))
    return BenchReport(str(model), str(dev), dtype_name(dt), prompt_tokens, new_tokens, repeats,
                       copy_bw, bytes_step, results)
