// y[M, N] = x[M, K] @ w^T for a weight packed in blocks of 32 rows (packed_layout.py), bf16 in and out,
// fp32 sums: any number of rows, from a decode step's one to a prompt's thousands.
//
// The layout [N / 32, K / 2, 32, 2] puts, for each pair of k, the 32 rows' two weights side by side: one
// 64-byte register holds w[n0 + i, 2p : 2p + 2] in lanes i = 0..15, the next lanes i = 16..31. Example,
// the block of rows 32..63, pair p = 5: its 128 bytes start at element (1 * K / 2 + 5) * 64 and hold
// w[32, 10], w[32, 11], w[33, 10], w[33, 11], ... w[63, 11]. vdpbf16ps multiplies a register with the pair
// x[m, 2p : 2p + 2] broadcast to every lane and adds both products to lane i's sum: each lane is one
// output, so there are no horizontal sums, and each w register serves every x row of a tile (8 x rows,
// 16 sums in registers: a draft tree's 8 rows take one pass over the weights, not two). A block is a
// contiguous slab that a thread reads front to back; a block is small enough (32 rows x K, 36 KB at
// K = 576) for the tiles after the first to read it from L2, and a prompt's
// rows go through a thread's blocks 64 at a time (X_CHUNK).
//
// Each output's sum adds the pairs p = 0, 1, ... in order in its own lane, whatever rows come with it: a
// verify step's B x (K + 1) rows equal one-row products, bit for bit.
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cstring>

#include "avx512_bf16.h"
#include "kernels.h"

namespace {

using redline::PACK_ROWS;
constexpr int REGISTERS = PACK_ROWS / 16;  // fp32 lanes of a block's 32 rows: 2 registers
constexpr int X_TILE = 8;
// x rows a thread takes through all its blocks before the next ones: a prompt's x (2,000 rows of K = 1,536:
// 6 MB) read anew for every block came from L3 (1.5x torch's GEMM); 64 rows (196 KB at K = 1,536) stay in L2
constexpr int64_t X_CHUNK = 64;

// y[m, 0:32] for the XR x rows at x (rows K apart) and the block at w; y points at y[m0, n0], rows N apart
template <int XR>
void tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t N, at::BFloat16* y) {
  __m512 acc[XR][REGISTERS];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    __m512bh pairs[REGISTERS];
    for (int j = 0; j < REGISTERS; ++j)
      pairs[j] = (__m512bh)_mm512_loadu_si512(w + (p * PACK_ROWS + j * 16) * 2);
    for (int m = 0; m < XR; ++m) {
      int32_t x_pair;  // x[m, 2p], x[m, 2p + 1] as one 32-bit lane
      std::memcpy(&x_pair, x + m * K + 2 * p, sizeof x_pair);
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(x_pair);
      for (int j = 0; j < REGISTERS; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xs, pairs[j]);
    }
  }
  for (int m = 0; m < XR; ++m)
    for (int j = 0; j < REGISTERS; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + j * 16),
                          (__m256i)_mm512_cvtneps_pbh(acc[m][j]));  // to nearest even, as at::BFloat16
}

using Tile = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, at::BFloat16*);
// the last 1 .. X_TILE - 1 x rows: TAIL[rows]
constexpr Tile TAIL[X_TILE] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>};

// y[m, 0:32] for the M x rows at x and the block at w, in tiles of up to X_TILE rows
void block(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, at::BFloat16* y) {
  int64_t m = 0;
  for (; m + X_TILE <= M; m += X_TILE) tile<X_TILE>(x + m * K, K, w, N, y + m * N);
  if (m < M) TAIL[M - m](x + m * K, K, w, N, y + m * N);
}

}  // namespace

namespace redline {

void packed_rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, at::BFloat16* y) {
  at::parallel_for(0, N / PACK_ROWS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += X_CHUNK) {  // a decode step's rows: one chunk
      const int64_t rows = std::min(X_CHUNK, M - m0);
      for (int64_t b = begin; b < end; ++b)
        block(x + m0 * K, rows, K, w + b * PACK_ROWS * K, N, y + m0 * N + b * PACK_ROWS);
    }
  });
}

}  // namespace redline
