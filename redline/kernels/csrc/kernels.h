// The kernels as C++ functions over raw bf16 data, for the ops that compose them (dense_layer_bf16.cpp)
// as well as their own torch ops. bf16 data is read as uint16_t (its bits) and written as at::BFloat16.
#pragma once
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <utility>

namespace redline {

inline const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

// y[M, N] = x[M, K] @ w[N, K]^T, each row's result independent of M (few_rows_bf16.cpp)
void few_rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, at::BFloat16* y);

// Rows of a packed weight (packed_layout.py): w[N, K] stored as [N / PACK_ROWS, K / 2, PACK_ROWS, 2]
constexpr int64_t PACK_ROWS = 32;

// y[M, N] = x[M, K] @ w^T for w packed, each row's result independent of M (packed_rows_bf16.cpp)
void packed_rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, at::BFloat16* y);

// A weight of y = x @ w^T for N outputs of K inputs: bf16 [N, K] row-major or packed, or quantized in
// groups of `group` along k (bits 4: quantized_rows_bf16.cpp; bits 8: int8_rows_vnni.cpp; both on AVX2:
// ../csrc_avx2/quantized_rows_avx2.cpp)
struct Weight {
  const void* data;
  int64_t N, K;
  bool packed;
  int bits = 16;
  int64_t group = 0;
};

// The weight a contiguous CPU tensor holds: bf16 [N, K], or [N / PACK_ROWS, K / 2, PACK_ROWS, 2] packed;
// uint8 (int4) or int8 [N / PACK_ROWS, K / G, G * PACK_ROWS * bits / 8 + 4 * PACK_ROWS] quantized
// (kernels/quantized_layout.py).
inline Weight weight_of(const at::Tensor& w, const char* op) {
  TORCH_CHECK(w.is_contiguous() && w.is_cpu(), op, ": weights must be contiguous CPU tensors");
  const auto type = w.scalar_type();
  if (type == at::kByte || type == at::kChar) {
    const int bits = type == at::kByte ? 4 : 8;
    const int64_t scales = 4 * PACK_ROWS, per_weight = PACK_ROWS * bits / 8;  // bytes of a group: G * that
    TORCH_CHECK(w.dim() == 3 && w.size(2) > scales && (w.size(2) - scales) % (2 * per_weight) == 0, op,
                ": a quantized weight is [N / ", PACK_ROWS, ", K / G, G * ", per_weight, " + ", scales,
                "], not ", w.sizes());
    const int64_t group = (w.size(2) - scales) / per_weight;
    return {w.data_ptr(), w.size(0) * PACK_ROWS, w.size(1) * group, false, bits, group};
  }
  TORCH_CHECK(type == at::kBFloat16, op, ": weights are bf16, int4 (uint8) or int8, not ", type);
  if (w.dim() == 4) {
    TORCH_CHECK(w.size(2) == PACK_ROWS && w.size(3) == 2, op, ": a packed weight is [N / ", PACK_ROWS,
                ", K / 2, ", PACK_ROWS, ", 2], not ", w.sizes());
    return {w.data_ptr(), w.size(0) * PACK_ROWS, w.size(1) * 2, true};
  }
  TORCH_CHECK(w.dim() == 2, op, ": a weight is [N, K] or packed, not ", w.sizes());
  return {w.data_ptr(), w.size(0), w.size(1), false};
}

// y[M, w.N] = x[M, w.K] @ w^T for a quantized w (quantized_rows_bf16.cpp): int4 there, int8 by int8_rows
void quantized_rows(const uint16_t* x, int64_t M, const Weight& w, at::BFloat16* y);

// y[M, w.N] = x[M, w.K] @ w^T for an int8 w, in integer products with x in int16 (int8_rows_vnni.cpp)
void int8_rows(const uint16_t* x, int64_t M, const Weight& w, at::BFloat16* y);

