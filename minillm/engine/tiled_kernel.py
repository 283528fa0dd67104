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
That was the first version, which ran the rows in passes of 8 and so read the weight again for each
pass. Now each tile is multiplied by every group of 8 rows while it sits in the L2 cache, and in the
matmul choice's own timing (``engine/matmul.py``, 8192×2048, median of 3) it took 3.23, 10.1 and 38.5 ms at
16, 64 and 256 rows against oneDNN's 3.44, 10.3 and 39.9. The choice times both per shape and row bucket.

bf16 (the same weight, same VM, median of 3), ms per weight:

====  ============================  ==============================  ===================
rows  tiled, AVX512-BF16 pair dots  tiled, bf16 widened to float    oneDNN, pre-packed
====  ============================  ==============================  ===================
1     1.14                          1.29                            1.60
8     1.29                          2.00                            1.60
256   20.4                          51.5                            19.8
====  ============================  ==============================  ===================

Widened to floats, a bf16 weight costs the arithmetic of an fp32 one for half the bytes, and at 8 rows
the kernel ran out of arithmetic; where the CPU has AVX512-BF16 the tile holds k and k+1 side by side
and one instruction adds both products.

What bounds 8 rows on the AMD EPYC VM (Zen 4, 2 cores). The arithmetic: one core ran 3.58 G pair-dot
instructions a second (3.60 G fp32 FMAs), and this kernel's 8-row loop over a tile in the L2 cache
3.25–3.30 G, 91 % of that: 26 GB/s of bf16 weights a core, about 52 GB/s for two. The memory read 30–35 GB/s
in its slow stretches and 55–65 in its fast ones (chapter 10.6: the bound moves), so in the fast ones bf16's
crossover B* falls below 8 rows (chapter 10.3), and no kernel of these instructions keeps 8 rows as fast as
one there. In the slow ones the arithmetic is not what binds, and yet 8 rows read slower than one: at 16
pair dots per 128 bytes of weights the core's instruction window covers little more than a kilobyte of the
stream ahead, too few lines in flight to hide the memory's latency (likely: not counted with hardware
counters). So from ``ahead_rows`` rows up each tile asks for its weights ``AHEAD`` bytes before it reads
them, into the L2 cache. Measured in a C loop of this tile over ``cpu-small``'s 49 weight shapes (164 MB in
2 MiB pages, 2 threads, variants in turn, each against a sum over the same bytes): at 8 rows, while the
memory was fast, 39.3 GB/s without against 41.0 (4 KB ahead), 47.5 (6 KB) and 48.6 (8 KB), every one of 24
rounds ahead; while it was slow, 81 % of the sum's rate without against 98 % with 8 KB, at 6 rows 84 %
against 95 %; at 1, 2 and 4 rows it cost 1–12 %, so it starts at 6. In the engine, switched on and off
between rounds in one process (``read_ahead_from_rows``, 8 rounds; the memory at 30–56 GB/s): the compiled
bf16 step at 8 rows 1.086× as fast (every round 1.03–1.17×), at 1 row unchanged (1.01×); fp32 at 8 rows
1.13× (0.94–1.25×); the 49 matmuls alone at 16 and 64 rows 1.105× and 1.036× (bf16). An earlier try, one
line 2 KB ahead per 128 bytes into the L1 cache, gained 7–12 % alone and could not be told from the drift in
the step.

The layout: the weight [N, K] is cut into tiles of ``TILE`` output features, and each tile is stored
K-major, [N/TILE, K, TILE]. One tile's K×TILE block is one contiguous stream. For each k the kernel
loads TILE weights (two vector registers) and, for each of the R rows, broadcasts x[r, k] and adds
x[r, k]·w[k, :] into the row's two accumulators: 2R accumulators stay in registers for the whole tile.
The rows are first copied k-major (xt[k, r]): read row by row they are 8 KB apart, and eight such
streams land in the same sets of the L1 cache (measured: 3.31 ms at 8 rows without the copy, 2.18 with).

The threads split the tiles statically, each reading one contiguous half. While the memory was fast,
the main thread finished its half first in 86–99 % of a batch-1 step's 51 calls, the other 0.5–0.9 ms a
step later (bf16, timed inside the kernel), so balancing looked worth a try. It was not, measured in the
engine with the variants in turn (bf16, 1 row): tiles handed out one at a time (OpenMP ``dynamic``) 0.88× as
fast, ``guided`` 0.99×, two threads from the two ends 0.96×, each its own half and then the other's last
tiles 1.00× (0.93–1.28×). One thread's contiguous stream is what the memory serves best, and when one thread
is slower the memory, not the split, sets the pace.

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

