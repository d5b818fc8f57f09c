// What the kernels share: bf16 loads, the sum of each of 16 registers' lanes in one pass, and e^x.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace redline {

constexpr int64_t CHUNK = 32;  // bf16 elements in a register: one vdpbf16ps multiplies 32 pairs

// Up to 32 bf16 from p, zeros past `left`. Example: left = 6 loads mask (1 << 6) - 1 = 0b111111.
__attribute__((always_inline)) inline __m512bh load_chunk(const uint16_t* p, int64_t left) {
  if (left >= CHUNK) return (__m512bh)_mm512_loadu_si512(p);
  return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << left) - 1), p);
}

// Lane i of the result is the sum of v[i]'s 16 lanes, always added in the same tree, whatever the other
// registers hold (so a sum does not depend on its neighbours). With 128-bit quarters Q0..Q3 of 4 lanes:
//   1. pairs (v[2i], v[2i+1]) -> one register: per quarter [a0+a2, b0+b2, a1+a3, b1+b3]
//   2. pairs of those -> per quarter Q: [A, B, C, D] = the quarter-Q sums of 4 registers
//   3, 4. quarters added across registers: (Q0 + Q1) + (Q2 + Q3), lane 4i + r ends as register 4i + r.
__attribute__((always_inline)) inline __m512 sums16(__m512 v[16]) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // shuffle_f32x4(a, b, 0x88) = quarters [a.Q0, a.Q2, b.Q0, b.Q2]; 0xDD = [a.Q1, a.Q3, b.Q1, b.Q3]
  for (int i = 0; i < 2; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

// e^x in each lane for x <= 0 (0 at -inf, NaN kept), within 3 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r
// by its Taylor series to r^6 (the next term is at most 2^-23 there), times 2^n. Example: x = -1 gives
// n = -1, r = ln2 - 1 = -0.3069, e^r = 0.7358, / 2 = 0.3679 = e^-1.
__attribute__((always_inline)) inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-150.0f), x);  // e^-150: 2^-216 rounds to 0; a NaN x stays (2nd operand)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts: n ln2 exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

}  // namespace redline
