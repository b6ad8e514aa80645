// y[M, N] = x[M, K] @ w[K, N] (or @ w[N, K]^T) in float32 for a few rows M, as XLA FFI
// custom calls on CPU.
//
// XLA:CPU multiplies 2 to 32 float32 rows by a weight matrix at 35-60 GFLOP/s, so a
// speculative verify of 8 tokens costs about two decode steps where reading the weights once
// (what one row costs) would allow one (BENCHMARKS.md, issue 19). This kernel reads each
// weight matrix once for all rows: the threads of XLA's intra-op pool take column ranges, and
// each walks the matrix in blocks of rows (that many streams through memory), keeping a
// tile of up to kRows x 64 results in AVX-512 registers per block (8 rows: 8 x 48, one tile,
// so a verify of 8 tokens reads each block once into registers). A matrix held transposed,
// w[N, K] (a tied embedding table as an LM head), is read row by row instead: 16 lanes of
// partial sums per result, added up at the end.
//
// Every result element is computed by the same instructions in the same order whatever M, the
// thread count or the tiling (w[K, N]: one fused multiply-add chain over k = 0 .. K-1; w[N, K]:
// sixteen chains over k = l mod 16, then one fixed reduction): a row's result does not depend
// on the other rows, so a decode step (M = 1) and a verify (M = 8) give a token the same bits.
//
// Each row's sum over x's last axis (RowSum, the norms' mean squares and the rotary's pairs)
// is the same chain as a product by a column of ones, with a row per lane instead: a
// prefill's thousands of rows by one column would leave 15 of 16 lanes and all but one thread
// idle.
//
// Built by dspark_jax/models/cpu_kernels.py with the host's C++ compiler (-O3 -mavx512f).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu_lanes.h"
#include "cpu_matmul_handlers.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Rows of w per block: that many sequential memory streams, by the rows of x. On the AMD EPYC
// kind a verify of 8 / 16 tokens took 25-28 / 34-41 ms with blocks of 64 (or 128) against
// 33-37 / 46-48 ms with 16, while one row decoded 14-20% faster with 16 than with 32 or 64
// (benchmarks/verify_cost.py, bench_ar_generate.py). The block does not change any result.
constexpr int64_t kKBlockOneRow = 16;
constexpr int64_t kKBlock = 64;
constexpr int kRows = 8;     // rows of x per register tile
constexpr int kVectors = 4;  // 16-float vectors of columns per register tile (64 columns) ...
// ... for up to kWideRows rows; taller tiles take 3 (8 x 3 accumulators + 3 w vectors + one
// broadcast fill 28 of the 32 registers). One 8 x 48 tile for 8 rows reads a block of w from
// memory once, where a 6 x 64 tile and a 2 x 64 tile took ~10-20% longer (a C++ harness).
constexpr int kWideRows = 6;

// The 16-float vectors of columns per tile for M rows.
constexpr int VectorsFor(int64_t M) {
  return std::min<int64_t>(M, kRows) > kWideRows ? 3 : kVectors;
}

// acc(m, j) over rows [k0, k1) of w, for MR rows of x and NV vectors of columns from w's
// column 0 (w, y already offset). The last vector is masked by `tail` (N not a multiple of 16).
template <int MR, int NV>
void Tile(const float* x, int64_t K, const float* w, int64_t N, float* y, int64_t k0,
          int64_t k1, int64_t block, __mmask16 tail) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const __mmask16 mask = j == NV - 1 ? tail : __mmask16(0xFFFF);
      acc[m][j] = k0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, y + m * N + 16 * j);
    }
  }
  for (int64_t k = k0; k < k1; ++k) {
    __m512 wv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const __mmask16 mask = j == NV - 1 ? tail : __mmask16(0xFFFF);
      wv[j] = _mm512_maskz_loadu_ps(mask, w + k * N + 16 * j);
      // The same columns of the next block's rows, into L2 (a prefetch past w's end is
      // harmless): the hardware prefetchers alone left one core at about 8 GB/s.
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + block) * N + 16 * j), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * K + k]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_fmadd_ps(xb, wv[j], acc[m][j]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const __mmask16 mask = j == NV - 1 ? tail : __mmask16(0xFFFF);
      _mm512_mask_storeu_ps(y + m * N + 16 * j, mask, acc[m][j]);
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                        int64_t, __mmask16);

// Tiles by rows and vectors; rows above kWideRows have no 4-vector tile (it would spill): the
// slot is null, and its untaken branch names Tile<MR, VectorsFor(MR)> = Tile<MR, 3>, so that
// Tile<MR, 4> is never instantiated.
template <int MR>
constexpr TileFn kTilesOf[kVectors] = {Tile<MR, 1>, Tile<MR, 2>, Tile<MR, 3>,
                                       MR > kWideRows ? nullptr : Tile<MR, VectorsFor(MR)>};

constexpr const TileFn* kTiles[kRows] = {kTilesOf<1>, kTilesOf<2>, kTilesOf<3>, kTilesOf<4>,
                                         kTilesOf<5>, kTilesOf<6>, kTilesOf<7>, kTilesOf<8>};

// Columns [c0, c1) of y = x @ w.
void Columns(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
             int64_t c0, int64_t c1) {
  const int64_t step = 16 * VectorsFor(M);
  const int64_t block = M == 1 ? kKBlockOneRow : kKBlock;
  for (int64_t k0 = 0; k0 < K; k0 += block) {
    const int64_t k1 = std::min(K, k0 + block);
    for (int64_t n = c0; n < c1; n += step) {
      const int64_t width = std::min<int64_t>(c1 - n, step);
      const int nv = static_cast<int>((width + 15) / 16);
      const int64_t rest = width - 16 * (nv - 1);
      const __mmask16 tail = static_cast<__mmask16>((1u << rest) - 1u);
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int mr = static_cast<int>(std::min<int64_t>(kRows, M - m0));
        kTiles[mr - 1][nv - 1](x + m0 * K, K, w + n, N, y + m0 * N + n, k0, k1, block, tail);
      }
    }
  }
}

