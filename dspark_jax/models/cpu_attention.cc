// Attention of T new tokens per row over one layer of the KV cache and over each other, in
// float32, as an XLA FFI custom call on CPU.
//
// A decode or verify step of the einsum path (layers.attend_cached) first copies each layer's
// cache out of the stacked [L, ...] arrays (the layer scan's dynamic slice), then reads every
// slot of the step's view, committed or not, in two batched matmuls: about a tenth of a decode
// step and a quarter of a verify of 8 tokens on a 2-core Xeon (BENCHMARKS.md, issue 19). This
// kernel takes the whole stacked cache and the layer's index, so it reads the layer where it
// lies, and reads only each row's committed slots (lengths[b]).
//
// One work item is a block of new tokens of row b in every query head of one kv head (a
// verify's queries read its keys and values together, up to 12 queries per pass), taken by
// whoever of XLA's intra-op threads is free (cpu_parallel.h). A query's keys, in position
// order, are the committed slots s < lengths[b] of its kv head, then the new tokens t' its
// row's mask shows it. Their scores go to a scratch row, then one softmax (max, exp, sum in
// 16 fixed lanes) and one weighted sum of the values (a fused multiply-add chain over the keys
// in order). A score is one fused multiply-add chain
// over the head dim, by the same code whether its key is a committed slot or a new token (laid
// out as the cache holds keys): the result for a query depends only on the keys it sees, so a
// token's attention in a verify has the bits of the same token's attention in a decode step,
// where the tokens before it are committed slots.
//
// A prefill's attention within its rows (no cache: each row's tokens attend causally to each
// other, RowAttention) runs by the same chains: a block of a row's tokens lays out the keys and
// values it can see as the cache holds them and scores them as the cache's slots, so the
// [B, K, G, T, T] scores of the einsum are never stored, and (without a window) a prompt
// token's attention has the bits of a decode step's attention for it over the same keys and
// values.
//
// Built by dspark_jax/models/cpu_kernels.py with the host's C++ compiler (-O3 -mavx512f).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_lanes.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kSlotVectors = 4;  // 16-slot vectors of scores per pass over the head dim
constexpr int kMaxHeadVectors = 16;  // head dims up to 256

struct Shapes {
  int64_t B, T, H, K, D, N;
};

constexpr int kMaxQueries = 12;  // queries scored together in one pass over the keys

// scores[q][s] = scale * queries[q] . keys[:, s] for QB queries and s in [0, len): keys [D, N]
// (a kv head's transposed cache), each lane one fused multiply-add chain over d = 0 .. D-1.
// SV 16-slot vectors of keys per step of d: QB x SV accumulators within 24 registers.
template <int QB, int SV>
void CacheScores(const float* const* queries, const float* keys, int64_t D, int64_t N,
                 int64_t len, float scale, float* const* scores) {
  for (int64_t s0 = 0; s0 < len; s0 += 16 * SV) {
    __mmask16 mask[SV];
    __m512 acc[QB][SV];
#pragma GCC unroll 4
    for (int j = 0; j < SV; ++j) {
      mask[j] = dspark::Mask(std::max<int64_t>(0, len - s0 - 16 * j));
#pragma GCC unroll 12
      for (int q = 0; q < QB; ++q) acc[q][j] = _mm512_setzero_ps();
    }
    for (int64_t d = 0; d < D; ++d) {
      const float* row = keys + d * N + s0;
      __m512 k[SV];
#pragma GCC unroll 4
      for (int j = 0; j < SV; ++j) k[j] = _mm512_maskz_loadu_ps(mask[j], row + 16 * j);
#pragma GCC unroll 12
      for (int q = 0; q < QB; ++q) {
        const __m512 qd = _mm512_set1_ps(queries[q][d]);
#pragma GCC unroll 4
        for (int j = 0; j < SV; ++j) acc[q][j] = _mm512_fmadd_ps(qd, k[j], acc[q][j]);
      }
    }
#pragma GCC unroll 12
    for (int q = 0; q < QB; ++q) {
#pragma GCC unroll 4
      for (int j = 0; j < SV; ++j) {
        _mm512_mask_storeu_ps(scores[q] + s0 + 16 * j, mask[j],
                              _mm512_mul_ps(acc[q][j], _mm512_set1_ps(scale)));
      }
    }
  }
}

