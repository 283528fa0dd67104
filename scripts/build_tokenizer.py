"""Rebuild the default tokenizer shipped in minillm/assets/tokenizer/.

A byte-level BPE with exactly 8192 tokens, trained with the `tokenizers` library on text we may
redistribute: the Python standard library's own source on this machine (PSF licence) and a short
Chinese text written for this project (scripts/corpus_zh.txt). Byte-level means every string
round-trips, and a Chinese character (3 UTF-8 bytes) may be split across tokens — exactly the
case incremental detokenization must handle.

    python scripts/build_tokenizer.py [--out minillm/assets/tokenizer] [--max-mb 6]

The result is loaded through transformers' PreTrainedTokenizerFast (AutoTokenizer).
"""
from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 8192                      # = minillm.model.config.DEFAULT_VOCAB (the tiny preset's vocabulary)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# ChatML-style template: <|im_start|>role\ncontent<|im_end|>\n ... then the assistant's turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HERE = Path(__file__).resolve().parent


def corpus(max_bytes: int) -> list[str]:
    """Sorted stdlib .py files up to max_bytes (deterministic), then the Chinese text 20 times
    (it is short; repeating it gives its characters enough weight to earn merges)."""
    texts, total = [], 0
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in p.parts or "test" in p.parts:
            continue
        try:
            t = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(t)
        total += len(t.encode())
        if total >= max_bytes:
            break
    zh = (HERE / "corpus_zh.txt").read_text(encoding="utf-8")
    return texts + [zh] * 20


def build(max_mb: float) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # ids 0..5, <|endoftext|> = 0
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(int(max_mb * 2**20)), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    assert tok.token_to_id("<|endoftext|>") == 0
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL[1:], chat_template=CHAT_TEMPLATE,
                                   model_max_length=1 << 20, clean_up_tokenization_spaces=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE.parent / "minillm" / "assets" / "tokenizer"))
    ap.add_argument("--max-mb", type=float, default=6.0, help="megabytes of stdlib source to train on")
    a = ap.parse_args()
    fast = build(a.max_mb)
    fast.save_pretrained(a.out)
    print(f"wrote {len(fast)} tokens to {a.out}")


if __name__ == "__main__":
    main()
