// Eight float32 lanes of the functions the kernels apply element by element (AVX2 + FMA, what the kernels are
// compiled for on x86-64): the exponential of a non-positive argument, SiLU and tanh built on it, and the lane sums of
// 8 vectors at once.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TSERVE_VECTOR_MATH 1

namespace tserve_vector {

// exp(x) for x <= 0 (a softmax's x - max, or -|x|): Cephes' single-precision polynomial (relative error about
// 1e-7); below -87 the result is exp(-87), 1.6e-38; NaN stays NaN.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(two_n));
}

// x * sigmoid(x), from e = exp(-|x|) (never overflows): sigmoid is 1 / (1 + e) for x >= 0, e / (1 + e) below.
inline __m256 silu(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp_nonpositive(_mm256_or_ps(x, _mm256_set1_ps(-0.0f)));
  return _mm256_div_ps(_mm256_mul_ps(x, _mm256_blendv_ps(one, e, x)), _mm256_add_ps(one, e));
}

// tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2 |y|).
inline __m256 tanh(__m256 y) {
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  const __m256 e = exp_nonpositive(_mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(sign, y)));
  const __m256 magnitude = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_or_ps(magnitude, _mm256_and_ps(y, sign));
}

// The sums of 8 vectors' lanes, as one vector (lane i: the sum of a[i]).
inline __m256 lane_sums(const __m256* a) {
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

}  // namespace tserve_vector

#endif
