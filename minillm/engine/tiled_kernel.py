"""A decode matmul written for the batch (chapter 10.3): every tile of the weight is read from memory
once, and all the batch's rows are multiplied by it while it sits in registers.

Why write one: decode is bound by the weight read, so B rows should cost what one costs until the
arithmetic catches up (B*). The libraries torch calls do not all work that way on every CPU. Measured
on the project's AMD EPYC VM (2 cores, AVX-512, torch 2.13.0+cpu, 2 threads, a stack of 8192×2048
fp32 weights past the cache, median of 7 passes), ms per weight:

====  ==========  ===================
rows  this kernel oneDNN, pre-packed
====  ==========  ===================
1     2.00        2.67
2     2.00        3.19
4     2.16        2.35
8     2.18        3.10
16    4.17        3.47
====  ==========  ===================

Up to 8 rows it reads the weight at the same 31–34 GB/s whatever the batch: one read serves every row.
At 16 rows it reads the weight twice (two passes of 8), and oneDNN's blocked GEMM wins; the matmul
choice (``engine/matmul.py``) times both per shape and row bucket and keeps the faster.

The layout: the weight [N, K] is cut into tiles of ``TILE`` output features, and each tile is stored
K-major, [N/TILE, K, TILE]. One tile's K×TILE block is one contiguous stream. For each k the kernel
loads TILE weights (two vector registers) and, for each of the R rows, broadcasts x[r, k] and adds
x[r, k]·w[k, :] into the row's two accumulators: 2R accumulators stay in registers for the whole tile.
The rows are first copied k-major (xt[k, r]): read row by row they are 8 KB apart, and eight such
streams land in the same sets of the L1 cache (measured: 3.31 ms at 8 rows without the copy, 2.18 with).

Two things the first version got wrong, so the next reader need not: an accumulator array of ATen's
``Vectorized<float>`` was stored to the stack on every k by GCC 12 (6.45 ms at 8 rows), and GCC does not
fuse ``a += x * w`` into an FMA under the flags Inductor builds with (``-ffp-contract=off``), so the
function asks for ``fp-contract=fast`` itself.

It is built with Inductor's own C++ toolchain (``CppCodeCache``: the flags, OpenMP runtime and on-disk
cache Inductor's generated kernels use), in about 1.5 s the first time and from the cache after. Where
no compiler works it is simply not a candidate. ``tiled_linear`` is a torch custom operator, so a
compiled decode calls it as one opaque kernel.
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

log = logging.getLogger("minillm.engine")

SOURCE = r"""
#include <cstdint>
#include <cstring>
#include <vector>

// One vector register of floats: AVX-512 holds 16, AVX2 and NEON pairs hold 8.
#ifdef __AVX512F__
constexpr int64_t V = 16;
constexpr int MAX_ROWS = 8;     // 2 x 8 accumulators of the 32 registers
#else
constexpr int64_t V = 8;
constexpr int MAX_ROWS = 6;     // 2 x 6 accumulators of AVX2's 16 registers
#endif
constexpr int64_t TILE = 2 * V; // output features per tile: two registers of weights per k
typedef float vec __attribute__((vector_size(V * sizeof(float))));

static inline vec load(const float* p) { vec v; std::memcpy(&v, p, sizeof v); return v; }
static inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

// y[r, t*TILE : (t+1)*TILE] for R rows: the tile's K x TILE weights are read once for all R rows.
template <int R>
__attribute__((optimize("fp-contract=fast")))      // a += x * w as one FMA
static void tile(const float* xt, const float* tiles, const float* bias, float* y,
                 int64_t t, int64_t N, int64_t K) {
  vec a0[R], a1[R];
  for (int r = 0; r < R; ++r) { a0[r] = vec{}; a1[r] = vec{}; }
  const float* w = tiles + t * K * TILE;                     // this tile: [K, TILE], contiguous
  for (int64_t k = 0; k < K; ++k) {
    vec w0 = load(w + k * TILE), w1 = load(w + k * TILE + V);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float x = xt[k * R + r];                               // broadcast x[r, k]
      a0[r] += x * w0;
      a1[r] += x * w1;
    }
  }
  const int64_t n0 = t * TILE;
  const vec b0 = bias ? load(bias + n0) : vec{}, b1 = bias ? load(bias + n0 + V) : vec{};
  for (int r = 0; r < R; ++r) {
    store(y + r * N + n0, a0[r] + b0);
    store(y + r * N + n0 + V, a1[r] + b1);
  }
}

