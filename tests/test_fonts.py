"""Chinese in figures: a CJK font where one is installed, the English label where none is, never
boxes (matplotlib draws a missing glyph as a box and only warns)."""
from __future__ import annotations

import warnings

import matplotlib
import pytest

matplotlib.use("Agg")   # a test process, not library code: the library leaves the backend alone
import matplotlib.pyplot as plt  # noqa: E402

from minillm.plots import fonts  # noqa: E402
from minillm.plots.figures import save_figure, section_line  # noqa: E402


@pytest.fixture
def no_cjk_font(monkeypatch):
    monkeypatch.setattr(fonts, "cjk_font", lambda: None)


def _missing_glyph_warnings(fig) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig.canvas.draw()
    return [str(w.message) for w in caught if "missing from" in str(w.message)]


def test_has_cjk_tells_chinese_from_latin():
    assert fonts.has_cjk("首 token 延迟") and fonts.has_cjk("（") and not fonts.has_cjk("TTFT · p99 ≤ 1 s")


def test_without_a_cjk_font_labels_are_english_and_no_glyph_is_missing(no_cjk_font, tmp_path):
    assert fonts.bilingual("Four metrics", "四个指标") == "Four metrics"
    assert section_line("10-2-itl-distribution") == "Figure 10-2 · 10.2 Four metrics"
    fig, ax = plt.subplots()
    ax.set_title(fonts.bilingual("Time to first token", "首 token 延迟"))
    save_figure(fig, "10-2-itl-distribution", "measured here", tmp_path)
    assert _missing_glyph_warnings(fig) == []
    plt.close(fig)


def test_chinese_text_without_a_font_is_named_with_the_package_to_install(no_cjk_font):
    fig, ax = plt.subplots()
    ax.set_title("首 token 延迟")
    with pytest.warns(UserWarning, match="fonts-noto-cjk"):
        assert fonts.use_cjk_font(fig) == 1
    plt.close(fig)


def test_a_figure_outside_the_chapter_has_no_section_line():
    assert section_line("my-own-plot") is None and section_line("10-9-x") is None


@pytest.mark.skipif(fonts.cjk_font() is None,
                    reason="no CJK font installed here (e.g. Debian's fonts-noto-cjk)")
def test_with_a_cjk_font_chinese_is_drawn_with_every_glyph(tmp_path):
    assert fonts.bilingual("Four metrics", "四个指标") == "Four metrics · 四个指标"
    fig, ax = plt.subplots()
    ax.set_title(fonts.bilingual("Time to first token", "首 token 延迟"))
    save_figure(fig, "10-2-itl-distribution", "measured here", tmp_path)
    assert _missing_glyph_warnings(fig) == []
    assert fonts.cjk_font() in ax.title.get_fontfamily()
    plt.close(fig)
