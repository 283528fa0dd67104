"""``python -m minillm bench-engine``: engine v2's benchmarks, each printed beside its peer from
the same run (never a timed test):

- **stall**: N requests decode when a long prompt arrives; max and p99 ITL of the decoders,
  aggregate output tok/s and the long request's TTFT, under ``prefill-first`` and ``chunked``
  (chapter 10.4's stall and its fix);
- **prefix**: TTFT of one long prompt, cold (nothing cached) against warm (the same prompt ran
  before: a prefix-cache hit), alternating (10.6's fourth self-deception);
- **packed**: prefill of prompts of different lengths, packed ``[N]`` tokens through the engine
  against one padded ``[B, max T]`` forward of the same model.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from minillm.core.result import Result
from minillm.engine.llm import LLM
from minillm.engine.sampling import SamplingParams
from minillm.loadgen.workload import LengthDist, make_prompts, stall_scenario
from minillm.metrics.definitions import request_metrics


@dataclass
class StallRow:
    policy: str
    budget: int
    itl_max_ms: float
    itl_p99_ms: float
    itl_p50_ms: float
    output_tok_s: float
    long_ttft_ms: float


@dataclass
class EngineBench(Result):
    model: str
    device: str
    dtype: str
    torch_threads: int
    stall: list[StallRow] = field(default_factory=list)
    stall_setup: dict = field(default_factory=dict)
    prefix_cold_ms: list[float] = field(default_factory=list)
    prefix_warm_ms: list[float] = field(default_factory=list)
    prefix_cached_tokens: int = 0
    packed_ms: list[float] = field(default_factory=list)
    padded_ms: list[float] = field(default_factory=list)
    packed_lengths: list[int] = field(default_factory=list)

    def table(self) -> str:
        out = [f"engine benchmarks: {self.model} {self.dtype} on {self.device}, {self.torch_threads} torch "
               "threads"]
        if self.stall:
            s = self.stall_setup
            out.append(f"\nstall: {s['n_short']} requests decoding, a {s['long_prompt_len']}-token prompt "
                       "arrives")
            out.append(f"{'policy':<14}{'budget':>7}{'ITL max ms':>12}{'ITL p99 ms':>12}{'ITL p50 ms':>12}"
                       f"{'out tok/s':>11}{'long TTFT ms':>14}")
            for r in self.stall:
                out.append(f"{r.policy:<14}{r.budget:>7}{r.itl_max_ms:>12.1f}{r.itl_p99_ms:>12.1f}{r.itl_p50_ms:>12.1f}{r.output_tok_s:>11.1f}{r.long_ttft_ms:>14.1f}")
            a, b = self.stall[0], self.stall[-1]
            out.append(f"chunked/prefill-first: max ITL ÷{a.itl_max_ms / b.itl_max_ms:.2f}, output tok/s "
                       f"×{b.output_tok_s / a.output_tok_s:.3f}, long TTFT "
                       f"×{b.long_ttft_ms / a.long_ttft_ms:.2f}")
        if self.prefix_cold_ms:
            c, w = statistics.median(self.prefix_cold_ms), statistics.median(self.prefix_warm_ms)
            out.append(f"\nprefix cache: TTFT cold {c:.1f} ms (median of {len(self.prefix_cold_ms)}, "
                       f"{min(self.prefix_cold_ms):.1f}–{max(self.prefix_cold_ms):.1f}), warm {w:.1f} ms "
                       f"({min(self.prefix_warm_ms):.1f}–{max(self.prefix_warm_ms):.1f}; "
                       f"{self.prefix_cached_tokens} tokens cached): ×{c / w:.1f}")
        if self.packed_ms:
            n = sum(self.packed_lengths)
            p, q = statistics.median(self.packed_ms), statistics.median(self.padded_ms)
            padded = len(self.packed_lengths) * max(self.packed_lengths)
            out.append(f"\npacked prefill of {len(self.packed_lengths)} prompts ({n} tokens; padded: "
                       f"{padded}): packed {p:.0f} ms = {n / p * 1e3:.0f} tok/s, padded {q:.0f} ms = "
                       f"{n / q * 1e3:.0f} tok/s: ×{q / p:.2f}")
        return "\n".join(out)


def _stall_row(llm: LLM, policy: str, budget: int, setup: dict) -> StallRow:
    eng = llm.engine
    eng.scheduler.policy = policy
    eng.scheduler.max_num_batched_tokens = budget
    eng.allocator.forget()
    res = stall_scenario(llm, **setup)
    ms = [request_metrics(o.trace) for o in res.outputs]
    short = [m for m in ms if m.request_id in res.short_ids]
    itl = np.array([g for m in short for g in m.itl_s]) * 1e3
    start = min(m.t_start_ns for m in ms)
    end = max(m.t_end_ns for m in ms)
    n_out = sum(m.output_tokens for m in ms)
    long_m = next(m for m in ms if m.request_id == res.long_id)
    return StallRow(policy, budget, float(itl.max()), float(np.percentile(itl, 99)),
                    float(np.percentile(itl, 50)),
                    n_out / ((end - start) / 1e9), long_m.ttft_s * 1e3)


def run_engine_bench(model: str = "cpu-small", device: str | None = None, dtype: str | None = None,
                     n_short: int = 8, long_prompt: int = 2048, chunk: int = 256, prefix_prompt: int = 1024,
                     repeats: int = 3, packed_lengths: list[int] | None = None,
                     parts: tuple[str, ...] = ("stall", "prefix", "packed")) -> EngineBench:
    llm = LLM(model, device=device, dtype=dtype, max_batch_size=max(n_short + 1, 8),
              max_model_len=max(long_prompt, prefix_prompt) + 64, scheduling_policy="prefill-first")
    res = EngineBench(model, str(llm.device), str(llm.dtype).replace("torch.", ""), torch.get_num_threads())
    vocab = llm.model.config.vocab_size
    llm.generate([[5] * 32], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))    # warm-up
    if "stall" in parts:
        setup = dict(n_short=n_short, short_prompt_len=16, short_output=48, long_prompt_len=long_prompt,
                     long_output=4, arrive_after_tokens=16)
        res.stall_setup = setup
        res.stall = [_stall_row(llm, "prefill-first", max(2048, long_prompt), setup),
                     _stall_row(llm, "chunked", chunk, setup)]
    eng = llm.engine
    eng.scheduler.policy, eng.scheduler.max_num_batched_tokens = "chunked", 2048
    if "prefix" in parts:
        p = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        for i in range(repeats):
            prompt = make_prompts(1, LengthDist.fixed(prefix_prompt), 1000 + i, vocab)[0]
            eng.allocator.forget()
            cold = llm.generate([prompt], p)[0]
            warm = llm.generate([prompt], p)[0]
            res.prefix_cold_ms.append(cold.metrics.ttft_s * 1e3)
            res.prefix_warm_ms.append(warm.metrics.ttft_s * 1e3)
            res.prefix_cached_tokens = warm.num_cached_tokens
    if "packed" in parts:
        lengths = packed_lengths or [16, 32, 64, 128, 256, 512, 768, 1024]
        res.packed_lengths = lengths
        prompts = [make_prompts(1, LengthDist.fixed(n), 50 + i, vocab)[0] for i, n in enumerate(lengths)]
        p = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        padded = torch.zeros(len(lengths), max(lengths), dtype=torch.long, device=llm.device)
        for b, ids in enumerate(prompts):
            padded[b, :len(ids)] = torch.tensor(ids)
        for _ in range(repeats):
            eng.allocator.forget()
            eng.scheduler.max_num_batched_tokens = sum(lengths)      # one step holds every prompt
            t0 = time.perf_counter()
            llm.generate(prompts, p)
            res.packed_ms.append((time.perf_counter() - t0) * 1e3)
            with torch.inference_mode():
                t0 = time.perf_counter()
                _padded_prefill(llm.model, padded, torch.tensor(lengths, device=llm.device) - 1)
                if llm.device.type == "cuda":
                    torch.cuda.synchronize()
                res.padded_ms.append((time.perf_counter() - t0) * 1e3)
    return res


def _padded_prefill(model, tokens: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The v1 engine's prefill: one [B, max T] forward, right-padded, causal attention, and the
    LM head on each row's last real token only (so the comparison is the padding alone)."""
    from minillm.model.transformer import rope_cos_sin
    B, T = tokens.shape
    positions = torch.arange(T, device=tokens.device).expand(B, T)
    x = model.model.embed_tokens(tokens)                                     # [B, T, hidden]
    cos, sin = rope_cos_sin(model.inv_freq, positions, x.dtype)
    for layer in model.model.layers:
        x = layer(x, cos, sin)
    x = x[torch.arange(B, device=x.device), last]                            # [B, hidden]
    return model.lm_head(model.model.norm(x))                                # [B, vocab]
