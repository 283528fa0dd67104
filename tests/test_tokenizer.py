"""The shipped tokenizer and the UTF-8-safe incremental detokenizer."""
import json

import pytest

from minillm.engine.tokenizer import (
    DEFAULT_TOKENIZER_DIR,
    IncrementalDetokenizer,
    apply_chat,
    encode_prompt,
    load_tokenizer,
)
from minillm.model.config import DEFAULT_VOCAB


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def test_default_tokenizer_shape(tok):
    assert len(tok) == DEFAULT_VOCAB == 8192
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert (DEFAULT_TOKENIZER_DIR / "tokenizer.json").exists()
    assert json.loads((DEFAULT_TOKENIZER_DIR / "tokenizer.json").read_text())["model"]["type"] == "BPE"


@pytest.mark.parametrize("text",
                         ["def f(x):\n    return x + 1", "你好，世界！推理请求的生命周期", "emoji 🚀 ok",
                          "\t  spaces  "])
def test_round_trip(tok, text):
    assert tok.decode(encode_prompt(tok, text)) == text


def test_some_chinese_character_spans_several_tokens(tok):
    """Otherwise the streaming test below would prove nothing."""
    text = "屋顶线模型的脊点与算术强度，龘靐齉"
    pieces = [tok.decode([i]) for i in tok.encode(text)]
    assert any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("text", ["屋顶线模型的脊点与算术强度，龘靐齉", "mixed 中文 and code: x = 1  # 注释",
                                  "🚀🚀 ok"])
def test_incremental_detokenizer_never_breaks_a_character(tok, text):
    d = IncrementalDetokenizer(tok)
    deltas = [d.push(i) for i in tok.encode(text)] + [d.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)


def test_incremental_detokenizer_uses_prompt_as_context(tok):
    prompt = tok.encode("你好")
    out = tok.encode("世界")
    d = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(d.push(i) for i in out) + d.flush() == "世界"


def test_unknown_ids_do_not_crash(tok):
    """A shape twin has a 128k vocabulary: ids beyond ours become visible placeholders."""
    d = IncrementalDetokenizer(tok)
    ids = tok.encode("ab") + [100_000] + tok.encode("cd") + [-1]
    text = "".join(d.push(i) for i in ids) + d.flush()
    assert text == "ab<unk:100000>cd<unk:-1>" and d.unknown_ids == 2


def test_unknown_id_in_the_middle_of_a_character_flushes_it(tok):
    ids = tok.encode("龘")
    assert len(ids) > 1
    d = IncrementalDetokenizer(tok)
    held = d.push(ids[0])
    text = held + d.push(99_999) + "".join(d.push(i) for i in ids[1:]) + d.flush()
    assert "<unk:99999>" in text and text.count("<unk:") == 1


def test_chat_template(tok):
    s = apply_chat(tok, [{"role": "user", "content": "hi"}])
    assert s == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="role"):
        apply_chat(tok, [{"content": "no role"}])


def test_bad_tokenizer_names_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(str(tmp_path / "missing" / "nowhere"))
    f = tmp_path / "tokenizer.json"
    f.write_text("{}")
    with pytest.raises(ValueError, match="directory"):
        load_tokenizer(str(f))


def test_checkpoint_without_tokenizer_says_what_to_do(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer='default'"):
        load_tokenizer(str(tmp_path))


@pytest.mark.parametrize("kind", ["stream", "window"])
@pytest.mark.parametrize("prompt", ["", "你好"])
def test_bytes_that_never_complete_a_character_are_not_lost_at_the_end(tok, kind, prompt):
    """A request cut by max_tokens in the middle of a character: while it runs nothing broken is
    emitted, and at its end the held bytes come out as the tokenizer decodes them (U+FFFD), so the
    final text is the tokenizer's own decode of the output, whichever detokenizer ran."""
    from minillm.engine.output import StreamDetokenizer
    ids = tok.encode("ab龘")[:-1]                       # the last character's final piece is missing
    assert tok.decode(ids).endswith("\ufffd")
    prompt_ids = tok.encode(prompt) if prompt else []
    d = StreamDetokenizer(tok, prompt_ids) if kind == "stream" else IncrementalDetokenizer(tok, prompt_ids)
    running = [d.push(i) for i in ids]
    assert all("\ufffd" not in x for x in running)
    assert "".join(running) + d.flush() == tok.decode(ids)
    assert d.flush() == ""                               # given once
