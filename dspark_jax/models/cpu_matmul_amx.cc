// y[M, N] = x[M, K] @ w[K, N] (or @ w[N, K]^T) for bfloat16 x and w and a float32 y, M <= 64,
// on the AMX tile unit of x86 CPUs (Sapphire Rapids and later), as XLA FFI custom calls.
//
// A float32 product of 8 rows is bound by the AVX-512 multiply-adds of a 2-core machine (8
// rows cost 1.3-1.5x one row), and XLA:CPU's bfloat16 product of a few rows runs below the
// float32 one. An AMX tile multiply-add (TDPBF16PS) takes 16 rows x 32 k of x against 32 k x
// 16 columns of w in one instruction, so the rows cost little beside reading w's bytes: a
// decode step of 1 token and a verify of 8 read the bfloat16 weights (half float32's bytes)
// at the same speed (BENCHMARKS.md, issue 19).
//
// w[K, N] (the layer matrices): the threads of XLA's intra-op pool take column ranges. Up to
// 16 rows (decode steps, verifies: a stream over w) each thread walks w in blocks of kKBlock
// rows, and for each strip of 32 columns packs 32 rows into the tile unit's pair layout (rows k
// and k + 1 interleaved, on the fly, in a 2 KB scratch) and multiplies them with x's rows into
// two float32 result tiles, loaded and stored once per block. More rows (batches: the result
// tiles' loads and stores would outweigh the multiplies) take a strip's whole K packed once
// and every 32 rows of x against it, the result tiles staying in the tile unit over all of K.
// w[N, K] (a tied embedding table as LM head) is multiplied the other way round, y^T = w x^T:
// 16 rows of w are a tile as they lie, x^T is packed once per call (four row groups of 16: four
// result tiles), and each result tile [16 columns x 16 rows] is written out transposed. Beyond
// 64 rows XLA's dot is as fast (benchmarks/bf16_rows.py).
//
// Every result element is the same sequence of tile multiply-adds over k = 0, 32, 64, ... in
// order whatever M, the path, the threads or the strips (the tile unit sums each element's 32
// products in a fixed order and rounds as TDPBF16PS defines; a result tile stored and loaded
// back between blocks is exact), so a row's result does not depend on the other rows: a
// decode step, a verify and a batch of any size give a token the same bits. The process must
// be allowed the tile data state first (Linux arch_prctl ARCH_REQ_XCOMP_PERM; cpu_kernels.py).
//
// Built by dspark_jax/models/cpu_kernels.py with the host's C++ compiler
// (-O3 -mavx512f -mavx512bw -mamx-tile -mamx-bf16).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_matmul_handlers.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 64;     // four row groups of 16
constexpr int kStreamRows = 16;  // the most rows multiplied by streaming w (one row group)
constexpr int kTallRows = 32;    // rows of x per pass over a packed strip (two row groups)
constexpr int64_t kKStep = 32;   // k per tile multiply-add (16 pairs)
// Rows of w per block (one tile step) when streaming: the result tiles are loaded and stored
// once per block and the next block is prefetched. Longer blocks (64, 128) streamed slower for
// 1 and 8 rows in a jitted chain of SmolLM2's 210 layer matrices (the float32 sums between
// blocks are exact, so the block does not change any result).
constexpr int64_t kKBlock = 32;
constexpr int64_t kStrip = 32;   // columns per strip: two result tiles of 16

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile registers. w[K, N]: result tiles 2 g + j (x's row group g, w's column tile j), x's row
// groups in 4 and 5, w's packed column tiles in 6 and 7. w[N, K]: result tile g per row group
// of x, 16 rows of w in 4, x^T's packed row groups in 5, 6, 7 (and 5 again for the fourth).
// Every tile 16 rows of 64 bytes, except that the streaming path's x tile (4) and result
// tiles (0, 1) have `rows` rows: x's rows are its rows as they lie. The other paths read
// padded operands and always multiply full tiles.
void Configure(int rows = 16) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = t == 0 || t == 1 || t == 4 ? rows : 16;
    c.colsb[t] = 64;
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

// Rows [0, rows) of a stored result tile `out` [16 x 16] into y (row stride ld floats).
inline void StoreRows(const float* out, int rows, float* y, int64_t ld) {
  for (int m = 0; m < rows; ++m) {
    _mm512_storeu_ps(y + m * ld, _mm512_load_ps(out + 16 * m));
  }
}

