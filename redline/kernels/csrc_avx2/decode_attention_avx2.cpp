// Attention of a decode step's few queries (K + 1, or a tree's rows) over the paged KV cache on CPUs with
// AVX2 (and FMA, F16C), fp32 or bf16 queries and cache (the model's dtype), fp32 scores, softmax and sums:
// what ../csrc/decode_attention_bf16.cpp computes on AVX-512 BF16, for the models that kernel does not take
// (fp32 and bf16 models on CPUs without AVX-512 BF16, fp32 ones on those with it), without gathering the
// cache or building masks (attention_core.decode_attention_reference is the definition).
//
// One task per (row b, query token t, query head h) over the keys it sees (../csrc/paged_keys.h). Each
// task's arithmetic is the same whatever else is in the step, so a query's output does not depend on the
// number of rows or tokens (a verify step's K + 1 queries equal K + 1 one-token steps). A query with no key
// gets zeros, as the reference.
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../csrc/kernels.h"
#include "../csrc/paged_keys.h"
#include "avx2.h"

namespace {

using redline::load8;
constexpr int64_t LANES = 8;      // fp32 lanes of an AVX2 register
constexpr int64_t MAX_DIM = 256;  // head_dim: a multiple of 8 up to 256
static_assert(MAX_DIM == 256, "paged_cache (../csrc/kernels.h) checks head_dim <= 256 for the stack arrays");
constexpr int VALUE_TILE = 8;     // value registers summed at once: 8 independent FMA chains

// sum_j scores[j] v_j[first .. first + 8 R) over the values at `offsets`, into acc[first ..]: each element
// summed in key order, one FMA a key, whatever R (the tiling of head_dim does not move a sum)
template <int R, typename Element>
void weigh_values(const Element* v_cache, const std::vector<int64_t>& offsets, const float* scores,
                  int64_t first, float* acc) {
  __m256 sums[R];
  for (auto& s : sums) s = _mm256_setzero_ps();
  for (size_t j = 0; j < offsets.size(); ++j) {
    const Element* value = v_cache + offsets[j] + first;
    const __m256 weight = _mm256_set1_ps(scores[j]);
    for (int r = 0; r < R; ++r) sums[r] = _mm256_fmadd_ps(weight, load8(value + LANES * r), sums[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + first + LANES * r, sums[r]);
}

// One query (D elements) over the n keys at `offsets`, into out[D]. Scores 8 keys at a time, 8 FMA chains
// along head_dim, sums8 adding each key's lanes; then e^(score - top) 8 at a time, and the values weighted
// by them (weigh_values), divided by their sum at the end.
template <typename Element, typename Out>
void attend(const Element* query_row, const Element* k_cache, const Element* v_cache,
            const std::vector<int64_t>& offsets, int64_t D, float scale, std::vector<float>& scores,
            Out* out) {
  const int64_t n = offsets.size(), chunks = D / LANES;
  if (n == 0) {
    std::fill(out, out + D, Out(0.0f));
    return;
  }
  alignas(32) float query[MAX_DIM], acc[MAX_DIM];
  for (int64_t c = 0; c < chunks; ++c) _mm256_store_ps(query + LANES * c, load8(query_row + LANES * c));
  scores.resize((n + LANES - 1) / LANES * LANES);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 top = _mm256_set1_ps(-INFINITY);
  for (int64_t g = 0; g < n; g += LANES) {
    const Element* keys[LANES];  // past the last key: the last again, its score masked below
    for (int i = 0; i < LANES; ++i) keys[i] = k_cache + offsets[std::min<int64_t>(g + i, n - 1)];
    __m256 dots[LANES];
    for (auto& d : dots) d = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256 q = _mm256_load_ps(query + LANES * c);
      for (int i = 0; i < LANES; ++i) dots[i] = _mm256_fmadd_ps(q, load8(keys[i] + LANES * c), dots[i]);
    }
    // lanes i < n - g hold keys: n - g = 3 keeps lanes 0-2 and puts -inf in 3-7
    const __m256 real = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - g), lane));
    const __m256 scored = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                           _mm256_mul_ps(redline::sums8(dots), _mm256_set1_ps(scale)), real);
    _mm256_storeu_ps(scores.data() + g, scored);
    top = _mm256_max_ps(top, scored);
  }
  alignas(32) float lanes[LANES];
  _mm256_store_ps(lanes, top);
  const __m256 highest = _mm256_set1_ps(*std::max_element(lanes, lanes + LANES));
  __m256 total = _mm256_setzero_ps();
  for (int64_t g = 0; g < n; g += LANES) {  // lanes past n hold -inf: e^-inf = 0
    const __m256 e = redline::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores.data() + g), highest));
    _mm256_storeu_ps(scores.data() + g, e);
    total = _mm256_add_ps(total, e);
  }
  // head_dim in tiles of 8 registers, then the rest as one tile: D = 40 is one tile of 5, D = 80 one of 8
  // and one of 2
  using Weigh = void (*)(const Element*, const std::vector<int64_t>&, const float*, int64_t, float*);
  constexpr Weigh by_registers[] = {weigh_values<1, Element>, weigh_values<2, Element>,
                                    weigh_values<3, Element>, weigh_values<4, Element>,
                                    weigh_values<5, Element>, weigh_values<6, Element>,
                                    weigh_values<7, Element>};
  int64_t c = 0;
  for (; c + VALUE_TILE <= chunks; c += VALUE_TILE)
    weigh_values<VALUE_TILE>(v_cache, offsets, scores.data(), LANES * c, acc);
  if (c < chunks) by_registers[chunks - c - 1](v_cache, offsets, scores.data(), LANES * c, acc);
  _mm256_store_ps(lanes, total);
  const float inverse = 1.0f / (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                                ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])));
  for (int64_t d = 0; d < D; ++d) out[d] = Out(acc[d] * inverse);
}

