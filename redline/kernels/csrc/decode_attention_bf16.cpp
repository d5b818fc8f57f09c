// Attention of a decode step's few queries (K + 1, or a tree's rows) over the paged KV cache, on CPU, bf16
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
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "avx512_bf16.h"
#include "kernels.h"

namespace {

using redline::CHUNK;
constexpr int64_t LANES = 16;  // fp32 lanes of an AVX-512 register

// Where one row's keys for one kv head lie: offsets[j] is the element offset of key lo + j in a cache,
// entry (lo + j) % BLOCK of block table[(lo + j) / BLOCK]. Example: BLOCK 16, table = [4, 9], lo = 0,
// Hkv = 1, D = 64: key 17 is block 9, entry 1, at (9 * 16 + 1) * 64. The values lie at the same offsets.
void key_offsets(const int32_t* table, int64_t lo, int64_t n, int64_t kv_heads, int64_t kv_head,
                 int64_t block_size, int64_t blocks, int64_t head_dim, std::vector<int64_t>& offsets) {
  offsets.resize(n);
  int64_t entry = lo / block_size, slot = lo % block_size;
  for (int64_t j = 0; j < n; ++entry, slot = 0) {
    const int64_t block = table[entry];
    TORCH_CHECK(block >= 0 && block < blocks, "decode_attention_bf16: no block ", block, " in the cache");
    const int64_t base = (block * kv_heads + kv_head) * block_size;
    for (; slot < block_size && j < n; ++slot, ++j) offsets[j] = (base + slot) * head_dim;
  }
}

// A token tree's keys for one query (kernels.h TreeRows): positions lo .. base - 1, then the slots base + j
// of the set bits of `bits`, all below kv_len. lo is 0, or with Llama 4's chunked layers the start of the
// root's chunk (attention_core.tree_visible). Example: base 40, bits 0b101: keys 0..39, 40 and 42; chunk 32:
// keys 32..39, 40 and 42.
void tree_key_offsets(const int32_t* table, int64_t base, int64_t bits, int64_t chunk, int64_t kv_len,
                      int64_t kv_heads, int64_t kv_head, int64_t block_size, int64_t blocks, int64_t head_dim,
                      std::vector<int64_t>& offsets) {
  const int64_t lo = chunk > 0 ? base - base % chunk : 0;
  key_offsets(table, lo, std::max<int64_t>(std::min(base, kv_len) - lo, 0), kv_heads, kv_head, block_size,
              blocks, head_dim, offsets);
  std::vector<int64_t> one;
  for (int64_t j = 0; j < 63 && base + j < kv_len; ++j) {  // 63 slots: draft_tree.TREE_SLOTS
    if ((bits >> j) & 1) {
      key_offsets(table, base + j, 1, kv_heads, kv_head, block_size, blocks, head_dim, one);
      offsets.push_back(one[0]);
    }
  }
}

// One query (C chunks of 32: head_dim = 32 C) over the n keys at `offsets`, into out[32 C]. Scores 16 keys
// at a time: vdpbf16ps multiplies the bf16 query and key exactly and adds in fp32, and sums16 adds each
// key's lanes; then e^(score - top) 16 at a time, and the values weighted by them, divided by their sum at
// the end. The same arithmetic for every query, whatever else is in the step.
template <int C>
void attend(const uint16_t* query_row, const uint16_t* k_cache, const uint16_t* v_cache,
            const std::vector<int64_t>& offsets, float scale, std::vector<float>& scores, at::BFloat16* out) {
  __m512bh query[C];
  for (int c = 0; c < C; ++c) query[c] = redline::load_chunk(query_row + c * CHUNK, CHUNK);
  const int64_t n = offsets.size();
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
  const int64_t D = cache.head_dim, G = Hq / cache.kv_heads;
  const float scale = 1.0f / std::sqrt(float(D));
  using Attend = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const std::vector<int64_t>&,
                          float, std::vector<float>&, at::BFloat16*);
  constexpr Attend by_chunks[] = {attend<1>, attend<2>, attend<3>, attend<4>,
                                  attend<5>, attend<6>, attend<7>, attend<8>};
  const Attend run = by_chunks[D / CHUNK - 1];  // head_dim 64: 2 chunks, attend<2>
  at::parallel_for(0, B * T * Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> offsets;
    // (b, kv head, lo, hi) that `offsets` holds: consecutive tasks are the G query heads of one kv head
    int64_t walked[4] = {-1, -1, -1, -1};
    for (int64_t task = begin; task < end; ++task) {
      // task = (b * T + t) * Hq + h, out's layout: T = 2, Hq = 9, task 25 is b = 1, t = 0, h = 7
      const int64_t b = task / (T * Hq), t = task / Hq % T, h = task % Hq;
      if (tree != nullptr) {  // (b, kv head, t, -2): a tree's rows each see their own keys
        const int64_t walk[4] = {b, h / G, t, -2};
        if (!std::equal(walk, walk + 4, walked)) {
          tree_key_offsets(cache.tables + b * cache.per_row, tree->base[b], tree->bits[b * T + t], chunk,
                           kv_len, cache.kv_heads, h / G, cache.block_size, cache.blocks, D, offsets);
          std::copy(walk, walk + 4, walked);
        }
        run(q + (b * T + t) * q_stride + h * D, cache.k, cache.v, offsets, scale, scores, out + task * D);
        continue;
      }
      const int64_t position = positions[b * T + t];
      const int64_t hi = std::min(position, kv_len - 1);
      const int64_t lo = chunk > 0 ? position - position % chunk : 0;
      at::BFloat16* task_out = out + task * D;
      if (lo > hi) {
        std::fill(task_out, task_out + D, at::BFloat16(0.0f));
        continue;
      }
      const int64_t walk[4] = {b, h / G, lo, hi};
      if (!std::equal(walk, walk + 4, walked)) {
        key_offsets(cache.tables + b * cache.per_row, lo, hi - lo + 1, cache.kv_heads, h / G,
                    cache.block_size, cache.blocks, D, offsets);
        std::copy(walk, walk + 4, walked);
      }
      run(q + (b * T + t) * q_stride + h * D, cache.k, cache.v, offsets, scale, scores, task_out);
    }
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
