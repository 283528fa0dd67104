"""Logprobs and min_tokens, against transformers.

Logprobs are vLLM's default "raw" ones: log_softmax of the model's logits in fp32, before
temperature, top-k/top-p and the min_tokens mask. Every value is checked token by token
against ``torch.log_softmax`` of a tiny random ``LlamaForCausalLM`` (fp32, CPU) fed the same
prefix. min_tokens (vLLM's semantics) is checked on a checkpoint whose EOS is the greedy first
token of a prompt, so without it the request would stop at once.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_reference import make_hf_model

from minillm import LLM, SamplingParams
from minillm.engine.sampling import MAX_LOGPROBS, ban_tokens

VOCAB = 512
ATOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama_logprobs")
    return d, make_hf_model("llama", d, vocab=VOCAB, seed=8, eos=None)


@pytest.fixture(scope="module")
def llm(ckpt):
    return make_llm(ckpt[0])


def make_llm(d, **kw) -> LLM:
    opts = dict(tokenizer="default", device="cpu", dtype="fp32", max_model_len=128, max_batch_size=8)
    opts.update(kw)
    return LLM(model=str(d), **opts)


def rand_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


def ref_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: transformers' log_softmax (fp32) of the logits that chose each output
    token (one forward over prompt + output: causal, so position i sees only its prefix)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0].float()               # [T, V]
    return logits[len(prompt) - 1: len(prompt) + len(output) - 1].log_softmax(-1)     # [n, V]


def check_against_reference(hf, prompt, out, n_top: int) -> torch.Tensor:
    """Every token's logprob, rank and top-n against transformers; returns the reference."""
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    ref = ref_logprobs(hf, prompt, out.token_ids)
    for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        want = ref[j]
        assert lp.token_id == tok
        assert abs(lp.logprob - want[tok].item()) <= ATOL, (j, lp.logprob, want[tok].item())
        assert lp.rank == int((want > want[tok]).sum()) + 1, j
        top = want.topk(n_top)
        assert [t for t, _ in lp.top] == top.indices.tolist(), j
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), top.values, atol=ATOL), j
    return ref


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


# ---------------------------------------------------------------------------- logprobs
@pytest.mark.parametrize("static_decode", [False, True])
def test_greedy_logprobs_match_transformers(ckpt, static_decode):
    d, hf = ckpt
    llm = make_llm(d)
    llm.engine.runner.static_decode = static_decode      # the CUDA-graph path, run eagerly on a CPU
    prompts = [rand_prompt(n, 10 + n) for n in (4, 13, 30)]
    outs = llm.generate(prompts, [greedy(8, logprobs=5) for _ in prompts])
    for p, o in zip(prompts, outs):
        ref = check_against_reference(hf, p, o, 5)
        assert o.token_ids == ref.argmax(-1).tolist()          # greedy: the argmax, rank 1
        assert all(lp.rank == 1 for lp in o.logprobs)


def test_logprobs_zero_gives_only_the_chosen_token(ckpt, llm):
    _, hf = ckpt
    p = rand_prompt(9, 20)
    o = llm.generate([p], greedy(6, logprobs=0))[0]
    assert all(lp.top == [] for lp in o.logprobs)
    check_against_reference(hf, p, o, 0)


def test_max_logprobs(ckpt, llm):
    _, hf = ckpt
    p = rand_prompt(7, 21)
    o = llm.generate([p], greedy(3, logprobs=MAX_LOGPROBS))[0]
    check_against_reference(hf, p, o, MAX_LOGPROBS)


def test_rows_without_logprobs_are_unaffected(ckpt, llm):
    """Same batch, same tokens whether or not neighbours ask for logprobs; no logprobs where
    nobody asked. Seeded sampled rows included (their draw must not move)."""
    prompts = [rand_prompt(5 + 4 * i, 30 + i) for i in range(4)]

    def params(with_logprobs: bool) -> list[SamplingParams]:
        lp = dict(logprobs=3) if with_logprobs else {}
        return [greedy(7),
                SamplingParams(max_tokens=7, temperature=0.9, seed=5, ignore_eos=True, **lp),
                greedy(7, **lp),
                SamplingParams(max_tokens=7, temperature=1.1, top_k=40, seed=6, ignore_eos=True)]

    base = llm.generate(prompts, params(False))
    mixed = llm.generate(prompts, params(True))
    assert [o.token_ids for o in mixed] == [o.token_ids for o in base]
    assert [o.logprobs is None for o in mixed] == [True, False, False, True]
    assert all(o.logprobs is None for o in base)