// Softmax weights in place over scores[0 .. n) (n > 0); returns their sum.
float Softmax(float* s, int64_t n) {
  __m512 peak = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    peak = _mm512_max_ps(peak, _mm512_mask_loadu_ps(peak, dspark::Mask(n - i), s + i));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = dspark::Mask(n - i);
    const __m512 w = _mm512_maskz_mov_ps(
        mask, dspark::Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + i), m)));
    _mm512_mask_storeu_ps(s + i, mask, w);
    sum = _mm512_add_ps(sum, w);
  }
  return _mm512_reduce_add_ps(sum);
}

// out[q][0 .. 16 DV) = sum_i weight_i value_i / denom[q] for QB queries over the keys in order:
// the cache's first `len` slots (weights[q][i], values [N, D], slot-major: read once for all QB
// queries), then the new tokens u = 0 .. T-1 a query sees (new_weights[q][u], masked off where
// new_visible[q][u] is 0), each value one fused multiply-add chain over its keys.
template <int QB, int DV>
void Weighted(const float* const* weights, int64_t len, const float* cache_values,
              int64_t T, const float* const* new_values, const float* const* new_weights,
              const uint8_t* const* new_visible, const float* denom, float* const* out) {
  __m512 acc[QB][DV];
#pragma GCC unroll 6
  for (int q = 0; q < QB; ++q) {
#pragma GCC unroll 16
    for (int j = 0; j < DV; ++j) acc[q][j] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < len; ++i) {
    const float* v = cache_values + i * 16 * DV;
    __m512 w[QB];
#pragma GCC unroll 6
    for (int q = 0; q < QB; ++q) w[q] = _mm512_set1_ps(weights[q][i]);
#pragma GCC unroll 16
    for (int j = 0; j < DV; ++j) {
      const __m512 value = _mm512_loadu_ps(v + 16 * j);
#pragma GCC unroll 6
      for (int q = 0; q < QB; ++q) acc[q][j] = _mm512_fmadd_ps(w[q], value, acc[q][j]);
    }
  }
  for (int64_t u = 0; u < T; ++u) {
    __m512 w[QB];
    __mmask16 seen[QB];
#pragma GCC unroll 6
    for (int q = 0; q < QB; ++q) {
      w[q] = _mm512_set1_ps(new_weights[q][u]);
      seen[q] = new_visible[q][u] ? __mmask16(0xFFFF) : __mmask16(0);
    }
#pragma GCC unroll 16
    for (int j = 0; j < DV; ++j) {
      const __m512 value = _mm512_loadu_ps(new_values[u] + 16 * j);
#pragma GCC unroll 6
      for (int q = 0; q < QB; ++q) {
        acc[q][j] = _mm512_mask3_fmadd_ps(w[q], value, acc[q][j], seen[q]);
      }
    }
  }
#pragma GCC unroll 6
  for (int q = 0; q < QB; ++q) {
    const __m512 div = _mm512_set1_ps(denom[q]);
#pragma GCC unroll 16
    for (int j = 0; j < DV; ++j) _mm512_storeu_ps(out[q] + 16 * j, _mm512_div_ps(acc[q][j], div));
  }
}

using ScoresFn = void (*)(const float* const*, const float*, int64_t, int64_t, int64_t, float,
                          float* const*);
using WeightedFn = void (*)(const float* const*, int64_t, const float*, int64_t,
                            const float* const*, const float* const*, const uint8_t* const*,
                            const float*, float* const*);

// Up to 6 queries: 4 slot vectors per step (24 accumulators); 7 to 12: 2.
constexpr ScoresFn kScores[kMaxQueries] = {
    CacheScores<1, 4>, CacheScores<2, 4>, CacheScores<3, 4>,  CacheScores<4, 4>,
    CacheScores<5, 4>, CacheScores<6, 4>, CacheScores<7, 2>,  CacheScores<8, 2>,
    CacheScores<9, 2>, CacheScores<10, 2>, CacheScores<11, 2>, CacheScores<12, 2>};

