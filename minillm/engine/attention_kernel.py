"""Decode attention read straight from the K/V cache (chapter 10.3: what a decode step reads besides the
weights): for each row, its one new query against positions ``[0, len)`` of its own cache slot.

Why write one: a decode row's attention is tiny work (``cpu-small``: 12 query heads × 64 dims against
128 cached positions), but the way torch does it on a CPU costs more than the work. The static decode
first copies every row's K/V out of the cache into a ``[B, L, KVH, D]`` tensor (the gather, with a
length mask), then calls ``scaled_dot_product_attention``, whose flash kernel is built for long query
blocks. Profiled in the compiled bf16 decode of ``cpu-small`` at 1 row and 128 cached tokens (AMD EPYC
VM, 2 threads, 39 steps): the gather's fused kernel took 56 µs a layer and the attention kernel 60 µs,
1.4 ms of a 6.8 ms step whose 49 matmuls took 4.3 ms. Here a row's positions are cut into chunks
(a task each, so that one row still keeps every thread busy), each task reads its positions' K/V rows
whole and in order for all heads at once, with sums in fp32 whatever the cache holds, and the chunks are
merged (the kernel's comments say how).

One layer alone, ``cpu-small``'s heads at 128 cached tokens, warm caches, median of 200, 2 threads, µs
(the gather and SDPA in brackets): fp32 12 (65) at 1 row, 52 (320) at 8, 455–505 (2755–2885) at 64;
bf16 16 (147), 76 (981–994), 592–598 (8065–8095). That was its first version. Three changes since, each
found in a profile of the kernel (``perf``, 8 rows bf16) and timed against the version before it in one
process, alternating (5 rounds, medians; the first column the first version):

======  ====  =================  =================  =================
dtype   rows  first version, µs  this version, µs   ratio
======  ====  =================  =================  =================
fp32    1     16.3               13.7               0.84
fp32    8     53.5               41.6               0.78
fp32    64    435                308                0.71
bf16    1     19.5               14.1               0.72
bf16    8     77.4               41.9               0.54
bf16    64    613                287                0.47
======  ====  =================  =================  =================

- Scores: a horizontal sum per (head, position) took 8 of a score's ~17 operations; V positions' sums are now
  folded together (``fold_all``), 3 operations a score.
- Values: the heads that share a K/V head (GQA) now read and widen each V row once between them.
- bf16: GCC widened 16 bf16 to floats in four instructions on 256-bit halves (its tuning for this AMD Zen 4,
  which splits 512-bit operations); one zero-extending load and a shift now (``cpp_build.VECTORS``). The
  scores' maximum, the query's conversion and the chunk buffer (no longer zero-filled) are vector code too.
The results are the same bits: every sum is taken in the same order as before.

Where it is used, measured in one process with the two paths alternating round by round (``cpu-small``,
100-token prompts, 48 new tokens, median per-request tok/s of 5 rounds, 2 threads, AMD EPYC VM; the
ratio is this kernel's rate over the one before it):

================  ==========================  ======  ======  ======
path              before                      B = 1   B = 8   B = 64
================  ==========================  ======  ======  ======
compiled bf16     gather + SDPA (fp32)        0.98    1.12    1.27
eager fp32        gather + SDPA               1.16    1.17    1.10
compiled fp32     Inductor's fused reduction  0.99    0.99    1.03
================  ==========================  ======  ======  ======

The compiled fp32 decode ran level with Inductor's reduction (``attention.decode_attention_by_reduction``),
and its graphs compiled 4–11 s faster with the kernel (runner.py), so every decode on a CPU beside the
chosen matmuls uses the kernel; the reduction serves the compiled plain path.

Its weak point: in a step a row's K/V comes from memory cold, after the weight stream. One row's 128
positions (256 KB in fp32) took 38–54 µs after a 64 MB read or a tiled matmul against 14–22 µs warm; a
plain torch sum over the same 128 KB of keys took 30 µs cold against 7 warm, so most of that is the
memory's start-up on this VM, not the kernel's arithmetic. So a task first reads one byte of every cache
line of its K and V (``touch``), a plain stream the memory serves at its pace, and the arithmetic then
finds them in the L2 cache. Timed on the AMD EPYC VM with 12 layers' caches, each layer's attention
after a 12 MB read (a layer's weights), 144 positions a row, both versions built side by side and taken
in turn (30 rounds, median µs a layer; warm: the same call 200 times over):

======  ====  ============  =============  ============  =============
dtype   rows  cold, before  cold, touched  warm, before  warm, touched
======  ====  ============  =============  ============  =============
bf16    1     34.7          30.0           15.2          16.0
bf16    8     103.9         87.5           41.6          47.0
bf16    64    724.5         633.7          311.5         369.3
fp32    1     45.2          36.7           16.3          16.3
fp32    8     161.9         130.0          41.6          52.5
fp32    64    1157.3        909.3          687.9         520.5
======  ====  ============  =============  ============  =============

The touch costs a little where the lines are already cached, and a decode step never finds them there.
Inside the compiled decode of ``cpu-small`` (128 cached tokens) the gain mostly moves: profiled in bf16 (20
steps) the kernel went from 24.3 to 19.3 µs a layer at 1 row and from 119.8 to 88.3 at 8, and the matmuls
after it took longer. The step as a whole, with the touch switched on and off between rounds in one process
(12 rounds of 10 steps, paired): 1.018× and 1.002× as fast at 1 and 8 rows in bf16, 1.011× and 1.018× in fp32
(2 threads), 1.039× and 1.019× in fp32 on one thread; every median above 1, every one within rounds ranging
0.83–1.21×. The memory's time is the step's, whichever kernel waits for it: a small gain, kept because it
costs nothing. Prefetch instructions in its place (the whole chunk at once, or 16 to 32 positions ahead) and
reading each position's heads together instead of one K/V head at a time gained nothing even alone
(101.6–107.7 and 103.4 µs against 100.7 and 101.3 at 8 rows, bf16). A q whose rows stand apart is read in
place (``attend``'s comment says where such a q comes from); at 8 rows the compiled graph had copied it
before every call (9.4 µs a layer).

Rows of the static decode that are padding point at the cache's reserved slot with length 1: they read
its zero row and give zeros, as the gather did.

It is built like the tiled matmul (``engine/tiled_kernel.py``: Inductor's C++ toolchain and cache), is a
torch operator so that a compiled decode calls it as one opaque kernel, and where no compiler works the
attention backend keeps the gather and ``scaled_dot_product_attention``.
"""
from __future__ import annotations

