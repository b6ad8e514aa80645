// y[M, N] = x[M, K] @ w[K, N] (or @ w[N, K]^T) for bfloat16 x and w and a float32 y, M <= 32,
// on the AMX tile unit of x86 CPUs (Sapphire Rapids and later), as XLA FFI custom calls.
//
// A float32 product of 8 rows is bound by the AVX-512 multiply-adds of a 2-core machine (8
// rows cost 1.3-1.5x one row), and XLA:CPU's bfloat16 product of a few rows runs below the
// float32 one. An AMX tile multiply-add (TDPBF16PS) takes 16 rows x 32 k of x against 32 k x
// 16 columns of w in one instruction, so the rows cost nothing beside reading w's bytes: a
// decode step of 1 token and a verify of 8 read the bfloat16 weights (half float32's bytes)
// at the same speed (BENCHMARKS.md, issue 19).
//
// w[K, N] (the layer matrices): the threads of XLA's intra-op pool take column ranges; each
// walks w in blocks of kKBlock rows, and for each strip of 32 columns packs 32 rows into the
// tile unit's pair layout (rows k and k + 1 interleaved, on the fly, in a 2 KB scratch) and
// multiplies them with x's rows (two row groups of up to 16: tiles 4 and 5) into 2 x 2 float32
// result tiles, loaded and stored once per block. w[N, K] (a tied embedding table as LM head)
// is multiplied the other way round, y^T = w x^T: 16 rows of w are a tile as they lie, x^T is
// packed once per call, and each result tile [16 columns x rows] is written out transposed.
//
// Every result element is the same sequence of tile multiply-adds over k = 0, 32, 64, ... in
// order whatever M, the threads or the strips (the tile unit sums each element's 32 products
// in a fixed order and rounds as TDPBF16PS defines), so a row's result does not depend on the
// other rows: a decode step and a verify give a token the same bits. The process must be
// allowed the tile data state first (Linux arch_prctl ARCH_REQ_XCOMP_PERM; cpu_kernels.py).
//
// Built by dspark_jax/models/cpu_kernels.py with the host's C++ compiler
// (-O3 -mavx512f -mavx512bw -mamx-tile -mamx-bf16).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 32;     // two row groups of 16
constexpr int64_t kKStep = 32;   // k per tile multiply-add (16 pairs)
// Rows of w per block (one tile step): the result tiles are loaded and stored once per block
// and the next block is prefetched. Longer blocks (64, 128) streamed slower for 1 and 8 rows
// in a jitted chain of SmolLM2's 210 layer matrices (the float32 sums between blocks are
// exact, so the block does not change any result).
constexpr int64_t kKBlock = 32;
constexpr int64_t kStrip = 32;   // columns per strip: two result tiles of 16

// Tile registers. w[K, N]: C[g][j] = 2 g + j (row group g, column tile j), A[g] = 4 + g (x's
// row group g), B[j] = 6 + j (w's packed columns j). w[N, K]: C[g][i] = 2 g + i (x's row group
// g, w's row block i), A[i] = 4 + i (16 rows of w), B[g] = 6 + g (x's row group g, packed).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void Configure(const int rows[2], bool transposed) {
  TileConfig c;
  for (int g = 0; g < 2; ++g) {
    const int r = std::max(rows[g], 1);  // an empty group's tiles are configured, never used
    for (int t = 0; t < 2; ++t) {
      c.rows[2 * g + t] = transposed ? 16 : r;
      c.colsb[2 * g + t] = transposed ? 4 * r : 64;
    }
    c.rows[4 + g] = transposed ? 16 : r;  // A: x's rows, or 16 rows of w
    c.colsb[4 + g] = 64;
    c.rows[6 + g] = 16;                   // B: 16 pairs of k
    c.colsb[6 + g] = transposed ? 4 * r : 64;
  }
  _tile_loadconfig(&c);
}

// Interleaves rows k .. k + 31 of 16 columns of w (row stride N) into the pair layout:
// out[p][c] = (w[2p][c], w[2p + 1][c]), 16 rows of 64 bytes.
inline void PackPairs(const uint16_t* w, int64_t N, uint16_t* out) {
  const __m512i order = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                         40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                         32, 0);
#pragma GCC unroll 16
  for (int p = 0; p < 16; ++p) {
    const __m512i even = _mm512_castsi256_si512(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2 * p * N)));
    const __m512i odd = _mm512_castsi256_si512(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (2 * p + 1) * N)));
    _mm512_store_si512(reinterpret_cast<__m512i*>(out + 32 * p),
                       _mm512_permutex2var_epi16(even, order, odd));
  }
}