constexpr int kMaxValueQueries = 6;  // queries of one values' pass

template <int QB>
constexpr WeightedFn kWeightedOf[kMaxHeadVectors] = {
    Weighted<QB, 1>,  Weighted<QB, 2>,  Weighted<QB, 3>,  Weighted<QB, 4>,
    Weighted<QB, 5>,  Weighted<QB, 6>,  Weighted<QB, 7>,  Weighted<QB, 8>,
    Weighted<QB, 9>,  Weighted<QB, 10>, Weighted<QB, 11>, Weighted<QB, 12>,
    Weighted<QB, 13>, Weighted<QB, 14>, Weighted<QB, 15>, Weighted<QB, 16>};

constexpr const WeightedFn* kWeighted[kMaxValueQueries] = {
    kWeightedOf<1>, kWeightedOf<2>, kWeightedOf<3>, kWeightedOf<4>, kWeightedOf<5>,
    kWeightedOf<6>};

// Queries of the values' pass held at once: their accumulators (16 DV floats each) within
// 24 of the 32 vector registers.
int ValueQueries(int64_t D) {
  return static_cast<int>(std::clamp<int64_t>(24 / (D / 16), 1, kMaxValueQueries));
}

// Per thread: the scores of an item's queries over their keys, and the new keys and values.
struct Scratch {
  std::vector<float> scores;
  std::vector<float> new_keys;  // the kv head's new keys (a prefill block's visible ones), [D, T]
                                // as the cache holds keys
  std::vector<float> values;    // a prefill block's values, [n, D] as the cache holds them
  std::vector<float> new_scores;
  std::vector<float> new_weights;
  std::vector<uint8_t> new_visible;
  std::vector<const float*> new_values;
  std::vector<const float*> queries;
  std::vector<float*> score_rows, new_score_rows, new_weight_rows, out_rows;
  std::vector<const uint8_t*> visible_rows;
  std::vector<float> denom;
};

