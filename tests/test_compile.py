"""The optional compiled decode (EngineConfig.compile): torch.compile of the static decode step must
give the same tokens (and logprobs) as eager, which stays the default and the reference."""
import pytest
import torch

from minillm.engine.compiled import compile_unavailable

WHY = compile_unavailable("cpu")
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"torch.compile is unavailable here: {WHY}")


def _generate(model, tok, prompts, compile):
    from minillm.engine.engine import LLMEngine
    from minillm.engine.sampling import SamplingParams
    eng = LLMEngine(model, tok, max_batch_size=2, max_model_len=32, compile=compile)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
    rids = [eng.add_request(p, params) for p in prompts]
    while not all(eng.get(r).finished for r in rids):
        eng.step()
    outs = [eng.output_of(eng.pop_finished(r)) for r in rids]
    return outs, eng


def _tiny_model(dtype: str, seed: int, max_positions: int = 64):
    """Two layers, peaked logits (the LM head scaled up), so greedy never hinges on a last-bit tie."""
    from minillm.model.config import ModelConfig
    from minillm.model.loader import load_model
    cfg = ModelConfig(name="tiny-2l", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=max_positions)
    model = load_model(cfg, device="cpu", dtype=dtype, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    return model


def measured_choice(monkeypatch, model, faster_than_inductor: bool, attention: str = "native",
                    reduction_faster: bool = False, kernel: str = "onednn-packed"):
    """Make the decode matmul choice what a machine could have measured: every shape on ``kernel``
    (oneDNN's packed one unless named), which ran one step's matmuls 2× faster than MKL's packing
    (so a compiled fp32 decode keeps it) or 2× slower (so Inductor's freezing lays the weights out);
    and one row written as a compiled reduction timed 2× faster than that kernel, or 2× slower."""
    from minillm.engine import matmul
    rows = list(matmul.DECODE_ROWS)
    shapes = [matmul.ShapeChoice(n, k, b, kernel, {kernel: {str(r): 1.0 for r in rows}},
                                 by_rows={str(r): kernel for r in rows},
                                 inductor_ms={str(r): 2.0 if faster_than_inductor else 0.5 for r in rows},
                                 reduction_ms=0.5 if reduction_faster else 2.0, reduction_beside_ms=1.0)
              for n, k, b in matmul.linear_shapes(model)]
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    ch = matmul.MatmulChoice("test", matmul.machine_id(), torch.__version__, torch.get_num_threads(),
                             dtype, rows, shapes, attention=attention)
    monkeypatch.setattr(matmul, "choose", lambda m, *a, **k: ch)
    return ch


def _packed_linears(model) -> int:
    from minillm.engine.matmul import PackedLinear
    return sum(isinstance(m, PackedLinear) for m in model.modules())


# bf16: the logits here reach about 25, where bf16's spacing is 0.125; a logprob (a logit minus
# a log-sum-exp, each rounded) may move by that much when other kernels sum in another order.
def _tiled_builds() -> bool:
    from minillm.engine import tiled_kernel
    return tiled_kernel.available()


@pytest.mark.parametrize("dtype,logprob_tol,choice_faster,kernel", [
    ("fp32", 1e-4, False, "onednn-packed"), ("fp32", 1e-4, True, "onednn-packed"),
    pytest.param("fp32", 1e-4, True, "tiled",
                 marks=pytest.mark.skipif(not _tiled_builds(), reason="the tiled kernel does not build")),
    ("bf16", 0.125, True, "onednn-packed")])
def test_compiled_decode_gives_the_same_tokens_as_eager(monkeypatch, dtype, logprob_tol, choice_faster,
                                                        kernel):
    """Small on purpose (2 layers, 512 tokens, 2 rows, 4 tokens: one bucket, one compilation):
    Inductor compiles C++ on the CPU, and CI has 2 cores. bf16 compiles with frozen weights and
    autotuned GEMMs (``inductor_options``): other kernels, so its logprobs agree to bf16's
    precision, not fp32's; its tokens must still be the same. fp32 runs the machine's chosen decode
    matmuls frozen where they beat Inductor's MKL packing, else Inductor's (engine/matmul.py prepare);
    bf16 always Inductor's."""
    from minillm.engine.tokenizer import load_tokenizer
    model = _tiny_model(dtype, seed=2)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported() and dtype == "bf16":
        pytest.skip("no oneDNN bf16 kernels on this CPU")
    # bf16: the machine measured decode attention faster upcast to fp32, which holds compiled too
    measured_choice(monkeypatch, model, choice_faster, attention="fp32" if dtype == "bf16" else "native",
                    kernel=kernel)
    tok = load_tokenizer(None)
    prompts = [[5, 17, 300, 42, 9], [7, 8, 9, 10, 11, 12, 13, 14]]
    eager, eng_e = _generate(model, tok, prompts, compile=False)
    assert _packed_linears(model) > 0                                 # eager runs the chosen kernels
    from torch._dynamo.utils import counters
    torch._dynamo.reset()          # compile anew: a graph of an earlier case would pass for this one's
    counters.clear()
    compiled, eng_c = _generate(model, tok, prompts, compile=True)
    # the settings reached the compiler: the weights were frozen and pre-packed for the CPU's
    # kernels (freezing must be on while TorchDynamo traces), by Inductor or by the choice
    packed = counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"]
    kept = dtype == "fp32" and choice_faster
    assert (_packed_linears(model) > 0) is kept and (eng_c.runner.matmul_choice is not None) is kept
    assert (packed > 0) is not kept
    assert {m.candidate for m in model.modules() if hasattr(m, "candidate")} == ({kernel} if kept else set())
    assert eng_e.runner.backend.decode_upcast is eng_c.runner.backend.decode_upcast is (dtype == "bf16")
    assert eng_e.runner.compile_s == {} and not eng_e.runner.static_decode
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]
    assert len({t for o in eager for t in o.token_ids}) > 2          # not a degenerate repeat
    for a, b in zip(eager, compiled):
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.token_id == lb.token_id and abs(la.logprob - lb.logprob) <= logprob_tol
    # the compile time is reported: per bucket on the runner, and on the step that paid it
    assert list(eng_c.runner.compile_s) == [(2, 16)] and eng_c.runner.compile_s[(2, 16)] > 0
    paid = [r for r in eng_c.step_history if r.compile_ms]
    assert len(paid) == 1 and paid[0].bucket == (2, 16) and paid[0].to_dict()["compile_ms"] > 0


