// What the AVX2 kernels share: loads of fp32 or bf16 as fp32, the sum of each of 8 registers' lanes in one
// pass, and e^x.
#pragma once
#include <immintrin.h>

#include <initializer_list>
#include <type_traits>

namespace redline {

// 8 values at p (fp32, or bf16: a float's high half) as fp32
template <typename T>
__attribute__((always_inline)) inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
}

// Lane i of the result is the sum of v[i]'s 8 lanes, always added in the same tree, whatever the other
// registers hold (so a sum does not depend on its neighbours). Writing L and H for a register's lanes 0-3
// and 4-7 summed as (0 + 1) + (2 + 3) and (4 + 5) + (6 + 7):
//   hadd(hadd(v0, v1), hadd(v2, v3)) = [v0 L, v1 L, v2 L, v3 L | v0 H, v1 H, v2 H, v3 H], and so for v4..v7;
//   their low halves side by side plus their high halves side by side: lane i is v[i] L + v[i] H.
__attribute__((always_inline)) inline __m256 sums8(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// e^x in each lane for x <= 0 (0 below -87 and at -inf, NaN kept), within 3 ulp: x = n ln2 + r with |r| <=
// ln2 / 2, e^r by its Taylor series to r^6 (the next term is at most 2^-23 there), times 2^n, built in a
// float's exponent bits (n >= -126 above -87: a normal float). Example: x = -1 gives n = -1, r = ln2 - 1 =
// -0.3069, e^r = 0.7358, / 2 = 0.3679 = e^-1. As csrc/avx512_bf16.h's above -87; below, 0 where that one
// gives e^x down to its subnormals (under e^-87 = 1.6e-38 of the top key's 1: no attention output shows it).
__attribute__((always_inline)) inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.0f);
  const __m256 below = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);  // -inf too; not a NaN
  x = _mm256_max_ps(lowest, x);                                // a NaN x stays (max's 2nd operand)
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: n ln2 exact
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i exponent = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  const __m256i two_to_n = _mm256_slli_epi32(exponent, 23);
  return _mm256_andnot_ps(below, _mm256_mul_ps(p, _mm256_castsi256_ps(two_to_n)));
}

}  // namespace redline
