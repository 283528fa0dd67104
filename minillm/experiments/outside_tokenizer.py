"""What tokenizing and detokenizing cost per token (chapter 10.5: time on the host, outside the
accelerator), for English prose, Chinese prose and source code.

- **encode**: ``tokenizer.encode(text)`` on a text of about ``n_tokens`` tokens, µs per token
  produced. A server pays it once per request, for the whole prompt (it is part of TTFT).
- **incremental decode**: the ids pushed one at a time through the detokenizer the engine uses
  (``minillm.engine.output.make_detokenizer``: ``DecodeStream`` for a fast tokenizer), µs per
  token. A server pays it for every output token of every running request, every step. The
  window detokenizer (``IncrementalDetokenizer``, the fallback for slow tokenizers) is timed
  beside it.

Any Hugging Face tokenizer directory works (``tokenizers=[None, "/path/to/Llama-3.1-8B"]``;
None is the shipped 8k BPE). The texts are built in (English and Chinese written for this
project, code from minillm's own source), so the measurement needs no download.

Tokenizers cache the pieces of words they have seen; the texts repeat to reach ``n_tokens``
and every timing is a warm one, as in a server that has been running for a while.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from minillm.core.result import Col, Result, text_table

ENGLISH = """\
A request for a language model begins its life at the gateway. The server checks the key that came
with it, counts it against a rate limit, and reads the body: a prompt, the number of tokens wanted,
and how to choose them. Then the prompt is cut into tokens, and the request waits in a queue until
the scheduler finds room for it in the next step.

Its first step is the prefill. The model reads the whole prompt at once, writes the keys and values
of every position into the cache, and produces the first new token. After that the request decodes:
one token per step, and every step reads all of the model's weights again. That is why a single
request is slow and a batch is cheap, since sixty-four requests can share one reading of the weights.

Around each step the host keeps busy. It decides which requests run, copies their tokens and
positions to the device, launches the kernels of every layer, waits for the result, picks the next
token of each row from its probabilities, turns the new ids into text, checks the stop rules, and
hands each piece of text to a stream that carries it back to the user as an event.

None of this is the big matrix multiplication that benchmarks like to quote. On a large model with a
large batch it hides in the shadow of the device's work. On a small model, or with one request, it
can be a third of the time, and a faster accelerator will not make it any shorter. Measuring it is
the first step towards removing it: capture the launches in a graph, sample on the device, overlap
the host's work for the next step with the device's work for this one.
"""

CHINESE = """\
一次推理请求的旅程从服务器的入口开始。入口先核对请求带来的密钥，再按照速率限制计数，然后读取请求体：
提示词、想要生成的词元数量，以及挑选词元的方式。接着提示词被切分成词元，请求在队列里等候，直到调度器
在下一步里为它腾出位置。

它的第一步是预填充。模型一次读完整段提示词，把每个位置的键和值写进缓存，并产生第一个新词元。此后请求
进入解码阶段：每一步只产生一个词元，而每一步都要把模型的全部权重重新读一遍。所以单独一个请求跑得很慢，
一批请求却很划算，因为六十四个请求可以共享同一次权重读取。

在每一步的前后，主机也没有闲着。它要决定哪些请求参与运行，把它们的词元和位置复制到设备上，逐层发起计算
内核，等待结果，根据概率为每一行挑选下一个词元，把新的编号还原成文字，检查停止条件，再把每一段文字交给
数据流，以事件的形式送回用户手中。

这些工作都不是基准测试喜欢引用的大矩阵乘法。模型大、批次大的时候，它们藏在设备计算的阴影里；模型小，
或者只有一个请求的时候，它们可能占到三分之一的时间，而且换一块更快的加速卡也不会让它们变短。先把它们
测量出来，才谈得上消除：用计算图一次提交所有内核，在设备上完成采样，让主机为下一步做的准备与设备这一步
的计算重叠起来。
"""

_CODE_FILES = ("engine/scheduler.py", "engine/sampling.py", "engine/output.py", "engine/runner.py")


def code_text() -> str:
    """Real Python: minillm's own scheduler, sampler, output processor and runner."""
    root = Path(__file__).resolve().parents[1]
    return "\n".join((root / f).read_text(encoding="utf-8") for f in _CODE_FILES)


def sample_texts() -> dict[str, str]:
    return {"English": ENGLISH, "Chinese": CHINESE, "code": code_text()}


@dataclass
class TokenizerRow:
    tokenizer: str
    text: str                    # "English", "Chinese", "code"
    op: str                      # "encode", "decode (DecodeStream)", "decode (window)"
    n_tokens: int
    n_chars: int
    us_per_token: list[float]    # every sample
    us_per_token_median: float = 0.0
    same_text: bool = True    # decode: the deltas add up to tokenizer.decode(ids) (modulo surrounding spaces)

    def __post_init__(self) -> None:
        if self.us_per_token and not self.us_per_token_median:
            self.us_per_token_median = statistics.median(self.us_per_token)

    @property
    def chars_per_token(self) -> float:
        return self.n_chars / self.n_tokens if self.n_tokens else float("nan")


