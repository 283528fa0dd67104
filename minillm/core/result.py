"""The JSON side of every result dataclass, written once.

A result (a benchmark's report, a sweep, one experiment's rows) is a dataclass of plain data:
:meth:`Result.to_dict` gives its JSON-ready dict (nested dataclasses included) and
:meth:`Result.from_dict` reads one back, ignoring keys a later version added and rebuilding its
``rows`` as ``row_type`` when the class names one.
"""
from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, ClassVar


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
