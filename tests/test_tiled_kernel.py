"""The project's own decode matmul (engine/tiled_kernel.py): the same product as F.linear for any row
count, a layout that goes back to the weight, and one operator a compiled graph can call."""
import pytest
import torch
import torch.nn.functional as F

from minillm.engine import matmul, tiled_kernel

pytestmark = pytest.mark.skipif(not tiled_kernel.available(), reason="the tiled kernel does not build here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_computes_f_linear_for_every_row_count(bias, dtype):
    """Rows 1–17 and 33 cover every register-tile size, whole and partial groups of rows; K = 100 is
    no multiple of a vector. bf16 is compared with the product of the same bf16 numbers in fp32, to
    within the output's own rounding (its spacing near 10 is 0.0625)."""
    g = torch.Generator().manual_seed(0)
    tw = tiled_kernel.tile_width()
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=0.1)
    w = torch.randn(3 * tw, 100, generator=g).to(dtype)
    b = torch.randn(3 * tw, generator=g).to(dtype) if bias else None
    tiles = tiled_kernel.pack(w)
    assert tiles.shape[0] == 3 and tiles.dtype == dtype

    def want(x):
        return F.linear(x.float(), w.float(), b.float() if bias else None)

    for rows in [*range(1, 18), 33]:
        x = torch.randn(rows, 100, generator=g).to(dtype)
        got = tiled_kernel.run(x, tiles, b)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want(x), **tol)
    x3 = torch.randn(2, 3, 100, generator=g).to(dtype)                # leading dims kept
    torch.testing.assert_close(tiled_kernel.run(x3, tiles, b).float(), want(x3), **tol)
    assert tiled_kernel.run(x3[:, :0], tiles, b).shape == (2, 0, 3 * tw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reading_the_weights_ahead_changes_no_bit_of_the_answer(dtype):
    """The read-ahead only asks for lines early: every row count gives the same bits with it on for
    every row count (1), at its default, and off (a row count no group reaches)."""
    g = torch.Generator().manual_seed(1)
    tw = tiled_kernel.tile_width()
    w = torch.randn(4 * tw, 96, generator=g).to(dtype)
    tiles = tiled_kernel.pack(w)
    default = tiled_kernel.read_ahead_from_rows(1)
    try:
        for rows in [1, 5, 6, 8, 9, 16, 17]:
            x = torch.randn(rows, 96, generator=g).to(dtype)
            got = {}
            for setting in (1, default, 10_000):
                tiled_kernel.read_ahead_from_rows(setting)
                got[setting] = tiled_kernel.run(x, tiles, None)
            assert torch.equal(got[1], got[default]) and torch.equal(got[1], got[10_000])
    finally:
        assert tiled_kernel.read_ahead_from_rows(default) == 10_000
    assert tiled_kernel.read_ahead_from_rows(default) == default


def test_tiles_go_back_to_the_weight_and_a_ragged_weight_is_refused():
    tw = tiled_kernel.tile_width()
    w = torch.randn(2 * tw, 48)
    assert torch.equal(tiled_kernel.unpack(tiled_kernel.pack(w)), w)
    wb = torch.randn(tw, 48).to(torch.bfloat16)
    assert torch.equal(tiled_kernel.unpack(tiled_kernel.pack(wb)), wb)
    with pytest.raises(ValueError, match=f"not a multiple of the kernel's tile of {tw}"):
        tiled_kernel.pack(torch.randn(tw + 8, 48))
    sc = matmul.choose_for_shape(tw + 8, 48, False, torch.float32, (1, 2), repeats=1, stack_bytes=2**20)
    assert "tiled" in sc.rejected and "tiled" not in sc.ms and sc.chosen != "tiled"


def test_a_compiled_graph_calls_the_kernel_as_one_operator():
    from minillm.engine.compiled import compile_unavailable
    if compile_unavailable("cpu"):
        pytest.skip("torch.compile is unavailable here")
    tw = tiled_kernel.tile_width()
    w, b, x = torch.randn(2 * tw, 64), torch.randn(2 * tw), torch.randn(3, 64)
    tiles = tiled_kernel.pack(w)
    fn = torch.compile(lambda x: torch.relu(tiled_kernel.forward(x * 2, tiles, b)), fullgraph=True)
    torch.testing.assert_close(fn(x), torch.relu(F.linear(x * 2, w, b)), rtol=1e-5, atol=1e-4)


def test_a_tiled_linear_keeps_its_plain_weight_for_conversion():
    lin = torch.nn.Linear(64, 2 * tiled_kernel.tile_width())
    packed = matmul.PackedLinear(lin, "tiled", {"1": "tiled", "8": "tiled"})
    assert torch.equal(packed.weight, lin.weight) and torch.equal(packed.state_dict()["weight"], lin.weight)
    x = torch.randn(5, 64)
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-4)


def test_the_operators_cpu_kernel_is_registered_from_cpp_and_python_serves_where_that_does_not_build():
    """Where torch ships its stable C++ operator API the operator's CPU kernel is the C++ one (a compiled
    graph's C++ wrapper then calls it without entering Python); where a registration fails to build, the
    kernel alone is built and a Python implementation serves the operator."""
    from minillm.engine import cpp_build
    if cpp_build.stable_api_available():
        assert ".main.cpp" in torch._C._dispatch_dump("minillm::tiled_linear")     # the built C++ source
    lib = torch.library.Library("minillm_fallback_test", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    built = cpp_build.load_with_operator('extern "C" int answer() { return 42; }', "#error does not build",
                                         "a test kernel", lib, "twice", lambda x: x * 2)
    assert built is not None and built.answer() == 42
    assert torch.equal(torch.ops.minillm_fallback_test.twice(torch.ones(2)), torch.full((2,), 2.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_operator_takes_a_strided_input_and_returns_a_fresh_contiguous_output(dtype):
    """The C++ operator copies only an input that is not contiguous, and allocates its output itself."""
    lin = torch.nn.Linear(64, 2 * tiled_kernel.tile_width(), bias=True).to(dtype)
    tiles = tiled_kernel.pack(lin.weight.detach())
    x = torch.randn(64, 6).to(dtype).t()                                         # [6, 64], strided
    assert not x.is_contiguous()
    y = torch.ops.minillm.tiled_linear(x, tiles, lin.bias.detach())
    assert y.shape == (6, lin.out_features) and y.is_contiguous() and y.dtype == dtype
    assert torch.equal(y, tiled_kernel.run(x.contiguous(), tiles, lin.bias.detach()))


def test_under_the_profiler_the_kernel_runs_as_its_operator():
    """The profiler records operators by name and never sees a ctypes call: while it records, the
    eager forward calls the operator, so a profiled step counts its matmuls (10.5's device busy);
    the answer is the same either way."""
    w, x = torch.randn(96, 64), torch.randn(3, 64)
    tiles = tiled_kernel.pack(w)
    plain = tiled_kernel.forward(x, tiles, None)
    with torch.profiler.profile() as prof:
        profiled = tiled_kernel.forward(x, tiles, None)
    assert "minillm::tiled_linear" in {e.name for e in prof.events()}
    torch.testing.assert_close(profiled, plain)
    torch.testing.assert_close(plain, F.linear(x, w), rtol=1e-4, atol=1e-4)
