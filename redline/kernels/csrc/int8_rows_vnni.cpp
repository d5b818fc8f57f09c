// y[M, N] = x[M, K] @ w^T for an int8 weight in groups along k (kernels/quantized_layout.py): codes q in
// 0 .. 255 with an fp16 scale s and zero z per group of G weights of one row, w = q * s + z; bf16 x and y.
//
// The products are integer: AVX-512 VNNI's vpdpwssd multiplies a register of 32 int16 weights (the codes
// zero-extended, one instruction) by a pair of int16 x broadcast, adding both products to each 32-bit
// lane, as vdpbf16ps does for bf16 pairs: a register of codes costs 1 instruction where converting it to
// bf16 cost 5 (through fp32). x is carried in int16 for this: each row's group of G is scaled by its own
// t = max |x| / 32767 and rounded, xq = round(x / t), and y is exactly x rounded so times the dequantized
// weight: y = sum_g (s t sum_k xq_k q_k + z t sum_k xq_k). Each x moves by at most t / 2, 2^-16 of its
// group's largest |x|: for that value 128 times less than bf16's own rounding (2^-9 of it), and for every
// value of the group at most as much as the largest value's bf16 rounding / 128.
//
// The layout is the int4 kernel's blocks of 32 rows and groups (quantized_rows_bf16.cpp) with a byte a
// code: per group, G / 2 pairs of k of 64 bytes (rows 0-15, then rows 16-31; byte l of a half is row l / 2,
// k = 2p + l % 2), then the 32 scales and zeros (fp16). A half zero-extended to int16 holds one row's pair
// in each 32-bit lane. Example, G = 32: bytes 3 * 64 + 32 + 10 and + 11 of group 1 are q[16 + 5, 32 + 6]
// and q[16 + 5, 32 + 7] (pair 3, second half, row 5), lane 5 of the pair's second register.
// Per group a lane sums sum_k xq_k q_k in int32 (exact: at most 256 * 255 * 32767 < 2^31). A row's
// arithmetic does not depend on the other rows: a verify step's rows equal one-row products, bit for bit.
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "avx512_bf16.h"
#include "kernels.h"

namespace {

using redline::PACK_ROWS;
constexpr int64_t MAX_GROUP = 256;  // int32 sums of a group stay exact (see above)
constexpr int X_TILE = 4;  // 4 rows: 8 int32 and 8 fp32 sums and 2 weight registers in AVX-512's 32
constexpr int64_t X_CHUNK = 64;  // x rows a thread takes through its blocks before the next ones

// x in int16 per group: codes [M, K], and per group of a row its scale t and t * sum_k xq_k [M, groups]
struct Int16Rows {
  std::unique_ptr<int16_t[]> codes;
  std::vector<float> scales, sums;
};

// 16 bf16 at p as fp32
__attribute__((always_inline)) inline __m512 bf16_to_fp32(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));  // a bf16 is a float's high half
}

// x [M, K] bf16 in int16, each row's groups of G (a multiple of 16) with their own scale; rows in parallel
Int16Rows int16_rows(const uint16_t* x, int64_t M, int64_t K, int64_t G) {
  const int64_t groups = K / G;
  Int16Rows r{std::unique_ptr<int16_t[]>(new int16_t[M * K]), std::vector<float>(M * groups),
              std::vector<float>(M * groups)};
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        const uint16_t* row = x + m * K + g * G;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t k = 0; k < G; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(bf16_to_fp32(row + k)));
        const float t = _mm512_reduce_max_ps(amax) / 32767.0f;
        int16_t* codes = r.codes.get() + m * K + g * G;
        __m512i sum = _mm512_setzero_si512();
        for (int64_t k = 0; k < G; k += 16) {  // x / t to nearest even; saturated (a subnormal t)
          const __m512 v = bf16_to_fp32(row + k);
          const __m512 q = t > 0 ? _mm512_div_ps(v, _mm512_set1_ps(t)) : _mm512_setzero_ps();
          const __m512i n = _mm512_cvt_roundps_epi32(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          const __m256i n16 = _mm512_cvtsepi32_epi16(n);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + k), n16);
          sum = _mm512_add_epi32(sum, _mm512_cvtepi16_epi32(n16));
        }
        r.scales[m * groups + g] = t;
        r.sums[m * groups + g] = t * static_cast<float>(_mm512_reduce_add_epi32(sum));
      }
  });
  return r;
}

