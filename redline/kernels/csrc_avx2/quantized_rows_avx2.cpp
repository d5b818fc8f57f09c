// y[M, N] = x[M, K] @ w^T for an int4 or int8 weight in groups along k (kernels/quantized_layout.py), on
// CPUs with AVX2 (and FMA, F16C), for the models the AVX-512 BF16 kernels do not take (every model on an
// AVX2-only CPU; fp32 ones on AVX-512): codes q with an fp16 scale s and zero z per group of G weights of
// one row, w = q * s + z; x and y fp32 or bf16, the model's dtype.
//
// The products are integer, as int8_rows_vnni.cpp's: x is carried in int16 per group of a row (t = max |x| /
// 32767, xq = round(x / t), saturated), the codes are zero-extended to int16, and vpmaddwd multiplies 16
// int16 weights by a pair of xq broadcast, adding a row's two products into each of 8 int32 lanes; a group's
// lanes then give y += s t sum_k xq_k q_k + z t sum_k xq_k. So y is x rounded so times the dequantized
// weight, with each x moved by at most t / 2 (2^-16 of its group's largest), exact int32 sums (int8: at most
// 256 * 255 * 32767 < 2^31), fp32 from there.
//
// A pair p of k holds the block's 32 rows as four registers of 8 rows, r = 0 .. 3 for rows 8r .. 8r + 7:
//   int8, 64 bytes a pair: register r is bytes 16r .. 16r + 15 (byte l: row 8r + l / 2, k = 2p + l % 2);
//   int4, 32 bytes a pair (low nibble of byte l row l / 2, high nibble row 16 + l / 2): bytes 0 .. 15 are
//   rows 0-7 (low) and 16-23 (high), bytes 16 .. 31 rows 8-15 (low) and 24-31 (high).
// Example, int4, G = 32: byte 16 + 5 of pair 3 holds q[8 + 2, 7] low and q[24 + 2, 7] high: lane 2 of
// registers 1 and 3. A group's 32 fp16 scales, then its 32 zeros, follow its codes: 8 a register.
// A row's arithmetic does not depend on the other rows: a verify step's rows equal one-row products, bit
// for bit.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "../csrc/kernels.h"
#include "avx2.h"

namespace {

using redline::load8;
using redline::PACK_ROWS;
constexpr int64_t MAX_GROUP = 256;  // int32 sums of a group stay exact (see above)
// rows a tile multiplies: 8 int32 sums, 4 weight registers and x in AVX2's 16 registers (the 8 fp32 sums,
// touched once a group, may spill)
constexpr int X_TILE = 2;
constexpr int64_t X_CHUNK = 64;  // x rows a thread takes through its blocks before the next ones

// x in int16 per group: codes [M, K], and per group of a row its scale t and t * sum_k xq_k [M, groups]
struct Int16Rows {
  std::unique_ptr<int16_t[]> codes;
  std::vector<float> scales, sums;
};

// x [M, K] in int16, each row's groups of G (a multiple of 16) with their own scale; rows in parallel
template <typename T>
Int16Rows int16_rows(const T* x, int64_t M, int64_t K, int64_t G) {
  const int64_t groups = K / G;
  Int16Rows r{std::unique_ptr<int16_t[]>(new int16_t[M * K]), std::vector<float>(M * groups),
              std::vector<float>(M * groups)};
  const __m256 sign = _mm256_set1_ps(-0.0f);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        const T* row = x + m * K + g * G;
        __m256 amax = _mm256_setzero_ps();
        for (int64_t k = 0; k < G; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, load8(row + k)));
        float lanes[8];
        _mm256_storeu_ps(lanes, amax);
        const float t = *std::max_element(lanes, lanes + 8) / 32767.0f;
        int16_t* codes = r.codes.get() + m * K + g * G;
        int32_t sum = 0;
        for (int64_t k = 0; k < G; k += 16) {  // x / t to nearest even (the default rounding), saturated
          __m256i n[2];
          for (int h = 0; h < 2; ++h) {
            const __m256 v = load8(row + k + 8 * h);
            n[h] = _mm256_cvtps_epi32(t > 0 ? _mm256_div_ps(v, _mm256_set1_ps(t)) : _mm256_setzero_ps());
          }
          // packs interleaves 128-bit lanes ([n0 0-3, n1 0-3, n0 4-7, n1 4-7]): 0xD8 puts them back in order
          const __m256i n16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(n[0], n[1]), 0xD8);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + k), n16);
          for (int j = 0; j < 16; ++j) sum += codes[k + j];
        }
        r.scales[m * groups + g] = t;
        r.sums[m * groups + g] = t * static_cast<float>(sum);
      }
  });
  return r;
}

// The four registers of rows 8r .. 8r + 7 of pair p (module doc), codes zero-extended to int16
template <int BITS>
__attribute__((always_inline)) inline void pair_codes(const uint8_t* c, __m256i out[4]) {
  const auto* bytes16 = reinterpret_cast<const __m128i*>(c);  // 16 bytes a load
  if constexpr (BITS == 8) {
    for (int r = 0; r < 4; ++r) out[r] = _mm256_cvtepu8_epi16(_mm_loadu_si128(bytes16 + r));
  } else {
    const __m256i low = _mm256_set1_epi16(15);
    for (int h = 0; h < 2; ++h) {  // bytes 16h .. 16h + 15: rows 8h + l / 2 (low), 16 + 8h + l / 2 (high)
      const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(bytes16 + h));
      out[h] = _mm256_and_si256(bytes, low);
      out[2 + h] = _mm256_srli_epi16(bytes, 4);
    }
  }
}

