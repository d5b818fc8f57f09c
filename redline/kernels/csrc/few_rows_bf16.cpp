// y[M, N] = x[M, K] @ w[N, K]^T for the few rows of a decode step, bf16 in and out, fp32 sums.
//
// It takes every row of a decode step (layers/linear.product). Decode reads every weight once per step,
// so the product is a stream over w: each thread takes a contiguous range of w's rows and reads each row
// front to back (one sequential stream the hardware prefetcher follows), with an explicit prefetch of
// the row PREFETCH_ROWS ahead. AVX-512 BF16's vdpbf16ps multiplies 32 bf16 pairs and adds them into 16
// fp32 lanes; ACCUMULATORS independent sums per row keep the instruction's latency off the critical
// path. Each x row is reduced separately in the same order for every M, so a row's result does not
// depend on how many rows came with it (a verify step's B x (K + 1) rows equal one-row products, bit for
// bit).
//
// Worked example of the tail mask: K = 70 runs two full 32-element chunks (k = 0, 32), then k = 64
// has 6 elements left, mask (1 << 6) - 1 = 0b111111 loads them and zeros the other 26 lanes.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <torch/library.h>
#include <torch/types.h>

namespace {

constexpr int64_t ACCUMULATORS = 4;
constexpr int64_t PREFETCH_ROWS = 8;
constexpr int64_t CHUNK = 32;  // bf16 elements per vdpbf16ps

inline __m512bh load_chunk(const uint16_t* p, int64_t left) {
  if (left >= CHUNK) return (__m512bh)_mm512_loadu_si512(p);
  return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << left) - 1), p);
}

float row_dot(const uint16_t* x, const uint16_t* w, int64_t K) {
  __m512 sums[ACCUMULATORS];
  for (auto& s : sums) s = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + CHUNK * ACCUMULATORS <= K; k += CHUNK * ACCUMULATORS)
    for (int64_t i = 0; i < ACCUMULATORS; ++i) {
      const int64_t at = k + CHUNK * i;
      sums[i] = _mm512_dpbf16_ps(sums[i], load_chunk(x + at, CHUNK), load_chunk(w + at, CHUNK));
    }
  for (; k < K; k += CHUNK)
    sums[0] = _mm512_dpbf16_ps(sums[0], load_chunk(x + k, K - k), load_chunk(w + k, K - k));
  for (int64_t i = 1; i < ACCUMULATORS; ++i) sums[0] = _mm512_add_ps(sums[0], sums[i]);
  return _mm512_reduce_add_ps(sums[0]);
}

at::Tensor few_rows_bf16(const at::Tensor& x, const at::Tensor& w) {  // x [M, K], w [N, K] -> [M, N]
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "few_rows_bf16: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "few_rows_bf16: bf16 only");
  TORCH_CHECK(x.is_cpu() && w.is_cpu() && x.is_contiguous() && w.is_contiguous(),
              "few_rows_bf16: contiguous CPU tensors");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* ws = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* ys = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint16_t* row = ws + n * K;
      if (n + PREFETCH_ROWS < end) {
        const char* ahead = reinterpret_cast<const char*>(row + PREFETCH_ROWS * K);
        for (int64_t byte = 0; byte < K * 2; byte += 64) _mm_prefetch(ahead + byte, _MM_HINT_T0);
      }
      for (int64_t m = 0; m < M; ++m) ys[m * N + n] = at::BFloat16(row_dot(xs + m * K, row, K));
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(redline_cpu, m) { m.def("few_rows_bf16(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(redline_cpu, CPU, m) { m.impl("few_rows_bf16", few_rows_bf16); }