// y[m, 0:32] for the XR x rows at x (int16, rows K apart; their scales t and sums t * sum xq at scales
// and sums, groups apart) and the block at w; y points at y[m0, n0], rows N apart
template <int XR>
void tile(const int16_t* x, const float* scales, const float* sums, const redline::Weight& w,
          const uint8_t* block, at::BFloat16* y) {
  const int64_t G = w.group, groups = w.K / G, codes = G * PACK_ROWS;
  __m512 acc[XR][2];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = block + g * (codes + 4 * PACK_ROWS);
    __m512i dot[XR][2];
    for (auto& row : dot)
      for (auto& d : row) d = _mm512_setzero_si512();
    for (int64_t p = 0; p < G / 2; ++p) {
      __m512i pair[2];  // rows 0-15 and 16-31, a row's q[n, 2p], q[n, 2p + 1] in each 32-bit lane
      for (int j = 0; j < 2; ++j) {
        const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + p * 64 + 32 * j));
        pair[j] = _mm512_cvtepu8_epi16(half);
      }
      for (int m = 0; m < XR; ++m) {
        int32_t x_pair;  // xq[m, gG + 2p], xq[m, gG + 2p + 1] as one 32-bit lane
        std::memcpy(&x_pair, x + m * w.K + g * G + 2 * p, sizeof x_pair);
        const __m512i xs = _mm512_set1_epi32(x_pair);
        for (int j = 0; j < 2; ++j) dot[m][j] = _mm512_dpwssd_epi32(dot[m][j], pair[j], xs);
      }
    }
    const __m256i* fp16 = reinterpret_cast<const __m256i*>(c + codes);  // 32 fp16 scales, then 32 zeros
    for (int j = 0; j < 2; ++j) {
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(fp16 + j));
      const __m512 z = _mm512_cvtph_ps(_mm256_loadu_si256(fp16 + 2 + j));
      for (int m = 0; m < XR; ++m) {
        const __m512 st = _mm512_mul_ps(s, _mm512_set1_ps(scales[m * groups + g]));
        acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][j]), st, acc[m][j]);
        acc[m][j] = _mm512_fmadd_ps(z, _mm512_set1_ps(sums[m * groups + g]), acc[m][j]);
      }
    }
  }
  for (int m = 0; m < XR; ++m)
    for (int j = 0; j < 2; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * w.N + j * 16),
                          (__m256i)_mm512_cvtneps_pbh(acc[m][j]));  // to nearest even, as at::BFloat16
}

using Tile = void (*)(const int16_t*, const float*, const float*, const redline::Weight&, const uint8_t*,
                      at::BFloat16*);

// y[m, 0:32] for x rows m0 .. m0 + M of r and the block at b, in tiles of up to X_TILE rows
void block(const Int16Rows& r, int64_t m0, int64_t M, const redline::Weight& w, const uint8_t* b,
           at::BFloat16* y) {
  constexpr Tile TILES[X_TILE + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>};
  const int64_t groups = w.K / w.group;
  for (int64_t m = m0; m < m0 + M; m += X_TILE) {
    const int64_t rows = std::min<int64_t>(X_TILE, m0 + M - m);
    TILES[rows](r.codes.get() + m * w.K, r.scales.data() + m * groups, r.sums.data() + m * groups, w, b,
                y + m * w.N);
  }
}

}  // namespace

namespace redline {

void int8_rows(const uint16_t* x, int64_t M, const Weight& w, at::BFloat16* y) {
  TORCH_CHECK(w.group % 16 == 0 && w.group <= MAX_GROUP, "int8 weights: groups of 16 .. ", MAX_GROUP,
              " (a multiple of 16), not ", w.group);
  const Int16Rows r = int16_rows(x, M, w.K, w.group);
  const auto* codes = static_cast<const uint8_t*>(w.data);
  const int64_t block_bytes = w.K / w.group * (w.group * PACK_ROWS + 4 * PACK_ROWS);
  at::parallel_for(0, w.N / PACK_ROWS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += X_CHUNK) {
      const int64_t chunk = std::min(X_CHUNK, M - m0);
      for (int64_t b = begin; b < end; ++b)
        block(r, m0, chunk, w, codes + b * block_bytes, y + b * PACK_ROWS);
    }
  });
}

}  // namespace redline
