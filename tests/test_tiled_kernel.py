"""The project's own decode matmul (engine/tiled_kernel.py): the same product as F.linear for any row
count, a layout that goes back to the weight, and one operator a compiled graph can call."""
import pytest
import torch
import torch.nn.functional as F

from minillm.engine import matmul, tiled_kernel

pytestmark = pytest.mark.skipif(not tiled_kernel.available(), reason="the tiled kernel does not build here")


@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_computes_f_linear_for_every_row_count(bias):
    """Rows 1–17 and 33 cover every register-tile size, whole and partial groups of rows; K = 100 is
    no multiple of a vector."""
    g = torch.Generator().manual_seed(0)
    tw = tiled_kernel.tile_width()
    w = torch.randn(3 * tw, 100, generator=g)
    b = torch.randn(3 * tw, generator=g) if bias else None
    tiles = tiled_kernel.pack(w)
    assert tiles.shape == (3, 100, tw)
    for rows in [*range(1, 18), 33]:
        x = torch.randn(rows, 100, generator=g)
        torch.testing.assert_close(tiled_kernel.run(x, tiles, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, 3, 100, generator=g)                      # leading dims kept, strided input copied
    torch.testing.assert_close(tiled_kernel.run(x3, tiles, b), F.linear(x3, w, b), rtol=1e-5, atol=1e-4)
    assert tiled_kernel.run(x3[:, :0], tiles, b).shape == (2, 0, 3 * tw)


def test_tiles_go_back_to_the_weight_and_a_ragged_weight_is_refused():
    tw = tiled_kernel.tile_width()
    w = torch.randn(2 * tw, 48)
    assert torch.equal(tiled_kernel.unpack(tiled_kernel.pack(w)), w)
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