// R rows of one tile, R a compile-time constant so that the accumulators stay in registers.
static void rows_of_tile(int64_t R, const float* xt, const float* tiles, const float* bias, float* y,
                         int64_t t, int64_t N, int64_t K) {
  switch (R) {
    case 1: tile<1>(xt, tiles, bias, y, t, N, K); break;
    case 2: tile<2>(xt, tiles, bias, y, t, N, K); break;
    case 3: tile<3>(xt, tiles, bias, y, t, N, K); break;
    case 4: tile<4>(xt, tiles, bias, y, t, N, K); break;
    case 5: tile<5>(xt, tiles, bias, y, t, N, K); break;
    case 6: tile<6>(xt, tiles, bias, y, t, N, K); break;
#ifdef __AVX512F__
    case 7: tile<7>(xt, tiles, bias, y, t, N, K); break;
    case 8: tile<8>(xt, tiles, bias, y, t, N, K); break;
#endif
  }
}

extern "C" int64_t tile_width() { return TILE; }
extern "C" int64_t rows_per_group() { return MAX_ROWS; }

// y [R, N] = x [R, K] . W^T (+ bias), W held as tiles [N/TILE, K, TILE].
// The rows go in groups of MAX_ROWS, each group copied k-major (xt[k, r]). Each thread takes whole
// tiles and runs every group over a tile before the next: the tile (K x TILE floats, 96-256 KB for
// cpu-small) comes from memory once and from the L2 cache for the other groups.
extern "C" void tiled_linear_f32(const float* x, const float* tiles, const float* bias, float* y,
                                 int64_t R, int64_t N, int64_t K) {
  std::vector<float> xt(R * K);
  for (int64_t r0 = 0; r0 < R; r0 += MAX_ROWS) {
    const int64_t r = R - r0 < MAX_ROWS ? R - r0 : MAX_ROWS;
    for (int64_t i = 0; i < r; ++i)
      for (int64_t k = 0; k < K; ++k) xt[r0 * K + k * r + i] = x[(r0 + i) * K + k];
  }
  const int64_t T = N / TILE;
  #pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r0 = 0; r0 < R; r0 += MAX_ROWS) {
      const int64_t r = R - r0 < MAX_ROWS ? R - r0 : MAX_ROWS;
      rows_of_tile(r, xt.data() + r0 * K, tiles, bias, y + r0 * N, t, N, K);
    }
}
"""


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The kernel built with Inductor's toolchain and cached on disk by it; None where it cannot be."""
    try:
        from torch._inductor.codecache import CppCodeCache
        lib = CppCodeCache.load(SOURCE)
    except Exception as e:                # no compiler, no Inductor, a failed build: not a candidate
        log.info("the tiled decode kernel is not available here: %s", str(e).splitlines()[0][:200])
        return None
    fn = lib.tiled_linear_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    lib.tile_width.restype = lib.rows_per_group.restype = ctypes.c_int64
    return lib


def available(dtype: torch.dtype = torch.float32) -> bool:
    return dtype == torch.float32 and _library() is not None


def tile_width() -> int:
    return _library().tile_width()


def pack(w: torch.Tensor) -> torch.Tensor:
    """weight [N, K] → tiles [N/TILE, K, TILE]. A weight whose N is not a whole number of tiles is not
    held this way (the choice records why and keeps another candidate)."""
    tw = tile_width()
    n, k = w.shape
    if n % tw:
        raise ValueError(f"{n} output features are not a multiple of the kernel's tile of {tw}")
    return w.reshape(n // tw, tw, k).transpose(1, 2).contiguous()        # [T, K, TILE]


def unpack(tiles: torch.Tensor) -> torch.Tensor:
    """tiles [T, K, TILE] → weight [N, K]."""
    t, k, tw = tiles.shape
    return tiles.transpose(1, 2).reshape(t * tw, k)                      # [N, K]


def run(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] → [..., N] through the kernel (fp32, CPU)."""
    t, k, tw = tiles.shape
    xc = x.contiguous()
    y = x.new_empty(*x.shape[:-1], t * tw)                               # [..., N]
    rows = x.numel() // k
    if rows:
        _library().tiled_linear_f32(xc.data_ptr(), tiles.data_ptr(),
                                    bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                    rows, t * tw, k)
    return y


# A compiled graph calls the kernel as one operator (TorchDynamo cannot trace into ctypes). Defined at
# the library's low level: a call costs about 2 µs more than calling ``run`` directly, where
# ``torch.library.custom_op``'s wrapper cost 11 µs, about 0.7 ms over a decode step's 61 matmuls.
_OPS = torch.library.Library("minillm", "DEF")
_OPS.define("tiled_linear(Tensor x, Tensor tiles, Tensor? bias) -> Tensor")
_OPS.impl("tiled_linear", run, "CPU")


@torch.library.register_fake("minillm::tiled_linear")
def _(x, tiles, bias):
    return x.new_empty(*x.shape[:-1], tiles.shape[0] * tiles.shape[2])


def forward(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The candidate's forward: the custom operator inside a compiled graph, the plain call in eager
    (the operator's dispatch costs microseconds a step of 84 matmuls would pay for nothing)."""
    if torch.compiler.is_compiling():
        return torch.ops.minillm.tiled_linear(x, tiles, bias)
    return run(x, tiles, bias)