// y[m, 0:32] for the XR x rows at x (int16, rows K apart; their scales t and sums t * sum xq at scales and
// sums, groups apart) and the block at w; y points at y[m0, n0], rows N apart
template <int BITS, int XR, typename T>
void tile(const int16_t* x, const float* scales, const float* sums, const redline::Weight& w,
          const uint8_t* block, T* y) {
  const int64_t G = w.group, groups = w.K / G, pair_bytes = 8 * BITS, codes = G / 2 * pair_bytes;
  __m256 acc[XR][4];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = block + g * (codes + 4 * PACK_ROWS);
    __m256i dot[XR][4];
    for (auto& row : dot)
      for (auto& d : row) d = _mm256_setzero_si256();
    for (int64_t p = 0; p < G / 2; ++p) {
      __m256i pair[4];
      pair_codes<BITS>(c + p * pair_bytes, pair);
      for (int m = 0; m < XR; ++m) {
        int32_t x_pair;  // xq[m, gG + 2p], xq[m, gG + 2p + 1] as one 32-bit lane
        std::memcpy(&x_pair, x + m * w.K + g * G + 2 * p, sizeof x_pair);
        const __m256i xs = _mm256_set1_epi32(x_pair);
        for (int r = 0; r < 4; ++r) dot[m][r] = _mm256_add_epi32(dot[m][r], _mm256_madd_epi16(pair[r], xs));
      }
    }
    const auto* fp16 = reinterpret_cast<const __m128i*>(c + codes);  // 32 fp16 scales, then 32 zeros
    for (int r = 0; r < 4; ++r) {
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(fp16 + r));
      const __m256 z = _mm256_cvtph_ps(_mm_loadu_si128(fp16 + 4 + r));
      for (int m = 0; m < XR; ++m) {
        const __m256 st = _mm256_mul_ps(s, _mm256_set1_ps(scales[m * groups + g]));
        acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][r]), st, acc[m][r]);
        acc[m][r] = _mm256_fmadd_ps(z, _mm256_set1_ps(sums[m * groups + g]), acc[m][r]);
      }
    }
  }
  for (int m = 0; m < XR; ++m)
    for (int r = 0; r < 4; ++r) {
      float out[8];
      _mm256_storeu_ps(out, acc[m][r]);
      for (int i = 0; i < 8; ++i) y[m * w.N + 8 * r + i] = T(out[i]);  // bf16: to nearest even
    }
}

// y[M, N] = x @ w^T: x in int16 first, then the blocks in parallel, each through X_CHUNK rows at a time
template <int BITS, typename T>
void rows(const T* x, int64_t M, const redline::Weight& w, T* y) {
  using Tile =
      void (*)(const int16_t*, const float*, const float*, const redline::Weight&, const uint8_t*, T*);
  constexpr Tile TILES[X_TILE + 1] = {nullptr, tile<BITS, 1, T>, tile<BITS, 2, T>};
  const Int16Rows r = int16_rows(x, M, w.K, w.group);
  const int64_t groups = w.K / w.group;
  const int64_t block_bytes = groups * (w.group * PACK_ROWS * BITS / 8 + 4 * PACK_ROWS);
  const auto* codes = static_cast<const uint8_t*>(w.data);
  at::parallel_for(0, w.N / PACK_ROWS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += X_CHUNK) {
      const int64_t chunk = std::min(X_CHUNK, M - m0);
      for (int64_t b = begin; b < end; ++b)
        for (int64_t m = m0; m < m0 + chunk; m += X_TILE) {
          const int64_t n = std::min<int64_t>(X_TILE, m0 + chunk - m);
          TILES[n](r.codes.get() + m * w.K, r.scales.data() + m * groups, r.sums.data() + m * groups, w,
                   codes + b * block_bytes, y + m * w.N + b * PACK_ROWS);
        }
    }
  });
}

template <typename T>
void dispatch(const T* x, int64_t M, const redline::Weight& w, T* y) {
  if (w.bits == 4)
    rows<4>(x, M, w, y);
  else
    rows<8>(x, M, w, y);
}

at::Tensor quantized_rows_avx2(const at::Tensor& x, const at::Tensor& weight) {
  const redline::Weight w = redline::weight_of(weight, "quantized_rows_avx2");
  TORCH_CHECK(w.bits != 16, "quantized_rows_avx2: the weight is not quantized (int4 uint8 or int8 blocks)");
  TORCH_CHECK(w.group % 16 == 0 && w.group <= MAX_GROUP, "quantized_rows_avx2: groups of 16 .. ", MAX_GROUP,
              " (a multiple of 16), not ", w.group);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K && x.is_contiguous() && x.is_cpu(),
              "quantized_rows_avx2: x is a contiguous CPU [M, ", w.K, "], not ", x.sizes());
  const auto type = x.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16, "quantized_rows_avx2: x is fp32 or bf16, not ",
              type);
  at::Tensor y = at::empty({x.size(0), w.N}, x.options());
  if (type == at::kFloat)
    dispatch(x.data_ptr<float>(), x.size(0), w, y.data_ptr<float>());
  else
    dispatch(x.data_ptr<at::BFloat16>(), x.size(0), w, y.data_ptr<at::BFloat16>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(redline_cpu_avx2, m) { m.def("quantized_rows(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(redline_cpu_avx2, CPU, m) { m.impl("quantized_rows", quantized_rows_avx2); }