import torch

from minillm.engine.cpp_build import VECTORS, load_with_operator, profiling

SOURCE = VECTORS + r"""
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// V floats a vector register (cpp_build.VECTORS, above this source)
#ifdef __AVX512F__
constexpr int MAX_ROWS = 8;     // 2 x 8 accumulators of the 32 registers
#else
constexpr int MAX_ROWS = 6;     // 2 x 6 accumulators of AVX2's 16 registers
#endif
constexpr int64_t TILE = 2 * V; // output features per tile: two registers of weights per k
// From this many rows a tile asks for its weights AHEAD bytes before it reads them, into the L2 cache (the
// module's docstring has the measurement); read_ahead_from_rows() changes it, for a paired comparison.
static int ahead_rows = 6;
constexpr int64_t AHEAD = 8192;
template <typename T>
static inline void read_ahead(const T* w) {   // TILE weights AHEAD bytes on (past the last tile: no fault)
  for (int64_t b = 0; b < TILE * int64_t(sizeof(T)); b += 64)
    __builtin_prefetch((const char*)w + AHEAD + b, 0, 2);     // locality 2: the L2 cache
}
static inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
static inline void store(bf16* p, vec v) {                   // rounded to nearest even, as torch rounds
  uvec u = (uvec)v;
  hvec h = __builtin_convertvector((u + 0x7FFF + ((u >> 16) & 1)) >> 16, hvec);
  std::memcpy(p, &h, sizeof h);
}

// y[r, t*TILE : (t+1)*TILE] for R rows: the tile's K x TILE weights are read once for all R rows.
// T is the weights' and the output's type; the sums are in float either way.
template <int R, typename T>
__attribute__((optimize("fp-contract=fast")))      // a += x * w as one FMA
static void tile(const float* xt, const T* tiles, const T* bias, T* y, int64_t t, int64_t N, int64_t K) {
  vec a0[R], a1[R];
  for (int r = 0; r < R; ++r) { a0[r] = vec{}; a1[r] = vec{}; }
  const T* w = tiles + t * K * TILE;                         // this tile: [K, TILE], contiguous
  const bool ahead = R >= ahead_rows;
  for (int64_t k = 0; k < K; ++k) {
    if (ahead) read_ahead(w + k * TILE);
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

#ifdef __AVX512BF16__
#include <immintrin.h>
// bf16 on a CPU with AVX512-BF16: one instruction multiplies pairs of bf16 and adds both products to a
// float, so the tile holds each output's weights for k and k+1 side by side ([K/2, TILE, 2]) and the
// rows come as pairs too (xt2[k/2, r] = x[r, k], x[r, k+1]). Twice the arithmetic per instruction of
// widening to floats, which ran out of arithmetic at 8 rows (measured in the module's docstring).
constexpr int64_t PAIR = 2;
template <int R>
static void tile_pairs(const uint32_t* xt2, const bf16* tiles, const bf16* bias, bf16* y,
                       int64_t t, int64_t N, int64_t K) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) { a0[r] = _mm512_setzero_ps(); a1[r] = _mm512_setzero_ps(); }
  const bf16* w = tiles + t * K * TILE;                      // this tile: [K/2, TILE, 2], contiguous
  const bool ahead = R >= ahead_rows;
  for (int64_t k2 = 0; k2 < K / 2; ++k2) {
    if (ahead) { read_ahead(w + k2 * 2 * TILE); read_ahead(w + k2 * 2 * TILE + TILE); }
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k2 * 2 * TILE);
    __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + k2 * 2 * TILE + 2 * V);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512bh x = (__m512bh)_mm512_set1_epi32(xt2[k2 * R + r]);
      a0[r] = _mm512_dpbf16_ps(a0[r], x, w0);
      a1[r] = _mm512_dpbf16_ps(a1[r], x, w1);
    }
  }
  const int64_t n0 = t * TILE;
  const vec b0 = bias ? load(bias + n0) : vec{}, b1 = bias ? load(bias + n0 + V) : vec{};
  for (int r = 0; r < R; ++r) {
    store(y + r * N + n0, (vec)a0[r] + b0);
    store(y + r * N + n0 + V, (vec)a1[r] + b1);
  }
}
#else
constexpr int64_t PAIR = 1;
#endif

// f(std::integral_constant<int, R>{}) for a group of R rows: R a compile-time constant, so that the
// accumulators stay in registers.
template <typename F>
static void with_rows(int64_t R, F&& f) {
  switch (R) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
#ifdef __AVX512F__
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
#endif
  }
}

// The rows go in groups of MAX_ROWS, each group copied k-major (xt[k, r] = row(r, k), KX entries per row:
// one float per k, or one pair of bf16 per two k). Each thread takes whole tiles and runs every group over
// a tile before the next: the tile (K x TILE weights, 96-256 KB for cpu-small in fp32) comes from memory
// once and from the L2 cache for the other groups. tile(rows, xt of the group, first row, t) does the work.
template <typename X, typename Row, typename Tile>
static void over_tiles(int64_t R, int64_t N, int64_t KX, Row row, Tile tile) {
  std::vector<X> xt(R * KX);
  for (int64_t r0 = 0; r0 < R; r0 += MAX_ROWS) {
    const int64_t r = R - r0 < MAX_ROWS ? R - r0 : MAX_ROWS;
    for (int64_t i = 0; i < r; ++i)
      for (int64_t k = 0; k < KX; ++k) xt[r0 * KX + k * r + i] = row(r0 + i, k);
  }
  #pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N / TILE; ++t)
    for (int64_t r0 = 0; r0 < R; r0 += MAX_ROWS)
      with_rows(R - r0 < MAX_ROWS ? R - r0 : MAX_ROWS,
                [&](auto rows) { tile(rows, xt.data() + r0 * KX, r0, t); });
}

// y [R, N] = x [R, K] . W^T (+ bias), W held as tiles [N/TILE, K, TILE] (bf16 pairs: [N/TILE, K/2, TILE, 2]).
template <typename T>
static void widened(const T* x, const T* tiles, const T* bias, T* y, int64_t R, int64_t N, int64_t K) {
  over_tiles<float>(R, N, K, [&](int64_t r, int64_t k) { return widen(x[r * K + k]); },
                    [&](auto rows, const float* xt, int64_t r0, int64_t t) {
                      tile<decltype(rows)::value>(xt, tiles, bias, y + r0 * N, t, N, K);
                    });
}

extern "C" int64_t tile_width() { return TILE; }
extern "C" int64_t rows_per_group() { return MAX_ROWS; }
extern "C" int64_t bf16_k_pair() { return PAIR; }       // 2: bf16 tiles hold k and k+1 side by side
extern "C" int64_t read_ahead_from_rows(int64_t rows) {
  const int64_t was = ahead_rows;
  ahead_rows = int(rows);
  return was;
}
extern "C" void tiled_linear_f32(const float* x, const float* tiles, const float* bias, float* y,
                                 int64_t R, int64_t N, int64_t K) {
  widened(x, tiles, bias, y, R, N, K);
}
extern "C" void tiled_linear_bf16(const bf16* x, const bf16* tiles, const bf16* bias, bf16* y,
                                  int64_t R, int64_t N, int64_t K) {
#ifdef __AVX512BF16__
  auto pair = [&](int64_t r, int64_t k2) { uint32_t p; std::memcpy(&p, x + r * K + 2 * k2, 4); return p; };
  over_tiles<uint32_t>(R, N, K / 2, pair,
                       [&](auto rows, const uint32_t* xt2, int64_t r0, int64_t t) {
                         tile_pairs<decltype(rows)::value>(xt2, tiles, bias, y + r0 * N, t, N, K);
                       });
#else
  widened(x, tiles, bias, y, R, N, K);
#endif
}
"""

