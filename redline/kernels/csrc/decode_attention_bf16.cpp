// Attention of a decode step's few queries (K + 1 <= 9 per row) over the paged KV cache, on CPU, bf16
// queries and cache, fp32 scores, softmax and sums: what kernels/decode_attention.py computes on CUDA
// (decode_attention_reference is the definition), without gathering the cache or building masks.
//
// One task per (row b, query token t, query head h); it reads kv head h / G (GQA, G = Hq / Hkv) and the
// keys at positions lo..hi: hi = min(position, kv_len - 1), lo = 0, or with Llama 4's chunked layers the
// start of the query's chunk (position - position % chunk). Key j of row b is entry j % BLOCK of block
// tables[b][j / BLOCK]. Example: BLOCK 16, tables[b] = [4, 9], key 17 is block 9, entry 1.
// Each task's arithmetic is the same whatever else is in the step, so a query's output does not depend
// on the number of rows or tokens (a verify step's K + 1 queries equal K + 1 one-token steps). A query
// with no key (lo > hi: never in a step, whose query sees at least itself) gets zeros, as the reference.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t LANES = 16;  // fp32 lanes of an AVX-512 register

inline __m512 load_bf16(const uint16_t* p) {  // 16 bf16 -> 16 fp32 (a bf16 is a float's high half)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// q [B, T, Hq, D]; k_cache, v_cache [blocks, Hkv, BLOCK, D]; positions [B, T] int64; tables [B, n] int32
at::Tensor decode_attention_bf16(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& positions_in, const at::Tensor& tables, int64_t kv_len,
                                 int64_t chunk) {
  TORCH_CHECK(q_in.dim() == 4 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "decode_attention_bf16: q [B, T, Hq, D], caches [blocks, Hkv, BLOCK, D]");
  TORCH_CHECK(q_in.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "decode_attention_bf16: bf16 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && tables.scalar_type() == at::kInt,
              "decode_attention_bf16: contiguous caches, int32 tables");
  const int64_t batch = q_in.size(0), head_dim = q_in.size(3);
  TORCH_CHECK(head_dim == k_cache.size(3) && head_dim % LANES == 0 && k_cache.size(1) > 0 &&
                  q_in.size(2) % k_cache.size(1) == 0,
              "decode_attention_bf16: q's head_dim is the cache's, a multiple of 16; Hq a multiple of Hkv");
  TORCH_CHECK(positions_in.sizes() == q_in.sizes().slice(0, 2), "decode_attention_bf16: positions [B, T]");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && kv_len <= tables.size(1) * k_cache.size(2),
              "decode_attention_bf16: tables [B, n] covering kv_len positions");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const at::Tensor table = tables.contiguous();
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t Hkv = k_cache.size(1), BLOCK = k_cache.size(2), per_row = table.size(1);
  const int64_t G = Hq / Hkv, blocks = k_cache.size(0);
  const float scale = 1.0f / std::sqrt(float(D));
  at::Tensor out = at::empty_like(q);
  const auto* qs = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* ks = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vs = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int32_t* tab = table.data_ptr<int32_t>();
  auto* os = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, B * T * Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512> query(D / LANES), acc(D / LANES);
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      // task = (b * T + t) * Hq + h, q's own layout: T = 2, Hq = 9, task 25 is b = 1, t = 0, h = 7
      const int64_t b = task / (T * Hq), t = task / Hq % T, h = task % Hq, kv_head = h / G;
      const int64_t position = pos[b * T + t];
      const int64_t hi = std::min(position, kv_len - 1);
      const int64_t lo = chunk > 0 ? position - position % chunk : 0;
      const uint16_t* qrow = qs + task * D;  // q is [B, T, Hq, D]: task is (b * T + t) * Hq + h
      for (int64_t i = 0; i < D / LANES; ++i)
        query[i] = _mm512_mul_ps(load_bf16(qrow + i * LANES), _mm512_set1_ps(scale));
      scores.assign(std::max<int64_t>(hi - lo + 1, 0), 0.0f);
      float top = -INFINITY;
      for (int64_t j = lo; j <= hi; ++j) {
        const int64_t block = tab[b * per_row + j / BLOCK];
        TORCH_CHECK(block >= 0 && block < blocks, "decode_attention_bf16: no block ", block, " in the cache");
        const uint16_t* key = ks + ((block * Hkv + kv_head) * BLOCK + j % BLOCK) * D;
        __m512 products = _mm512_setzero_ps();
        for (int64_t i = 0; i < D / LANES; ++i)
          products = _mm512_fmadd_ps(query[i], load_bf16(key + i * LANES), products);
        const float dot = _mm512_reduce_add_ps(products);
        scores[j - lo] = dot;
        top = std::max(top, dot);
      }
      float total = 0.0f;
      for (float& s : scores) total += (s = std::exp(s - top));
      std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
      for (int64_t j = lo; j <= hi; ++j) {
        const int64_t block = tab[b * per_row + j / BLOCK];
        const uint16_t* value = vs + ((block * Hkv + kv_head) * BLOCK + j % BLOCK) * D;
        const __m512 weight = _mm512_set1_ps(scores[j - lo] / total);
        for (int64_t i = 0; i < D / LANES; ++i)
          acc[i] = _mm512_fmadd_ps(weight, load_bf16(value + i * LANES), acc[i]);
      }
      alignas(64) float sums[LANES];
      for (int64_t i = 0; i < D / LANES; ++i) {
        _mm512_store_ps(sums, acc[i]);
        for (int64_t l = 0; l < LANES; ++l) os[task * D + i * LANES + l] = at::BFloat16(sums[l]);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(redline_cpu, m) {
  m.def("decode_attention_bf16(Tensor q, Tensor k_cache, Tensor v_cache, Tensor positions, Tensor tables, "
        "SymInt kv_len, int chunk) -> Tensor");
}
TORCH_LIBRARY_IMPL(redline_cpu, CPU, m) { m.impl("decode_attention_bf16", decode_attention_bf16); }
