"""The decode matmul kernels a weight can be held for (chapter 10.3): each :class:`Candidate` says how
to lay a weight out and how to multiply by it, and :class:`PackedLinear` is the ``nn.Linear`` that
holds it so. Which one each weight shape runs is chosen per machine by measurement in
``engine/matmul.py``, which also holds the measurements that chose them."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minillm.engine import tiled_kernel

PAD_ROWS = 4                            # onednn-packed-pad4 pads fewer rows to this many
# What Inductor's freezing makes of an fp32 nn.Linear when torch has MKL: the weight packed for MKL's
# sgemm at the graph's row count (torch/_inductor/fx_passes/mkldnn_fusion.py). It is timed beside the
# candidates, so that the compiled decode keeps the choice only where it reads faster (matmul.prepare).
INDUCTOR_FP32 = "mkl-packed"


# One decode row written as a product and a sum over the input features, for Inductor to generate as
# one streaming loop over the weight (compiled only: in eager the product [1, N, K] would be written
# out and read back, three times the bytes). Timed per shape beside the chosen kernel (matmul.py).
# Only one row: written for 2–8 rows the same way, it loses to oneDNN's packed kernel, which read an
# 8192×2048 fp32 weight at 8 rows in 2.69–3.54 ms, 1.1–1.3× the one-row sum's 2.05–2.72 in the same
# runs. Measured on the AMD EPYC VM, compiled, medians of 30: one sum per row, which Inductor fuses
# into one loop over the weight with 8 accumulators, 7.2–7.8 ms at 8 rows (its rows are re-read from
# L2 for every output); a [N, B] output 5.9–6.4 ms; the input features split in chunks of 64–256 so the
# rows stay in L1, 9.7–13.8 ms. In bf16 the one-row sum read a weight faster than oneDNN (1.27–1.60
# against 1.51–1.80 ms for 8192×2048, three rounds), but the compiled step of cpu-small with every
# weight read that way took 12.0 and 12.5 ms against 7.1 and 8.2 with Inductor's own bf16 GEMMs (1 row,
# 128 cached tokens, median of 60, fresh processes alternating), so bf16 keeps those.
ONE_ROW_REDUCTION = "reduction (compiled, 1 row)"


def one_row_reduction(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] of one row, w [N, K] → [..., N], as Σ_k x_k·w_nk: what a compiled graph fuses."""
    y = (x.reshape(1, 1, -1) * w).sum(-1)                              # [1, N]
    if b is not None:
        y = y + b
    return y.view(*x.shape[:-1], -1)


@dataclass(frozen=True)
class Candidate:
    name: str
    why: str
    layout: str                       # how the weight is held; the candidates of one layout share it
    available: Callable[[torch.dtype], bool]
    prepare: Callable[[torch.Tensor], torch.Tensor]                 # weight [N, K] → what forward holds
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    unpack: Callable[[torch.Tensor], torch.Tensor]                  # what forward holds → weight [N, K]