# The operator's CPU kernel in C++ (cpp_build.py says why): the same call as ``run``.
OPERATOR = r"""
static Tensor tiled_linear_cpu(Tensor x, Tensor tiles, std::optional<Tensor> bias) {
  const Tensor xc = as_contiguous(x);
  const int64_t K = xc.size(xc.dim() - 1), N = tiles.size(0) * tiles.size(2);
  std::vector<int64_t> shape;
  for (int64_t i = 0; i + 1 < xc.dim(); ++i) shape.push_back(xc.size(i));
  shape.push_back(N);
  Tensor y = empty_cpu(xc, shape);                                    // [..., N]
  const int64_t rows = K ? xc.numel() / K : 0;
  if (rows && xc.scalar_type() == torch::headeronly::ScalarType::Float)
    tiled_linear_f32((const float*)xc.data_ptr(), (const float*)tiles.data_ptr(),
                     bias ? (const float*)bias->data_ptr() : nullptr, (float*)y.data_ptr(), rows, N, K);
  else if (rows)
    tiled_linear_bf16((const bf16*)xc.data_ptr(), (const bf16*)tiles.data_ptr(),
                      bias ? (const bf16*)bias->data_ptr() : nullptr, (bf16*)y.data_ptr(), rows, N, K);
  return y;
}
STABLE_TORCH_LIBRARY_IMPL(minillm, CPU, m) { m.impl("tiled_linear", TORCH_BOX(&tiled_linear_cpu)); }
"""


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The kernel built with Inductor's toolchain and cached on disk by it; None where it cannot be."""
    lib = load_with_operator(SOURCE, OPERATOR, "the tiled decode kernel", _OPS, "tiled_linear", run)
    if lib is None:
        return None
    for fn in (lib.tiled_linear_f32, lib.tiled_linear_bf16):
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    lib.tile_width.restype = lib.rows_per_group.restype = lib.bf16_k_pair.restype = ctypes.c_int64
    lib.read_ahead_from_rows.restype, lib.read_ahead_from_rows.argtypes = ctypes.c_int64, [ctypes.c_int64]
    return lib


