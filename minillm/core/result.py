"""The JSON side of every result dataclass, written once.

A result (a benchmark's report, a sweep, one experiment's rows) is a dataclass of plain data:
:meth:`Result.to_dict` gives its JSON-ready dict (nested dataclasses included) and
:meth:`Result.from_dict` reads one back, ignoring keys a later version added and rebuilding its
``rows`` as ``row_type`` when the class names one.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Iterable, Sequence


class Result:
    row_type: ClassVar[type | None] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        if cls.row_type is not None and "rows" in kwargs:
            kwargs["rows"] = [cls.row_type(**r) for r in kwargs["rows"]]
        return cls(**kwargs)


@dataclass(frozen=True)
class Col:
    """One column of a fixed-width text table: its header, its width, how a number is formatted
    (``".1f"``), what follows it inside the width (``"%"``), and left or right alignment."""
    header: str
    width: int
    fmt: str = ""
    suffix: str = ""
    left: bool = False

    def cell(self, value: Any) -> str:
        if value is None:
            text = "-"
        elif isinstance(value, str):
            text = value
        else:
            text = format(value, self.fmt) + self.suffix
        return f"{text:<{self.width}}" if self.left else f"{text:>{self.width}}"


def text_table(cols: Sequence[Col], rows: Iterable[Sequence[Any]]) -> list[str]:
    """The header line and one line per row, every result's table drawn the same way. ``None``
    prints as ``-``; a row shorter than the columns prints its last value as it is, after the
    columns before it (a status such as ``"oom"`` in place of the numbers)."""
    lines = ["".join(c.cell(c.header) for c in cols)]
    for row in rows:
        row = list(row)
        if len(row) < len(cols):
            *head, rest = row
            lines.append("".join(c.cell(v) for c, v in zip(cols, head)) + str(rest))
        else:
            lines.append("".join(c.cell(v) for c, v in zip(cols, row)))
    return lines


NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def json_finite(o):
    """Strict JSON has no Infinity/NaN (B* is infinite when KV traffic outgrows compute)."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {k: json_finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_finite(v) for v in o]
    return o


def dumps_strict(d: dict) -> str:
    """Indented strict JSON (no Infinity/NaN tokens, which other tools' parsers refuse)."""
    return json.dumps(json_finite(d), indent=1, default=str, allow_nan=False)


def restore_nonfinite(d: dict) -> dict:
    """The inverse of :func:`json_finite` on one level of a dict: "inf", "-inf", "nan" back to floats."""
    return {k: NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in d.items()}
