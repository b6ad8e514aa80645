// 16-float-lane helpers on AVX-512 for the CPU kernels (the attention's softmax, the training
// loss's): one definition each, so every kernel masks and rounds an exp alike.

#ifndef DSPARK_JAX_CPU_LANES_H_
#define DSPARK_JAX_CPU_LANES_H_

#include <immintrin.h>

#include <cstdint>

namespace dspark {

// The first min(n, 16) lanes, n >= 0.
inline __mmask16 Mask(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// exp(x) for x <= 0 lane by lane (Cephes' expf polynomial, about 1 ulp): x = n ln 2 + r,
// exp(x) = 2^n exp(r) with |r| <= ln 2 / 2.
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

}  // namespace dspark

#endif  // DSPARK_JAX_CPU_LANES_H_
