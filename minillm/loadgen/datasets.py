"""What a load test sends: prompts from a dataset (random words, a lognormal of lengths, a JSONL file,
ShareGPT) with their token counts, and when (a Poisson or gamma arrival schedule), as vLLM's
``bench serve`` draws them."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minillm.loadgen.workload import LengthDist, gamma_arrivals

# ---------------------------------------------------------------------------------------------
# Workload
_WORDS = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
          "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "they", "you",
          "were", "her", "she", "there", "one", "all", "we", "their", "been", "has", "when", "who", "will",
          "more", "no", "if", "out", "so", "said", "what", "up", "its", "about", "into", "than", "them",
          "can", "only", "other", "new", "some", "could", "time", "these", "two", "may", "then", "do",
          "first", "any", "my", "now", "such", "like", "our", "over", "man", "me", "even", "most", "made",
          "after", "also", "did", "many", "before", "must", "through", "back", "years", "where", "much",
          "your", "way", "well", "down", "should", "because", "each", "just", "those", "people", "how",
          "too", "little", "state", "good", "very", "make", "world", "still", "own", "see", "men", "work",
          "long", "get", "here", "between", "both", "life", "being", "under", "never", "day", "same",
          "another", "know", "while", "last", "might", "us", "great", "old", "year", "off", "come", "since",
          "against", "go", "came", "right", "used", "take", "three"]


@dataclass
class BenchRequest:
    prompt: str
    output_len: int
    input_len: int           # the target: tokens with --tokenizer, else words (usage says what was processed)


def _prompt(rng: np.random.Generator, n_words: int, unique: bool, prefix_rng: np.random.Generator) -> str:
    words = [_WORDS[i] for i in rng.integers(0, len(_WORDS), size=max(n_words - 1 if unique else n_words, 0))]
    if unique:   # a random prefix: no two prompts share even their first token
        words.insert(0, "".join(prefix_rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=8)))
    return " ".join(words)


def range_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's ``--random-range-ratio`` form: lengths uniform in [⌊L(1−r)⌋, ⌈L(1+r)⌉], r ∈ [0, 1)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if length < 1:
        raise ValueError(f"lengths must be ≥ 1, got {length}")
    return max(1, math.floor(length * (1 - range_ratio))), max(1, math.ceil(length * (1 + range_ratio)))


SHAREGPT_DEFAULT = Path(__file__).resolve().parents[1] / "assets" / "prompts" / "sharegpt_minillm.json"
DATASETS = ("random", "lognormal", "jsonl", "sharegpt")


def load_count_tokenizer(name: str | None):
    """The tokenizer ``--tokenizer`` names (a local directory, ``default`` for minillm's shipped
    BPE, or a hub id already in the local cache), or None. It only *counts* tokens: exact prompt
    lengths for ``random``, output lengths for ``sharegpt``, and the counts of a server that sends
    no ``usage``."""
    if not name:
        return None
    from minillm.engine.tokenizer import load_tokenizer
    return load_tokenizer(name)


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _sharegpt_rows(path: str | Path, tokenizer, output_len: int | None) -> list[BenchRequest]:
    """ShareGPT's format, as vLLM reads it: a JSON list of ``{"conversations": [{"from": "human",
    "value": ...}, {"from": "gpt", "value": ...}, ...]}``; the first human turn is the prompt and
    the reply after it sets the output length (its token count with ``--tokenizer``, else its word
    count, a target, or ``--sharegpt-output-len``). Unlike vLLM, short turns are kept (vLLM drops
    prompts or replies under 4 tokens): "hi" and "ok thanks" are real traffic too."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the ShareGPT file {path}: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    rows = []
    for conv in data:
        turns = ((conv.get("conversations") or conv.get("conversation") or []) if isinstance(conv, dict)
                 else [])
        for a, b in zip(turns, turns[1:]):
            if (isinstance(a, dict) and isinstance(b, dict)
                    and a.get("from") == "human" and b.get("from") == "gpt"
                    and isinstance(a.get("value"), str) and isinstance(b.get("value"), str)
                    and a["value"].strip()):
                n_in = count_tokens(tokenizer, a["value"]) if tokenizer else len(a["value"].split())
                n_out = output_len or (count_tokens(tokenizer, b["value"]) if tokenizer
                                       else len(b["value"].split()))
                rows.append(BenchRequest(a["value"], max(1, n_out), n_in))
                break
    if not rows:
        raise ValueError(f"{path} holds no human → gpt turn")
    return rows


