"""The decode attention kernel (engine/attention_kernel.py): the same result as scaled_dot_product_attention
over each row's own positions, whatever the lengths, the heads' grouping or the split of a row into chunks;
one operator in a compiled graph; and the backend uses it where it is on, and SDPA on the plain path."""
import pytest
import torch

from minillm.engine import attention_kernel
from minillm.engine.attention import AttentionBackend, build_metadata, decode_attention
from minillm.engine.kv_cache import KVCache
from minillm.model.config import ModelConfig

pytestmark = pytest.mark.skipif(not attention_kernel.available(torch.float32),
                                reason="the decode attention kernel does not build here")


def reference(q, k_flat, v_flat, slots, lens, max_len):
    """SDPA over each row's positions [0, len) of its slot, in fp32, one row at a time."""
    out = []
    for b in range(q.shape[0]):
        s, n = int(slots[b]), int(lens[b])
        k = k_flat[s * max_len:s * max_len + n][None].float()                    # [1, n, KVH, D]
        v = v_flat[s * max_len:s * max_len + n][None].float()
        out.append(decode_attention(q[b:b + 1].float(), k, v, None))
    return torch.cat(out)                                                        # [B, H, D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,KVH,D,lens", [
    (1, 12, 4, 64, [128]),                  # cpu-small's heads, one row split into chunks across the threads
    (1, 4, 4, 16, [1]),                     # one position; no grouping; D of one vector
    (3, 8, 2, 20, [1, 33, 200]),            # D no multiple of a vector; rows of very different lengths
    (5, 6, 3, 32, [31, 32, 33, 64, 65]),    # around the 32-position chunk boundary
    (2, 14, 2, 64, [16, 47]),               # seven heads share a K/V head (summed four, then three)
])
def test_the_kernel_matches_sdpa_over_each_rows_own_positions(dtype, B, H, KVH, D, lens):
    g = torch.Generator().manual_seed(B * 100 + D)
    slots_n, max_len = B + 2, 256
    k = torch.randn(slots_n * max_len, KVH, D, generator=g).to(dtype)
    v = torch.randn(slots_n * max_len, KVH, D, generator=g).to(dtype)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    q[0] *= 40                  # row 0 peaked: exponents far below -87, where the kernel clamps e^x
    slots = torch.randperm(slots_n, generator=g)[:B]
    lens_t = torch.tensor(lens)
    got = attention_kernel.run(q, k, v, slots, lens_t, max_len)
    assert got.shape == (B, H, D) and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(got.float(), reference(q, k, v, slots, lens_t, max_len), **tol)


def test_positions_past_a_rows_length_are_never_read():
    """A row of length n must ignore what sits at n and after in its slot: a NaN there (a previous
    owner's, or never written) would otherwise poison its output."""
    KVH, D, max_len = 2, 16, 64
    k, v = torch.randn(2 * max_len, KVH, D), torch.randn(2 * max_len, KVH, D)
    k[10:max_len], v[10:max_len] = float("nan"), float("nan")
    q = torch.randn(1, 4, D)
    got = attention_kernel.run(q, k, v, torch.tensor([0]), torch.tensor([10]), max_len)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference(q, k, v, torch.tensor([0]), torch.tensor([10]), max_len))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_rows_that_stand_apart_are_read_in_place(dtype):
    """A compiled decode hands over q as a view of the rope's output, q and k side by side: rows 16 heads
    apart. Through the operator (what the graph calls) and the plain call, the same as a packed copy; a
    q whose heads are not packed is copied first, not misread."""
    KVH, D, max_len = 4, 64, 48
    g = torch.Generator().manual_seed(7)
    k = torch.randn(4 * max_len, KVH, D, generator=g).to(dtype)
    v = torch.randn(4 * max_len, KVH, D, generator=g).to(dtype)
    qk = torch.randn(3, 16, D, generator=g).to(dtype)
    q = qk[:, :12]                                                   # [3, 12, D], rows 16·D apart
    assert not q.is_contiguous()
    slots, lens = torch.tensor([3, 0, 1]), torch.tensor([40, 1, 33])
    want = attention_kernel.run(q.contiguous(), k, v, slots, lens, max_len)
    assert torch.equal(attention_kernel.run(q, k, v, slots, lens, max_len), want)
    assert torch.equal(torch.ops.minillm.decode_attention(q, k, v, slots, lens, max_len), want)
    heads_apart = torch.randn(3, D, 12, generator=g).to(dtype).transpose(1, 2)      # [3, 12, D], D outer
    assert torch.equal(attention_kernel.run(heads_apart, k, v, slots, lens, max_len),
                       attention_kernel.run(heads_apart.contiguous(), k, v, slots, lens, max_len))
    assert torch.equal(torch.ops.minillm.decode_attention(heads_apart, k, v, slots, lens, max_len),
                       attention_kernel.run(heads_apart.contiguous(), k, v, slots, lens, max_len))