// The queries of row b's new tokens [t0, t1) in every query head of kv head kv, in passes
// over its keys and values that serve up to kMaxQueries (values: ValueQueries) at once.
void Item(const Shapes& sh, int64_t b, int64_t kv, int64_t t0, int64_t t1, const float* q,
          const float* keys, const float* values, const int32_t* lengths, const float* k_new,
          const float* v_new, const bool* visible, float scale, float* out, Scratch& scratch) {
  const int64_t D = sh.D, T = sh.T, K = sh.K, H = sh.H, groups = H / K;
  const int64_t len = std::clamp<int64_t>(lengths[b], 0, sh.N);
  const int64_t width = len + T;  // a query's keys at most
  const int64_t nq = (t1 - t0) * groups;
  scratch.scores.resize(nq * width);
  scratch.new_keys.resize(D * T);
  scratch.new_scores.resize(nq * T);
  scratch.new_weights.resize(nq * T);
  scratch.new_visible.resize(nq * T);
  scratch.new_values.resize(T);
  scratch.queries.resize(nq);
  scratch.score_rows.resize(nq);
  scratch.new_score_rows.resize(nq);
  scratch.new_weight_rows.resize(nq);
  scratch.out_rows.resize(nq);
  scratch.visible_rows.resize(nq);
  scratch.denom.resize(nq);
  for (int64_t i = 0; i < nq; ++i) {  // query i: token t0 + i / groups, head i % groups
    const int64_t t = t0 + i / groups, h = kv * groups + i % groups;
    scratch.queries[i] = q + ((b * T + t) * H + h) * D;
    scratch.score_rows[i] = scratch.scores.data() + i * width;
    scratch.new_score_rows[i] = scratch.new_scores.data() + i * T;
    scratch.new_weight_rows[i] = scratch.new_weights.data() + i * T;
    scratch.visible_rows[i] = scratch.new_visible.data() + i * T;
    scratch.out_rows[i] = out + ((b * T + t) * H + h) * D;
  }
  const float* cache_keys = keys + (b * K + kv) * D * sh.N;
  for (int64_t i = 0; i < nq; i += kMaxQueries) {
    const int qb = static_cast<int>(std::min<int64_t>(kMaxQueries, nq - i));
    kScores[qb - 1](scratch.queries.data() + i, cache_keys, D, sh.N, len, scale,
                    scratch.score_rows.data() + i);
  }
  // The new tokens' keys laid out as the cache's, scored by the same chains: a key's score has
  // the same bits whether it is a new token's or, in a later step, a committed slot's.
  float* laid = scratch.new_keys.data();
  for (int64_t u = 0; u < T; ++u) {
    const float* key = k_new + ((b * T + u) * K + kv) * D;
    for (int64_t d = 0; d < D; ++d) laid[d * T + u] = key[d];
    scratch.new_values[u] = v_new + ((b * T + u) * K + kv) * D;
  }
  for (int64_t i = 0; i < nq; i += kMaxQueries) {
    const int qb = static_cast<int>(std::min<int64_t>(kMaxQueries, nq - i));
    kScores[qb - 1](scratch.queries.data() + i, laid, D, T, T, scale,
                    scratch.new_score_rows.data() + i);
  }
  // Each query's keys in order (its cache slots, then the new tokens it sees) and their
  // softmax; the new tokens' weights go back to their token's place for the values' pass.
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t t = t0 + i / groups;
    float* row = scratch.score_rows[i];
    uint8_t* seen = scratch.new_visible.data() + i * T;
    int64_t n = len;
    for (int64_t u = 0; u < T; ++u) {
      seen[u] = visible[(b * T + t) * T + u];
      if (seen[u]) row[n++] = scratch.new_score_rows[i][u];
    }
    scratch.denom[i] = n > 0 ? Softmax(row, n) : 1.0f;  // nothing seen: zeros, as the einsum
    float* new_weight = scratch.new_weight_rows[i];
    for (int64_t u = 0, m = len; u < T; ++u) new_weight[u] = seen[u] ? row[m++] : 0.0f;
  }
  const float* cache_values = values + (b * K + kv) * sh.N * D;
  const int step = ValueQueries(D);
  for (int64_t i = 0; i < nq; i += step) {
    const int m = static_cast<int>(std::min<int64_t>(step, nq - i));
    kWeighted[m - 1][D / 16 - 1](scratch.score_rows.data() + i, len, cache_values, T,
                                 scratch.new_values.data(), scratch.new_weight_rows.data() + i,
                                 scratch.visible_rows.data() + i, scratch.denom.data() + i,
                                 scratch.out_rows.data() + i);
  }
}