def _jsonl_rows(path: str, tokenizer) -> list[BenchRequest]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for ln, line in enumerate(f, 1):
            if line.strip():
                d = json.loads(line)
                if (not isinstance(d, dict) or not isinstance(d.get("prompt"), str)
                        or not int(d.get("output_len", 0)) >= 1):
                    raise ValueError(f"{path}:{ln}: need {{'prompt': str, 'output_len': int ≥ 1}}")
                n_in = count_tokens(tokenizer, d["prompt"]) if tokenizer else len(d["prompt"].split())
                rows.append(BenchRequest(d["prompt"], int(d["output_len"]), n_in))
    if not rows:
        raise ValueError(f"{path} holds no requests")
    return rows


def _trim_to_tokens(tokenizer, prompt: str, n: int) -> str:
    """The prompt cut to exactly its first ``n`` tokens (re-encoding may merge a token or two at
    the cut; the server's usage says what it really processed)."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)[:n]
    return tokenizer.decode(ids)


def sample_requests(n: int, dataset: str = "random", input_len: int = 128, output_len: int = 64,
                    range_ratio: float = 0.0, lognormal_sigma: float = 0.5, dataset_path: str | None = None,
                    same_prompt: bool = False, seed: int = 0, tokenizer=None,
                    sharegpt_output_len: int | None = None, nonce: int | None = None) -> list[BenchRequest]:
    """``n`` requests: prompts and output lengths from the chosen dataset (lengths and words
    deterministic per seed). File datasets are shuffled with the seed and cycled when they hold
    fewer than ``n``.

    Unique prompts start with a random prefix drawn from ``nonce`` as well as the seed, and the
    nonce is fresh each run unless given: a second run with the same ``--seed`` against the same
    server must not find the first run's prompts in its prefix cache (that would be the fourth
    self-deception of 10.6, by accident). File prompts repeat across runs, as in vLLM's client."""
    if n < 0:
        raise ValueError(f"--num-prompts must be ≥ 0, got {n}")
    rng = np.random.default_rng(seed)
    prefix_rng = np.random.default_rng([seed,
                                        nonce if nonce is not None
                                        else int.from_bytes(os.urandom(8), "little")])
    if dataset in ("jsonl", "sharegpt"):
        if dataset == "jsonl" and not dataset_path:
            raise ValueError("--dataset-name jsonl needs --dataset-path")
        rows = _jsonl_rows(dataset_path, tokenizer) if dataset == "jsonl" else \
            _sharegpt_rows(dataset_path or SHAREGPT_DEFAULT, tokenizer, sharegpt_output_len)
        order = rng.permutation(len(rows)) if dataset == "sharegpt" else np.arange(len(rows))
        reqs = [rows[order[i % len(rows)]] for i in range(n)]
        return [BenchRequest(reqs[0].prompt, r.output_len,
                             reqs[0].input_len) for r in reqs] if same_prompt else reqs
    if dataset == "random":
        in_d, out_d = LengthDist.uniform(*range_bounds(input_len, range_ratio)), \
            LengthDist.uniform(*range_bounds(output_len, range_ratio))
    elif dataset == "lognormal":
        in_d = LengthDist.lognormal(input_len, lognormal_sigma, 1, max(1, 8 * input_len))
        out_d = LengthDist.lognormal(output_len, lognormal_sigma, 1, max(1, 8 * output_len))
    else:
        raise ValueError(f"--dataset-name must be one of {', '.join(DATASETS)}, got {dataset!r}")
    ins, outs = in_d.sample(n, rng), out_d.sample(n, rng)               # [n], [n]

    def make(n_in: int, unique: bool) -> str:
        p = _prompt(rng, n_in, unique, prefix_rng)
        return _trim_to_tokens(tokenizer, p, n_in) if tokenizer else p

    if same_prompt and n:
        p = make(int(ins[0]), unique=False)
        return [BenchRequest(p, int(o), int(ins[0])) for o in outs]
    return [BenchRequest(make(int(i), unique=True), int(o), int(i)) for i, o in zip(ins, outs)]


def arrival_schedule(n: int, request_rate: float = math.inf, burstiness: float = 1.0,
                     seed: int = 0) -> list[float]:
    """Send times (seconds after the start) of ``n`` requests, computed before anything is sent.
    ``inf``: all at 0. Otherwise Gamma gaps with shape ``burstiness`` and mean 1/rate
    (:func:`~minillm.loadgen.workload.gamma_arrivals`; burstiness 1 = Poisson)."""
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * n
    return gamma_arrivals(request_rate, n, burstiness=burstiness, seed=seed)


