"""The engine end to end: continuous batching against transformers' generate, streaming,
errors, aborts, and the trace every request carries."""
import pytest
import torch
from hf_reference import make_hf_model

from minillm import LLM, SamplingParams
from minillm.engine.engine import RequestError


@pytest.fixture(scope="module")
def hf_and_llm(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    hf = make_hf_model("llama", d, vocab=512, eos=None, seed=11)
    llm = LLM(model=str(d), tokenizer="default", device="cpu", dtype="fp32", max_batch_size=2)
    return hf, llm


def test_greedy_continuous_batching_equals_transformers_generate(hf_and_llm):
    hf, llm = hf_and_llm
    g = torch.Generator().manual_seed(5)
    lengths, new = [3, 17, 8, 30, 5], [12, 5, 9, 7, 10]
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in lengths]
    # 5 requests, 2 slots: requests wait, join the running batch as others finish, and
    # run in batches whose members have different lengths.
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in new]
    outs = llm.generate(prompts, params)
    batch_sizes = {e.extra["batch_size"] for o in outs for e in o.trace if e.event == "prefill_start"}
    assert max(batch_sizes) == 2, "some prefill must have run two prompts together"
    for p, n, o in zip(prompts, new, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        assert o.token_ids == ref[0, len(p):].tolist()
        assert o.finish_reason == "length"
    assert llm.engine.allocator.num_free == llm.engine.cache.num_slots


def test_decode_batches_are_mixed_lengths(hf_and_llm):
    """While one request decodes, another is prefilled and joins: the decode steps that follow
    hold sequences of different lengths (continuous batching, not static batching)."""
    _, llm = hf_and_llm
    eng = llm.engine
    eng.add_request([5] * 4, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), request_id="a")
    eng.step()                                   # prefill a
    eng.step()                                   # decode a
    eng.add_request([7] * 9, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), request_id="b")
    eng.step()                                   # chunked: a decodes while b is prefilled, one forward
    rec = eng.step_history[-1]
    assert (rec.num_decode_rows, rec.num_prefill_rows, rec.num_prefill_tokens) == (1, 1, 9)
    a, b = eng.get("a"), eng.get("b")
    eng.step()                                   # one decode step with both
    assert a.num_tokens != b.num_tokens and len(a.output_ids) == 4 and len(b.output_ids) == 2
    while eng.has_unfinished():
        eng.step()
    assert eng.pop_finished("a").finish_reason == "length" and eng.pop_finished("b").finish_reason == "length"


def test_stream_reassembles_to_final_text_with_chinese(tiny_llm):
    prompt = "推理请求的生命周期：从网关到流式返回。"
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=3, ignore_eos=True)
    deltas = list(tiny_llm.stream(prompt, params))
    final = tiny_llm.last_output
    assert "".join(deltas) == final.text
    # a random model emits arbitrary bytes, so replacement characters can be genuine; streaming
    # must add none of its own (the per-character check on real Chinese is in test_tokenizer.py)
    again = tiny_llm.generate([prompt], params)[0]            # same seed → same tokens
    assert again.token_ids == final.token_ids and again.text == final.text
    # the text is exactly what the tokenizer makes of the ids
    assert final.text == tiny_llm.tokenizer.decode(final.token_ids, skip_special_tokens=True)


def test_chinese_round_trip_through_the_engine(tiny_llm):
    """Feed the token ids of Chinese text as 'output' by forcing them as a prompt continuation:
    the incremental detokenizer in the engine must rebuild the characters exactly."""
    from minillm.engine.tokenizer import IncrementalDetokenizer
    text = "一个字符可能跨越多个字节级词元：性能指标"
    ids = tiny_llm.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) / 2        # several byte-level tokens per character somewhere
    d = IncrementalDetokenizer(tiny_llm.tokenizer)
    deltas = [d.push(i) for i in ids] + [d.flush()]
    assert "".join(deltas) == text and all("\ufffd" not in x for x in deltas)