def _onednn_ok(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _onednn(x: torch.Tensor, p: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")


def _onednn_padded(x: torch.Tensor, p: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Fewer than PAD_ROWS rows padded with zero rows: oneDNN's kernel for 1 or 2 rows read a
    4096×768 fp32 weight 10–30 % slower than its kernel for 4 (the project's VM, 1 and 2 threads);
    the extra rows cost arithmetic a bandwidth-bound step has to spare."""
    k = x.shape[-1]
    n = x.numel() // k
    if n >= PAD_ROWS or n == 0:        # no rows (a step whose rows all skip the LM head): nothing to pad
        return _onednn(x, p, b)
    xp = x.new_zeros(PAD_ROWS, k)                                      # [4, K]
    xp[:n] = x.reshape(n, k)
    return _onednn(xp, p, b)[:n].view(*x.shape[:-1], -1)               # [..., N]


CANDIDATES: dict[str, Candidate] = {
    "aten": Candidate(
        "aten", "torch's F.linear (MKL or OpenBLAS sgemm, oneDNN for bf16): the reference", "plain",
        lambda dt: True, lambda w: w, lambda x, w, b: F.linear(x, w, b), lambda w: w),
    "aten-kmajor": Candidate(
        "aten-kmajor", "x @ Wᵀ with Wᵀ stored K-major: the library's other operand order", "kmajor",
        lambda dt: True, lambda w: w.t().contiguous(),                 # [K, N]
        lambda x, wt, b: torch.addmm(b, x.reshape(-1, x.shape[-1]), wt).view(*x.shape[:-1], wt.shape[1])
        if b is not None else (x @ wt),
        lambda wt: wt.t()),
    "onednn-packed": Candidate(
        "onednn-packed",
        "oneDNN with the weight reordered once into its blocked layout (Inductor's freezing)", "onednn",
        _onednn_ok, lambda w: torch.ops.mkldnn._reorder_linear_weight(w), _onednn, lambda p: p.to_dense()),
    "onednn-packed-pad4": Candidate(
        "onednn-packed-pad4", "the same, with fewer than 4 rows padded to 4 (its faster kernel)", "onednn",
        _onednn_ok, lambda w: torch.ops.mkldnn._reorder_linear_weight(w), _onednn_padded,
        lambda p: p.to_dense()),
    "tiled": Candidate(
        "tiled", "the project's kernel: each weight tile read once for up to 8 rows (engine/tiled_kernel.py)",
        "tiles", tiled_kernel.available, tiled_kernel.pack, tiled_kernel.forward, tiled_kernel.unpack),
}


def inductor_packing_timed(dtype: torch.dtype) -> bool:
    """Whether Inductor would pack this dtype's weights for MKL when it freezes them (fp32 with MKL);
    bf16 it packs for oneDNN and autotunes itself (engine/compiled.py), so there is nothing to compare."""
    return dtype == torch.float32 and torch.backends.mkl.is_available()


def _mkl_packed(rows: int) -> Callable:
    """MKL's packed sgemm for exactly ``rows`` rows, as a frozen graph calls it: held = (packed, plain)."""
    return lambda x, h, b: torch.ops.mkl._mkl_linear(x, h[0], h[1], b, rows)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is held the way the chosen candidate wants it (a oneDNN
    blocked layout, a transposed copy). It replaces the original: the plain weight is not kept, so
    the memory a model takes does not double. ``weight`` and ``state_dict()`` give the plain
    weight back (unpacked on demand), so a packed model still converts to ``transformers`` or GGUF.
    ``by_rows`` ({row bucket: candidate}, all of ``candidate``'s layout): the kernel each row count
    runs, the smallest bucket at or above it deciding; past the largest bucket, the largest's."""

    def __init__(self, linear: nn.Linear, candidate: str, by_rows: dict[str, str] | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.candidate = candidate
        c = CANDIDATES[candidate]
        with torch.no_grad():
            self.register_buffer("held", c.prepare(linear.weight.detach()), persistent=False)
        self.bias = linear.bias
        self._forward = c.forward
        # one lookup per call: the kernel for 0 … max_rows rows, indexed by the row count
        routes = sorted((int(r), CANDIDATES[n].forward) for r, n in (by_rows or {}).items())
        self._by_n = [next((f for r, f in routes if r >= n), routes[-1][1]) for n in range(routes[-1][0] + 1)
                      ] if routes else []
        # one kernel at every row count: no lookup, so a graph whose row count is a symbol can call it
        self._single = c.forward if all(f is c.forward for f in self._by_n) else None
        self.register_buffer("plain", None, persistent=False)   # see reduce_one_row_when_compiled

    def runs_any_row_count(self) -> bool:
        """Whether one kernel serves every row count and takes it as a symbol (a compiled graph for
        every row bucket): the tiled kernel's operator does; Inductor's lowering of oneDNN's packed
        linear asserted on a symbolic row count (torch 2.13.0+cpu)."""
        return self._single is not None and self.candidate == "tiled"

    def reduce_one_row_when_compiled(self) -> None:
        """Also hold the weight plain, for a compiled graph of one row to read it through
        :func:`one_row_reduction` (where the machine measured that faster than the held layout's
        kernel: matmul.prepare). Eager steps keep the held kernel. Costs a second copy of the weight."""
        with torch.no_grad():
            self.register_buffer("plain", self.weight.detach().contiguous().clone(), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return CANDIDATES[self.candidate].unpack(self.held)            # [N, K]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // self.in_features                              # rows this step
        if n == 1 and self.plain is not None and torch.compiler.is_compiling():
            return one_row_reduction(x, self.plain, self.bias)         # [..., N], fused by Inductor
        if self._single is not None:
            return self._single(x, self.held, self.bias)
        fwd = self._by_n[n] if n < len(self._by_n) else self._by_n[-1] if self._by_n else self._forward
        return fwd(x, self.held, self.bias)                            # [..., K] → [..., N]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, candidate={self.candidate}"


# A tiled layout within this factor of the best layout's score is held: where every weight is tiled, the
# compiled decode is one graph for every bucket from 2 rows up (runner.rows_can_be_dynamic). Measured on the
# AMD EPYC VM, fp32 cpu-small: a near tie (768x2048: tiled 1.101, oneDNN's 1.075, faster at 1-8 rows, slower
# at 16-256) held oneDNN's, and `bench --peers --batches --compile` compiled 7 graphs in 76 s, against 2
# in 35 s with every weight tiled.
TILED_WITHIN = 1.05


def route(ms: dict[str, dict[str, float]]) -> tuple[str, dict[str, str]]:
    """From {candidate: {rows: ms}}: the layout to hold and the kernel each row count runs. Each
    layout is scored by its fastest candidate at each row count: the geometric mean over the row
    counts of that time ÷ the best of all there (one slow sample weighs less than in a sum); the tiled
    layout wins a near tie (``TILED_WITHIN``). Returns the held layout's overall best candidate (its
    name prepares the weight) and {rows: candidate}."""
    best = {k: min(t[k] for t in ms.values()) for k in next(iter(ms.values()))}
    layouts: dict[str, dict[str, str]] = {}
    for name in ms:
        fastest = layouts.setdefault(CANDIDATES[name].layout, {})
        for k in best:
            if k not in fastest or ms[name][k] < ms[fastest[k]][k]:
                fastest[k] = name
    score = {lay: math.prod(ms[fastest[k]][k] / best[k] for k in best) ** (1 / len(best))
             for lay, fastest in layouts.items()}
    held = min(score, key=score.get)
    tiled = CANDIDATES["tiled"].layout
    if tiled in score and score[tiled] <= TILED_WITHIN * score[held]:
        held = tiled
    by_rows = layouts[held]
    in_layout = set(by_rows.values())
    chosen = min(in_layout, key=lambda n: math.prod(ms[n][k] / best[k] for k in best))
    return chosen, by_rows