ffi::Error CachedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lengths,
                           ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                           ffi::Buffer<ffi::PRED> new_visible, float scale,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k_cache.dimensions(), vd = v_cache.dimensions();
  const auto nd = k_new.dimensions(), md = new_visible.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5 || nd.size() != 4 || md.size() != 3) {
    return ffi::Error::InvalidArgument(
        "cached_attention: q [B, T, H, D], k_cache [L, B, K, D, N], v_cache [L, B, K, N, D], "
        "k_new [B, T, K, D] and new_visible [B, T, T] expected");
  }
  const Shapes sh{qd[0], qd[1], qd[2], kd[2], qd[3], kd[4]};
  const int64_t L = kd[0];
  if (kd[1] != sh.B || kd[3] != sh.D || vd[0] != L || vd[1] != sh.B || vd[2] != sh.K ||
      vd[3] != sh.N || vd[4] != sh.D || nd[0] != sh.B || nd[1] != sh.T || nd[2] != sh.K ||
      nd[3] != sh.D || md[0] != sh.B || md[1] != sh.T || md[2] != sh.T ||
      lengths.element_count() != sh.B || sh.K == 0 || sh.H == 0 || sh.H % sh.K != 0) {
    return ffi::Error::InvalidArgument("cached_attention: inconsistent shapes");
  }
  if (sh.D == 0 || sh.D % 16 != 0 || sh.D > 16 * kMaxHeadVectors) {
    return ffi::Error::InvalidArgument("cached_attention: a head dim that is a multiple of 16 "
                                       "up to 256 expected");
  }
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= L) {
    return ffi::Error::InvalidArgument("cached_attention: layer index out of range");
  }
  const float* keys = k_cache.typed_data() + index * sh.B * sh.K * sh.D * sh.N;
  const float* values = v_cache.typed_data() + index * sh.B * sh.K * sh.N * sh.D;
  const float* qp = q.typed_data();
  const int32_t* lp = lengths.typed_data();
  const float* kn = k_new.typed_data();
  const float* vn = v_new.typed_data();
  const bool* vis = new_visible.typed_data();
  float* op = out->typed_data();
  // One item: row b, kv head kv, a block of its new tokens (all its query heads), sized so that
  // a verify's queries share passes over the keys (up to kMaxQueries at once) while a step of
  // one row still spreads over the threads.
  const int64_t groups = sh.H / sh.K;
  const int64_t tokens = std::clamp<int64_t>(kMaxQueries / groups, 1, std::max<int64_t>(sh.T, 1));
  const int64_t blocks = (sh.T + tokens - 1) / tokens;
  dspark::ParallelFor(pool, sh.B * sh.K * blocks, 0, [=](int64_t i) {
    thread_local Scratch scratch;
    const int64_t block = i % blocks, kv = (i / blocks) % sh.K, b = i / (blocks * sh.K);
    const int64_t t0 = block * tokens, t1 = std::min(sh.T, t0 + tokens);
    Item(sh, b, kv, t0, t1, qp, keys, values, lp, kn, vn, vis, scale, op, scratch);
  });
  return ffi::Error::Success();
}

// The queries of row b's tokens [t0, t1) in every query head of kv head kv over the row's own
// tokens (a prefill: no cache): token t sees the tokens u <= t (and u > t - window where
// window > 0) among the row's first len. The keys the block's queries can see, [base, t1), are
// laid out once as the cache holds them ([D, n] keys, [n, D] values) and read by the cache
// kernel's chains; a key that a query does not see gets weight 0, which adds +0 to each value's
// chain. Without a window (full-attention layers, whose decode steps Item attends) a query's
// attention has the bits that Item gives the same token with the tokens before it committed.
void RowItem(const Shapes& sh, int64_t b, int64_t kv, int64_t t0, int64_t t1, int64_t window,
             const float* q, const float* k, const float* v, const int32_t* lengths,
             float scale, float* out, Scratch& scratch) {
  const int64_t D = sh.D, T = sh.T, K = sh.K, H = sh.H, groups = H / K;
  const int64_t len = std::clamp<int64_t>(lengths[b], 0, T);
  for (int64_t t = std::max(t0, len); t < t1; ++t) {  // padding queries: zeros
    for (int64_t g = 0; g < groups; ++g) {
      std::fill_n(out + ((b * T + t) * H + kv * groups + g) * D, D, 0.0f);
    }
  }
  t1 = std::min(t1, len);
  if (t0 >= t1) return;
  const auto first_seen = [window](int64_t t) {  // the first token that token t sees
    return window > 0 ? std::max<int64_t>(0, t - window + 1) : 0;
  };
  const int64_t base = first_seen(t0), n = t1 - base;
  scratch.new_keys.resize(D * n);
  scratch.values.resize(n * D);
  float* laid = scratch.new_keys.data();
  float* values = scratch.values.data();
  for (int64_t u = 0; u < n; ++u) {
    const float* key = k + ((b * T + base + u) * K + kv) * D;
    for (int64_t d = 0; d < D; ++d) laid[d * n + u] = key[d];
    std::copy_n(v + ((b * T + base + u) * K + kv) * D, D, values + u * D);
  }
  const int64_t pass_tokens = std::max<int64_t>(1, kMaxQueries / groups);
  const int64_t most = pass_tokens * groups;  // queries of one pass at most
  scratch.new_scores.resize(most * n);
  scratch.queries.resize(most);
  scratch.score_rows.resize(most);
  scratch.out_rows.resize(most);
  scratch.denom.resize(most);
  for (int64_t s0 = t0; s0 < t1; s0 += pass_tokens) {
    const int64_t s1 = std::min(t1, s0 + pass_tokens), nq = (s1 - s0) * groups;
    for (int64_t i = 0; i < nq; ++i) {  // query i: token s0 + i / groups, head i % groups
      const int64_t t = s0 + i / groups, h = kv * groups + i % groups;
      scratch.queries[i] = q + ((b * T + t) * H + h) * D;
      scratch.score_rows[i] = scratch.new_scores.data() + i * n;
      scratch.out_rows[i] = out + ((b * T + t) * H + h) * D;
    }
    for (int64_t i = 0; i < nq; i += kMaxQueries) {
      const int qb = static_cast<int>(std::min<int64_t>(kMaxQueries, nq - i));
      kScores[qb - 1](scratch.queries.data() + i, laid, D, n, s1 - base, scale,
                      scratch.score_rows.data() + i);
    }
    for (int64_t i = 0; i < nq; ++i) {  // query i's softmax over the keys [lo, t] it sees
      const int64_t t = s0 + i / groups, lo = first_seen(t) - base, end = t + 1 - base;
      float* row = scratch.score_rows[i];
      scratch.denom[i] = Softmax(row + lo, end - lo);
      std::fill(row, row + lo, 0.0f);
      std::fill(row + end, row + s1 - base, 0.0f);
    }
    const int step = ValueQueries(D);
    for (int64_t i = 0; i < nq; i += step) {
      const int m = static_cast<int>(std::min<int64_t>(step, nq - i));
      kWeighted[m - 1][D / 16 - 1](scratch.score_rows.data() + i, s1 - base, values, 0,
                                   nullptr, nullptr, nullptr, scratch.denom.data() + i,
                                   scratch.out_rows.data() + i);
    }
  }
}

