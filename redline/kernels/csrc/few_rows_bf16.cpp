// y[M, N] = x[M, K] @ w[N, K]^T for the few rows of a decode step, bf16 in and out, fp32 sums; the op
// few_rows_bf16 takes a packed weight (any number of rows) to packed_rows_bf16.cpp.
//
// It takes every row of a decode step (layers/linear.product) for a weight that is not packed. Decode
// reads every weight once per step, so the product is a stream over w: each thread takes a contiguous
// range of w's rows and reads them front to back. Each 32-element chunk of a w row is loaded once and
// multiplied with the same chunk of up to 4 x rows (X_TILE) by AVX-512 BF16's vdpbf16ps. Each (x row,
// w row) pair has one fp32 accumulator that adds the chunks in order; a tile of 4 w rows x up to 4 x rows
// (W_TILE x X_TILE) then sums its 16 accumulators' lanes by the same tree (sums16) whatever the tile
// holds. So a row's result does not depend on how many rows came with it: a verify step's B x (K + 1)
// rows equal one-row products, bit for bit.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "avx512_bf16.h"
#include "kernels.h"

namespace {

using redline::CHUNK;
constexpr int64_t W_TILE = 4, X_TILE = 4;

// acc[m] += x[m, k:k + 32] . w[k:k + 32] for one w row, zeros past `left` elements
template <int XR>
__attribute__((always_inline)) inline void add_chunk(const uint16_t* x, const uint16_t* w, int64_t K,
                                                     int64_t left, __m512* acc) {
  const __m512bh row = redline::load_chunk(w, left);
  for (int m = 0; m < XR; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], redline::load_chunk(x + m * K, left), row);
}

// out[m * W_TILE] = the fp32 lanes of x[m] . w for one w row, its chunks added in order. The XR
// accumulators are locals of constant index, so they stay in registers: an accumulator in memory (indexed
// by the w row) put a store and a load between each chunk's vdpbf16ps and the next. The hardware
// prefetcher follows the stream alone: software prefetches ahead made one core read slower (BENCHMARKS.md
// "One call a decoder layer").
template <int XR>
__attribute__((always_inline)) inline void row_sums(const uint16_t* x, const uint16_t* w, int64_t K,
                                                    __m512* out) {
  __m512 acc[XR];
  for (auto& a : acc) a = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + CHUNK <= K; k += CHUNK) add_chunk<XR>(x + k, w + k, K, CHUNK, acc);
  if (k < K) add_chunk<XR>(x + k, w + k, K, K - k, acc);
  for (int m = 0; m < XR; ++m) out[m * W_TILE] = acc[m];
}

// y[m, r] for the XR x rows at x and the WR w rows at w; y points at y[m0, n0], rows N apart. One w row
// after another, front to back, as memory streams them (the rows' sums are independent: the core overlaps
// them).
template <int XR, int WR>
void tile(const uint16_t* x, const uint16_t* w, int64_t K, int64_t N, at::BFloat16* y) {
  __m512 acc[16];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int r = 0; r < WR; ++r) row_sums<XR>(x, w + r * K, K, acc + r);
  alignas(64) float sums[16];
  _mm512_store_ps(sums, redline::sums16(acc));  // sums[m * W_TILE + r] = y[m, r]
  for (int m = 0; m < XR; ++m)
    for (int r = 0; r < WR; ++r) y[m * N + r] = at::BFloat16(sums[m * W_TILE + r]);
}

template <int WR>
void w_rows(const uint16_t* x, int64_t M, const uint16_t* w, int64_t K, int64_t N, at::BFloat16* y) {
  int64_t m = 0;
  for (; m + X_TILE <= M; m += X_TILE) tile<X_TILE, WR>(x + m * K, w, K, N, y + m * N);
  switch (M - m) {  // the last 1-3 x rows
    case 3: tile<3, WR>(x + m * K, w, K, N, y + m * N); break;
    case 2: tile<2, WR>(x + m * K, w, K, N, y + m * N); break;
    case 1: tile<1, WR>(x + m * K, w, K, N, y + m * N); break;
    default: break;
  }
}

}  // namespace

namespace redline {

void few_rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, at::BFloat16* y) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + W_TILE <= end; n += W_TILE) w_rows<W_TILE>(x, M, w + n * K, K, N, y + n);
    for (; n < end; ++n) w_rows<1>(x, M, w + n * K, K, N, y + n);  // the last 1-3 w rows
  });
}

}  // namespace redline

namespace {

// x [M, K]; w [N, K], packed or quantized (kernels.h weight_of) -> [M, N]
at::Tensor few_rows_bf16(const at::Tensor& x, const at::Tensor& w_in) {
  const redline::Weight w = redline::weight_of(w_in, "few_rows_bf16");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K, "few_rows_bf16: x [M, K] for a weight of K = ", w.K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_cpu() && x.is_contiguous(),
              "few_rows_bf16: x a contiguous bf16 CPU tensor");
  at::Tensor y = at::empty({x.size(0), w.N}, x.options());
  redline::product(redline::bits(x), x.size(0), w, y.data_ptr<at::BFloat16>());
  return y;
}

}  // namespace

TORCH_LIBRARY(redline_cpu, m) { m.def("few_rows_bf16(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(redline_cpu, CPU, m) { m.impl("few_rows_bf16", few_rows_bf16); }