// Columns [c0, c1) of y = x @ w, w[K, N], M <= kStreamRows; c1 - c0 a multiple of kStrip or
// ending at N (N a multiple of 16: a last strip of 16 columns uses one column tile).
void StreamColumns(const uint16_t* x, const uint16_t* w, float* y, int M, int64_t K, int64_t N,
                   int64_t c0, int64_t c1) {
  Configure(M);
  alignas(64) uint16_t packed[2][16 * 32];
  const int64_t ld_x = 2 * K, ld_y = 4 * N;
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
    const int64_t k1 = std::min(K, k0 + kKBlock);
    for (int64_t n = c0; n < c1; n += kStrip) {
      const bool two = n + 16 < c1;
      float* yn = y + n;
      if (k0 == 0) {
        _tile_zero(0); _tile_zero(1);
      } else {
        _tile_loadd(0, yn, ld_y);
        if (two) _tile_loadd(1, yn + 16, ld_y);
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
      }
      _tile_stored(0, yn, ld_y);
      if (two) _tile_stored(1, yn + 16, ld_y);
    }
  }
  _tile_release();
}

// Columns [c0, c1) of y = x @ w, w[K, N], kStreamRows < M <= kMaxRows: x padded with zero rows
// to a multiple of kTallRows. Each strip's K x 32 columns are packed once (K x 128 bytes) and
// multiplied with every 32 rows of x, the four result tiles held over all of K.
void TallColumns(const uint16_t* x, const uint16_t* w, float* y, int64_t M, int64_t K,
                 int64_t N, int64_t c0, int64_t c1) {
  Configure();
  const int64_t steps = K / kKStep;
  std::vector<__m512i> scratch(steps * 2 * 16);  // [step][column tile][16 pairs x 64 bytes]
  auto* packed = reinterpret_cast<uint16_t*>(scratch.data());
  alignas(64) float out[16 * 16];
  const int64_t ld_x = 2 * K;
  for (int64_t n = c0; n < c1; n += kStrip) {
    const bool two = n + 16 < c1;
    for (int64_t s = 0; s < steps; ++s) {
      const uint16_t* wk = w + s * kKStep * N + n;
      PackPairs(wk, N, packed + s * 1024);
      if (two) PackPairs(wk + 16, N, packed + s * 1024 + 512);
      for (int r = 0; r < kKStep; ++r) {  // the next strip's line of these rows, into L2
        _mm_prefetch(reinterpret_cast<const char*>(wk + r * N + kStrip), _MM_HINT_T1);
      }
    }
    for (int64_t m0 = 0; m0 < M; m0 += kTallRows) {
      const bool second = M - m0 > 16;  // rows in x's second group of 16
      const uint16_t* xm = x + m0 * K;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t s = 0; s < steps; ++s) {
        _tile_loadd(4, xm + s * kKStep, ld_x);
        _tile_loadd(6, packed + s * 1024, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
          _tile_loadd(7, packed + s * 1024 + 512, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (second) {
          _tile_loadd(5, xm + 16 * K + s * kKStep, ld_x);
          _tile_dpbf16ps(2, 5, 6);
          if (two) _tile_dpbf16ps(3, 5, 7);
        }
      }
      // Result tile 2 g + j: x's rows m0 + 16 g .., columns n + 16 j ..
      for (int g = 0; g < (second ? 2 : 1); ++g) {
        const int rows = static_cast<int>(std::min<int64_t>(16, M - m0 - 16 * g));
        for (int j = 0; j < (two ? 2 : 1); ++j) {
          float* yt = y + (m0 + 16 * g) * N + n + 16 * j;
          switch (2 * g + j) {
            case 0: _tile_stored(0, out, 64); break;
            case 1: _tile_stored(1, out, 64); break;
            case 2: _tile_stored(2, out, 64); break;
            default: _tile_stored(3, out, 64); break;
          }
          StoreRows(out, rows, yt, N);
        }
      }
    }
  }
  _tile_release();
}

// x^T in the pair layout, per k step and row group: xt[s][g][p][m] = (x[16 g + m][32 s + 2 p],
// x[16 g + m][32 s + 2 p + 1]) for `groups` groups of 16 rows of 64 bytes (xt zeroed by the
// caller: rows of x past M stay zeros).
void PackTransposed(const uint16_t* x, int M, int64_t K, int groups, uint32_t* xt) {
  const int64_t steps = K / kKStep;
  for (int m = 0; m < M; ++m) {
    const int g = m / 16, c = m % 16;
    for (int64_t s = 0; s < steps; ++s) {
      for (int p = 0; p < 16; ++p) {
        uint32_t pair;
        std::memcpy(&pair, x + m * K + s * kKStep + 2 * p, sizeof(pair));
        xt[((s * groups + g) * 16 + p) * 16 + c] = pair;
      }
    }
  }
}

// out[c][m] -> y[m][c] for rows m < rows: a stored result tile of y^T written out as y's rows.
inline void StoreTransposed(const float* out, int rows, float* y, int64_t ld) {
  if (rows < 4) {
    for (int m = 0; m < rows; ++m) {
      for (int c = 0; c < 16; ++c) y[m * ld + c] = out[c * 16 + m];
    }
    return;
  }
  const __m512i column = _mm512_mullo_epi32(_mm512_set1_epi32(16),
                                            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                             6, 5, 4, 3, 2, 1, 0));
  for (int m = 0; m < rows; ++m) {
    const __m512i at = _mm512_add_epi32(column, _mm512_set1_epi32(m));
    _mm512_storeu_ps(y + m * ld, _mm512_i32gather_ps(at, out, 4));
  }
}

