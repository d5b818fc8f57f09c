// Attention of a decode step's few queries (K + 1, or a tree's rows) over the paged KV cache, on CPU, bf16
// queries and cache, fp32 scores, softmax and sums: what kernels/decode_attention.py computes on CUDA
// (decode_attention_reference is the definition), without gathering the cache or building masks.
//
// One task per (row b, query token t, query head h) over the keys it sees (paged_keys.h). Each task's
// arithmetic is the same whatever else is in the step, so a query's output does not depend on the number
// of rows or tokens (a verify step's K + 1 queries equal K + 1 one-token steps). A query with no key gets
// zeros, as the reference.
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "avx512_bf16.h"
#include "kernels.h"
#include "paged_keys.h"

namespace {

using redline::CHUNK;
constexpr int64_t LANES = 16;  // fp32 lanes of an AVX-512 register

// One query (C chunks of 32: head_dim = 32 C) over the n keys at `offsets`, into out[32 C]. Scores 16 keys
// at a time: vdpbf16ps multiplies the bf16 query and key exactly and adds in fp32, and sums16 adds each
// key's lanes; then e^(score - top) 16 at a time, and the values weighted by them, divided by their sum at
// the end. The same arithmetic for every query, whatever else is in the step.
template <int C>
void attend(const uint16_t* query_row, const uint16_t* k_cache, const uint16_t* v_cache,
            const std::vector<int64_t>& offsets, float scale, std::vector<float>& scores, at::BFloat16* out) {
  const int64_t n = offsets.size();
  if (n == 0) {
    std::fill(out, out + C * CHUNK, at::BFloat16(0.0f));
    return;
  }
  __m512bh query[C];
  for (int c = 0; c < C; ++c) query[c] = redline::load_chunk(query_row + c * CHUNK, CHUNK);
  scores.resize((n + LANES - 1) / LANES * LANES);
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t g = 0; g < n; g += LANES) {
    __m512 dots[LANES];
    for (int i = 0; i < LANES; ++i) {  // past the last key: the last again, its score masked below
      const uint16_t* key = k_cache + offsets[std::min<int64_t>(g + i, n - 1)];
      dots[i] = _mm512_setzero_ps();
      for (int c = 0; c < C; ++c)
        dots[i] = _mm512_dpbf16_ps(dots[i], query[c], (__m512bh)_mm512_loadu_si512(key + c * CHUNK));
    }
    const __mmask16 real = n - g >= LANES ? 0xFFFF : (__mmask16)((1u << (n - g)) - 1);
    const __m512 scored =
        _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), real, redline::sums16(dots), _mm512_set1_ps(scale));
    _mm512_storeu_ps(scores.data() + g, scored);
    top = _mm512_max_ps(top, scored);
  }
  const __m512 highest = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t g = 0; g < n; g += LANES) {  // lanes past n hold -inf: e^-inf = 0
    const __m512 e = redline::exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores.data() + g), highest));
    _mm512_storeu_ps(scores.data() + g, e);
    total = _mm512_add_ps(total, e);
  }
  // A value chunk of 32 bf16 becomes two fp32 registers by interleaving zeros below each bf16 (a bf16 is
  // a float's high half): in 128-bit quarter q, `low` holds elements 8q..8q+3, `high` 8q+4..8q+7.
  __m512 acc[2 * C];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* value = v_cache + offsets[j];
    const __m512 weight = _mm512_set1_ps(scores[j]);
    for (int c = 0; c < C; ++c) {
      const __m512i chunk = _mm512_loadu_si512(value + c * CHUNK);
      const __m512 low = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, chunk));
      const __m512 high = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, chunk));
      acc[2 * c] = _mm512_fmadd_ps(weight, low, acc[2 * c]);
      acc[2 * c + 1] = _mm512_fmadd_ps(weight, high, acc[2 * c + 1]);
    }
  }
  const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
  alignas(64) float low[LANES], high[LANES];
  for (int c = 0; c < C; ++c) {  // back to element order: lane 4q + e of low is element 32c + 8q + e
    _mm512_store_ps(low, _mm512_mul_ps(acc[2 * c], inverse));
    _mm512_store_ps(high, _mm512_mul_ps(acc[2 * c + 1], inverse));
    for (int q = 0; q < 4; ++q)
      for (int e = 0; e < 4; ++e) {
        out[c * CHUNK + 8 * q + e] = at::BFloat16(low[4 * q + e]);
        out[c * CHUNK + 8 * q + 4 + e] = at::BFloat16(high[4 * q + e]);
      }
  }
}

}  // namespace

namespace redline {

void decode_attention(const uint16_t* q, int64_t q_stride, int64_t B, int64_t T, int64_t Hq,
                      const int64_t* positions, const PagedCache& cache, int64_t kv_len, int64_t chunk,
                      at::BFloat16* out, const TreeRows* tree) {
  const int64_t D = cache.head_dim;
  const float scale = 1.0f / std::sqrt(float(D));
  using Attend = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const std::vector<int64_t>&,
                          float, std::vector<float>&, at::BFloat16*);
  constexpr Attend by_chunks[] = {attend<1>, attend<2>, attend<3>, attend<4>,
                                  attend<5>, attend<6>, attend<7>, attend<8>};
  const Attend run = by_chunks[D / CHUNK - 1];  // head_dim 64: 2 chunks, attend<2>
  const auto* k = static_cast<const uint16_t*>(cache.k);
  const auto* v = static_cast<const uint16_t*>(cache.v);
  for_each_query(B, T, Hq, positions, cache, kv_len, chunk, tree,
                 [&](int64_t task, int64_t query, const std::vector<int64_t>& offsets) {
                   thread_local std::vector<float> scores;
                   run(q + query * q_stride + task % Hq * D, k, v, offsets, scale, scores, out + task * D);
                 });
}

}  // namespace redline

namespace {

// q [B, T, Hq, D]; k_cache, v_cache [blocks, Hkv, BLOCK, D]; positions [B, T] int64; tables [B, n] int32
at::Tensor decode_attention_bf16(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& positions_in, const at::Tensor& tables, int64_t kv_len,
                                 int64_t chunk, const std::optional<at::Tensor>& tree_base,
                                 const std::optional<at::Tensor>& tree_bits) {
  TORCH_CHECK(q_in.dim() == 4 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "decode_attention_bf16: q [B, T, Hq, D], caches [blocks, Hkv, BLOCK, D]");
  TORCH_CHECK(q_in.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "decode_attention_bf16: bf16 only");
  TORCH_CHECK(positions_in.sizes() == q_in.sizes().slice(0, 2), "decode_attention_bf16: positions [B, T]");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const at::Tensor table = tables.contiguous();
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  const redline::PagedCache cache = redline::paged_cache(k_cache, v_cache, table, B, Hq, D, kv_len);
  at::Tensor out = at::empty_like(q);
  std::pair<at::Tensor, at::Tensor> kept;
  redline::TreeRows rows;
  const redline::TreeRows* tree = redline::tree_rows(tree_base, tree_bits, B, T, kept, rows);
  redline::decode_attention(redline::bits(q), Hq * D, B, T, Hq, positions.data_ptr<int64_t>(), cache, kv_len,
                            chunk, out.data_ptr<at::BFloat16>(), tree);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(redline_cpu, m) {
  m.def("decode_attention_bf16(Tensor q, Tensor k_cache, Tensor v_cache, Tensor positions, Tensor tables, "
        "SymInt kv_len, int chunk, Tensor? tree_base=None, Tensor? tree_bits=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(redline_cpu, CPU, m) { m.impl("decode_attention_bf16", decode_attention_bf16); }
