// y[M, N] = x[M, K] @ w[K, N] (or @ w[N, K]^T) for bfloat16 x and w and a float32 y, M <= 64,
// with AVX-512 BF16's pair dot products (VDPBF16PS), as XLA FFI custom calls: the bfloat16
// kernel of x86 CPUs without AMX (AMD Zen 4 and later, Intel Cooper Lake).
//
// A decode step of a small model reads every weight once per token, so bfloat16 weights (half
// float32's bytes) could almost halve it, but XLA:CPU's bfloat16 dot on such a CPU runs below
// its float32 one (BENCHMARKS.md, issue 19). VDPBF16PS multiplies 16 pairs of bfloat16 by 16
// pairs and adds each pair's two products to a float32 lane: twice the products of a float32
// multiply-add per instruction. This kernel reads each matrix once for all rows, like
// cpu_matmul.cc: the threads of XLA's intra-op pool take column ranges, and each walks w[K, N]
// in blocks of kKBlock rows (that many memory streams), interleaving rows k and k + 1 of 32
// columns into the pair layout on the fly (one permute per 16 columns) and keeping a tile of
// up to 4 rows x 64 results in registers per block. A matrix held transposed, w[N, K] (a tied
// embedding table as LM head), already holds its pairs along k: 16 lanes of partial sums per
// result, added up at the end.
//
// Every result element is computed by the same instructions in the same order whatever M, the
// thread count or the tiling (w[K, N]: one chain of pair dot products over k = 0, 2, 4, ...,
// stored and reloaded exactly between blocks; w[N, K]: sixteen chains over the pairs k = 2l,
// 2l + 1 mod 32, then one fixed reduction), so a row's result does not depend on the other
// rows: a decode step, a verify and a batch of up to 64 rows give a token the same bits. The
// sums are VDPBF16PS's (round to nearest even, denormals flushed), within bfloat16's tolerance
// of XLA's bfloat16 dot.
//
// Built by dspark_jax/models/cpu_kernels.py with the host's C++ compiler
// (-O3 -mavx512f -mavx512bw -mavx512bf16).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cpu_matmul_handlers.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 64;
// Rows of w per block (even): that many memory streams. A verify of 8 or 16 rows took 10-20%
// less time with 32-128 than with 16 (benchmarks/verify_cost.py, an AMD EPYC).
constexpr int64_t kKBlock = 64;
// A register tile: up to 4 rows of x by two groups of 32 columns (16 accumulators). Tiles of 8
// rows by one group (as many accumulators, half the permutes per product) were no faster.
constexpr int kRows = 4;
constexpr int kGroups = 2;

inline __m512 Dot(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// acc(m, 2g + h) over rows [k0, k1) of w, for MR rows of x and G groups of 32 columns from
// w's column 0 (w, y already offset); the last group's columns masked by `tail` (bit c: column
// c of the group). Vector 2g + h of a row holds the group's columns 16h .. 16h + 15.
template <int MR, int G>
void Tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t N, float* y, int64_t k0,
          int64_t k1, __mmask32 tail) {
  // Pair layout: lane c of the result holds (row k, row k + 1) of column c (16-bit elements
  // 2c and 2c + 1), for columns 0 .. 15 (low) and 16 .. 31 (high) of the two rows.
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                       40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                       32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  __m512 acc[MR][2 * G];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int v = 0; v < 2 * G; ++v) {
      const __mmask16 mask = v / 2 == G - 1 ? __mmask16(tail >> (16 * (v % 2))) : __mmask16(0xFFFF);
      acc[m][v] = k0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, y + m * N + 16 * v);
    }
  }
  for (int64_t k = k0; k < k1; k += 2) {
    __m512i wv[2 * G];
#pragma GCC unroll 2
    for (int g = 0; g < G; ++g) {
      const __mmask32 mask = g == G - 1 ? tail : __mmask32(0xFFFFFFFF);
      const uint16_t* wk = w + k * N + 32 * g;
      const __m512i even = _mm512_maskz_loadu_epi16(mask, wk);
      const __m512i odd = _mm512_maskz_loadu_epi16(mask, wk + N);
      wv[2 * g] = _mm512_permutex2var_epi16(even, low, odd);
      wv[2 * g + 1] = _mm512_permutex2var_epi16(even, high, odd);
      // The same columns of the next block's two rows, into L2 (past w's end: harmless).
      _mm_prefetch(reinterpret_cast<const char*>(wk + kKBlock * N), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(wk + (kKBlock + 1) * N), _MM_HINT_T1);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      int32_t pair;  // x[m][k], x[m][k + 1]
      __builtin_memcpy(&pair, x + m * K + k, sizeof(pair));
      const __m512i xb = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int v = 0; v < 2 * G; ++v) acc[m][v] = Dot(acc[m][v], wv[v], xb);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int v = 0; v < 2 * G; ++v) {
      const __mmask16 mask = v / 2 == G - 1 ? __mmask16(tail >> (16 * (v % 2))) : __mmask16(0xFFFF);
      _mm512_mask_storeu_ps(y + m * N + 16 * v, mask, acc[m][v]);
    }
  }
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t,
                        int64_t, __mmask32);