def test_one_row_compiled_as_a_reduction_gives_eagers_tokens(monkeypatch):
    """Where the machine timed one row faster as a sum Inductor fuses than through the chosen kernel,
    a compiled 1-row decode reads the weights that way (the eager steps keep the kernel); the tokens and
    logprobs are eager's."""
    from minillm.engine.tokenizer import load_tokenizer
    model = _tiny_model("fp32", seed=3)
    measured_choice(monkeypatch, model, faster_than_inductor=True, reduction_faster=True)
    tok = load_tokenizer(None)
    prompts = [[5, 17, 300, 42, 9]]                                   # one row: the 1-row bucket
    eager, _ = _generate(model, tok, prompts, compile=False)
    reducing = lambda: sum(getattr(m, "plain", None) is not None for m in model.modules())   # noqa: E731
    assert reducing() == 0                                            # eager holds the kernel's layout only
    compiled, eng_c = _generate(model, tok, prompts, compile=True)
    assert reducing() == _packed_linears(model) > 0
    assert list(eng_c.runner.compile_s) == [(1, 16)]
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]
    for a, b in zip(eager, compiled):
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.token_id == lb.token_id and abs(la.logprob - lb.logprob) <= 1e-4


def test_compile_refused_with_the_reason_when_unavailable(monkeypatch):
    from minillm.engine import compiled
    from minillm.engine.engine import LLMEngine
    from minillm.engine.tokenizer import load_tokenizer
    from minillm.model.loader import load_model
    compiled._cxx_compiler.cache_clear()
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    try:
        assert "C++ compiler" in compiled.compile_unavailable("cpu")
        with pytest.raises(ValueError, match="compile=True, but torch.compile cannot run here"):
            LLMEngine(load_model("tiny", device="cpu"), load_tokenizer(None), max_batch_size=1,
                      max_model_len=16,
                      compile=True)
    finally:
        compiled._cxx_compiler.cache_clear()


