// The full-vocabulary part of the DSpark loss for a chunk of slots, in float32, as an XLA FFI
// custom call on CPU: from the draft logits z [n, V] and the target logits t [n, V], each
// slot's cross-entropy against its label, the L1 distance between the two softmaxes and the
// gradient of c_ce CE + c_l1 L1 with respect to z (losses.vocab_loss: the logits' matmuls stay
// XLA's, this is everything between them).
//
// XLA:CPU runs that part as a dozen passes over [n, V] arrays, each a fresh buffer, and sums
// their rows with a scalar loop (about 30 ms per reduction of 448 x 49,152 floats on a 2-core
// Xeon: BENCHMARKS.md, issue 18). Here a thread takes a slot (a row: 192 KB of z and of t for
// SmolLM2, which stay in its L2) and passes over it four times with 16 lanes:
//   1. the maxima of z and t;
//   2. e = exp(z - max z) into the gradient's row, exp(t - max t) into a scratch row, and
//      their sums;
//   3. p = e / sum e, q = exp(t - max t) / its sum, L1 = sum |p - q|, and s = sign(p - q)
//      (kept in the scratch) with <p, s>;
//   4. g = c_ce (p - onehot(label)) + c_l1 p (s - <p, s>).
// CE = log(sum e) + max z - z[label]. Every sum is 16 lanes in a fixed order, then one
// reduction: the results do not depend on the thread count.
//
// Built by dspark_jax/models/cpu_kernels.py with the host's C++ compiler (-O3 -mavx512f).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_lanes.h"
#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One slot: z and t its rows of V logits; its CE and L1, and its gradient row g (V floats),
// with `scratch` V floats.
void Slot(const float* z, const float* t, int32_t label, float c_ce, float c_l1, int64_t V,
          float* g, float* scratch, float* ce, float* l1) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 zmax = lowest, tmax = lowest;
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = dspark::Mask(V - i);
    zmax = _mm512_max_ps(zmax, _mm512_mask_loadu_ps(lowest, m, z + i));
    tmax = _mm512_max_ps(tmax, _mm512_mask_loadu_ps(lowest, m, t + i));
  }
  const float zpeak = _mm512_reduce_max_ps(zmax), tpeak = _mm512_reduce_max_ps(tmax);
  const __m512 zm = _mm512_set1_ps(zpeak), tm = _mm512_set1_ps(tpeak);
  __m512 zsum = _mm512_setzero_ps(), tsum = _mm512_setzero_ps();
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = dspark::Mask(V - i);
    const __m512 ez =
        _mm512_maskz_mov_ps(m, dspark::Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, z + i), zm)));
    const __m512 et =
        _mm512_maskz_mov_ps(m, dspark::Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, t + i), tm)));
    _mm512_mask_storeu_ps(g + i, m, ez);
    _mm512_mask_storeu_ps(scratch + i, m, et);
    zsum = _mm512_add_ps(zsum, ez);
    tsum = _mm512_add_ps(tsum, et);
  }
  const float zs = _mm512_reduce_add_ps(zsum), ts = _mm512_reduce_add_ps(tsum);
  const __m512 zd = _mm512_set1_ps(zs), td = _mm512_set1_ps(ts);
  const __m512 one = _mm512_set1_ps(1.0f), minus_one = _mm512_set1_ps(-1.0f);
  __m512 dist = _mm512_setzero_ps(), along = _mm512_setzero_ps();
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = dspark::Mask(V - i);
    const __m512 p = _mm512_div_ps(_mm512_maskz_loadu_ps(m, g + i), zd);
    const __m512 q = _mm512_div_ps(_mm512_maskz_loadu_ps(m, scratch + i), td);
    const __m512 d = _mm512_sub_ps(p, q);
    // sign(d): +1, -1, or 0 where p == q (lanes past V are 0 - 0)
    const __m512 s = _mm512_mask_mov_ps(
        _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ), one),
        _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_LT_OQ), minus_one);
    dist = _mm512_add_ps(dist, _mm512_abs_ps(d));
    along = _mm512_fmadd_ps(p, s, along);
    _mm512_mask_storeu_ps(g + i, m, p);
    _mm512_mask_storeu_ps(scratch + i, m, s);
  }
  const float inner = _mm512_reduce_add_ps(along);
  const __m512 cc = _mm512_set1_ps(c_ce), cl = _mm512_set1_ps(c_l1), ps = _mm512_set1_ps(inner);
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = dspark::Mask(V - i);
    const __m512 p = _mm512_maskz_loadu_ps(m, g + i);
    const __m512 s = _mm512_maskz_loadu_ps(m, scratch + i);
    // c_ce p + c_l1 p (s - <p, s>); the label's -c_ce below
    const __m512 w = _mm512_fmadd_ps(cl, _mm512_sub_ps(s, ps), cc);
    _mm512_mask_storeu_ps(g + i, m, _mm512_mul_ps(p, w));
  }
  if (label >= 0 && label < V) g[label] -= c_ce;
  *l1 = _mm512_reduce_add_ps(dist);
  const float zl = label >= 0 && label < V ? z[label] : std::numeric_limits<float>::quiet_NaN();
  *ce = std::log(zs) + zpeak - zl;
}

ffi::Error VocabLoss(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> z, ffi::Buffer<ffi::F32> t,
                     ffi::Buffer<ffi::S32> labels, ffi::Buffer<ffi::F32> c_ce,
                     ffi::Buffer<ffi::F32> c_l1, ffi::ResultBuffer<ffi::F32> g,
                     ffi::ResultBuffer<ffi::F32> ce, ffi::ResultBuffer<ffi::F32> l1) {
  const auto zd = z.dimensions();
  const auto td = t.dimensions();
  if (zd.size() != 2 || td.size() != 2 || td[0] != zd[0] || td[1] != zd[1] ||
      labels.element_count() != zd[0] ||
      c_ce.element_count() != zd[0] || c_l1.element_count() != zd[0]) {
    return ffi::Error::InvalidArgument(
        "vocab_loss: z and t [n, V], labels, c_ce and c_l1 [n] expected");
  }
  const int64_t n = zd[0], V = zd[1];
  const float* zp = z.typed_data();
  const float* tp = t.typed_data();
  const int32_t* lp = labels.typed_data();
  const float* ccp = c_ce.typed_data();
  const float* clp = c_l1.typed_data();
  float* gp = g->typed_data();
  float* cep = ce->typed_data();
  float* l1p = l1->typed_data();
  dspark::ParallelFor(pool, n, 0, [=](int64_t r) {
    thread_local std::vector<float> scratch;
    scratch.resize(V);
    Slot(zp + r * V, tp + r * V, lp[r], ccp[r], clp[r], V, gp + r * V, scratch.data(), cep + r,
         l1p + r);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DsparkVocabLoss, VocabLoss,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // z: draft logits [n, V]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // t: target logits [n, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // labels [n]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // c_ce [n]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // c_l1 [n]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // g [n, V]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // ce [n]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // l1 [n]
