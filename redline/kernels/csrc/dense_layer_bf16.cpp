// One dense Llama decoder layer for the few rows of a decode step, as one call: what
// models/llama.DecoderLayer computes with a rotary, non-MoE, unsharded layer (its ops are the definition,
// and the path everywhere else):
//
//   h = rms_norm(x) * w_in                    rounded to bf16 after each op, as torch's eager ops (but for
//                                             subnormals: vcvtneps2bf16 flushes them to zero)
//   q, k, v = split(h @ qkv^T); q, k rotated by (cos, sin)
//   the cache takes k, v at their positions; a = attention(q) over the cache (decode_attention)
//   r = x + a @ o^T;  g, u = split(rms_norm(r) * w_post @ gate_up^T);  out = r + (silu(g) * u) @ down^T
//
// In a compiled step each op of this chain was a call from the graph's Python, about 12 a layer; here the
// chain is one call (BENCHMARKS.md "One call a decoder layer"). The products are few_rows (or packed_rows,
// for packed weights) and the attention decode_attention, whose rows do not depend on the other rows, and
// the elementwise steps work row by row: a verify step's K + 1 rows equal K + 1 one-token steps, bit for
// bit.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <vector>

#include "avx512_bf16.h"
#include "kernels.h"

namespace {

constexpr int64_t LANES = 16;

// Up to 16 bf16 from p as fp32 (zeros past `left`); a bf16 is a float's high half. Example: left = 3 loads
// mask 0b111.
inline __m512 load16(const uint16_t* p, int64_t left) {
  const __mmask16 mask = left >= LANES ? 0xFFFF : (__mmask16)((1u << left) - 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

// v rounded to bf16 (to nearest even, as at::BFloat16), stored up to `left` of 16.
inline void store16(at::BFloat16* p, __m512 v, int64_t left) {
  const __mmask16 mask = left >= LANES ? 0xFFFF : (__mmask16)((1u << left) - 1);
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

inline __m512 round_bf16(__m512 v) {  // v as bf16 and back: the rounding of a bf16 intermediate
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// out[m] = bf16(bf16(x[m] * rsqrt(mean(x[m]^2) + eps)) * w) for rows m < M of H features: rms_normalize,
// then the learned scale (layers/norm.py).
void rms_norm(const uint16_t* x, int64_t M, int64_t H, const uint16_t* w, float eps, at::BFloat16* out) {
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* row = x + m * H;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < H; i += LANES) {
      const __m512 v = load16(row + i, H - i);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / H + eps));
    for (int64_t i = 0; i < H; i += LANES) {
      const __m512 normed = round_bf16(_mm512_mul_ps(load16(row + i, H - i), scale));
      store16(out + m * H + i, _mm512_mul_ps(normed, load16(w + i, H - i)), H - i);
    }
  }
}

// Rotates `heads` heads of D at p (one row) in place by cos, sin [D / 2] (layers/rotary.py): halves, the
// pair (i, i + D / 2), or adjacent pairs (2i, 2i + 1) when interleaved. Example, D = 4 halves: (p0, p2) and
// (p1, p3) turn by angles 0 and 1.
void rotate(at::BFloat16* p, int64_t heads, int64_t D, const float* cos, const float* sin, bool interleaved) {
  for (int64_t h = 0; h < heads; ++h, p += D)
    for (int64_t i = 0; i < D / 2; ++i) {
      const int64_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + D / 2;
      const float a = p[ia], b = p[ib];
      p[ia] = at::BFloat16(a * cos[i] - b * sin[i]);
      p[ib] = at::BFloat16(a * sin[i] + b * cos[i]);
    }
}

// silu(g) * u for the I gate and up features of each row (gate_up [M, 2I] -> out [M, I]), with silu(g) =
// g / (1 + e^-g) = g e^g / (1 + e^g) for g < 0, e^-|g| so that the exponent is never positive.
void silu_times_up(const uint16_t* gate_up, int64_t M, int64_t I, at::BFloat16* out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < I; i += LANES) {
      const __m512 g = load16(gate_up + m * 2 * I + i, I - i);
      const __m512 e = redline::exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
      const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
      const __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(negative, one, e), _mm512_add_ps(one, e));
      const __m512 silu = round_bf16(_mm512_mul_ps(g, sigmoid));
      store16(out + m * I + i, _mm512_mul_ps(silu, load16(gate_up + m * 2 * I + I + i, I - i)), I - i);
    }
}