KERNELS = {torch.float32: "tiled_linear_f32", torch.bfloat16: "tiled_linear_bf16"}


def available(dtype: torch.dtype = torch.float32) -> bool:
    return dtype in KERNELS and _library() is not None


def tile_width() -> int:
    return _library().tile_width()


def read_ahead_from_rows(rows: int) -> int:
    """From ``rows`` rows up each tile asks for its weights ahead (a larger number: never); returns
    the setting it replaces. The answers do not change, only when the weights arrive."""
    return _library().read_ahead_from_rows(rows)


def pack(w: torch.Tensor) -> torch.Tensor:
    """weight [N, K] → tiles [N/TILE, K, TILE]; bf16 on a CPU with AVX512-BF16 [N/TILE, K/2, TILE, 2]
    (k and k+1 side by side, the pairs its dot-product instruction reads). A weight whose N is not a
    whole number of tiles, or (paired) whose K is odd, is not held this way (the choice records why
    and keeps another candidate)."""
    tw = tile_width()
    n, k = w.shape
    if n % tw:
        raise ValueError(f"{n} output features are not a multiple of the kernel's tile of {tw}")
    if _paired(w.dtype):
        if k % 2:
            raise ValueError(f"{k} input features are odd: bf16 tiles hold them in pairs")
        return w.reshape(n // tw, tw, k // 2, 2).transpose(1, 2).contiguous()   # [T, K/2, TILE, 2]
    return w.reshape(n // tw, tw, k).transpose(1, 2).contiguous()        # [T, K, TILE]


def _paired(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and _library().bf16_k_pair() == 2


def unpack(tiles: torch.Tensor) -> torch.Tensor:
    """tiles [T, K, TILE] (or [T, K/2, TILE, 2]) → weight [N, K]."""
    t, tw = tiles.shape[0], tiles.shape[2]
    return tiles.transpose(1, 2).reshape(t * tw, -1)                     # [N, K]


def run(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] → [..., N] through the kernel (fp32 or bf16, CPU; x, tiles and bias of one dtype)."""
    t, tw, k = tiles.shape[0], tiles.shape[2], x.shape[-1]
    xc = x.contiguous()
    y = x.new_empty(*x.shape[:-1], t * tw)                               # [..., N]
    rows = x.numel() // k
    if rows:
        getattr(_library(), KERNELS[tiles.dtype])(xc.data_ptr(), tiles.data_ptr(),
                                    bias.data_ptr() if bias is not None else None, y.data_ptr(),
                                    rows, t * tw, k)
    return y


# A compiled graph calls the kernel as one operator (TorchDynamo cannot trace into ctypes). Defined at
# the library's low level, where ``torch.library.custom_op``'s wrapper cost 11 µs a call, about 0.5 ms over
# ``cpu-small``'s 49 matmuls a step; its CPU kernel is ``OPERATOR`` (C++), else ``run`` (cpp_build.py).
_OPS = torch.library.Library("minillm", "FRAGMENT")
_OPS.define("tiled_linear(Tensor x, Tensor tiles, Tensor? bias) -> Tensor")


@torch.library.register_fake("minillm::tiled_linear")
def _(x, tiles, bias):
    return x.new_empty(*x.shape[:-1], tiles.shape[0] * tiles.shape[2])


def forward(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The candidate's forward: the custom operator inside a compiled graph and under the profiler, the
    plain call in eager (the operator's dispatch costs microseconds a step of 49 matmuls would pay for
    nothing)."""
    if torch.compiler.is_compiling() or profiling():
        return torch.ops.minillm.tiled_linear(x, tiles, bias)
    return run(x, tiles, bias)