constexpr int64_t kRowTokens = 64;  // tokens of one row attention item

ffi::Error RowAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lengths, float scale,
                        int64_t window, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return ffi::Error::InvalidArgument(
        "row_attention: q [B, T, H, D], k and v [B, T, K, D] expected");
  }
  const Shapes sh{qd[0], qd[1], qd[2], kd[2], qd[3], 0};
  if (kd[0] != sh.B || kd[1] != sh.T || kd[3] != sh.D || vd[0] != sh.B || vd[1] != sh.T ||
      vd[2] != sh.K || vd[3] != sh.D || lengths.element_count() != sh.B || sh.K == 0 ||
      sh.H == 0 || sh.H % sh.K != 0) {
    return ffi::Error::InvalidArgument("row_attention: inconsistent shapes");
  }
  if (sh.D == 0 || sh.D % 16 != 0 || sh.D > 16 * kMaxHeadVectors) {
    return ffi::Error::InvalidArgument("row_attention: a head dim that is a multiple of 16 up "
                                       "to 256 expected");
  }
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const int32_t* lp = lengths.typed_data();
  float* op = out->typed_data();
  // One item: row b, kv head kv, a block of kRowTokens tokens; the last blocks (the most keys)
  // first, so that the threads finish together.
  const int64_t blocks = (sh.T + kRowTokens - 1) / kRowTokens;
  dspark::ParallelFor(pool, sh.B * sh.K * blocks, 0, [=](int64_t i) {
    thread_local Scratch scratch;
    const int64_t block = blocks - 1 - i / (sh.B * sh.K), kv = i % sh.K, b = (i / sh.K) % sh.B;
    const int64_t t0 = block * kRowTokens, t1 = std::min(sh.T, t0 + kRowTokens);
    RowItem(sh, b, kv, t0, t1, window, qp, kp, vp, lp, scale, op, scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkRowAttention, RowAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkCachedAttention, CachedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // lengths
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_new
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_new
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // new_visible
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