TOKENIZER_OPS = ("encode", "decode (DecodeStream)", "decode (window)")
TOKENIZER_COLUMNS = (Col("tokenizer", 24, left=True), Col("text", 9, left=True),
                     Col("chars/token", 12, ".2f"), Col("encode", 10, ".2f"),
                     Col("decode (DecodeStream)", 23, ".2f"), Col("decode (window)", 17, ".2f"))


@dataclass
class TokenizerBench(Result):
    hardware: str
    repeats: int
    n_tokens: int
    rows: list[TokenizerRow] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)

    def get(self, tokenizer: str, text: str, op: str) -> TokenizerRow | None:
        return next((r for r in self.rows if (r.tokenizer, r.text, r.op) == (tokenizer, text, op)), None)

    def table(self) -> str:
        out = [f"tokenizer cost, µs per token (median of {self.repeats}; ~{self.n_tokens} tokens per text) "
               f"on {self.hardware}"]
        rows = []
        for tk in dict.fromkeys(r.tokenizer for r in self.rows):
            for text in dict.fromkeys(r.text for r in self.rows if r.tokenizer == tk):
                enc = self.get(tk, text, "encode")
                us = [getattr(self.get(tk, text, op), "us_per_token_median", None) for op in TOKENIZER_OPS]
                rows.append([tk[:23], text, enc.chars_per_token if enc else float("nan"), *us])
        return "\n".join(out + text_table(TOKENIZER_COLUMNS, rows))


def tokenizer_label(name_or_path: str | None) -> str:
    if name_or_path is None or str(name_or_path) == "default":
        return "default (8k BPE)"
    return Path(str(name_or_path)).name or str(name_or_path)


def _repeat_to(tokenizer, text: str, n_tokens: int) -> tuple[str, list[int]]:
    """``text`` repeated (whole copies) until it holds at least ``n_tokens`` tokens; a text far
    longer than that is cut to about ``n_tokens`` tokens instead."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) > 2 * n_tokens:
        text = tokenizer.decode(ids[:n_tokens], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text, tokenizer.encode(text, add_special_tokens=False)
    copies = max(1, -(-n_tokens // max(1, len(ids))))
    full = "\n".join([text] * copies)
    return full, tokenizer.encode(full, add_special_tokens=False)


def time_encode(tokenizer, text: str, repeats: int) -> list[float]:
    """µs per token of ``tokenizer.encode(text)``, one sample per call (after one warm call)."""
    n = len(tokenizer.encode(text, add_special_tokens=False))
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokenizer.encode(text, add_special_tokens=False)
        out.append((time.perf_counter() - t0) * 1e6 / n)
    return out


def time_incremental_decode(tokenizer, ids: list[int], repeats: int,
                            window: bool = False) -> tuple[list[float], bool]:
    """µs per token of pushing ``ids`` one by one through a fresh detokenizer: the engine's
    (``make_detokenizer``) or, with ``window``, ``IncrementalDetokenizer``; and whether the
    deltas added up to the whole decoded text."""
    from minillm.engine.output import make_detokenizer
    from minillm.engine.tokenizer import IncrementalDetokenizer

    expected = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    out, same = [], True
    for _ in range(repeats + 1):                                   # the first pass warms up
        d = IncrementalDetokenizer(tokenizer) if window else make_detokenizer(tokenizer, [])
        t0 = time.perf_counter()
        parts = [d.push(t) for t in ids]
        parts.append(d.flush())
        dt = time.perf_counter() - t0
        same = same and "".join(parts).strip() == expected.strip()
        out.append(dt * 1e6 / len(ids))
    return out[1:], same


def run_tokenizer_bench(tokenizers: list[str | None] | tuple = (None,), texts: dict[str, str] | None = None,
                        n_tokens: int = 2000, repeats: int = 5) -> TokenizerBench:
    """Encode and incremental decode, µs per token, for each tokenizer × text (module docstring)."""
    import tokenizers as tk_lib
    import transformers

    from minillm.engine.output import StreamDetokenizer, make_detokenizer
    from minillm.engine.tokenizer import load_tokenizer
    from minillm.hardware.machine import describe_hardware

    texts = texts or sample_texts()
    rows: list[TokenizerRow] = []
    for name in tokenizers:
        tok = load_tokenizer(name)
        label = tokenizer_label(name)
        stream = isinstance(make_detokenizer(tok, []), StreamDetokenizer)
        for kind, base in texts.items():
            text, ids = _repeat_to(tok, base, n_tokens)
            rows.append(TokenizerRow(label, kind, "encode", len(ids), len(text),
                                     time_encode(tok, text, repeats)))
            ops = (["decode (DecodeStream)"] if stream else []) + ["decode (window)"]
            for op in ops:
                us, same = time_incremental_decode(tok, ids, repeats, window=op == "decode (window)")
                rows.append(TokenizerRow(label, kind, op, len(ids), len(text), us, same_text=same))
    return TokenizerBench(hardware=describe_hardware("cpu").summary(), repeats=repeats, n_tokens=n_tokens,
                          rows=rows,
                          versions={"tokenizers": tk_lib.__version__,
                                    "transformers": transformers.__version__})