// Columns [c0, c1) of y = x @ w, w[K, N]; c1 - c0 a multiple of kStrip or ending at N (N a
// multiple of 16: a last strip of 16 columns uses one column tile).
void Columns(const uint16_t* x, const uint16_t* w, float* y, int M, int64_t K, int64_t N,
             int64_t c0, int64_t c1) {
  const int rows[2] = {std::min(M, 16), std::max(M - 16, 0)};
  Configure(rows, false);
  alignas(64) uint16_t packed[2][16 * 32];
  const int64_t ld_x = 2 * K, ld_y = 4 * N;
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
    const int64_t k1 = std::min(K, k0 + kKBlock);
    for (int64_t n = c0; n < c1; n += kStrip) {
      const bool two = n + 16 < c1;
      float* yn = y + n;
      if (k0 == 0) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      } else {
        _tile_loadd(0, yn, ld_y);
        if (two) _tile_loadd(1, yn + 16, ld_y);
        if (rows[1]) {
          _tile_loadd(2, yn + 16 * N, ld_y);
          if (two) _tile_loadd(3, yn + 16 * N + 16, ld_y);
        }
      }
      for (int64_t k = k0; k < k1; k += kKStep) {
        const uint16_t* wk = w + k * N + n;
        PackPairs(wk, N, packed[0]);
        if (two) PackPairs(wk + 16, N, packed[1]);
        // The same strip of the next block, into L2 (one 64-byte line per row of w).
        for (int r = 0; r < kKStep; ++r) {
          _mm_prefetch(reinterpret_cast<const char*>(wk + (kKBlock + r) * N), _MM_HINT_T1);
        }
        _tile_loadd(4, x + k, ld_x);
        _tile_loadd(6, packed[0], 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
          _tile_loadd(7, packed[1], 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (rows[1]) {
          _tile_loadd(5, x + 16 * K + k, ld_x);
          _tile_dpbf16ps(2, 5, 6);
          if (two) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, yn, ld_y);
      if (two) _tile_stored(1, yn + 16, ld_y);
      if (rows[1]) {
        _tile_stored(2, yn + 16 * N, ld_y);
        if (two) _tile_stored(3, yn + 16 * N + 16, ld_y);
      }
    }
  }
  _tile_release();
}

// x^T in the pair layout, per k step and row group: xt[s][g][p][m] = (x[16 g + m][32 s + 2 p],
// x[16 g + m][32 s + 2 p + 1]), 16 rows of 64 bytes (xt zeroed by the caller: rows of x past M stay zeros).
void PackTransposed(const uint16_t* x, int M, int64_t K, uint32_t* xt) {
  const int64_t steps = K / kKStep;
  for (int m = 0; m < M; ++m) {
    const int g = m / 16, c = m % 16;
    for (int64_t s = 0; s < steps; ++s) {
      for (int p = 0; p < 16; ++p) {
        uint32_t pair;
        std::memcpy(&pair, x + m * K + s * kKStep + 2 * p, sizeof(pair));
        xt[((s * 2 + g) * 16 + p) * 16 + c] = pair;
      }
    }
  }
}

// Columns [c0, c1) of y = x @ w^T, w[N, K]: blocks of 16 rows of w, two at a time.
void ColumnsT(const uint32_t* xt, const uint16_t* w, float* y, int M, int64_t K, int64_t N,
              int64_t c0, int64_t c1) {
  const int rows[2] = {std::min(M, 16), std::max(M - 16, 0)};
  Configure(rows, true);
  alignas(64) float out[16 * 16];
  const int64_t ld_w = 2 * K;
  for (int64_t n = c0; n < c1; n += 32) {
    const bool two = n + 16 < c1;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t s = 0; s < K / kKStep; ++s) {
      const uint16_t* ws = w + n * K + s * kKStep;
      _tile_loadd(4, ws, ld_w);
      _tile_loadd(6, xt + (s * 2) * 256, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (two) {
        _tile_loadd(5, ws + 16 * K, ld_w);
        _tile_dpbf16ps(1, 5, 6);
      }
      if (rows[1]) {
        _tile_loadd(7, xt + (s * 2 + 1) * 256, 64);
        _tile_dpbf16ps(2, 4, 7);
        if (two) _tile_dpbf16ps(3, 5, 7);
      }
    }
    // Each result tile holds [16 columns of y x the group's rows]: written out transposed.
    for (int g = 0; g < 2; ++g) {
      for (int i = 0; i < (two ? 2 : 1); ++i) {
        if (!rows[g]) continue;
        if (g == 0 && i == 0) _tile_stored(0, out, 64);
        if (g == 0 && i == 1) _tile_stored(1, out, 64);
        if (g == 1 && i == 0) _tile_stored(2, out, 64);
        if (g == 1 && i == 1) _tile_stored(3, out, 64);
        for (int m = 0; m < rows[g]; ++m) {
          float* row = y + (16 * g + m) * N + n + 16 * i;
          for (int c = 0; c < 16; ++c) row[c] = out[c * 16 + m];
        }
      }
    }
  }
  _tile_release();
}

// y = x @ w (transposed: w[N, K]) on the pool's threads, one range of whole strips each.
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::BF16>& x, ffi::Buffer<ffi::BF16>& w,
               ffi::ResultBuffer<ffi::F32>& y, bool transposed) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const char* name = transposed ? "small_matmul_amx_t" : "small_matmul_amx";
  if (wd.size() != 2 || xd.size() < 1) {
    return ffi::Error::InvalidArgument(std::string(name) + ": x [..., K] and a 2-d w expected");
  }
  const int64_t K = transposed ? wd.back() : wd.front();
  const int64_t N = transposed ? wd.front() : wd.back();
  int64_t M = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) M *= xd[i];
  if (xd.back() != K || K % kKStep != 0 || N % 16 != 0 || M > kMaxRows) {
    return ffi::Error::InvalidArgument(
        std::string(name) + ": x [M <= 32, K], w with K a multiple of 32 and N of 16 expected");
  }
  if (M == 0 || N == 0) return ffi::Error::Success();
  float* out = y->typed_data();
  if (K == 0) {
    std::fill(out, out + M * N, 0.0f);
    return ffi::Error::Success();
  }
  const auto* a = reinterpret_cast<const uint16_t*>(x.typed_data());
  const auto* b = reinterpret_cast<const uint16_t*>(w.typed_data());
  const int rows = static_cast<int>(M);
  const int64_t strips = (N + kStrip - 1) / kStrip;
  const int64_t chunks = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), strips);
  const int64_t width = kStrip * ((strips + chunks - 1) / chunks);
  const int64_t count = (N + width - 1) / width;
  if (transposed) {
    std::vector<uint32_t> xt(K / kKStep * 2 * 256);
    PackTransposed(a, rows, K, xt.data());
    const uint32_t* packed = xt.data();
    dspark::ParallelFor(pool, count, 0, [=](int64_t c) {
      ColumnsT(packed, b, out, rows, K, N, c * width, std::min(N, (c + 1) * width));
    });
  } else {
    dspark::ParallelFor(pool, count, 0, [=](int64_t c) {
      Columns(a, b, out, rows, K, N, c * width, std::min(N, (c + 1) * width));
    });
  }
  return ffi::Error::Success();
}

