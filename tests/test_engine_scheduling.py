"""The engine's scheduling and caches (design.md §8): parity with transformers under both policies and any
chunk budget, mixed batches against recomputation, stale slots, static decode, sampling, output rules, step
records, the prefix cache, thread ownership and the KV-size refusal.

The reference is a tiny random Llama saved with ``save_pretrained`` (fp32, CPU), as in
``hf_reference.py``, but with 2 layers and 1024 positions (the KV-size test needs a context
longer than 1024 is allowed to be) and a vocabulary of 2048 (ids the shipped tokenizer knows,
so output text is real text for the stop-rule tests).
"""
from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.core.step_record import PHASES
from minillm.engine.attention import AttentionBackend, build_metadata
from minillm.engine.config import POLICIES, EngineConfig
from minillm.engine.engine import LLMEngine
from minillm.engine.kv_cache import KVCache
from minillm.engine.sampling import Sampler, _top_k_top_p_sorted
from minillm.engine.tokenizer import apply_chat, encode_prompt
from minillm.model.loader import load_model

VOCAB = 2048


def make_llama(path, *, seed: int = 0, vocab: int = VOCAB, max_pos: int = 1024):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():          # non-trivial norm weights (a forgotten norm cannot pass)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama_v2")
    return d, make_llama(d, seed=21)


_REF: dict = {}


