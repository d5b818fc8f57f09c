// y[M, N] = x[M, K] @ w^T for a weight quantized in groups along k (kernels/quantized_layout.py): int4
// codes q (0 .. 15) with an fp16 scale s and zero z per group of G weights of one row, w = q * s + z. bf16 x
// and y, fp32 sums. int8 weights go to int8_rows_vnni.cpp.
//
// The layout is packed_rows_bf16.cpp's, 32 rows a block and a pair of k per 32-bit lane, with codes in
// place of bf16 and each group's scales and zeros after its codes, so a thread reads one contiguous slab:
//   block b, group g: G / 2 pairs of codes, 32 bytes a pair (the low nibble of byte l row l / 2 and the
//   high nibble row 16 + l / 2, k = 2p + l % 2), then the 32 rows' scales and their zeros (fp16).
// Example, G = 32: a group is 16 * 32 + 128 = 640 bytes; byte 5 of pair 3 holds q[2, 7] in its low
// nibble and q[18, 7] in its high one. (int8: 64 bytes a pair, rows 0-15 then 16-31, byte l of each half
// row l / 2, k = 2p + l % 2.)
//
// Codes become bf16 in registers by their bits, bf16 0x3F80 | q << 3 = 1 + q / 16 (exact; one shift and
// one bit-select a register: q = 5 gives 0x3FA8 = 1.3125, the mantissa's top 4 bits 0101). Each row's sums
// run per group, sum_k x_k q_k, then times the scale, plus zero * sum_k x_k (the row's sums per group,
// computed first): 1 + q / 16 adds x's sum, taken back in the zero term (16 s dot + (z - 16 s) sum).
// A row's arithmetic does not depend on the other rows: a verify step's rows equal one-row products, bit
// for bit.
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "avx512_bf16.h"
#include "kernels.h"

namespace {

using redline::PACK_ROWS;
// 4 rows: 8 sums, 8 group sums, 2 weight registers and their scales fit AVX-512's 32 registers
constexpr int X_TILE = 4;
constexpr int64_t X_CHUNK = 64;  // x rows a thread takes through its blocks before the next ones

// The two registers (rows 0-15, rows 16-31) of one pair of k as bf16 1 + q / 16, from its codes at c
__attribute__((always_inline)) inline void pair_weights(const uint8_t* c, __m512bh out[2]) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)));
  const __m512i nibble = _mm512_set1_epi16(0x78), one = _mm512_set1_epi16(0x3F80);
  // ternary logic 0xEA: (a & b) | c, one instruction: the nibble at bits 3-6 of a bf16 1.0
  out[0] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi16(bytes, 3), nibble, one, 0xEA);
  out[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(bytes, 1), nibble, one, 0xEA);
}

// y[m, 0:32] for the XR x rows at x (rows K apart, their group sums at sums, groups apart) and the block at
// w; y points at y[m0, n0], rows N apart
template <int XR>
void tile(const uint16_t* x, const float* sums, const redline::Weight& w, const uint8_t* block,
          at::BFloat16* y) {
  const int64_t G = w.group, groups = w.K / G, pair_bytes = 32, codes = G / 2 * pair_bytes;
  __m512 acc[XR][2];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = block + g * (codes + 4 * PACK_ROWS);
    __m512 part[XR][2];
    for (auto& row : part)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t p = 0; p < G / 2; ++p) {
      __m512bh pair[2];
      pair_weights(c + p * pair_bytes, pair);
      for (int m = 0; m < XR; ++m) {
        int32_t x_pair;  // x[m, gG + 2p], x[m, gG + 2p + 1] as one 32-bit lane
        std::memcpy(&x_pair, x + m * w.K + g * G + 2 * p, sizeof x_pair);
        const __m512bh xs = (__m512bh)_mm512_set1_epi32(x_pair);
        for (int j = 0; j < 2; ++j) part[m][j] = _mm512_dpbf16_ps(part[m][j], xs, pair[j]);
      }
    }
    const __m256i* scales = reinterpret_cast<const __m256i*>(c + codes);  // 32 fp16 scales, then 32 zeros
    for (int j = 0; j < 2; ++j) {
      // the codes were 1 + q / 16
      const __m512 s = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(scales + j)), _mm512_set1_ps(16.0f));
      const __m512 z = _mm512_sub_ps(_mm512_cvtph_ps(_mm256_loadu_si256(scales + 2 + j)), s);
      for (int m = 0; m < XR; ++m) {
        acc[m][j] = _mm512_fmadd_ps(part[m][j], s, acc[m][j]);
        acc[m][j] = _mm512_fmadd_ps(z, _mm512_set1_ps(sums[m * groups + g]), acc[m][j]);
      }
    }
  }
  for (int m = 0; m < XR; ++m)
    for (int j = 0; j < 2; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * w.N + j * 16),
                          (__m256i)_mm512_cvtneps_pbh(acc[m][j]));  // to nearest even, as at::BFloat16
}

using Tile = void (*)(const uint16_t*, const float*, const redline::Weight&, const uint8_t*, at::BFloat16*);

// y[m, 0:32] for the M x rows at x and the block at w, in tiles of up to X_TILE rows
void block(const uint16_t* x, const float* sums, int64_t M, const redline::Weight& w, const uint8_t* b,
           at::BFloat16* y) {
  constexpr Tile TAIL[X_TILE] = {nullptr, tile<1>, tile<2>, tile<3>};
  const int64_t groups = w.K / w.group;
  int64_t m = 0;
  for (; m + X_TILE <= M; m += X_TILE) tile<X_TILE>(x + m * w.K, sums + m * groups, w, b, y + m * w.N);
  if (m < M) TAIL[M - m](x + m * w.K, sums + m * groups, w, b, y + m * w.N);
}

void int4_rows(const uint16_t* x, int64_t M, const redline::Weight& w, at::BFloat16* y) {
  const int64_t groups = w.K / w.group;
  std::vector<float> sums(M * groups);  // sums[m * groups + g] = sum of x[m, gG : gG + G], added in order
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0;
      for (int64_t k = g * w.group; k < (g + 1) * w.group; ++k) {
        const uint32_t high = uint32_t(x[m * w.K + k]) << 16;  // a bf16 is a float's high half
        float v;
        std::memcpy(&v, &high, sizeof v);
        s += v;
      }
      sums[m * groups + g] = s;
    }
  const auto* codes = static_cast<const uint8_t*>(w.data);
  const int64_t block_bytes = groups * (w.group / 2 * 32 + 4 * PACK_ROWS);
  at::parallel_for(0, w.N / PACK_ROWS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += X_CHUNK) {
      const int64_t chunk = std::min(X_CHUNK, M - m0);
      for (int64_t b = begin; b < end; ++b)
        block(x + m0 * w.K, sums.data() + m0 * groups, chunk, w, codes + b * block_bytes,
              y + m0 * w.N + b * PACK_ROWS);
    }
  });
}

}  // namespace

namespace redline {

void quantized_rows(const uint16_t* x, int64_t M, const Weight& w, at::BFloat16* y) {
  if (w.bits == 4)
    int4_rows(x, M, w, y);
  else
    int8_rows(x, M, w, y);
}

}  // namespace redline
