"""Tokenize and detokenize (chapter 10.1's third and sixth stages; 10.5's time outside the GPU).

Any Hugging Face tokenizer directory works. The offline default is a byte-level BPE with 8192
tokens that this project trains itself (scripts/build_tokenizer.py) and ships in
minillm/assets/tokenizer/, so nothing is downloaded.

Streaming text is harder than it looks: one Chinese character is 3 UTF-8 bytes and a byte-level
BPE may put them in different tokens. Decoding token by token would emit "\ufffd" (the
replacement character) halfway through a character. ``IncrementalDetokenizer`` holds text back
until it decodes cleanly, and never crashes on ids the tokenizer does not know (a shape twin
has a 128k vocabulary; our default tokenizer has 8192).
"""
from __future__ import annotations

from pathlib import Path

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"
_CACHE: dict[str, object] = {}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(name_or_path: str | Path | None = None):
    """None or "default": the shipped BPE. A directory: a Hugging Face tokenizer saved there.
    Anything else: a hub id, looked up in the local cache first (no download unless the user
    asked for a hub model and the machine has access)."""
    from transformers import AutoTokenizer

    if name_or_path is None or str(name_or_path) == "default":
        path = DEFAULT_TOKENIZER_DIR
    else:
        path = Path(name_or_path).expanduser()
    key = str(path)
    if key in _CACHE:
        return _CACHE[key]
    if path.is_dir():
        if not any((path / f).exists() for f in _TOKENIZER_FILES):
            raise ValueError(f"{path} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}): pass "
                             f"tokenizer='default' for the shipped BPE, or a tokenizer directory")
        try:
            tok = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:
            raise ValueError(f"cannot load the tokenizer in {path}: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from None
    elif path.exists():
        raise ValueError(f"tokenizer {name_or_path!r} is a file; give its directory (with tokenizer.json)")
    else:
        try:
            tok = AutoTokenizer.from_pretrained(str(name_or_path), local_files_only=True)
        except Exception:
            try:
                tok = AutoTokenizer.from_pretrained(str(name_or_path))
            except Exception as e:
                raise ValueError(f"cannot load tokenizer {name_or_path!r}: not a directory, and not a hub id "
                                 f"in the local cache or reachable ({type(e).__name__}). Use None for the "
                                 f"default tokenizer.") from None
    _CACHE[key] = tok
    return tok


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Text → ids, with the tokenizer's own special tokens (a Llama tokenizer adds BOS), unless
    the text already starts with the BOS string (a chat template that writes {{ bos_token }}):
    then adding them would give two BOS tokens."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
    bos = getattr(tokenizer, "bos_token", None)
    add = not (isinstance(bos, str) and bos and prompt.startswith(bos))
    return list(tokenizer.encode(prompt, add_special_tokens=add))


def apply_chat(tokenizer, messages: list[dict]) -> str:
    """Chat messages → one prompt string, through the tokenizer's chat template (the default
    tokenizer ships a ChatML-style one). Tokenizers without a template get a plain format."""
    for m in messages:
        if (not isinstance(m, dict) or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)):
            raise ValueError("each message must be an object with string 'role' and 'content'")
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas whose concatenation is the decoded text.

    The method (also used by vLLM and TGI): keep a window of ids starting a few tokens back
    (``prefix``); decode the window with and without the newest ids; emit the difference once
    it no longer ends in a replacement character (a character whose bytes are still arriving).
    Decoding from a prefix rather than token by token also keeps tokenizers that drop a
    token's leading space at the start of a string (SentencePiece) correct.
    """

    MAX_HELD = 8   # a genuinely invalid byte sequence must not hold text back for ever

    def __init__(self, tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = [t for t in (prompt_ids or [])[-4:] if self._known(t)]  # context only
        self.prefix = 0                # window start
        self.read = len(self.ids)      # ids up to here have been emitted
        self.unknown_ids = 0           # how many ids had no token (shape twins)

    def _known(self, token_id: int) -> bool:
        return 0 <= token_id < self.vocab_size

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add one id; return the text that is now complete (maybe "")."""
        if not self._known(token_id):
            self.unknown_ids += 1
            return self.flush() + f"<unk:{token_id}>"
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        held = len(self.ids) - self.read
        if len(after) > len(before) and (not after.endswith("\ufffd") or held >= self.MAX_HELD):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Emit whatever is held back (at the end of a request, or before an unknown id)."""
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]