ffi::Error SmallMatmulAmx(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                          ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y) {
  return Run(pool, x, w, y, /*transposed=*/false);
}

ffi::Error SmallMatmulAmxT(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                           ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y) {
  return Run(pool, x, w, y, /*transposed=*/true);
}

// The matmul of one layer inside a scan over layers: x @ layers[index], with every layer's
// [K, N] array an operand and the layer's index a traced one, so the chosen matrix is read in
// place with no conditional of XLA's around the call (a switch over 30 layers cost about 5 us
// per matmul).
ffi::Error LayerMatmulAmx(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                          ffi::Buffer<ffi::S32> index, ffi::RemainingArgs layers,
                          ffi::ResultBuffer<ffi::F32> y) {
  auto w = layers.get<ffi::Buffer<ffi::BF16>>(static_cast<size_t>(index.typed_data()[0]));
  if (!w.has_value()) {
    return ffi::Error::InvalidArgument("layer_matmul_amx: the layer index is out of range");
  }
  return Run(pool, x, *w, y, /*transposed=*/false);
}

}  // namespace

#define DSPARK_BINDING                 \
  ffi::Ffi::Bind()                     \
      .Ctx<ffi::ThreadPool>()          \
      .Arg<ffi::Buffer<ffi::BF16>>()   \
      .Arg<ffi::Buffer<ffi::BF16>>()   \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkSmallMatmulAmx, SmallMatmulAmx, DSPARK_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkSmallMatmulAmxT, SmallMatmulAmxT, DSPARK_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkLayerMatmulAmx, LayerMatmulAmx,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x
                                  .Arg<ffi::Buffer<ffi::S32>>()   // the layer's index
                                  .RemainingArgs()                // every layer's matrix
                                  .Ret<ffi::Buffer<ffi::F32>>());