def test_a_compiled_graph_calls_the_kernel_as_one_operator():
    from minillm.engine.compiled import compile_unavailable
    if compile_unavailable("cpu"):
        pytest.skip("torch.compile is unavailable here")
    KVH, D, max_len = 2, 16, 32
    k, v = torch.randn(3 * max_len, KVH, D), torch.randn(3 * max_len, KVH, D)
    slots, lens = torch.tensor([2, 0]), torch.tensor([5, 32])
    fn = torch.compile(lambda q: attention_kernel.forward(q * 2, k, v, slots, lens, max_len) + 1,
                       fullgraph=True)
    q = torch.randn(2, 4, D)
    torch.testing.assert_close(fn(q), reference(q * 2, k, v, slots, lens, max_len) + 1)


def test_the_backend_reads_decode_rows_through_the_kernel_and_sdpa_gives_the_same():
    """Rows of different lengths, and equal lengths in a range of slots: the two ways the metadata holds
    them. The backend with the kernel off (the plain path) is the reference."""
    cfg = ModelConfig(num_heads=4, num_kv_heads=2, hidden_size=64, num_layers=1)
    cache = KVCache(cfg, 4, 48)
    g = torch.Generator().manual_seed(0)
    for t in cache.k_flat + cache.v_flat:
        t[:cache.reserved_slot * cache.max_len] = torch.randn(cache.reserved_slot * cache.max_len, 2, 16,
                                                              generator=g)
    for decode in ([(0, 7), (2, 30), (3, 1)], [(1, 12), (2, 12)]):
        q = torch.randn(len(decode), 4, 16, generator=g)
        kn, vn = torch.randn(len(decode), 2, 16, generator=g), torch.randn(len(decode), 2, 16, generator=g)
        outs = []
        for on in (True, False):
            backend = AttentionBackend(cache, 4, 2, 16)
            backend.decode_kernel = on
            backend.begin(build_metadata(cache, decode, [], torch.device("cpu")))
            assert (backend.meta.kernel_slots is not None) is on
            outs.append(backend.attend(0, q, kn, vn))                              # [B, H*D]
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_under_the_profiler_the_kernel_runs_as_its_operator():
    """As the tiled matmul: while the profiler records, the eager call goes through the operator, so the
    profile names it; the answer is the same."""
    KVH, D, max_len = 2, 16, 32
    k, v, q = torch.randn(2 * max_len, KVH, D), torch.randn(2 * max_len, KVH, D), torch.randn(2, 4, D)
    args = (q, k, v, torch.tensor([0, 1]), torch.tensor([5, 20]), max_len)
    plain = attention_kernel.forward(*args)
    with torch.profiler.profile() as prof:
        profiled = attention_kernel.forward(*args)
    assert "minillm::decode_attention" in {e.name for e in prof.events()}
    torch.testing.assert_close(profiled, plain)