def test_one_compiled_graph_per_row_bucket_whatever_the_kv_length():
    """Decoding past 16 and 32 cached tokens moves through three K/V-length buckets; on a CPU the
    K/V length is a dynamic size, so the row bucket compiles once and the tokens stay eager's."""
    from torch._dynamo.utils import counters

    from minillm.engine.engine import LLMEngine
    from minillm.engine.sampling import SamplingParams
    from minillm.engine.tokenizer import load_tokenizer
    model = _tiny_model("fp32", seed=5, max_positions=128)
    tok = load_tokenizer(None)
    prompt, params = list(range(3, 15)), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    outs, kv_lens = [], []
    for compile in (False, True):
        eng = LLMEngine(model, tok, max_batch_size=1, max_model_len=64, compile=compile)
        counters.clear()
        rid = eng.add_request(prompt, params)
        while not eng.get(rid).finished:
            eng.step()
        outs.append(eng.output_of(eng.pop_finished(rid)).token_ids)
        kv_lens = sorted({r.bucket[1] for r in eng.step_history if r.bucket})
    assert outs[1] == outs[0] and len(set(outs[0])) > 2
    assert kv_lens == [16, 32, 48]          # three K/V lengths were used, in steps of 16, not powers of 2
    assert list(eng.runner.compile_s) == [(1, 16)]                  # and one compilation served them
    assert counters["stats"]["unique_graphs"] == 1


