"""Memory in 2 MiB pages (chapter 10.3): what a weight read costs besides the bytes.

Decode streams every weight once a step. In 4 KiB pages the 164 MB of ``cpu-small``'s bf16 weights
span 40,000 pages, each a TLB entry the CPU walks the page table for when the stream reaches it; in
2 MiB pages they span about 80. Linux gives a process 2 MiB pages ("transparent huge pages") for the
memory it marks with ``madvise(MADV_HUGEPAGE)``, or for all of it where the system's mode is
``always``; torch's allocator asks for neither, and most distributions ship the mode ``madvise``.

Measured on the project's AMD EPYC VM (2 cores, mode ``madvise``, torch 2.13.0+cpu), one process,
buffers read in turn, median of 40 pairs: a sum over 164 MiB read 47.5 GB/s in 4 KiB pages and 56.4
in 2 MiB pages (1.21× paired), over 328 MiB 50.8 against 57.5 (1.11×). So the read bound is measured
in the same pages the engine holds its weights in (``machine.measure_read_bandwidth``), and the
engine holds them so (``engine/weight_pages.py``).

Where the system has no such pages (another OS, mode ``never``) the buffer is a plain one, and
:func:`huge_page_bytes` says how much of a buffer the kernel really backed with them.
"""
from __future__ import annotations

import mmap
import re
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20                                 # bytes: x86-64's and arm64's (4 KiB granule) size
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The system's transparent huge page mode ("always", "madvise" or "never"); None where there
    is no such setting (not Linux, or a kernel without it)."""
    try:
        m = re.search(r"\[(\w+)\]", THP_ENABLED.read_text())
    except OSError:
        return None
    return m[1] if m else None


def can_ask() -> bool:
    """Whether a buffer can be asked for in 2 MiB pages here."""
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def huge_page_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes``, 2 MiB-aligned and marked for 2 MiB pages where the
    system gives them (:func:`can_ask`) and it fills at least one, else aligned to a base page. Its
    pages are faulted in by the first write, which is when the kernel picks their size: write it
    before timing a read."""
    nbytes = int(nbytes)
    if nbytes < HUGE_PAGE or not can_ask():
        whole = torch.empty(nbytes + mmap.PAGESIZE, dtype=torch.uint8)
        start = -whole.data_ptr() % mmap.PAGESIZE
        return whole[start:start + nbytes]
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)   # anonymous, untouched
    whole = torch.frombuffer(region, dtype=torch.uint8)    # keeps ``region`` alive
    start = -whole.data_ptr() % HUGE_PAGE
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, start, length)
    return whole[start:start + nbytes]


def huge_page_bytes(t: torch.Tensor) -> int | None:
    """Bytes of ``t`` (of its storage, where it is not contiguous) that the kernel backs with 2 MiB pages
    right now, from ``AnonHugePages`` in ``/proc/self/smaps`` (each mapping that overlaps those bytes
    counts at most the overlap); None where that cannot be read."""
    if t.is_contiguous():
        lo, hi = t.data_ptr(), t.data_ptr() + t.nbytes
    else:
        lo = t.untyped_storage().data_ptr()
        hi = lo + t.untyped_storage().nbytes()
    total, overlap = 0, 0
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                if line[0].isupper():            # a field ("Rss: ..."); a mapping starts with its address
                    if overlap and line.startswith("AnonHugePages:"):
                        total += min(overlap, int(line.split()[1]) * 1024)
                    continue
                start, _, rest = line.partition("-")
                end = rest.split(" ", 1)[0]
                overlap = max(0, min(hi, int(end, 16)) - max(lo, int(start, 16)))
    except (OSError, ValueError):
        return None
    return total
