"""Chinese text in figures: drawn in a CJK font when one is installed, in English when none is.

matplotlib's default font (DejaVu Sans) has no Chinese glyphs: a label such as "首 token 延迟" comes
out as empty boxes, with only a warning in the log. The project does not ship a 20 MB font; it
looks for one the machine has (Noto Sans CJK from Debian's ``fonts-noto-cjk``, Source Han Sans,
WenQuanYi, or the system fonts of macOS and Windows) and, where none is, writes the English label
alone. Figures are labelled through :func:`bilingual`, so the choice is made in one place.
"""
from __future__ import annotations

import re
import warnings
from functools import lru_cache

# Families with Simplified Chinese glyphs, in order of preference: Linux packages first, then the
# fonts macOS and Windows ship.
CJK_FAMILIES = (
    "Noto Sans CJK SC", "Noto Sans SC", "Noto Sans CJK JP", "Source Han Sans SC", "Source Han Sans CN",
    "WenQuanYi Micro Hei", "WenQuanYi Zen Hei", "Droid Sans Fallback", "AR PL UMing CN",
    "PingFang SC", "Hiragino Sans GB", "Heiti SC", "Microsoft YaHei", "SimHei",
)
FONT_PACKAGE = "fonts-noto-cjk (Debian/Ubuntu), or any Noto Sans CJK / Source Han Sans install"

_CJK = re.compile(r"[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef]")


def has_cjk(text: str) -> bool:
    """True when ``text`` holds a character that DejaVu Sans cannot draw (CJK ideographs and punctuation)."""
    return bool(_CJK.search(text or ""))


# File names of the fonts above, for a font installed after matplotlib built its font cache
_CJK_FILES = re.compile(r"cjk|wqy|sourcehan|notosanssc|simhei|msyh|yahei|pingfang|hiragino|"
                        r"droidsansfallback|uming", re.IGNORECASE)


@lru_cache(maxsize=1)
def cjk_font() -> str | None:
    """The first installed family of :data:`CJK_FAMILIES`, or None. Cached: the font list is read once.
    matplotlib caches the fonts it found the first time it ran, so a font installed since is looked for
    among the system's font files too, and registered."""
    from matplotlib import font_manager

    def first_installed() -> str | None:
        installed = {f.name for f in font_manager.fontManager.ttflist}
        return next((name for name in CJK_FAMILIES if name in installed), None)
    found = first_installed()
    if found is None:
        for path in font_manager.findSystemFonts():
            if _CJK_FILES.search(path):
                try:
                    font_manager.fontManager.addfont(path)
                except (OSError, RuntimeError, ValueError):     # a file FreeType cannot read
                    continue
        found = first_installed()
    return found


def bilingual(en: str, zh: str, sep: str = " · ") -> str:
    """``"en · zh"`` where a CJK font is installed, else ``en`` alone: a label never turns into boxes."""
    return f"{en}{sep}{zh}" if cjk_font() else en


def use_cjk_font(fig) -> int:
    """Give every text of ``fig`` that holds Chinese a CJK font, Latin letters staying in the default
    font (matplotlib falls back glyph by glyph through a list of families). Returns how many texts
    hold Chinese; warns, naming the font package, when they will be drawn as boxes."""
    from matplotlib import rcParams
    from matplotlib.text import Text
    texts = [t for t in fig.findobj(Text) if has_cjk(t.get_text())]
    font = cjk_font()
    if texts and font is None:
        warnings.warn(f"{len(texts)} text(s) in this figure hold Chinese characters and no CJK font is "
                      f"installed, so they will be drawn as boxes; install {FONT_PACKAGE}, or label it with "
                      "minillm.plots.fonts.bilingual()", stacklevel=2)
    elif font is not None:
        families = [*rcParams["font.sans-serif"][:1], font]
        for t in texts:
            t.set_fontfamily(families)
    return len(texts)
