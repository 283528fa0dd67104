"""Notebook 01 walks one request through its stages by hand before any HTTP (chapter 10.1), and
what that walk shows holds for the engine itself: a prefill step fills exactly the prompt's
positions of its KV slot, each decode step one more, and the detokenizer never emits half a
character. The notebook's cells are found by their ids (nbstripout keeps them)."""
from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import nbformat
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "01_request_lifecycle.ipynb"
PROMPT = "The lifecycle of an inference request begins when"
CJK = re.compile(r"[\u4e00-\u9fff]")


def _cells() -> list:
    return nbformat.read(NOTEBOOK, as_version=4).cells


def _code_cell(cell_id: str):
    cell = next((c for c in _cells() if c.get("id") == cell_id), None)
    assert cell is not None and cell.cell_type == "code", f"notebook 01 has no code cell with id {cell_id!r}"
    return cell


def _run_cell(cell_id: str, namespace: dict) -> str:
    """Execute one of the notebook's cells in ``namespace``; return what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_code_cell(cell_id).source, f"01:{cell_id}", "exec"), namespace)  # noqa: S102
    return out.getvalue()


# ----------------------------------------------------------------------------- the notebook's walk
def test_a_code_cell_steps_the_engine_before_the_http_request():
    cells = _cells()
    code = [(i, c.source) for i, c in enumerate(cells) if c.cell_type == "code"]
    steps = [i for i, src in code if re.search(r"\bengine\.step\(\)", src)]
    http = [i for i, src in code if 'c.stream("POST"' in src]
    assert steps, "notebook 01: no code cell calls engine.step()"
    assert http, "notebook 01: the streamed HTTP request is gone"
    assert steps[0] < http[0], "notebook 01: the by-hand walk must come before the HTTP request"


def test_the_gateway_cells_show_a_401_and_a_429():
    ns = {"os": os, "MODEL": "tiny", "MAX_MODEL_LEN": 1024}
    assert _run_cell("walk-gateway", ns) == ""
    wrong = _run_cell("walk-gateway-401", ns)
    over = _run_cell("walk-gateway-429", ns)
    assert "HTTP 401" in wrong and '"code":"invalid_api_key"' in wrong and "429" not in wrong
    assert over.count("admitted as key-1") == 2, over            # the burst of 2 gets in
    assert "HTTP 429" in over and "Retry-After: 1" in over and '"code":"rate_limited"' in over


def test_a_cell_runs_the_incremental_detokenizer_on_chinese_text():
    cell = _code_cell("walk-detok")
    assert ".push(" in cell.source and CJK.search(cell.source), \
        "notebook 01: the detokenize cell must push the tokens of Chinese text through a detokenizer"
    assert "make_detokenizer" in cell.source or "IncrementalDetokenizer" in cell.source


def test_a_cell_builds_an_sse_line_with_the_servers_code():
    assert "sse_line(" in _code_cell("walk-sse").source


def test_the_notebook_says_why_tokenize_comes_before_the_queue():
    text = "\n".join(c.source for c in _cells() if c.cell_type == "markdown")
    assert "vLLM" in text and re.search(r"tokeni[sz]e[s]? first", text), \
        "notebook 01: say why tokenize precedes the queue here (the length is needed to admit and schedule)"


# ----------------------------------------------------------------------------- the engine itself
def _filled_positions(engine, slot: int) -> int:
    """How many positions of ``slot`` hold K/V in every layer, checking that they are a prefix
    [0, n): the slot was filled with NaN beforehand, so a written position is a finite one."""
    cache = engine.cache
    finite = torch.ones(cache.max_len, dtype=torch.bool)
    for t in cache.k + cache.v:
        finite &= torch.isfinite(t[slot]).flatten(1).all(dim=1)
    n = int(finite.sum())
    assert finite[:n].all(), f"slot {slot}: the written positions are not the first {n}"
    return n


@pytest.fixture(scope="module")
def walk_llm():
    from minillm import LLM
    return LLM(model="tiny", device="cpu", dtype="fp32", max_batch_size=2, max_model_len=64)


def test_prefill_fills_the_prompts_positions_and_each_decode_step_one_more(walk_llm):
    from minillm.engine.sampling import SamplingParams
    from minillm.engine.tokenizer import encode_prompt
    engine = walk_llm.engine
    for t in engine.cache.k + engine.cache.v:
        t[:engine.cache.num_slots].fill_(float("nan"))        # never the reserved slot (its zero row)
    ids = encode_prompt(walk_llm.tokenizer, PROMPT)
    seq = engine.prepare(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.enqueue(seq)
    assert list(engine.scheduler.waiting) == [seq] and seq.slot is None

    (first,) = engine.step()
    rec = engine.step_history[-1]
    assert first.request_id == seq.request_id and first.token_id is not None
    assert (rec.num_prefill_rows, rec.num_prefill_tokens, rec.num_decode_rows) == (1, len(ids), 0)
    assert seq.slot is not None and seq.num_computed == len(ids)
    assert _filled_positions(engine, seq.slot) == len(ids)

    for k in range(1, 4):
        (out,) = engine.step()
        rec = engine.step_history[-1]
        assert out.token_id is not None and len(seq.output_ids) == k + 1
        assert (rec.num_decode_rows, rec.num_decode_tokens, rec.num_prefill_tokens) == (1, 1, 0)
        assert rec.wall_ms > 0
        assert seq.num_computed == len(ids) + k
        assert _filled_positions(engine, seq.slot) == len(ids) + k
    engine.abort(seq.request_id)


def _a_character_over_several_tokens(tok) -> tuple[str, list[int]]:
    """A Chinese character that the byte-level BPE spreads over several tokens of its own."""
    for ch in "性指请求命期与标推":
        ids = tok.encode(ch, add_special_tokens=False)
        if len(ids) > 1 and tok.decode(ids) == ch:
            return ch, ids
    raise AssertionError("no test character spans several tokens: pick others")


@pytest.mark.parametrize("kind", ["engine", "incremental"])
def test_the_detokenizer_holds_back_a_partial_character_and_releases_it_whole(kind):
    from minillm.engine.output import make_detokenizer
    from minillm.engine.tokenizer import IncrementalDetokenizer, load_tokenizer
    tok = load_tokenizer()
    ch, ids = _a_character_over_several_tokens(tok)
    assert all("\ufffd" in tok.decode([i]) for i in ids[:-1])     # alone, each piece is no character
    detok = make_detokenizer(tok, prompt_ids=[]) if kind == "engine" else IncrementalDetokenizer(tok)
    emitted = [detok.push(i) for i in ids]
    assert emitted[:-1] == [""] * (len(ids) - 1)
    assert emitted[-1] == ch