// y[M, w.N] = x[M, w.K] @ w^T, each row's result independent of M
inline void product(const uint16_t* x, int64_t M, const Weight& w, at::BFloat16* y) {
  const auto* data = static_cast<const uint16_t*>(w.data);
  if (w.bits != 16)
    quantized_rows(x, M, w, y);
  else if (w.packed)
    packed_rows(x, M, w.K, data, w.N, y);
  else
    few_rows(x, M, w.K, data, w.N, y);
}

// A paged KV cache, k and v [blocks, kv_heads, block_size, head_dim] in the dtype paged_cache checked, and
// the rows' block tables [B, per_row]
struct PagedCache {
  const void* k;
  const void* v;
  int64_t blocks, kv_heads, block_size, head_dim;
  const int32_t* tables;
  int64_t per_row;
};

// The cache of k_cache, v_cache [blocks, Hkv, BLOCK, D] in `dtype` and tables [B, n] (contiguous int32, kept
// alive by the caller) for B rows of Hq query heads of head_dim D (a multiple of `multiple` up to 256)
// attending kv_len positions, checked.
inline PagedCache paged_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                              int64_t B, int64_t Hq, int64_t D, int64_t kv_len,
                              at::ScalarType dtype = at::kBFloat16, int64_t multiple = 32) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches [blocks, Hkv, BLOCK, D]");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype, "caches in ", dtype,
              " only, not ", k_cache.scalar_type(), " and ", v_cache.scalar_type());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && tables.is_contiguous() &&
                  tables.scalar_type() == at::kInt,
              "contiguous caches, contiguous int32 tables");
  TORCH_CHECK(D % multiple == 0 && D <= 256 && D == k_cache.size(3) && k_cache.size(1) > 0 &&
                  Hq % k_cache.size(1) == 0,
              "head_dim the cache's, a multiple of ", multiple, " up to 256; Hq a multiple of Hkv");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && kv_len <= tables.size(1) * k_cache.size(2),
              "tables [B, n] covering kv_len positions");
  return {k_cache.data_ptr(), v_cache.data_ptr(), k_cache.size(0), k_cache.size(1), k_cache.size(2), D,
          tables.data_ptr<int32_t>(), tables.size(1)};
}

// A token tree's mask (speculative/tree.py, attention_core.tree_visible): row b's queries see every key
// before base[b] (from the start of base[b]'s chunk in Llama 4's chunked layers), then slot base[b] + j
// where bit j of bits[b * T + t] is set (j < 63)
struct TreeRows {
  const int64_t* base;  // [B]
  const int64_t* bits;  // [B * T]
};

// out[B * T, Hq, D] = attention of queries q (row b * T + t at q + (b * T + t) * q_stride, head h at + h * D)
// at positions[B * T] over cache positions [0, kv_len), or under a tree's mask (decode_attention_bf16.cpp)
void decode_attention(const uint16_t* q, int64_t q_stride, int64_t B, int64_t T, int64_t Hq,
                      const int64_t* positions, const PagedCache& cache, int64_t kv_len, int64_t chunk,
                      at::BFloat16* out, const TreeRows* tree = nullptr);

// The tree of the optional tensors base [B] and bits [B, T] (both or neither), held in `kept`; nullptr
// without them
inline const TreeRows* tree_rows(const std::optional<at::Tensor>& base, const std::optional<at::Tensor>& bits,
                                 int64_t B, int64_t T, std::pair<at::Tensor, at::Tensor>& kept,
                                 TreeRows& rows) {
  TORCH_CHECK(base.has_value() == bits.has_value(), "a tree takes both tree_base and tree_bits");
  if (!base.has_value()) return nullptr;
  kept = {base->to(at::kLong).contiguous(), bits->to(at::kLong).contiguous()};
  TORCH_CHECK(kept.first.numel() == B && kept.second.numel() == B * T, "tree_base [B], tree_bits [B, T]");
  rows = {kept.first.data_ptr<int64_t>(), kept.second.data_ptr<int64_t>()};
  return &rows;
}

}  // namespace redline
