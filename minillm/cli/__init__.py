"""``python -m minillm <command>``: roofline (the main job), generate, bench, serve, the benchmarks,
diagnose, the reference runs, doctor. The parser is ``parser.py``; what each command does,
``commands.py``."""
from __future__ import annotations

import sys

from minillm.cli.parser import build_parser

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    try:
        a = build_parser().parse_args(argv)
    except SystemExit as e:      # --help (0) or a parse error (2, already reported)
        return e.code if isinstance(e.code, int) else 2
    try:
        return a.fn(a)
    except (ValueError, FileNotFoundError, OverflowError) as e:
        # bad input (a model name, a device, a dtype, a port): one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
