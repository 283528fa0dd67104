"""The project's own C++ kernels (``tiled_kernel``, ``attention_kernel``) built with Inductor's toolchain.

``CppCodeCache`` compiles a source with the flags, OpenMP runtime and on-disk cache that Inductor's
generated kernels use (about 1.5 s the first time, from the cache after), and loads it with ctypes. Where
no compiler works, or this torch has no Inductor, the kernel is simply not offered.
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("minillm.engine")


def load_cpp(source: str, what: str) -> ctypes.CDLL | None:
    """The library built from ``source``, or None (logged, naming ``what``) where it cannot be built."""
    try:
        from torch._inductor.codecache import CppCodeCache
        return CppCodeCache.load(source)
    except Exception as e:                # no compiler, no Inductor, a failed build: not offered
        log.info("%s is not available here: %s", what, str(e).splitlines()[0][:200])
        return None