// Columns [c0, c1) of y = x @ w^T, w[N, K] (x^T packed, zero columns past M): per block of 16
// rows of w, one result tile per row group of x.
void TransposedColumns(const uint32_t* xt, const uint16_t* w, float* y, int M, int64_t K,
                       int64_t N, int64_t c0, int64_t c1) {
  Configure();
  const int groups = (M + 15) / 16;
  alignas(64) float out[16 * 16];
  const int64_t ld_w = 2 * K;
  for (int64_t n = c0; n < c1; n += 16) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t s = 0; s < K / kKStep; ++s) {
      const uint32_t* xs = xt + s * groups * 256;
      _tile_loadd(4, w + n * K + s * kKStep, ld_w);
      _tile_loadd(5, xs, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (groups > 1) {
        _tile_loadd(6, xs + 256, 64);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (groups > 2) {
        _tile_loadd(7, xs + 512, 64);
        _tile_dpbf16ps(2, 4, 7);
      }
      if (groups > 3) {
        _tile_loadd(5, xs + 768, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    // Result tile g holds [16 columns of y x the group's rows]: written out transposed.
    for (int g = 0; g < groups; ++g) {
      switch (g) {
        case 0: _tile_stored(0, out, 64); break;
        case 1: _tile_stored(1, out, 64); break;
        case 2: _tile_stored(2, out, 64); break;
        default: _tile_stored(3, out, 64); break;
      }
      StoreTransposed(out, std::min(16, M - 16 * g), y + 16 * g * N + n, N);
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
        std::string(name) + ": x [M <= 64, K], w with K a multiple of 32 and N of 16 expected");
  }
  if (M == 0 || N == 0) return ffi::Error::Success();
  float* out = y->typed_data();
  if (K == 0) {
    std::fill(out, out + M * N, 0.0f);
    return ffi::Error::Success();
  }
  const auto* a = reinterpret_cast<const uint16_t*>(x.typed_data());
  const auto* b = reinterpret_cast<const uint16_t*>(w.typed_data());
  const int64_t strips = (N + kStrip - 1) / kStrip;
  const int64_t chunks = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), strips);
  const int64_t width = kStrip * ((strips + chunks - 1) / chunks);
  const int64_t count = (N + width - 1) / width;
  const int rows = static_cast<int>(M);
  if (transposed) {
    const int groups = (rows + 15) / 16;
    std::vector<uint32_t> xt(K / kKStep * groups * 256);
    PackTransposed(a, rows, K, groups, xt.data());
    const uint32_t* packed = xt.data();
    dspark::ParallelFor(pool, count, 0, [=](int64_t c) {
      TransposedColumns(packed, b, out, rows, K, N, c * width, std::min(N, (c + 1) * width));
    });
  } else if (M <= kStreamRows) {
    dspark::ParallelFor(pool, count, 0, [=](int64_t c) {
      StreamColumns(a, b, out, rows, K, N, c * width, std::min(N, (c + 1) * width));
    });
  } else {
    // x's rows padded with zeros to a multiple of kTallRows, so every tile load is in bounds.
    const int64_t padded = (M + kTallRows - 1) / kTallRows * kTallRows;
    std::vector<uint16_t> xp(padded * K, 0);
    std::memcpy(xp.data(), a, M * K * sizeof(uint16_t));
    const uint16_t* x_padded = xp.data();
    dspark::ParallelFor(pool, count, 0, [=](int64_t c) {
      TallColumns(x_padded, b, out, M, K, N, c * width, std::min(N, (c + 1) * width));
    });
  }
  return ffi::Error::Success();
}

}  // namespace

DSPARK_MATMUL_HANDLERS(Amx, ffi::BF16, Run);