def test_sampled_rows_report_the_token_actually_chosen(ckpt, llm):
    """temperature ≠ 1 and top-k/top-p: the logprob is still the raw one, of the token drawn."""
    _, hf = ckpt
    prompts = [rand_prompt(6, 40), rand_prompt(11, 41)]
    ps = [SamplingParams(max_tokens=10, temperature=1.5, seed=1, ignore_eos=True, logprobs=2),
          SamplingParams(max_tokens=10, temperature=0.8, top_k=30, top_p=0.9, seed=2, ignore_eos=True,
                         logprobs=4)]
    outs = llm.generate(prompts, ps)
    for p, sp, o in zip(prompts, ps, outs):
        check_against_reference(hf, p, o, sp.logprobs)
    assert any(lp.rank > 1 for o in outs for lp in o.logprobs)      # it really sampled


def test_streamed_logprobs_equal_the_final_ones(ckpt, llm):
    eng = llm.engine
    rid = eng.add_request(rand_prompt(8, 50), greedy(5, logprobs=2))
    other = eng.add_request(rand_prompt(8, 51), greedy(5))
    streamed: dict[str, list] = {rid: [], other: []}
    while eng.has_unfinished():
        for o in eng.step():
            streamed[o.request_id].append(o.logprobs)
    out = eng.output_of(eng.pop_finished(rid))
    assert streamed[rid] == out.logprobs and len(out.logprobs) == 5
    assert streamed[other] == [None] * 5 and eng.output_of(eng.pop_finished(other)).logprobs is None


# ---------------------------------------------------------------------------- min_tokens
@pytest.fixture(scope="module")
def eos_ckpt(ckpt, tmp_path_factory):
    """The same weights, with EOS = the greedy first token of ``prompt``: greedy stops at once."""
    d, hf = ckpt
    prompt = rand_prompt(10, 60)
    first = ref_logprobs(hf, prompt, [0])[0].argmax().item()
    e = tmp_path_factory.mktemp("llama_eos") / "ckpt"
    shutil.copytree(d, e)
    for name in ("config.json", "generation_config.json"):
        f = e / name
        if f.exists():
            cfg = json.loads(f.read_text())
            cfg["eos_token_id"] = first
            f.write_text(json.dumps(cfg))
    return e, hf, prompt, first


def greedy_with_banned(hf, prompt: list[int], n: int, banned: set[int], min_tokens: int) -> list[int]:
    """transformers' greedy tokens with ``banned`` at -inf for the first ``min_tokens``."""
    out: list[int] = []
    for j in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        if j < min_tokens:
            logits[sorted(banned)] = float("-inf")
        out.append(int(logits.argmax()))
    return out


def test_min_tokens_holds_eos_back(eos_ckpt):
    e, hf, prompt, eos = eos_ckpt
    llm = make_llm(e)
    assert eos in llm.engine.eos_ids
    other = rand_prompt(7, 61)
    ps = [SamplingParams(max_tokens=12, temperature=0),                           # stops at once
          SamplingParams(max_tokens=12, temperature=0, min_tokens=5, logprobs=1),
          SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),          # a bystander
          SamplingParams(max_tokens=12, temperature=0.5, seed=3, min_tokens=5)]   # sampled, masked too
    plain, held, bystander, sampled = llm.generate([prompt, prompt, other, prompt], ps)
    assert plain.token_ids == [eos] and plain.finish_reason == "stop"
    assert len(held.token_ids) >= 5 and eos not in held.token_ids[:5]
    banned = set(llm.engine.eos_ids)
    assert held.token_ids[:5] == greedy_with_banned(hf, prompt, 5, banned, 5)
    if len(held.token_ids) < 12:            # ended by EOS: only after min_tokens
        assert held.token_ids[-1] in banned and held.finish_reason == "stop"
    assert bystander.token_ids == make_llm(e).generate([other], ps[2])[0].token_ids
    assert len(sampled.token_ids) >= 5 and not banned & set(sampled.token_ids[:5])
    # the logprobs stay raw: the first token was not EOS, but EOS is still the most likely
    first = held.logprobs[0]
    assert first.rank == 2 and first.top[0][0] == eos
    check_against_reference(hf, prompt, held, 1)