import ctypes
import functools
import math

import torch

from minillm.engine.cpp_build import VECTORS, load_with_operator, profiling

SOURCE = VECTORS + r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <memory>
#include <omp.h>
#include <type_traits>
#include <vector>

// V floats a vector register, load and widen: cpp_build.VECTORS, above this source
static inline void narrow(float v, float* p) { *p = v; }
static inline void narrow(float v, bf16* p) {                   // rounded to nearest even, as torch rounds
  uint32_t u; std::memcpy(&u, &v, 4); *p = bf16((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
typedef int32_t ivec __attribute__((vector_size(V * sizeof(int32_t))));
template <typename F>
static inline float across(vec v, F f) {                       // the lanes combined by f in halves, a tree
#ifdef __AVX512F__
  v = f(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = f(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3));
  v = f(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1));
  v = f(v, __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0));
#else
  v = f(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = f(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1));
  v = f(v, __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0));
#endif
  return v[0];
}
static inline vec vmax(vec a, vec b) { return a > b ? a : b; }
static inline float sum(vec v) { return across(v, [](vec a, vec b) { return a + b; }); }
static inline float max_of(const float* x, int64_t n) {        // n >= 1
  int64_t j = 0;
  float m = x[0];
  if (n >= V) {
    vec mv = load(x);
    for (j = V; j + V <= n; j += V) mv = vmax(mv, load(x + j));
    m = across(mv, vmax);
  }
  for (; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

// e^x, V at a time, for x <= 0 (scores minus their maximum): x = n ln2 + r with |r| <= ln2/2, e^r by its
// Taylor polynomial to r^7/7! (relative error below 1e-7 there), 2^n put into the float's exponent bits.
// std::exp one score at a time took about a third of the kernel at 64 rows (an estimate from its count:
// 98K calls a layer).
static inline vec vexp(vec x) {
  x = x < -87.0f ? vec{} - 87.0f : x;                            // below it e^x is under float's smallest
  const float shifter = 12582912.0f;                             // 1.5 * 2^23: adding it rounds to an integer
  const vec t = x * 1.44269504f + shifter;
  const vec n = t - shifter;
  const vec r = (x - n * 0.693145752f) - n * 1.42860677e-6f;     // ln2 in two parts, for an exact n ln2
  vec p = vec{} + 1.0f / 5040;
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = p * r + c;
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;   // 2^n
  vec scale; std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// q·k over D dims (q already in floats), V at a time, then the tail one by one.
template <typename T>
__attribute__((optimize("fp-contract=fast")))
static inline float dot(const float* q, const T* k, int64_t D) {
  vec a = vec{};
  int64_t d = 0;
  for (; d + V <= D; d += V) a += load(q + d) * load(k + d);
  float s = sum(a);
  for (; d < D; ++d) s += q[d] * widen(k[d]);
  return s;
}

// acc[0:D] += p * v[0:D]
template <typename T>
__attribute__((optimize("fp-contract=fast")))
static inline void axpy(float* acc, float p, const T* v, int64_t D) {
  int64_t d = 0;
  for (; d + V <= D; d += V) {
    vec a = load(acc + d) + p * load(v + d);
    std::memcpy(acc + d, &a, sizeof a);
  }
  for (; d < D; ++d) acc[d] += p * widen(v[d]);
}

// Two vectors folded into one: for each block t of 2h lanes, the first h lanes of the result hold a's block
// with its two halves added, the next h lanes b's. Folding V vectors this way, pairing x[i] with x[i + N/2]
// at each level (h = V/2, V/4, ..., 1), leaves x[0]'s lane p holding the sum of x[p]'s lanes: V horizontal
// sums for 2V - 2 shuffles and V - 1 additions, where one sum at a time costs 2 log2(V) operations.
template <int h>
static inline vec fold(vec a, vec b) {
  ivec lo, hi;
  for (int i = 0; i < V; ++i) {
    const int t = i / (2 * h), j = i % (2 * h);
    lo[i] = j < h ? 2 * h * t + j : V + 2 * h * t + j - h;       // an index into a, then b
    hi[i] = lo[i] + h;
  }
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}
template <int N>
static inline void fold_all(vec* x) {                          // N vectors, halved N times into x[0]
  if constexpr (N > 1) {
    for (int i = 0; i < N / 2; ++i) x[i] = fold<N / 2>(x[i], x[i + N / 2]);
    fold_all<N / 2>(x);
  }
}

// One query head's scores over a chunk of n positions, for D = DV whole vectors: the query stays in
// registers, and V positions' products are summed across their lanes together (fold_all).
template <int DV, typename T>
__attribute__((optimize("fp-contract=fast")))
static void head_scores(const float* qh, const T* kb, int64_t row, int64_t n, float* s) {
  vec qv[DV];
  for (int i = 0; i < DV; ++i) qv[i] = load(qh + i * V);
  auto product = [&](const T* kj) {
    vec a = qv[0] * load(kj);
    for (int i = 1; i < DV; ++i) a += qv[i] * load(kj + i * V);
    return a;
  };
  int64_t j = 0;
  for (; j + V <= n; j += V) {
    vec a[V];
    for (int p = 0; p < V; ++p) a[p] = product(kb + (j + p) * row);
    fold_all<V>(a);
    std::memcpy(s + j, &a[0], sizeof(vec));
  }
  for (; j < n; ++j) s[j] = sum(product(kb + j * row));
}

// NH query heads that share one K/V head (GQA), their weighted values summed over the chunk: each V row is
// loaded (and widened) once for all NH heads, and the NH x DV sums stay in registers.
template <int DV, int NH, typename T>
__attribute__((optimize("fp-contract=fast")))
static void group_values(const float* p, int64_t n, const T* vb, int64_t row, float* acc, int64_t D) {
  vec a[NH][DV];
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < DV; ++i) a[h][i] = vec{};
  for (int64_t j = 0; j < n; ++j) {
    vec vj[DV];
    for (int i = 0; i < DV; ++i) vj[i] = load(vb + j * row + i * V);
    for (int h = 0; h < NH; ++h) {
      const vec pj = vec{} + p[h * n + j];
      for (int i = 0; i < DV; ++i) a[h][i] += pj * vj[i];
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < DV; ++i) std::memcpy(acc + h * D + i * V, &a[h][i], sizeof(vec));
}
// The G heads of one K/V head, up to 4 at a time (4 x DV sums in registers)
template <int DV, typename T>
static void head_values(const float* p, int64_t n, const T* vb, int64_t row, float* acc, int64_t D,
                        int64_t G) {
  for (int64_t h = 0; h < G; h += 4) {
    const float* ph = p + h * n;
    float* ah = acc + h * D;
    switch (G - h < 4 ? G - h : 4) {
      case 1: group_values<DV, 1>(ph, n, vb, row, ah, D); break;
      case 2: group_values<DV, 2>(ph, n, vb, row, ah, D); break;
      case 3: group_values<DV, 3>(ph, n, vb, row, ah, D); break;
      default: group_values<DV, 4>(ph, n, vb, row, ah, D); break;
    }
  }
}
template <typename T, typename F>
static bool with_vectors(int64_t D, F&& f) {                  // f(DV) for D = DV vectors, DV in 1, 2, 4, 8
  switch (D == V ? 1 : D == 2 * V ? 2 : D == 4 * V ? 4 : D == 8 * V ? 8 : 0) {
    case 1: f(std::integral_constant<int, 1>{}); return true;
    case 2: f(std::integral_constant<int, 2>{}); return true;
    case 4: f(std::integral_constant<int, 4>{}); return true;
    case 8: f(std::integral_constant<int, 8>{}); return true;
  }
  return false;
}

// Every cache line of [p, p + bytes) read once, before any arithmetic on it: see the module docstring
static inline void touch(const void* p, int64_t bytes) {
  for (const char* c = (const char*)p, *e = c + bytes; c < e; c += 64) (void)*(const volatile char*)c;
}

// Row b's positions [0, L) are cut into chunks, one task per (row, chunk), so that one row alone still
// keeps every thread busy (flash-decoding's split). A task reads its positions' K/V rows whole and in
// order, all heads at once: the rows stream from memory as one run of addresses. Each task leaves, per
// query head, its scores' maximum m, its sum of exp(score - m) and its unnormalised output; the chunks of
// a row are then merged by rescaling each to the row's maximum. Query head h reads K/V head h / G
// (G = H / KVH heads share one: GQA). Row b's query starts at q + b * qs (a compiled graph hands over q as
// a view of the rope's output, q and k side by side, so its rows are not adjacent).
template <typename T>
static void attend(const T* q, int64_t qs, const T* k, const T* v, const int64_t* slots, const int64_t* lens,
                   T* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t M, float scale) {
  // positions per task: enough tasks for twice the threads, at least 32 positions each (fewer are read
  // faster than a task is started)
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) longest = lens[b] > longest ? lens[b] : longest;
  const int64_t want = (2 * omp_get_max_threads() + B - 1) / B;
  const int64_t chunk = std::max<int64_t>(32, (longest + want - 1) / want);
  const int64_t G = H / KVH, HD = H * D, row = KVH * D, per = (longest + chunk - 1) / chunk;
  // per task: H maxima, H sums, H x D outputs (not zero-filled: every task writes its own)
  std::unique_ptr<float[]> part(new float[B * per * H * (D + 2)]);
  auto part_of = [&](int64_t b, int64_t c) { return part.get() + (b * per + c) * H * (D + 2); };
  #pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < B * per; ++task) {
    const int64_t b = task / per, c = task % per, j0 = c * chunk;
    const int64_t j1 = lens[b] < j0 + chunk ? lens[b] : j0 + chunk, n = j1 - j0;
    if (n <= 0) continue;
    const T* kb = k + (slots[b] * M + j0) * row;
    const T* vb = v + (slots[b] * M + j0) * row;
    touch(kb, n * row * sizeof(T));
    touch(vb, n * row * sizeof(T));
    std::vector<float> qf(HD), s(H * n);
    const T* qb = q + b * qs;
    int64_t i = 0;
    for (; i + V <= HD; i += V) {
      const vec scaled = load(qb + i) * scale;
      std::memcpy(qf.data() + i, &scaled, sizeof scaled);
    }
    for (; i < HD; ++i) qf[i] = widen(qb[i]) * scale;
    // scores, head by head over the chunk (its K rows stay in the L1/L2 cache for the next head)
    const bool whole = with_vectors<T>(D, [&](auto dv) {
      for (int64_t h = 0; h < H; ++h)
        head_scores<decltype(dv)::value>(qf.data() + h * D, kb + (h / G) * D, row, n, s.data() + h * n);
    });
    if (!whole)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t h = 0; h < H; ++h) s[h * n + j] = dot(qf.data() + h * D, kb + j * row + (h / G) * D, D);
    float* m = part_of(b, c);
    float* l = m + H;
    float* acc = l + H;
    for (int64_t h = 0; h < H; ++h) {                            // exp(score - the chunk's max), and its sum
      float* sh = s.data() + h * n;
      const float mh = max_of(sh, n);
      vec totals = vec{};
      int64_t j = 0;
      for (; j + V <= n; j += V) {
        const vec e = vexp(load(sh + j) - mh);
        std::memcpy(sh + j, &e, sizeof e);
        totals += e;
      }
      float total = sum(totals);
      for (; j < n; ++j) { sh[j] = std::exp(sh[j] - mh); total += sh[j]; }
      m[h] = mh;
      l[h] = total;
    }
    const bool summed = with_vectors<T>(D, [&](auto dv) {       // values, one K/V head's G heads at a time
      for (int64_t g = 0; g < KVH; ++g)
        head_values<decltype(dv)::value>(s.data() + g * G * n, n, vb + g * D, row, acc + g * G * D, D, G);
    });
    if (!summed) {
      std::memset(acc, 0, HD * sizeof(float));
      for (int64_t j = 0; j < n; ++j)
        for (int64_t h = 0; h < H; ++h) axpy(acc + h * D, s[h * n + j], vb + j * row + (h / G) * D, D);
    }
  }
  #pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < B * H; ++bh) {                     // merge a row's chunks, per query head
    const int64_t b = bh / H, h = bh % H, chunks = (lens[b] + chunk - 1) / chunk;
    float mx = part_of(b, 0)[h];
    for (int64_t c = 1; c < chunks; ++c) mx = part_of(b, c)[h] > mx ? part_of(b, c)[h] : mx;
    std::vector<float> o(D, 0.0f);
    float total = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      const float* p = part_of(b, c);
      const float w = std::exp(p[h] - mx);
      total += w * p[H + h];
      for (int64_t d = 0; d < D; ++d) o[d] += w * p[2 * H + h * D + d];
    }
    for (int64_t d = 0; d < D; ++d) narrow(o[d] / total, out + bh * D + d);
  }
}