// q [B, T, Hq, D] of Element (fp32, or bf16's bits), out the same shape of Out (fp32 or bf16)
template <typename Element, typename Out>
void attend_all(const Element* q, int64_t B, int64_t T, int64_t Hq, const int64_t* positions,
                const redline::PagedCache& cache, int64_t kv_len, int64_t chunk,
                const redline::TreeRows* tree, Out* out) {
  const int64_t D = cache.head_dim;
  const float scale = 1.0f / std::sqrt(float(D));
  const auto* k = static_cast<const Element*>(cache.k);
  const auto* v = static_cast<const Element*>(cache.v);
  redline::for_each_query(B, T, Hq, positions, cache, kv_len, chunk, tree,
                          [&](int64_t task, int64_t, const std::vector<int64_t>& offsets) {
                            thread_local std::vector<float> scores;  // q and out share the layout
                            attend(q + task * D, k, v, offsets, D, scale, scores, out + task * D);
                          });
}

// q [B, T, Hq, D]; k_cache, v_cache [blocks, Hkv, BLOCK, D] in q's dtype; positions [B, T]; tables [B, n]
// int32; tree_base [B] and tree_bits [B, T] (both or neither): a token tree's mask instead of the positions'
at::Tensor decode_attention_avx2(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& positions_in, const at::Tensor& tables, int64_t kv_len,
                                 int64_t chunk, const std::optional<at::Tensor>& tree_base,
                                 const std::optional<at::Tensor>& tree_bits) {
  const auto type = q_in.scalar_type();
  TORCH_CHECK(q_in.dim() == 4 && q_in.is_cpu() && (type == at::kFloat || type == at::kBFloat16),
              "decode_attention_avx2: q [B, T, Hq, D] fp32 or bf16 on CPU, not ", type, " ", q_in.sizes());
  TORCH_CHECK(positions_in.sizes() == q_in.sizes().slice(0, 2), "decode_attention_avx2: positions [B, T]");
  const at::Tensor q = q_in.contiguous(), table = tables.contiguous();
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  const redline::PagedCache cache =
      redline::paged_cache(k_cache, v_cache, table, B, Hq, D, kv_len, type, LANES);
  at::Tensor out = at::empty_like(q);
  std::pair<at::Tensor, at::Tensor> kept;
  redline::TreeRows rows;
  const redline::TreeRows* tree = redline::tree_rows(tree_base, tree_bits, B, T, kept, rows);
  const int64_t* at_positions = positions.data_ptr<int64_t>();
  if (type == at::kFloat)
    attend_all(q.data_ptr<float>(), B, T, Hq, at_positions, cache, kv_len, chunk, tree,
               out.data_ptr<float>());
  else
    attend_all(redline::bits(q), B, T, Hq, at_positions, cache, kv_len, chunk, tree,
               out.data_ptr<at::BFloat16>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(redline_cpu_avx2, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor positions, Tensor tables, "
        "SymInt kv_len, int chunk, Tensor? tree_base=None, Tensor? tree_bits=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(redline_cpu_avx2, CPU, m) { m.impl("decode_attention", decode_attention_avx2); }