// Transposed w[N, K]: results y[m, n .. n + NB) for MR rows of x, from 16-lane partial sums
// over k = l mod 16 (the last, partial vector of k masked by `tail`), reduced lane by lane.
template <int MR, int NB>
void TileT(const float* x, int64_t K, const float* w, int64_t N, float* y, __mmask16 tail) {
  __m512 acc[MR][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = k + 16 <= K ? __mmask16(0xFFFF) : tail;
    __m512 wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      wv[j] = _mm512_maskz_loadu_ps(mask, w + j * K + k);
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + NB) * K + k), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) y[m * N + j] = _mm512_reduce_add_ps(acc[m][j]);
  }
}

using TileTFn = void (*)(const float*, int64_t, const float*, int64_t, float*, __mmask16);

constexpr int kRowsT = 4;     // rows of x per tile of the transposed product
constexpr int kColumnsT = 4;  // rows of w[N, K] (result columns) per tile

template <int MR>
constexpr TileTFn kTilesTOf[kColumnsT] = {TileT<MR, 1>, TileT<MR, 2>, TileT<MR, 3>, TileT<MR, 4>};

constexpr const TileTFn* kTilesT[kRowsT] = {kTilesTOf<1>, kTilesTOf<2>, kTilesTOf<3>,
                                            kTilesTOf<4>};

// Columns [c0, c1) of y = x @ w^T, w[N, K].
void ColumnsT(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
              int64_t c0, int64_t c1) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (K % 16 == 0 ? 16 : K % 16)) - 1u);
  for (int64_t n = c0; n < c1; n += kColumnsT) {
    const int nb = static_cast<int>(std::min<int64_t>(kColumnsT, c1 - n));
    for (int64_t m0 = 0; m0 < M; m0 += kRowsT) {
      const int mr = static_cast<int>(std::min<int64_t>(kRowsT, M - m0));
      kTilesT[mr - 1][nb - 1](x + m0 * K, K, w + n * K, N, y + m0 * N + n, tail);
    }
  }
}

using ColumnsFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                           int64_t);

// y = x @ w (transposed: w[N, K]) on the pool's threads, one chunk of whole 16-column vectors
// each.
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& w,
               ffi::ResultBuffer<ffi::F32>& y, bool transposed) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const int64_t K = transposed ? wd.back() : wd.front();
  if (wd.size() != 2 || xd.size() < 1 || xd.back() != K) {
    return ffi::Error::InvalidArgument(transposed
        ? "small_matmul_t: x [..., K] and w [N, K] expected"
        : "small_matmul: x [..., K] and w [K, N] expected");
  }
  const int64_t N = transposed ? wd.front() : wd.back();
  int64_t M = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) M *= xd[i];
  if (M == 0 || N == 0) return ffi::Error::Success();
  float* out = y->typed_data();
  if (K == 0) {
    std::fill(out, out + M * N, 0.0f);
    return ffi::Error::Success();
  }
  const ColumnsFn columns = transposed ? ColumnsT : Columns;
  const float* a = x.typed_data();
  const float* b = w.typed_data();
  const int64_t vectors = (N + 15) / 16;
  const int64_t chunks = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), vectors);
  const int64_t width = 16 * ((vectors + chunks - 1) / chunks);
  dspark::ParallelFor(pool, (N + width - 1) / width, 0, [=](int64_t c) {
    columns(a, b, out, M, K, N, c * width, std::min(N, (c + 1) * width));
  });
  return ffi::Error::Success();
}

// y[m] = x[m][0] + x[m][1] + ... + x[m][K - 1], added in order from +0 for rows [m0, m1) of
// x [M, K]: the bits of the product by a column of ones above (a fused multiply-add by 1
// rounds as an add), with 16 rows per vector, a lane per row (one gather per k).
void SumRows(const float* x, int64_t K, int64_t m0, int64_t m1, float* y) {
  const __m512i lanes = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(static_cast<int32_t>(K)));
  for (int64_t m = m0; m < m1; m += 16) {
    const __mmask16 mask = dspark::Mask(m1 - m);
    const float* base = x + m * K;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      acc = _mm512_add_ps(
          acc, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, lanes, base + k, 4));
    }
    _mm512_mask_storeu_ps(y + m, mask, acc);
  }
}

constexpr int64_t kSumRowsPerItem = 256;  // rows per work item of RowSum

ffi::Error RowSum(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  if (xd.size() < 1) return ffi::Error::InvalidArgument("row_sum: x [..., K] expected");
  const int64_t K = xd.back();
  if (15 * K > std::numeric_limits<int32_t>::max()) {
    return ffi::Error::InvalidArgument("row_sum: rows of at most 143,165,576 elements expected");
  }
  int64_t M = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) M *= xd[i];
  const float* a = x.typed_data();
  float* out = y->typed_data();
  dspark::ParallelFor(pool, (M + kSumRowsPerItem - 1) / kSumRowsPerItem, 0, [=](int64_t i) {
    SumRows(a, K, i * kSumRowsPerItem, std::min(M, (i + 1) * kSumRowsPerItem), out);
  });
  return ffi::Error::Success();
}

}  // namespace

DSPARK_MATMUL_HANDLERS(, ffi::F32, Run);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkRowSum, RowSum,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