def test_min_tokens_holds_stop_token_ids_back(ckpt, llm):
    _, hf = ckpt
    p = rand_prompt(9, 70)
    stop = ref_logprobs(hf, p, [0])[0].argmax().item()          # the greedy first token
    ps = [greedy(10, stop_token_ids=[stop]), greedy(10, stop_token_ids=[stop], min_tokens=4)]
    plain, held = llm.generate([p, p], ps)
    assert plain.token_ids == [stop] and plain.finish_reason == "stop"
    assert len(held.token_ids) >= 4 and stop not in held.token_ids[:4]
    assert held.token_ids[:4] == greedy_with_banned(hf, p, 4, {stop}, 4)
    assert held.token_ids.count(stop) <= 1 and (stop not in held.token_ids or held.token_ids[-1] == stop)


@pytest.mark.parametrize("min_tokens", [2, 3])
def test_min_tokens_ignores_stop_strings_before_it(llm, min_tokens):
    """A stop string in the first token's text does not end the request before min_tokens, nor
    just after it (min_tokens=2: the match lies in the window searched next step, and must not
    count there); the streamed deltas still add up to the final text."""
    for seed in range(80, 120):                 # a prompt whose first output token is plain text
        p = rand_prompt(6, seed)
        head = llm.generate([p], greedy(1))[0].text
        if head.strip() and head.isprintable() and "\ufffd" not in head:
            break
    else:
        pytest.skip("no prompt whose first token has plain text")
    stop = head
    base = llm.generate([p], greedy(8))[0]
    plain = llm.generate([p], greedy(8, stop=[stop]))[0]
    assert plain.finish_reason == "stop" and len(plain.token_ids) == 1 and plain.text == ""
    eng = llm.engine
    rid = eng.add_request(p, greedy(8, stop=[stop], min_tokens=min_tokens))
    deltas = []
    while eng.has_unfinished():
        deltas += [o.delta for o in eng.step() if o.request_id == rid]
    held = eng.output_of(eng.pop_finished(rid))
    assert len(held.token_ids) >= min_tokens and held.token_ids == base.token_ids[:len(held.token_ids)]
    assert held.text.startswith(head)                  # the early stop string was ignored, not cut
    assert "".join(deltas) == held.text


def test_ban_tokens_touches_only_the_banned_entries():
    x = torch.randn(3, 50)
    assert ban_tokens(x, [[], [], []]) is x
    y = ban_tokens(x, [[4, 7], [], [0]])
    assert torch.equal(y[1], x[1]) and torch.isinf(y[0, [4, 7]]).all() and torch.isinf(y[2, 0])
    keep = torch.ones_like(x, dtype=torch.bool)
    keep[0, [4, 7]] = keep[2, 0] = False
    assert torch.equal(y[keep], x[keep]) and torch.isfinite(x).all()      # x itself untouched


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kw, field", [
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=1000), "logprobs"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(logprobs=2.0), "logprobs"),
    (dict(logprobs=True), "logprobs"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(min_tokens=1.5), "min_tokens"),
    (dict(min_tokens=None), "min_tokens"),
])
def test_invalid_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_valid_edges():
    SamplingParams(logprobs=0)
    SamplingParams(logprobs=MAX_LOGPROBS)
    SamplingParams(max_tokens=4, min_tokens=4)
    assert SamplingParams().logprobs is None and SamplingParams().min_tokens == 0