def reference(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate: the first n new tokens after ``prompt``."""
    key = (id(hf), tuple(prompt), n)
    if key not in _REF:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        _REF[key] = out[0, len(prompt):].tolist()
    return _REF[key]


def rand_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def make_llm(d, **kw) -> LLM:
    opts = dict(tokenizer="default", device="cpu", dtype="fp32", max_model_len=256)
    opts.update(kw)
    return LLM(model=str(d), **opts)


class capture_logits:
    """Wrap the runner's sampler: every call's (logits, params) is kept in ``self.calls``.
    Also a context manager that puts the real sampler back."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.real, self.calls = engine, engine.runner.sampler, []
        engine.runner.sampler = self

    def __call__(self, logits, params, generators):
        self.calls.append((logits.detach().clone(), list(params)))
        return self.real(logits, params, generators)

    def __enter__(self):
        return self.calls

    def __exit__(self, *exc):
        self.engine.runner.sampler = self.real


# ---------------------------------------------------------------------------- greedy parity
@pytest.mark.parametrize("budget", [1, 7, 64])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_parity_with_transformers(ckpt, policy, budget):
    d, hf = ckpt
    llm = make_llm(d, scheduling_policy=policy, max_num_batched_tokens=budget, max_batch_size=3)
    lengths, new = [3, 17, 40, 9, 33], [6, 4, 5, 8, 3]
    prompts = [rand_prompt(n, 100 + i) for i, n in enumerate(lengths)]
    outs = llm.generate(prompts, [greedy(n) for n in new])
    for p, n, o in zip(prompts, new, outs):
        assert o.token_ids == reference(hf, p, n)
        assert o.finish_reason == "length"
    recs = list(llm.engine.step_history)
    if policy == "chunked":
        assert all(r.num_prefill_tokens + r.num_decode_tokens <= budget for r in recs)
        if budget < 40:
            assert max(r.num_prefill_tokens for r in recs) == budget      # prompts were split
    else:
        assert not any(r.num_prefill_rows and r.num_decode_rows for r in recs)
    assert llm.engine.allocator.num_free == 3


@pytest.mark.parametrize("policy", POLICIES)
def test_requests_added_between_steps(ckpt, policy):
    d, hf = ckpt
    llm = make_llm(d, scheduling_policy=policy, max_num_batched_tokens=16, max_batch_size=4)
    eng = llm.engine
    plan = {0: [(5, 10)], 2: [(30, 6)], 3: [(12, 5), (3, 7)], 6: [(45, 4)], 7: [(8, 3)]}
    added = []
    for i in range(500):
        for n, new in plan.get(i, []):
            p = rand_prompt(n, 200 + len(added))
            added.append((eng.add_request(p, greedy(new)), p, new))
        if i > max(plan) and not eng.has_unfinished():
            break
        eng.step()
    for rid, p, new in added:
        seq = eng.pop_finished(rid)
        assert seq.output_ids == reference(hf, p, new), rid
    recs = list(eng.step_history)
    mixed = [r for r in recs if r.num_prefill_rows and r.num_decode_rows]
    assert bool(mixed) == (policy == "chunked")


def test_prefix_hits_same_prompt_shared_prefix_and_takeover(ckpt):
    d, hf = ckpt
    llm = make_llm(d, max_batch_size=1)          # one slot: every hit is on the slot just freed
    shared = rand_prompt(40, 1)
    a = shared + rand_prompt(30, 2)              # 70 tokens
    b = shared + rand_prompt(20, 3)              # shares 40 tokens with a
    n = 5

    def run(p):
        o = llm.generate([p], greedy(n))[0]
        assert o.token_ids == reference(hf, p, n)
        sched = o.trace.first("scheduled").extra["cached_tokens"]
        assert sched == o.num_cached_tokens
        return o.num_cached_tokens

    assert run(a) == 0
    assert run(a) == 64            # slot remembers 70 + 4 tokens; at most 69 usable → 4 blocks
    assert run(b) == 32            # shares 40 with a: 2 blocks; b takes the slot over
    # the slot now holds b's K/V after position 32: a may only reuse the 40 shared tokens → 32
    assert run(a) == 32
    assert llm.engine.allocator.hits == 3


def test_prefix_hit_on_a_slot_another_request_takes_over_while_batched(ckpt):
    """Two slots, interleaved prompts sharing a prefix: hits land on slots whose tail another
    request overwrote; every output still equals the reference."""
    d, hf = ckpt
    llm = make_llm(d, max_batch_size=2, max_num_batched_tokens=24)
    shared = rand_prompt(48, 9)
    prompts = [shared + rand_prompt(k, 300 + k) for k in (3, 20, 1, 35, 7, 16)]
    outs = llm.generate(prompts, [greedy(4 + i % 3) for i in range(len(prompts))])
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o.token_ids == reference(hf, p, 4 + i % 3)
    cached = [o.num_cached_tokens for o in outs]
    assert cached[:2] == [0, 0] and all(c >= 32 for c in cached[2:]), cached


# ---------------------------------------------------------------------------- mixed batches
def test_mixed_batch_logits_equal_full_recompute(ckpt):
    d, _ = ckpt
    model = load_model(d, device="cpu", dtype="fp32")
    cfg = model.config
    cache = KVCache(cfg, num_slots=6, max_len=128, device="cpu", dtype=torch.float32)
    for t in cache.k + cache.v:                  # stale garbage everywhere a request may look
        t[:cache.num_slots] = float("nan")
    backend = AttentionBackend(cache, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    seqs = [rand_prompt(60, 500 + i) for i in range(6)]

    def forward(decode, prefill):
        """decode: [(seq index, slot, cached len)]; prefill: [(seq index, slot, start, n)].
        Returns the logits of every packed token and the positions they belong to."""
        tokens, positions, where = [], [], []
        for i, _, L in decode:
            tokens.append(seqs[i][L])
            positions.append(L)
            where.append((i, L))
        for i, _, s, n in prefill:
            tokens += seqs[i][s:s + n]
            positions += range(s, s + n)
            where += [(i, p) for p in range(s, s + n)]
        meta = build_metadata(cache, [(slot, L) for _, slot, L in decode],
                              [(slot, s, n) for _, slot, s, n in prefill], torch.device("cpu"))
        backend.begin(meta)
        with torch.no_grad():
            logits = model.forward_packed(torch.tensor(tokens), torch.tensor(positions), backend,
                                          torch.arange(len(tokens)))
        return logits, where

    with torch.no_grad():
        full = [model(torch.tensor([s]))[0] for s in seqs]            # [T, V] recomputed without cache

    def check(logits, where):
        want = torch.stack([full[i][p] for i, p in where])
        assert torch.isfinite(logits).all()
        assert (logits - want).abs().max().item() <= 1e-4

    # fill: prompts of different lengths, two in chunks
    check(*forward([], [(0, 4, 0, 20), (1, 1, 0, 7), (2, 2, 0, 33), (3, 5, 0, 10)]))
    # decode rows of different lengths (gather path) + a later chunk + a chunk from position 0
    check(*forward([(0, 4, 20), (1, 1, 7), (2, 2, 33)], [(3, 5, 10, 15), (4, 0, 0, 12)]))
    # decode rows of equal length in contiguous slots (a view) + a chunk
    check(*forward([(3, 5, 25)], [(5, 3, 0, 25)]))
    check(*forward([(4, 0, 12)], [(0, 4, 21, 4)]))           # a decode and a chunk continuing
    check(*forward([(3, 5, 26), (5, 3, 25)], [(4, 0, 13, 13)]))    # equal lengths, slots 5,3: gather by slot
    check(*forward([(5, 3, 26), (3, 5, 27), (0, 4, 25)], []))      # pure decode, different lengths


def test_engine_mixed_steps_logits_equal_recompute(ckpt):
    """Logits the sampler sees in chunked steps (decodes + chunks) equal model(tokens)[-1]."""
    d, _ = ckpt
    llm = make_llm(d, max_num_batched_tokens=12, max_batch_size=4)
    eng = llm.engine
    calls = capture_logits(eng).calls
    params = [greedy(n) for n in (6, 5, 4, 7)]
    owner: dict[int, str] = {}
    snapshots = []
    prompts = [rand_prompt(n, 600 + n) for n in (4, 30, 9, 21)]
    for p, sp in zip(prompts, params):
        owner[id(sp)] = eng.add_request(p, sp)
    while eng.has_unfinished():
        before = len(calls)
        eng.step()
        if len(calls) > before:
            logits, ps = calls[-1]
            toks = [eng.get(owner[id(sp)]).all_token_ids[:-1] for sp in ps]   # before this step's token
            snapshots.append((logits, toks))
    assert any(r.num_prefill_rows and r.num_decode_rows for r in eng.step_history)
    with torch.no_grad():
        for logits, toks in snapshots:
            want = torch.stack([llm.model(torch.tensor([t]))[0, -1] for t in toks])
            assert (logits - want).abs().max().item() <= 1e-4


# ---------------------------------------------------------------------------- stale slots
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("kernel", [False, True])
def test_poisoned_free_slots_change_nothing(ckpt, static, kernel, monkeypatch):
    """Decode rows of different lengths read their positions either through the masked gather (the zero
    row standing in for what a row does not have) or through the decode attention kernel (each row's own
    positions only): neither may see a free slot's stale K/V."""
    from minillm.engine import attention_kernel
    if kernel and not attention_kernel.available(torch.float32):
        pytest.skip("the decode attention kernel does not build here")
    d, hf = ckpt
    lengths, new = [5, 23, 11, 40], [8, 6, 9, 5]
    prompts = [rand_prompt(n, 700 + i) for i, n in enumerate(lengths)]

    def run(poison: bool):
        llm = make_llm(d, max_batch_size=4, enable_prefix_caching=False)
        eng = llm.engine
        eng.runner.static_decode = static
        eng.runner.backend.decode_kernel = kernel
        llm.generate([rand_prompt(50, 799)] * 2, greedy(3))         # slots used and freed
        assert eng.allocator.num_free == 4
        if poison:
            for layer in range(len(eng.cache.k)):
                for slot in range(eng.cache.num_slots):
                    eng.cache.k[layer][slot, 0::2] = float("inf")
                    eng.cache.k[layer][slot, 1::2] = float("nan")
                    eng.cache.v[layer][slot, 0::2] = float("nan")
                    eng.cache.v[layer][slot, 1::2] = float("-inf")
        gathers = {"n": 0}
        real = eng.cache.gather if not kernel else attention_kernel.run

        def counted(*a):
            gathers["n"] += 1
            return real(*a)
        if kernel:
            monkeypatch.setattr(attention_kernel, "run", counted)
        else:
            eng.cache.gather = counted
        outs = llm.generate(prompts, [greedy(n) for n in new])
        assert gathers["n"] > 0                   # decodes of different lengths took the path under test
        return [o.token_ids for o in outs]

    clean, poisoned = run(False), run(True)
    assert poisoned == clean
    assert clean == [reference(hf, p, n) for p, n in zip(prompts, new)]


# ---------------------------------------------------------------------------- static decode
@pytest.fixture(scope="module")
def static_pair(ckpt):
    d, _ = ckpt
    dyn = make_llm(d, max_batch_size=17)
    st = make_llm(d, max_batch_size=17)
    st.engine.runner.static_decode = True
    return dyn, st


@pytest.mark.parametrize("bs", [1, 2, 3, 5, 9, 17])
def test_static_decode_matches_dynamic(ckpt, static_pair, bs):
    d, hf = ckpt
    dyn, st = static_pair
    cycle = [10, 25, 58, 5, 14, 30, 60, 3, 20]     # with 12 new tokens: contexts cross 16, 32 and 64
    prompts = [rand_prompt(cycle[i % len(cycle)], 800 + 31 * bs + i) for i in range(bs)]
    params = [greedy(12) for _ in prompts]
    for eng in (dyn.engine, st.engine):
        eng.allocator.forget()
        eng.step_history.clear()
    with capture_logits(dyn.engine) as cd, capture_logits(st.engine) as cs:
        a, b = dyn.generate(prompts, params), st.generate(prompts, params)
    assert [o.token_ids for o in b] == [o.token_ids for o in a]
    assert a[0].token_ids == reference(hf, prompts[0], 12)
    assert len(cd) == len(cs)
    for (la, _), (lb, _) in zip(cd, cs):
        assert la.shape == lb.shape and (la - lb).abs().max().item() <= 1e-5
    buckets = {r.bucket for r in st.engine.step_history if r.bucket is not None}
    # decode step j reads max(prompt) + j + 1 positions; bs=1 crosses 16→32, bs=2 32→64, bs≥3 64→128
    bucket = lambda n: 16 if n <= 16 else 1 << (n - 1).bit_length()     # noqa: E731
    want_L = {bucket(max(map(len, prompts)) + j + 1) for j in range(11)}
    assert len(want_L) == 2 and {L for _, L in buckets} == want_L
    assert {R for R, _ in buckets} == {next(b for b in st.engine.runner.row_buckets if b >= bs)}
    assert all(r.bucket is None for r in dyn.engine.step_history)


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_static_decode_with_single_token_chunks(ckpt, budget):
    """A small budget gives steps where every row computes one token but some of them are
    prompt chunks (not the last token, sampling nothing): those are not decodes."""
    d, hf = ckpt
    llm = make_llm(d, max_num_batched_tokens=budget, max_batch_size=3)
    llm.engine.runner.static_decode = True
    lengths, new = [4, 20, 9], [6, 5, 7]
    prompts = [rand_prompt(n, 900 + i) for i, n in enumerate(lengths)]
    outs = llm.generate(prompts, [greedy(n) for n in new])
    for p, n, o in zip(prompts, new, outs):
        assert o.token_ids == reference(hf, p, n)
    assert any(r.bucket is not None for r in llm.engine.step_history)


# ---------------------------------------------------------------------------- sampling
@pytest.fixture(scope="module")
def sampling_llm(ckpt):
    return make_llm(ckpt[0], max_batch_size=8)


def test_seeded_row_same_alone_and_in_a_batch(ckpt, sampling_llm):
    llm = sampling_llm
    p = rand_prompt(12, 1000)
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate([p], [sp])[0].token_ids
    assert alone != reference(ckpt[1], p, 12)                # it really sampled
    others = [SamplingParams(max_tokens=10, temperature=0.8, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=1.0, seed=7, ignore_eos=True),
              greedy(9),
              SamplingParams(max_tokens=12, temperature=1.2, top_k=20, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=1.0, seed=1235, ignore_eos=True),
              SamplingParams(max_tokens=11, temperature=0.5, top_p=0.5, ignore_eos=True),
              SamplingParams(max_tokens=13, temperature=1.0, ignore_eos=True)]
    prompts = [rand_prompt(3 + 2 * i, 1001 + i) for i in range(7)]
    outs = llm.generate(prompts[:3] + [p] + prompts[3:], others[:3] + [sp] + others[3:])
    assert outs[3].token_ids == alone
    other = make_llm(ckpt[0], max_batch_size=2, seed=99)     # another engine, another engine seed
    assert other.generate([p], [sp])[0].token_ids == alone


def test_unseeded_sampling_leaves_global_rng_alone(sampling_llm):
    state = torch.random.get_rng_state()
    outs = sampling_llm.generate([rand_prompt(6, 1100), rand_prompt(9, 1101)],
                                 [SamplingParams(max_tokens=6, temperature=1.0, top_k=50, ignore_eos=True),
                                  SamplingParams(max_tokens=6, temperature=0.7, top_p=0.8, ignore_eos=True)])
    assert all(len(o.token_ids) == 6 for o in outs)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_degenerate_row_changes_no_other_row(ckpt, sampling_llm):
    llm = sampling_llm
    prompts = [rand_prompt(5 + 3 * i, 1200 + i) for i in range(4)]
    others = [SamplingParams(max_tokens=8, temperature=1.0, seed=10 + i, ignore_eos=True) for i in range(3)]
    others.append(greedy(8))
    base = [o.token_ids for o in llm.generate(prompts, others)]
    deg_p = rand_prompt(7, 1299)
    deg = SamplingParams(max_tokens=8, temperature=3e-39, top_p=1e-300, top_k=1, ignore_eos=True)
    outs = llm.generate(prompts[:2] + [deg_p] + prompts[2:], others[:2] + [deg] + others[2:])
    got = [o.token_ids for i, o in enumerate(outs) if i != 2]
    assert got == base
    assert outs[2].token_ids == reference(ckpt[1], deg_p, 8)     # top_k=1: the argmax


def test_top_k_top_p_keep_the_expected_token_sets():
    probs = torch.tensor([0.1, 0.5, 0.05, 0.25, 0.05, 0.05])
    logits = probs.log()
    cases = [  # (top_k, top_p, tokens that may be drawn)
        (-1, 1.0, {0, 1, 2, 3, 4, 5}),
        (2, 1.0, {1, 3}),
        (1, 1.0, {1}),
        (-1, 0.6, {1, 3}),            # mass above token 3 is 0.5 < 0.6: kept; above token 0: 0.75
        (-1, 0.45, {1}),
        (-1, 0.8, {0, 1, 3}),
        (3, 0.7, {1, 3}),
        (2, 0.99, {1, 3}),
    ]
    reps = 300
    params, want = [], []
    for k, p, s in cases:
        params += [SamplingParams(temperature=1.0, top_k=k, top_p=p)] * reps
        want += [s] * reps
    sampler = Sampler(torch.device("cpu"), seed=3)
    ids = sampler(logits.repeat(len(params), 1), params, [None] * len(params)).tolist()
    for c, (k, p, s) in enumerate(cases):
        got = set(ids[c * reps:(c + 1) * reps])
        assert got == s, (k, p, got)
    # each case on its own (the top-k-only path when no row uses top-p)
    for k, p, s in cases:
        ps = [SamplingParams(temperature=1.0, top_k=k, top_p=p)] * reps
        got = set(sampler(logits.repeat(reps, 1), ps, [None] * reps).tolist())
        assert got == s, (k, p, got)


def test_top_p_one_filters_nothing_even_next_to_a_top_p_row():
    """A row with top_p=1 (off) in the sorted path must keep every token, however small."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2048, generator=g) * 3
    x[2] = 0
    x[2, 5] = 20.0                               # one token takes almost all the mass
    y = _top_k_top_p_sorted(x, torch.tensor([2048] * 3), torch.tensor([1.0, 0.5, 1.0]), 2048)
    assert torch.equal(y[0], x[0]) and torch.equal(y[2], x[2])
    assert torch.isinf(y[1]).any()


# ---------------------------------------------------------------------------- output rules
@pytest.fixture(scope="module")
def out_llm(ckpt):
    return make_llm(ckpt[0], max_batch_size=4)


def _text_of(llm, prompt, n):
    return llm.generate([prompt], greedy(n))[0].text


def test_stop_token_ids_and_include_stop_str(out_llm):
    llm, tok = out_llm, out_llm.tokenizer
    p = rand_prompt(8, 1300)
    base = llm.generate([p], greedy(20))[0].token_ids
    # a stop token whose own text is plain, non-empty ASCII, first seen at index i
    i = next(i for i in range(2, 20) if base[i] not in base[:i]
             and (s := tok.decode([base[i]])).strip() and s.isascii() and s.isprintable())
    stop = base[i]
    t0, t1 = _text_of(llm, p, i), _text_of(llm, p, i + 1)
    piece = t1[len(t0):]
    assert t1.startswith(t0) and piece.strip()
    out = llm.generate([p],
                       SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                      stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids == base[:i + 1]
    assert out.text == t0
    inc = llm.generate([p],
                       SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop],
                                      include_stop_str_in_output=True))[0]
    assert inc.finish_reason == "stop" and inc.text == t1 and inc.text.endswith(piece)


def test_stop_strings_and_include_stop_str(out_llm):
    llm = out_llm
    p = rand_prompt(6, 1400)
    base = llm.generate([p], greedy(24))[0].text
    assert len(base) > 12
    start = next(i for i in range(4, len(base) - 3)
                 if base[i:i + 3].strip() and base.find(base[i:i + 3]) == i)
    stop = base[start:start + 3]
    out = llm.generate([p], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == base[:start] and stop not in out.text
    inc = llm.generate([p], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop],
                                           include_stop_str_in_output=True))[0]
    assert inc.finish_reason == "stop" and inc.text == base[:start + 3]


def test_eos_from_generation_config(ckpt, tmp_path):
    d, hf = ckpt
    p = rand_prompt(10, 1500)
    base = reference(hf, p, 12)
    k = next(i for i in range(3, 12) if base[i] not in base[:i])
    eos = base[k]
    plain = make_llm(d)
    assert eos not in plain.engine.eos_ids
    assert plain.generate([p], SamplingParams(max_tokens=12, temperature=0))[0].finish_reason == "length"
    d2 = tmp_path / "with_gen_config"
    shutil.copytree(d, d2)
    cfg = json.loads((d2 / "config.json").read_text())
    assert cfg.get("eos_token_id") in (None, []) or eos not in (cfg["eos_token_id"] if isinstance(
        cfg["eos_token_id"], list) else [cfg["eos_token_id"]])
    (d2 / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    llm = make_llm(d2)
    assert eos in llm.engine.eos_ids
    out = llm.generate([p], SamplingParams(max_tokens=12, temperature=0))[0]
    assert out.finish_reason == "stop" and out.token_ids == base[:k + 1]


def _bos_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in "hello world user assistant : hi there".split():
        vocab[w] = len(vocab)
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
                         "{% endfor %}assistant :")
    return tok


def test_no_double_bos_with_a_chat_template(ckpt):
    tok = _bos_tokenizer()
    assert encode_prompt(tok, "hello world") == [1, 3, 4]              # plain text: one BOS added
    text = apply_chat(tok, [{"role": "user", "content": "hi there"}])
    assert text.startswith("<s>")
    ids = encode_prompt(tok, text)
    assert ids[0] == 1 and ids.count(1) == 1, ids
    model = load_model(ckpt[0], device="cpu", dtype="fp32")
    eng = LLMEngine(model, tok, EngineConfig(max_batch_size=1, max_model_len=64))
    seq = eng.prepare(text, greedy(2))
    assert seq.prompt_ids == ids


# ---------------------------------------------------------------------------- step records
def test_step_records_phases_and_token_counts(ckpt):
    d, _ = ckpt
    llm = make_llm(d, max_num_batched_tokens=32, max_batch_size=2)
    eng = llm.engine
    out = llm.generate([rand_prompt(100, 1600)], greedy(5))[0]
    assert len(out.token_ids) == 5
    recs = list(eng.step_history)
    assert [r.num_prefill_tokens for r in recs] == [32, 32, 32, 4, 0, 0, 0, 0]
    assert [r.num_decode_tokens for r in recs] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [r.num_sampled for r in recs] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert [r.step for r in recs] == list(range(recs[0].step, recs[0].step + 8))
    for r in recs:
        assert len(r.t_ns) == len(PHASES) == 6
        assert all(a <= b for a, b in zip([r.t_start_ns] + r.t_ns, r.t_ns))
        assert set(r.phase_ms) == set(PHASES) and all(v >= 0 for v in r.phase_ms.values())
        assert abs(sum(r.phase_ms.values()) - r.wall_ms) < 1e-6
        assert r.error is None
        d_ = r.to_dict()
        assert d_["wall_ms"] == r.wall_ms
    chunks = [e.extra["tokens"] for e in out.trace if e.event == "prefill_chunk"]
    assert chunks == [32, 32, 32, 4]


def test_step_history_is_bounded(ckpt):
    llm = make_llm(ckpt[0], step_history=5, max_batch_size=2)
    llm.generate([rand_prompt(4, 1700)], greedy(12))
    recs = list(llm.engine.step_history)
    assert len(recs) == 5
    assert [r.step for r in recs] == list(range(7, 12))    # the last five of 12 steps (1 prefill, 11 decodes)


# ---------------------------------------------------------------------------- prefix cache
def test_prefix_hit_is_reported_and_changes_no_output(ckpt):
    d, hf = ckpt
    llm = make_llm(d, max_batch_size=2)
    p = rand_prompt(50, 1800)
    first, second = llm.generate([p], greedy(6))[0], llm.generate([p], greedy(6))[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 48
    assert second.trace.first("scheduled").extra["cached_tokens"] == 48
    assert first.token_ids == second.token_ids == reference(hf, p, 6)
    assert llm.engine.allocator.hits == 1 and llm.engine.allocator.hit_tokens == 48


def test_prefix_cache_eviction_under_pressure(ckpt):
    d, hf = ckpt
    llm = make_llm(d, max_batch_size=2, max_num_batched_tokens=40)
    pa, pb, pc = rand_prompt(36, 1900), rand_prompt(50, 1901), rand_prompt(20, 1902)
    rounds = [
        [pa + [5, 6], pb + [7], pc, pa + [9] * 10],
        [pb + [1, 2, 3], rand_prompt(40, 1903), pa + [5, 6], pc + [4] * 20],
        [pa + rand_prompt(17, 1904), pb, pc + [4] * 20 + [8], pb + [7]],
    ]
    n = 0
    cached = []
    for prompts in rounds:
        outs = llm.generate(prompts, [greedy(3 + (n + i) % 4) for i in range(len(prompts))])
        for i, (p, o) in enumerate(zip(prompts, outs)):
            assert o.token_ids == reference(hf, p, 3 + (n + i) % 4), (n, i)
            cached.append(o.num_cached_tokens)
        n += 1
    assert llm.engine.allocator.hits > 0 and any(c > 0 for c in cached)
    assert 0 in cached[4:]                   # some prefix was evicted or never there
    assert llm.engine.allocator.num_free == 2


def test_prefix_hit_never_covers_an_uncomputed_token(ckpt):
    """A finished request's last token was sampled but never run through the model: its K/V
    are not in the slot, so a later prompt may not count it as cached (here it would complete
    the second block)."""
    d, hf = ckpt
    llm = make_llm(d, max_batch_size=1)
    eng = llm.engine
    p = rand_prompt(20, 2100)
    first = llm.generate([p], greedy(12))[0]                 # 32 tokens, 31 computed
    for t in eng.cache.k + eng.cache.v:                      # what the slot holds past them: garbage
        t[:eng.cache.num_slots, 31:] = float("nan")
    q = p + first.token_ids + rand_prompt(5, 2101)
    second = llm.generate([q], greedy(4))[0]
    assert second.num_cached_tokens == 16
    assert second.token_ids == reference(hf, q, 4)


def test_prefix_caching_off_gives_no_hits(ckpt):
    d, hf = ckpt
    llm = make_llm(d, max_batch_size=2, enable_prefix_caching=False)
    p = rand_prompt(50, 2000)
    outs = [llm.generate([p], greedy(4))[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert [o.trace.first("scheduled").extra["cached_tokens"] for o in outs] == [0, 0]
    assert llm.engine.allocator.hits == 0
    assert outs[0].token_ids == outs[1].token_ids == reference(hf, p, 4)


# ---------------------------------------------------------------------------- ownership, sizing
def test_only_the_engine_thread_may_step(ckpt):
    llm = make_llm(ckpt[0], max_batch_size=1)
    eng = llm.engine
    eng.add_request([1, 2, 3], greedy(3))
    eng.step()                                     # this thread owns the engine now
    err = []

    def other():
        try:
            eng.step()
        except RuntimeError as e:
            err.append(str(e))
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert err and "second thread" in err[0]
    while eng.has_unfinished():                    # the owner still steps normally
        eng.step()


def test_max_model_len_that_does_not_fit_is_refused(ckpt):
    with pytest.raises(MemoryError, match="max_model_len=1024 does not fit"):
        make_llm(ckpt[0], max_model_len=1024, kv_memory_fraction=1e-6, max_batch_size=4)


def test_top_k_top_p_through_topk_equals_the_full_sort():
    """When every row has a top-k, only the kmax largest are sorted; the kept logits are the
    same as through a full sort of the vocabulary."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3000, generator=g) * 2
    ks, ps = torch.tensor([5, 50, 7, 200]), torch.tensor([0.9, 0.5, 1.0, 0.95])
    fast = _top_k_top_p_sorted(x, ks, ps, 200)
    full = _top_k_top_p_sorted(x, ks, ps, 3000)
    assert torch.equal(torch.isinf(fast), torch.isinf(full))
    assert torch.equal(fast[~torch.isinf(fast)], full[~torch.isinf(full)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ids_are_the_first_maximum_in_every_dtype(dtype):
    """Greedy decoding takes argmax; on a CPU bf16 logits are upcast first (exact), so ties still go to
    the first maximal id."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g).to(dtype)                         # [R, V]
    logits[1, 7] = logits[1, 250] = 50.0                                         # a tie: 7 wins
    ids = Sampler(torch.device("cpu"), seed=0)(logits, [SamplingParams(temperature=0)] * 5, [None] * 5)
    assert ids.tolist() == logits.float().argmax(-1).tolist() and ids[1].item() == 7