def test_the_compile_step_collects_the_compilers_garbage():
    """Compiling leaves cyclic garbage (about 2,000 objects for `tiny`); the step that compiles
    collects it, so no later decode step pays a full collection for it."""
    import gc

    from minillm.engine.llm import LLM
    from minillm.engine.sampling import SamplingParams
    llm = LLM("tiny", device="cpu", dtype="fp32", max_batch_size=1, compile=True)
    gc.collect()
    gc.disable()                                        # no collection but the engine's own
    try:
        llm.generate([list(range(3, 9))], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        left = gc.collect()                             # what a later collection would have had to find
    finally:
        gc.enable()
    recs = [r for r in llm.engine.step_history if r.bucket]          # the static decode steps
    assert recs and recs[0].compile_ms is not None and recs[0].gc_ms > 0
    assert left < 100, left


def test_fp32_builds_the_cpp_wrapper_only_for_small_buckets():
    """The C++ wrapper costs a build at every compile and gains only where the host's share of an
    fp32 step is large (the module docstring's measurements); bf16 gains at every bucket."""
    from minillm.engine.compiled import FP32_WRAPPER_ROWS, inductor_options
    fp32 = {rows: inductor_options("cpu", torch.float32, rows)["cpp_wrapper"] for rows in (1, 2, 4, 8, 64)}
    assert fp32 == {1: True, 2: True, 4: True, 8: False, 64: False} and FP32_WRAPPER_ROWS == 4
    assert all(inductor_options("cpu", torch.bfloat16, rows)["cpp_wrapper"] for rows in (1, 8, 64))
    # fp32's attention reductions compile 6 s faster without the tiling heuristics, no slower to run
    assert inductor_options("cpu", torch.float32, 8)["cpp.enable_tiling_heuristics"] is False
    assert "cpp.enable_tiling_heuristics" not in inductor_options("cpu", torch.bfloat16, 8)
    assert inductor_options("cuda", torch.float32, 1) == {}


def test_a_bucket_past_the_wrapper_rows_compiles_without_it_and_keeps_eagers_tokens(monkeypatch):
    """Five rows run in the 8-row bucket: compiled with the settings for 8 rows (no C++ wrapper in
    fp32), and the tokens stay eager's."""
    import minillm.engine.compiled as compiled_mod
    from minillm.engine.engine import LLMEngine
    from minillm.engine.sampling import SamplingParams
    from minillm.engine.tokenizer import load_tokenizer
    seen = []
    real = compiled_mod.inductor_options
    monkeypatch.setattr(compiled_mod, "inductor_options",
                        lambda device, dtype, rows=1: seen.append(rows) or real(device, dtype, rows))
    model = _tiny_model("fp32", seed=3)
    tok = load_tokenizer(None)
    prompts = [[5 + i, 17, 300 - i, 42] for i in range(5)]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs = []
    for compile in (False, True):
        eng = LLMEngine(model, tok, max_batch_size=8, max_model_len=32, compile=compile)
        rids = [eng.add_request(p, params) for p in prompts]
        while not all(eng.get(r).finished for r in rids):
            eng.step()
        outs.append([eng.output_of(eng.pop_finished(r)).token_ids for r in rids])
    assert outs[1] == outs[0]
    assert list(eng.runner.compile_s) == [(8, 16)] and seen == [8]
    assert real("cpu", torch.float32, seen[0])["cpp_wrapper"] is False


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_attention_by_reduction_computes_the_attention_kernels_result(dtype, tol):
    """Grouped heads (12 query heads over 4 K/V heads), rows of different lengths under a mask,
    eager and compiled with the K/V read through gather indices: the same as SDPA's."""
    from minillm.engine.attention import decode_attention, decode_attention_by_reduction
    g = torch.Generator().manual_seed(0)
    B, H, KVH, D, L, positions = 3, 12, 4, 16, 20, 64
    q = torch.randn(B, H, D, generator=g).to(dtype)
    k_all = torch.randn(positions, KVH, D, generator=g).to(dtype)
    v_all = torch.randn(positions, KVH, D, generator=g).to(dtype)
    locs = torch.randint(0, positions, (B, L), generator=g)                      # [B, L]
    mask = (torch.arange(L)[None, :] < torch.tensor([L, 7, 1])[:, None])[:, None, None, :]
    expected = decode_attention(q, k_all[locs], v_all[locs], mask).float()       # [B, H, D]
    eager = decode_attention_by_reduction(q, k_all[locs], v_all[locs], mask)
    compiled = torch.compile(lambda q, k, v, i, m: decode_attention_by_reduction(q, k[i], v[i], m),
                             dynamic=False)(q, k_all, v_all, locs, mask)
    for got in (eager, compiled):
        assert got.shape == (B, H, D) and got.dtype == dtype
        torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)
    unmasked = decode_attention_by_reduction(q, k_all[locs], v_all[locs], None).float()
    torch.testing.assert_close(unmasked, decode_attention(q, k_all[locs], v_all[locs], None).float(),
                               atol=tol, rtol=tol)