extern "C" void decode_attention_f32(const float* q, int64_t qs, const float* k, const float* v,
                                     const int64_t* slots, const int64_t* lens, float* out, int64_t B,
                                     int64_t H, int64_t KVH, int64_t D, int64_t M, float scale) {
  attend(q, qs, k, v, slots, lens, out, B, H, KVH, D, M, scale);
}
extern "C" void decode_attention_bf16(const bf16* q, int64_t qs, const bf16* k, const bf16* v,
                                      const int64_t* slots, const int64_t* lens, bf16* out, int64_t B,
                                      int64_t H, int64_t KVH, int64_t D, int64_t M, float scale) {
  attend(q, qs, k, v, slots, lens, out, B, H, KVH, D, M, scale);
}
"""

# The operator's CPU kernel in C++ (cpp_build.py says why): the same call as ``run``.
OPERATOR = r"""
static Tensor decode_attention_cpu(Tensor q, Tensor k_flat, Tensor v_flat, Tensor slots, Tensor lens,
                                   int64_t max_len) {
  // q's rows may stand apart (attend's comment); its heads and dims must be packed
  const Tensor qc = q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : as_contiguous(q);
  const Tensor sc = as_contiguous(slots), lc = as_contiguous(lens);
  const int64_t B = qc.size(0), H = qc.size(1), D = qc.size(2), KVH = k_flat.size(1);
  Tensor out = empty_cpu(qc, {B, H, D});
  const float scale = float(1.0 / std::sqrt(double(D)));
  const int64_t* s = (const int64_t*)sc.data_ptr();
  const int64_t* l = (const int64_t*)lc.data_ptr();
  if (B && qc.scalar_type() == torch::headeronly::ScalarType::Float)
    attend((const float*)qc.data_ptr(), qc.stride(0), (const float*)k_flat.data_ptr(),
           (const float*)v_flat.data_ptr(),
           s, l, (float*)out.data_ptr(), B, H, KVH, D, max_len, scale);
  else if (B)
    attend((const bf16*)qc.data_ptr(), qc.stride(0), (const bf16*)k_flat.data_ptr(),
           (const bf16*)v_flat.data_ptr(),
           s, l, (bf16*)out.data_ptr(), B, H, KVH, D, max_len, scale);
  return out;
}
STABLE_TORCH_LIBRARY_IMPL(minillm, CPU, m) { m.impl("decode_attention", TORCH_BOX(&decode_attention_cpu)); }
"""

KERNELS = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = load_with_operator(SOURCE, OPERATOR, "the decode attention kernel", _OPS, "decode_attention", run)
    if lib is not None:
        for name in KERNELS.values():
            fn = getattr(lib, name)
            fn.restype = None
            fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5
                           + [ctypes.c_float])
    return lib


def available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    return torch.device(device).type == "cpu" and dtype in KERNELS and _library() is not None


def run(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor,
        lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """q [B, H, D]; k_flat, v_flat [num_slots · max_len, KVH, D], the cache's flat views (contiguous, q's
    dtype); slots, lens [B] int64, with 1 ≤ lens[b] ≤ max_len → [B, H, D]: row b attends to positions
    [0, lens[b]) of its slot, locations slots[b] · max_len + position. The flat views are the tensors the
    cache writes through: a compiled graph given a second view of them would see two aliased inputs, one
    mutated, and Inductor's freezing then failed (torch 2.13.0+cpu)."""
    B, H, D = q.shape
    M, KVH = max_len, k_flat.shape[1]
    qc = q if q.stride(2) == 1 and q.stride(1) == D else q.contiguous()  # rows may stand apart, heads not
    sc, lc = slots.contiguous(), lens.contiguous()
    out = torch.empty(B, H, D, dtype=q.dtype)                            # [B, H, D]
    if B:
        getattr(_library(), KERNELS[q.dtype])(qc.data_ptr(), qc.stride(0), k_flat.data_ptr(),
                                              v_flat.data_ptr(), sc.data_ptr(), lc.data_ptr(), out.data_ptr(),
                                              B, H, KVH, D, M, 1.0 / math.sqrt(D))
    return out


# One operator in a compiled graph, defined at the library's low level like ``tiled_linear`` (its
# comment has the cost of the alternative).
_OPS = torch.library.Library("minillm", "FRAGMENT")
_OPS.define("decode_attention(Tensor q, Tensor k_flat, Tensor v_flat, Tensor slots, Tensor lens, "
            "int max_len) -> Tensor")


@torch.library.register_fake("minillm::decode_attention")
def _(q, k_flat, v_flat, slots, lens, max_len):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def forward(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor,
            lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """The operator inside a compiled graph and under the profiler (``cpp_build.profiling`` says
    why), the plain call in eager."""
    if torch.compiler.is_compiling() or profiling():
        return torch.ops.minillm.decode_attention(q, k_flat, v_flat, slots, lens, max_len)
    return run(q, k_flat, v_flat, slots, lens, max_len)