// out[n] = bf16(a[n] + b[n]) for n elements
void add(const uint16_t* a, const uint16_t* b, int64_t n, at::BFloat16* out) {
  for (int64_t i = 0; i < n; i += LANES)
    store16(out + i, _mm512_add_ps(load16(a + i, n - i), load16(b + i, n - i)), n - i);
}

const uint16_t* bits(const at::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); }

// The weight w as the layer's [rows, cols]: [N, K], packed or quantized (kernels.h weight_of)
redline::Weight checked_weight(const at::Tensor& w, int64_t rows, int64_t cols, const char* name) {
  const redline::Weight weight = redline::weight_of(w, "dense_layer_bf16");
  TORCH_CHECK(weight.N == rows && weight.K == cols, "dense_layer_bf16: ", name, " must be a [", rows, ", ",
              cols, "] weight, not ", w.sizes());
  return weight;
}

// x [B, T, H]; k_cache, v_cache [blocks, Hkv, BLOCK, D] (written at the positions: a token tree's rows at
// their slots); positions [B, T]; tables [B, n] int32;
// cos, sin [B, T, 1, D / 2] fp32; qkv [(Hq + 2 Hkv) D, H]; o [H, Hq D];
// gate_up [2I, H]; down [H, I] (each [N, K], packed or quantized); norms [H]. Returns the output [B, T, H].
at::Tensor dense_layer_bf16(const at::Tensor& x_in, at::Tensor& k_cache, at::Tensor& v_cache,
                            const at::Tensor& positions_in, const at::Tensor& tables_in, int64_t kv_len,
                            int64_t chunk, const at::Tensor& cos_in, const at::Tensor& sin_in,
                            bool interleaved, const at::Tensor& input_norm, const at::Tensor& qkv,
                            const at::Tensor& o, const at::Tensor& post_norm, const at::Tensor& gate_up,
                            const at::Tensor& down, double eps, int64_t Hq,
                            const std::optional<at::Tensor>& tree_base,
                            const std::optional<at::Tensor>& tree_bits) {
  TORCH_CHECK(x_in.dim() == 3 && x_in.scalar_type() == at::kBFloat16, "dense_layer_bf16: x [B, T, H] bf16");
  const int64_t B = x_in.size(0), T = x_in.size(1), H = x_in.size(2), M = B * T;
  const int64_t Hkv = k_cache.size(1), D = k_cache.size(3);
  const int64_t I = redline::weight_of(down, "dense_layer_bf16").K;
  const int64_t Q = Hq * D, KV = Hkv * D;
  const at::Tensor x = x_in.contiguous(), tables = tables_in.contiguous();
  const redline::PagedCache cache = redline::paged_cache(k_cache, v_cache, tables, B, Hq, D, kv_len);
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(positions.numel() == M, "dense_layer_bf16: positions [B, T]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.numel() == M * D / 2 && sin.sizes() == cos.sizes(),
              "dense_layer_bf16: cos, sin [B, T, 1, D / 2] fp32");
  TORCH_CHECK(input_norm.numel() == H && post_norm.numel() == H && input_norm.is_contiguous() &&
                  post_norm.is_contiguous() && input_norm.scalar_type() == at::kBFloat16 &&
                  post_norm.scalar_type() == at::kBFloat16,
              "dense_layer_bf16: contiguous bf16 norm weights [H]");
  const redline::Weight w_qkv = checked_weight(qkv, Q + 2 * KV, H, "qkv"), w_o = checked_weight(o, H, Q, "o");
  const redline::Weight w_gate_up = checked_weight(gate_up, 2 * I, H, "gate_up");
  const redline::Weight w_down = checked_weight(down, H, I, "down");

  const auto options = x.options();
  at::Tensor normed = at::empty({M, H}, options), projected = at::empty({M, Q + 2 * KV}, options);
  at::Tensor attended = at::empty({M, Q}, options), residual = at::empty({M, H}, options);
  at::Tensor mixed = at::empty({M, 2 * I}, options), activated = at::empty({M, I}, options);
  at::Tensor out = at::empty({B, T, H}, options);
  auto* n = normed.data_ptr<at::BFloat16>();
  auto* p = projected.data_ptr<at::BFloat16>();
  auto* a = attended.data_ptr<at::BFloat16>();
  auto* r = residual.data_ptr<at::BFloat16>();
  auto* g = mixed.data_ptr<at::BFloat16>();
  auto* y = out.data_ptr<at::BFloat16>();

  rms_norm(redline::bits(x), M, H, redline::bits(input_norm), float(eps), n);
  redline::product(bits(n), M, w_qkv, p);
  const int64_t* at_positions = positions.data_ptr<int64_t>();
  auto* ks = reinterpret_cast<at::BFloat16*>(k_cache.data_ptr());
  auto* vs = reinterpret_cast<at::BFloat16*>(v_cache.data_ptr());
  // position p of row b (= m / T) is entry p % BLOCK of block tables[b, p / BLOCK], as AttentionBatch's
  // write_at. Example: BLOCK 16, tables[b] = [4, 9], p = 17: block 9, entry 1. Every row is checked before
  // the first write, so that a bad one leaves the caches as they were.
  std::vector<int64_t> entries(M);  // entries[m]: the row's element offset of kv head 0 in a cache
  for (int64_t m = 0; m < M; ++m) {
    const int64_t position = at_positions[m], entry = position / cache.block_size;
    TORCH_CHECK(position >= 0 && entry < cache.per_row, "dense_layer_bf16: position ", position,
                " is past the block table");
    const int64_t block = cache.tables[m / T * cache.per_row + entry];
    TORCH_CHECK(block >= 0 && block < cache.blocks, "dense_layer_bf16: no block ", block, " in the cache");
    entries[m] = (block * Hkv * cache.block_size + position % cache.block_size) * D;
  }
  for (int64_t m = 0; m < M; ++m) {  // row m: q at p + m (Q + 2 KV), then k, then v
    at::BFloat16* qkv_row = p + m * (Q + 2 * KV);
    const float* c = cos.data_ptr<float>() + m * D / 2;
    const float* s = sin.data_ptr<float>() + m * D / 2;
    rotate(qkv_row, Hq + Hkv, D, c, s, interleaved);  // q's heads and k's, adjacent in the row
    for (int64_t h = 0; h < Hkv; ++h) {  // entry [block, h, slot] of each cache, BLOCK * D after head h - 1
      const int64_t at = entries[m] + h * cache.block_size * D;
      std::copy(qkv_row + Q + h * D, qkv_row + Q + (h + 1) * D, ks + at);
      std::copy(qkv_row + Q + KV + h * D, qkv_row + Q + KV + (h + 1) * D, vs + at);
    }
  }
  std::pair<at::Tensor, at::Tensor> kept;
  redline::TreeRows rows;
  const redline::TreeRows* tree = redline::tree_rows(tree_base, tree_bits, B, T, kept, rows);
  redline::decode_attention(bits(p), Q + 2 * KV, B, T, Hq, at_positions, cache, kv_len, chunk, a, tree);
  redline::product(bits(a), M, w_o, n);  // the attention's output, in `normed`
  add(redline::bits(x), bits(n), M * H, r);
  rms_norm(bits(r), M, H, redline::bits(post_norm), float(eps), n);
  redline::product(bits(n), M, w_gate_up, g);
  silu_times_up(bits(g), M, I, activated.data_ptr<at::BFloat16>());
  redline::product(redline::bits(activated), M, w_down, n);  // the MLP's, in `normed`
  add(bits(r), bits(n), M * H, y);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(redline_cpu, m) {
  m.def("dense_layer_bf16(Tensor x, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor positions, Tensor tables, "
        "SymInt kv_len, int chunk, Tensor cos, Tensor sin, "
        "bool interleaved, Tensor input_norm, Tensor qkv, Tensor o, Tensor post_norm, Tensor gate_up, "
        "Tensor down, float eps, int heads, Tensor? tree_base=None, Tensor? tree_bits=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(redline_cpu, CPU, m) { m.impl("dense_layer_bf16", dense_layer_bf16); }
