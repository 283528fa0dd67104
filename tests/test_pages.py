"""Weights and the read bound in 2 MiB pages (hardware/pages.py, engine/weight_pages.py): the system's
mode is read right, a buffer is aligned and marked where it can be, and moving the chosen matmuls'
weights into one buffer changes no number the model computes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from minillm.engine import matmul, weight_pages
from minillm.engine.matmul_kernels import CANDIDATES, PackedLinear
from minillm.hardware import pages


@pytest.mark.parametrize("text, mode", [("always [madvise] never\n", "madvise"),
                                        ("[always] madvise never\n", "always"),
                                        ("always madvise [never]\n", "never")])
def test_the_systems_mode_is_the_bracketed_word(tmp_path, monkeypatch, text, mode):
    f = tmp_path / "enabled"
    f.write_text(text)
    monkeypatch.setattr(pages, "THP_ENABLED", f)
    assert pages.thp_mode() == mode
    assert pages.can_ask() == (mode != "never" and hasattr(pages.mmap, "MADV_HUGEPAGE"))


def test_no_setting_means_no_2_mib_pages_and_a_plain_buffer(tmp_path, monkeypatch):
    monkeypatch.setattr(pages, "THP_ENABLED", tmp_path / "absent")
    assert pages.thp_mode() is None and not pages.can_ask()
    buf = pages.huge_page_empty(3 * pages.HUGE_PAGE)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * pages.HUGE_PAGE


@pytest.mark.skipif(not pages.can_ask(), reason="this system gives no 2 MiB pages")
def test_a_buffer_asked_for_in_2_mib_pages_starts_on_one_and_is_writable():
    n = 3 * pages.HUGE_PAGE + 12345                        # not a whole number of pages
    buf = pages.huge_page_empty(n)
    assert buf.numel() == n and buf.data_ptr() % pages.HUGE_PAGE == 0
    buf.fill_(7)
    assert int(buf[-1]) == 7 and int(buf.sum()) == 7 * n
    huge = pages.huge_page_bytes(buf)
    assert huge is None or 0 <= huge <= n               # its own bytes, not the region's slack


def test_a_small_tensor_is_never_counted_as_more_than_its_bytes():
    t = torch.ones(1000)
    huge = pages.huge_page_bytes(t)
    assert huge is None or 0 <= huge <= t.nbytes


def _packed_model(dtype=torch.float32) -> nn.Module:
    """Three linears held as three candidates would hold them; the oneDNN one (an opaque tensor) where
    this torch has oneDNN."""
    g = torch.Generator().manual_seed(0)
    names = ["tiled", "aten-kmajor", "onednn-packed"]
    names = [n for n in names if CANDIDATES[n].available(dtype)]
    layers = []
    for i, name in enumerate(names):
        lin = nn.Linear(256, 512 if i % 2 == 0 else 256, bias=i == 1, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / 16)
        layers.append(PackedLinear(lin, name))
        if i % 2 == 0:
            layers.append(nn.Linear(512, 256, bias=False, dtype=dtype))   # plain: not the choice's, stays
    return nn.Sequential(*layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moving_the_weights_changes_no_output_and_moves_only_plain_held_tensors(dtype):
    model = _packed_model(dtype)
    x = torch.randn(3, 256, dtype=dtype)
    before = model(x)
    movable = [m for m in model if isinstance(m, PackedLinear) and m.held.layout == torch.strided]
    opaque = [m.held for m in model if isinstance(m, PackedLinear) and m.held.layout != torch.strided]
    plain = [m.weight for m in model if isinstance(m, nn.Linear)]

    done = weight_pages.move_to_huge_pages(model)

    assert torch.equal(model(x), before)
    assert done.tensors == len(movable)
    assert done.nbytes >= sum(m.held.nbytes for m in movable)
    assert len({m.held.untyped_storage().data_ptr() for m in movable}) == 1          # one buffer
    ptrs = [m.held.data_ptr() for m in movable]
    assert ptrs == sorted(ptrs) and all(p % weight_pages.ALIGN == 0 for p in ptrs)   # in module order
    assert all(a is b for a, b in zip(opaque, [m.held for m in model if isinstance(m, PackedLinear)
                                               and m.held.layout != torch.strided]))
    assert all(a is b for a, b in zip(plain, [m.weight for m in model if isinstance(m, nn.Linear)]))
    assert done.huge_bytes is None or done.huge_bytes <= done.nbytes
    assert "one buffer" in done.line()
    # a second engine on the same model: nothing copied again
    again = weight_pages.move_to_huge_pages(model)
    assert again is done and [m.held.data_ptr() for m in movable] == ptrs


def test_a_model_with_no_chosen_matmul_moves_nothing():
    model = nn.Sequential(nn.Linear(64, 64))
    done = weight_pages.move_to_huge_pages(model)
    assert done.tensors == 0 and "where torch allocated them" in done.line()


def test_the_line_says_when_the_system_gave_no_2_mib_pages():
    line = weight_pages.WeightPages(4, 8 << 20, 0, "never").line()
    assert "base pages" in line and "never" in line
    assert "6 MiB of it in 2 MiB pages" in weight_pages.WeightPages(4, 8 << 20, 6 << 20, "madvise").line()


def test_the_engine_moves_the_chosen_weights_and_keeps_eagers_tokens(monkeypatch, tmp_path):
    from minillm.model.loader import load_model
    from tests.test_matmul import _choice_for, _greedy
    monkeypatch.setenv("MINILLM_CACHE_DIR", str(tmp_path / "cache"))
    prompts = ["the lifecycle of a request", "decode reads every weight", "a"]
    plain = load_model("tiny", torch.device("cpu"), torch.float32, 0)
    want, eng = _greedy(plain, prompts, matmul="aten")
    assert eng.runner.weight_pages is None
    packed = load_model("tiny", torch.device("cpu"), torch.float32, 0)
    matmul.apply(packed, _choice_for(packed, "tiled"))
    got, eng = _greedy(packed, prompts, matmul="auto")
    assert got == want
    held = [m.held for m in packed.modules() if isinstance(m, PackedLinear)]
    assert eng.runner.weight_pages.tensors == len(held) > 0
    assert len({t.untyped_storage().data_ptr() for t in held}) == 1
    # the plain path asked for afterwards: torch's own tensors again, and no stale record
    matmul.restore_plain(packed)
    assert packed.weight_pages is None


def test_doctor_says_whether_the_system_gives_2_mib_pages(monkeypatch):
    from minillm import doctor
    monkeypatch.setattr(pages, "thp_mode", lambda: "never")
    monkeypatch.setattr(pages, "can_ask", lambda: False)
    (c,) = doctor.check_huge_pages()
    assert c.status == "--" and "never" in c.detail
    monkeypatch.setattr(pages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(pages, "can_ask", lambda: True)
    (c,) = doctor.check_huge_pages()
    assert c.status == "OK" and "madvise" in c.detail