def test_only_the_compiled_fp32_cpu_decode_attends_by_reduction(monkeypatch):
    """The compiled fp32 runner on the plain path (no decode attention kernel) turns it on, inside its
    compiled step only (an eager step, such as decode rows beside a prefill chunk, keeps the attention
    kernel); bf16, eager, and the runner with the decode attention kernel keep it off."""
    import minillm.engine.attention as attention
    from minillm.engine.engine import LLMEngine
    from minillm.engine.sampling import SamplingParams
    from minillm.engine.tokenizer import load_tokenizer
    tok = load_tokenizer(None)
    eager = LLMEngine(_tiny_model("fp32", seed=1), tok, max_batch_size=2, max_model_len=32)
    eager.runner.backend.decode_by_reduction = True

    def refuse(*args):
        raise AssertionError("an eager step attended by reduction")
    monkeypatch.setattr(attention, "decode_attention_by_reduction", refuse)
    rid = eager.add_request([5, 17, 300, 42], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while not eager.get(rid).finished:
        eager.step()
    assert len(eager.output_of(eager.pop_finished(rid)).token_ids) == 3
    flags = {}
    for dtype in ("fp32", "bf16"):
        for compile in (False, True):
            eng = LLMEngine(_tiny_model(dtype, seed=1), tok, max_batch_size=2, max_model_len=32,
                            compile=compile, matmul="aten")
            flags[dtype, compile] = eng.runner.backend.decode_by_reduction
    assert flags == {("fp32", False): False, ("fp32", True): True,
                     ("bf16", False): False, ("bf16", True): False}
    from minillm.engine import attention_kernel
    if attention_kernel.available(torch.float32):
        eng = LLMEngine(_tiny_model("fp32", seed=1), tok, max_batch_size=2, max_model_len=32, compile=True)
        assert eng.runner.backend.decode_kernel and not eng.runner.backend.decode_by_reduction


def test_two_models_of_the_same_shapes_each_decode_with_their_own_weights(monkeypatch):
    """The compiled step does not guard on the model (compile_step), so each model has its own code
    object: sharing one, the second model ran the first one's frozen weights."""
    from minillm.engine.tokenizer import load_tokenizer
    torch._dynamo.reset()
    tok, prompts = load_tokenizer(None), [[5, 17, 300, 42, 9]]
    outs = []
    for seed in (3, 4):
        model = _tiny_model("fp32", seed=seed)
        measured_choice(monkeypatch, model, faster_than_inductor=False)   # no timing: Inductor's own matmuls
        eager, _ = _generate(model, tok, prompts, compile=False)
        compiled, _ = _generate(model, tok, prompts, compile=True)
        assert compiled[0].token_ids == eager[0].token_ids
        outs.append(eager[0].token_ids)
    assert outs[0] != outs[1]                                   # the two models do differ


@pytest.mark.skipif(not _tiled_builds(), reason="the tiled kernel does not build")
def test_one_graph_serves_every_row_bucket_from_two_up_when_every_matmul_takes_a_symbolic_row_count(
        monkeypatch):
    """With the tiled kernel on every shape the rows of the compiled decode are a dynamic size: decodes of
    2, 3 and 6 rows (buckets 2, 4, 8) run through one graph, with eager's tokens. With oneDNN's packed
    kernel kept, whose lowering needs a fixed row count, each bucket keeps its own graph."""
    from torch._dynamo.utils import counters

    from minillm.engine.engine import LLMEngine
    from minillm.engine.sampling import SamplingParams
    from minillm.engine.tokenizer import load_tokenizer
    tok = load_tokenizer(None)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    batches = [[[5 + i, 17, 300, 42 + i] for i in range(n)] for n in (2, 3, 6)]

    def tokens(eng):
        out = []
        for prompts in batches:
            rids = [eng.add_request(p, params) for p in prompts]
            while not all(eng.get(r).finished for r in rids):
                eng.step()
            out.append([eng.output_of(eng.pop_finished(r)).token_ids for r in rids])
        return out

    for kernel, dynamic in (("tiled", True), ("onednn-packed", False)):
        model = _tiny_model("fp32", seed=4)
        measured_choice(monkeypatch, model, faster_than_inductor=True, kernel=kernel)
        eager = tokens(LLMEngine(model, tok, max_batch_size=8, max_model_len=32))
        torch._dynamo.reset()
        counters.clear()
        eng = LLMEngine(model, tok, max_batch_size=8, max_model_len=32, compile=True)
        assert eng.runner.rows_dynamic is dynamic
        assert tokens(eng) == eager
        buckets = {b for b, _ in eng.runner.compile_s}
        assert buckets == ({2} if dynamic else {2, 4, 8})
        assert counters["stats"]["unique_graphs"] == len(buckets)
        # an engine of another batch size (another cache size) on the same model: the same graphs, if dynamic
        other = LLMEngine(model, tok, max_batch_size=4, max_model_len=32, compile=True)
        rids = [other.add_request(p, params) for p in batches[1]]
        while not all(other.get(r).finished for r in rids):
            other.step()
        assert [other.output_of(other.pop_finished(r)).token_ids for r in rids] == eager[1]
        assert counters["stats"]["unique_graphs"] == len(buckets) + (0 if dynamic else 1)