template <int MR>
constexpr TileFn kTilesOf[kGroups] = {Tile<MR, 1>, Tile<MR, 2>};

constexpr const TileFn* kTiles[kRows] = {kTilesOf<1>, kTilesOf<2>, kTilesOf<3>, kTilesOf<4>};

// Columns [c0, c1) of y = x @ w, w[K, N] (K even).
void Columns(const uint16_t* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N,
             int64_t c0, int64_t c1) {
  const int64_t step = 32 * kGroups;
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
    const int64_t k1 = std::min(K, k0 + kKBlock);
    for (int64_t n = c0; n < c1; n += step) {
      const int64_t width = std::min<int64_t>(c1 - n, step);
      const int groups = static_cast<int>((width + 31) / 32);
      const int64_t rest = width - 32 * (groups - 1);
      const __mmask32 tail = rest == 32 ? __mmask32(0xFFFFFFFF)
                                        : static_cast<__mmask32>((1u << rest) - 1u);
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int mr = static_cast<int>(std::min<int64_t>(kRows, M - m0));
        kTiles[mr - 1][groups - 1](x + m0 * K, K, w + n, N, y + m0 * N + n, k0, k1, tail);
      }
    }
  }
}

// Transposed w[N, K] (K a multiple of 32): results y[m, n .. n + NB) for MR rows of x, from 16
// lanes of partial sums over the pairs k = 2l, 2l + 1 mod 32, reduced lane by lane.
template <int MR, int NB>
void TileT(const uint16_t* x, int64_t K, const uint16_t* w, int64_t N, float* y) {
  __m512 acc[MR][NB];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; k += 32) {
    __m512i wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      wv[j] = _mm512_loadu_si512(w + j * K + k);
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + NB) * K + k), _MM_HINT_T1);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const __m512i xv = _mm512_loadu_si512(x + m * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[m][j] = Dot(acc[m][j], wv[j], xv);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) y[m * N + j] = _mm512_reduce_add_ps(acc[m][j]);
  }
}

using TileTFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*);

constexpr int kRowsT = 4;     // rows of x per tile of the transposed product
constexpr int kColumnsT = 4;  // rows of w[N, K] (result columns) per tile

template <int MR>
constexpr TileTFn kTilesTOf[kColumnsT] = {TileT<MR, 1>, TileT<MR, 2>, TileT<MR, 3>, TileT<MR, 4>};

constexpr const TileTFn* kTilesT[kRowsT] = {kTilesTOf<1>, kTilesTOf<2>, kTilesTOf<3>,
                                            kTilesTOf<4>};

// Columns [c0, c1) of y = x @ w^T, w[N, K].
void ColumnsT(const uint16_t* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N,
              int64_t c0, int64_t c1) {
  for (int64_t n = c0; n < c1; n += kColumnsT) {
    const int nb = static_cast<int>(std::min<int64_t>(kColumnsT, c1 - n));
    for (int64_t m0 = 0; m0 < M; m0 += kRowsT) {
      const int mr = static_cast<int>(std::min<int64_t>(kRowsT, M - m0));
      kTilesT[mr - 1][nb - 1](x + m0 * K, K, w + n * K, N, y + m0 * N + n);
    }
  }
}

// y = x @ w (transposed: w[N, K]) on the pool's threads, one chunk of whole 32-column groups
// each.
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::BF16>& x, ffi::Buffer<ffi::BF16>& w,
               ffi::ResultBuffer<ffi::F32>& y, bool transposed) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const char* name = transposed ? "small_matmul_bf16_t" : "small_matmul_bf16";
  if (wd.size() != 2 || xd.size() < 1) {
    return ffi::Error::InvalidArgument(std::string(name) + ": x [..., K] and a 2-d w expected");
  }
  const int64_t K = transposed ? wd.back() : wd.front();
  const int64_t N = transposed ? wd.front() : wd.back();
  int64_t M = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) M *= xd[i];
  if (xd.back() != K || K % 32 != 0 || M > kMaxRows) {
    return ffi::Error::InvalidArgument(
        std::string(name) + ": x [M <= 64, K], w with K a multiple of 32 expected");
  }
  if (M == 0 || N == 0) return ffi::Error::Success();
  float* out = y->typed_data();
  if (K == 0) {
    std::fill(out, out + M * N, 0.0f);
    return ffi::Error::Success();
  }
  const auto* a = reinterpret_cast<const uint16_t*>(x.typed_data());
  const auto* b = reinterpret_cast<const uint16_t*>(w.typed_data());
  const int64_t groups = (N + 31) / 32;
  const int64_t chunks = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), groups);
  const int64_t width = 32 * ((groups + chunks - 1) / chunks);
  const auto columns = transposed ? ColumnsT : Columns;
  dspark::ParallelFor(pool, (N + width - 1) / width, 0, [=](int64_t c) {
    columns(a, b, out, M, K, N, c * width, std::min(N, (c + 1) * width));
  });
  return ffi::Error::Success();
}

}  // namespace

DSPARK_MATMUL_HANDLERS(Bf16, ffi::BF16, Run);
