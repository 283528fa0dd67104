"""The weights a decode step reads, moved into one buffer in 2 MiB pages (chapter 10.3).

A batch-1 decode streams every weight once a step, so each of the CPU's page-table walks is paid
again every step; in 2 MiB pages there are 512 times fewer of them (``hardware/pages.py`` says how the
pages are asked for, and what a plain sum gains). The engine copies each chosen matmul's weight, in
the order a step reads them, into one buffer in such pages, and the layers read views of it.

Measured on the project's AMD EPYC VM (2 cores, torch 2.13.0+cpu, ``cpu-small``, compiled decode at
1 row, 96 tokens a round, two engines in one process taking turns, 10 rounds): the forward ran at
1.125× the tokens/s of the same engine with torch's own allocation in bf16 (every round 1.06–1.25×)
and 1.12× in fp32 (1.02–1.23×). The same weights copied into one buffer in 4 KiB pages gained
nothing clear: 8 of 10 paired rounds at 0.95–1.11× (median 1.01×), the other two at 1.48 and 1.51×,
rounds in which only one of the pair met the memory at its fast speed (``hardware/read_probe.py``). So
it is the page size, not the order.

Only the weights the matmul choice holds move (``PackedLinear``'s plain tensors): a oneDNN blocked
weight is an opaque tensor that stays where oneDNN put it. The plain path (``matmul="aten"``,
``enforce_eager``) keeps torch's allocation, as it keeps torch's matmuls.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minillm.engine.matmul_kernels import PackedLinear
from minillm.hardware.pages import huge_page_bytes, huge_page_empty, thp_mode

ALIGN = 4096                   # each weight starts on a page of its own (4 KiB)


@dataclass(frozen=True)
class WeightPages:
    """What :func:`move_to_huge_pages` did: how many weights it moved, their bytes, and how many of those
    bytes the kernel backs with 2 MiB pages (None where that cannot be read)."""
    tensors: int
    nbytes: int
    huge_bytes: int | None
    thp_mode: str | None

    def line(self) -> str:
        if not self.tensors:
            return "weights: where torch allocated them (no chosen matmul holds a plain tensor)"
        where = f"{self.tensors} weights ({self.nbytes / 2**20:.0f} MiB) in one buffer"
        if self.huge_bytes is None:
            return f"{where}; its page size cannot be read here"
        if self.huge_bytes == 0:
            return (f"{where}, in base pages: the system gave no 2 MiB pages (transparent huge pages: "
                    f"{self.thp_mode or 'not available'})")
        return f"{where}, {self.huge_bytes / 2**20:.0f} MiB of it in 2 MiB pages"


def _movable(t: torch.Tensor | None) -> bool:
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided
            and t.is_contiguous() and t.numel() > 0)


def held_weights(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, buffer name) of every plain weight a chosen matmul holds, in the order a step reads
    them (module order), each tensor once."""
    out, seen = [], set()
    for mod in model.modules():
        if not isinstance(mod, PackedLinear):
            continue
        for name in ("held", "plain"):
            t = getattr(mod, name, None)
            if _movable(t) and t.data_ptr() not in seen:           # a tied weight once
                seen.add(t.data_ptr())
                out.append((mod, name))
    return out


def move_to_huge_pages(model: nn.Module) -> WeightPages:
    """Copy every weight of :func:`held_weights` into one buffer in 2 MiB pages (where the system gives
    them; a buffer under one such page stays in base pages) and point its module at the copy; the old
    tensors are freed. Call it once the matmul choice is applied and before a compiled decode freezes
    the weights. A second call on the same model (a second engine) finds them moved and returns what
    the first did."""
    found = held_weights(model)
    if not found:
        return WeightPages(0, 0, None, thp_mode())
    done = getattr(model, "weight_pages", None)
    if done is not None and len({getattr(m, n).untyped_storage().data_ptr() for m, n in found}) == 1:
        return done                                                     # all in one buffer already
    sizes = [-(-getattr(m, n).nbytes // ALIGN) * ALIGN for m, n in found]
    arena = huge_page_empty(sum(sizes))                                 # [bytes], uint8
    offset = 0
    with torch.no_grad():
        for (mod, name), size in zip(found, sizes):
            old = getattr(mod, name)
            new = arena[offset:offset + old.nbytes].view(old.dtype).view(old.shape)
            new.copy_(old)                                              # faults the pages in
            mod.register_buffer(name, new, persistent=False)
            offset += size
    model.weight_pages = WeightPages(len(found), sum(sizes), huge_page_bytes(arena), thp_mode())
    return model.weight_pages