def test_stop_strings_are_cut_and_streams_still_add_up(tiny_llm):
    base = tiny_llm.generate(["def f(x):"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    assert len(base.text) > 6
    stop = base.text[3:6]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    deltas = list(tiny_llm.stream("def f(x):", params))
    out = tiny_llm.last_output
    assert out.finish_reason == "stop" and stop not in out.text
    assert out.text == base.text[: base.text.find(stop)] == "".join(deltas)


def test_stop_token_ids_and_eos(tiny_llm):
    base = tiny_llm.generate(["hello"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    tok = base.token_ids[4]
    out = tiny_llm.generate(["hello"], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[tok]))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: base.token_ids.index(tok) + 1]


@pytest.mark.parametrize("kw,match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_k=-5), "top_k"), (dict(max_tokens=True), "max_tokens"),
    (dict(stop=[""]), "stop"), (dict(seed="x"), "seed"),
])
def test_bad_sampling_params_raise_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_prompt_longer_than_context_is_refused_and_loses_nothing(tiny_llm):
    eng = tiny_llm.engine
    n = eng.max_model_len
    with pytest.raises(RequestError, match=f"context is {n} tokens"):
        tiny_llm.generate([[1] * n])
    with pytest.raises(RequestError, match="empty"):
        tiny_llm.generate([""])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        tiny_llm.generate([[10**6]])
    # a bad prompt among good ones: nothing was queued, the engine still works
    with pytest.raises(RequestError):
        tiny_llm.generate(["fine", [1] * n])
    assert not eng.has_unfinished() and eng.allocator.num_free == eng.cache.num_slots
    assert tiny_llm.generate(["fine"], SamplingParams(max_tokens=3))[0].token_ids


def test_aborts_free_every_slot(tiny_llm):
    eng = tiny_llm.engine
    p = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    ids = [eng.add_request(f"request {i}", p) for i in range(12)]     # more than 8 slots: some wait
    for _ in range(3):
        eng.step()
    assert eng.num_running == 8 and eng.num_waiting == 4
    for rid in ids[::2]:                          # abort running and waiting ones alike
        assert eng.abort(rid)
    assert not eng.abort(ids[0])                  # twice: no error, nothing happens
    while eng.has_unfinished():
        eng.step()
    reasons = [eng.pop_finished(r).finish_reason for r in ids]
    assert reasons == ["abort", "length"] * 6
    assert eng.allocator.num_free == eng.cache.num_slots and not eng.allocator.used_slots


def test_closing_a_stream_early_aborts_and_frees_the_slot(tiny_llm):
    it = tiny_llm.stream("hello", SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    next(it)
    it.close()
    assert tiny_llm.last_output.finish_reason == "abort"
    assert tiny_llm.engine.allocator.num_free == tiny_llm.engine.cache.num_slots


def test_trace_records_every_stage_in_order(tiny_llm):
    out = tiny_llm.generate(["trace me"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    names = [e.event for e in out.trace]
    first = ["received", "tokenized", "enqueued", "scheduled", "prefill_start", "prefill_chunk",
             "prefill_end",
             "token"]
    assert names[:len(first)] == first
    assert names.count("token") == 5 and names[-1] == "finished"
    assert out.trace.last("finished").extra["reason"] == "length"
    ts = [e.t_ns for e in out.trace]
    assert ts == sorted(ts)
    m = out.metrics
    assert m.output_tokens == 5 and 0 < m.ttft_s <= m.e2e_s and m.tpot_s > 0


def test_a_failing_step_ends_its_batch_and_the_engine_goes_on(tiny_llm, monkeypatch):
    """An out-of-memory forward must not kill the engine: that batch ends with "error", its
    slots are freed, and the next request runs normally."""
    eng = tiny_llm.engine
    free_before = eng.allocator.num_free
    real = eng.runner.execute
    calls = {"n": 0}

    def flaky(batch, rec):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(batch, rec)

    monkeypatch.setattr(eng.runner, "execute", flaky)
    rid = eng.add_request([3, 4, 5], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    eng.step()                                    # prefill ok
    outs = eng.step()                             # decode fails
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [(rid, True, "error")]
    assert "out of memory" in eng.get(rid).error and eng.allocator.num_free == free_before
    assert eng.get(rid).trace.last("finished").extra["reason"] == "error"
    eng.pop_finished(rid)
    out = tiny_llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_prefill_first_budget_counts_packed_tokens():
    """Prompts are packed, not padded: 400 + 500 tokens fit a budget of 1000 together, the
    third (200 more) waits for the next step; under prefill-first whole prompts only."""
    llm = LLM(model="tiny", device="cpu", dtype="fp32", max_batch_size=8, max_num_batched_tokens=1000,
              scheduling_policy="prefill-first")
    eng = llm.engine
    p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    ids = [eng.add_request([5] * n, p) for n in (400, 500, 200)]
    eng.step()
    started = [eng.get(i).trace.first("prefill_start") is not None for i in ids]
    assert started == [True, True, False]
    assert eng.get(ids[0]).trace.first("prefill_start").extra["batch_size"] == 2
