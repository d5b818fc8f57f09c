// Which keys of the paged cache each query of a decode step sees, and the step's tasks over torch's thread
// pool: what the decode attention kernels share (decode_attention_bf16.cpp on AVX-512 BF16,
// ../csrc_avx2/decode_attention_avx2.cpp on AVX2). Index arithmetic only, no vector instructions.
//
// One task per (row b, query token t, query head h); it reads kv head h / G (GQA, G = Hq / Hkv) and the keys
// at positions lo..hi: hi = min(position, kv_len - 1), lo = 0, or with Llama 4's chunked layers the start of
// the query's chunk (position - position % chunk). Key j of row b is entry j % BLOCK of block
// tables[b][j / BLOCK]. Example: BLOCK 16, tables[b] = [4, 9], key 17 is block 9, entry 1.
#pragma once
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace redline {

// Where one row's keys for one kv head lie: offsets[j] is the element offset of key lo + j in a cache,
// entry (lo + j) % BLOCK of block table[(lo + j) / BLOCK]. Example: BLOCK 16, table = [4, 9], lo = 0,
// Hkv = 1, D = 64: key 17 is block 9, entry 1, at (9 * 16 + 1) * 64. The values lie at the same offsets.
inline void key_offsets(const int32_t* table, int64_t lo, int64_t n, int64_t kv_heads, int64_t kv_head,
                        int64_t block_size, int64_t blocks, int64_t head_dim, std::vector<int64_t>& offsets) {
  offsets.resize(n);
  int64_t entry = lo / block_size, slot = lo % block_size;
  for (int64_t j = 0; j < n; ++entry, slot = 0) {
    const int64_t block = table[entry];
    TORCH_CHECK(block >= 0 && block < blocks, "decode attention: no block ", block, " in the cache");
    const int64_t base = (block * kv_heads + kv_head) * block_size;
    for (; slot < block_size && j < n; ++slot, ++j) offsets[j] = (base + slot) * head_dim;
  }
}

// A token tree's keys for one query (kernels.h TreeRows): positions lo .. base - 1, then the slots base + j
// of the set bits of `bits`, all below kv_len. lo is 0, or with Llama 4's chunked layers the start of the
// root's chunk (attention_core.tree_visible). Example: base 40, bits 0b101: keys 0..39, 40 and 42; chunk 32:
// keys 32..39, 40 and 42.
inline void tree_key_offsets(const int32_t* table, int64_t base, int64_t bits, int64_t chunk, int64_t kv_len,
                             int64_t kv_heads, int64_t kv_head, int64_t block_size, int64_t blocks,
                             int64_t head_dim, std::vector<int64_t>& offsets) {
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

// Calls attend(task, query, offsets) for every task = (b * T + t) * Hq + h of a step, on torch's thread
// pool: query = b * T + t, offsets the keys it sees (key_offsets; tree_key_offsets under a tree's mask),
// empty where it sees none (lo > hi: a query whose chunk starts at or past kv_len, as position 150, chunk
// 64, kv_len 100: lo 128, hi 99; never in a step, whose query sees at least itself). Out's layout: T = 2,
// Hq = 9, task 25 is b = 1, t = 0, h = 7. Consecutive tasks are the G query heads of one kv head, which walk
// the same keys: those are found once.
template <typename Attend>
void for_each_query(int64_t B, int64_t T, int64_t Hq, const int64_t* positions, const PagedCache& cache,
                    int64_t kv_len, int64_t chunk, const TreeRows* tree, const Attend& attend) {
  const int64_t G = Hq / cache.kv_heads;
  at::parallel_for(0, B * T * Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> offsets;
    // (b, kv head, lo, hi) of the keys `offsets` holds; under a tree (b, kv head, t, -2): its rows each see
    // their own keys
    int64_t walked[4] = {-1, -1, -1, -1};
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (T * Hq), t = task / Hq % T, h = task % Hq;
      int64_t walk[4] = {b, h / G, t, -2};
      if (tree == nullptr) {
        const int64_t position = positions[b * T + t];
        walk[2] = chunk > 0 ? position - position % chunk : 0;
        walk[3] = std::min(position, kv_len - 1);
      }
      if (!std::equal(walk, walk + 4, walked)) {
        const int32_t* table = cache.tables + b * cache.per_row;
        if (tree != nullptr)
          tree_key_offsets(table, tree->base[b], tree->bits[b * T + t], chunk, kv_len, cache.kv_heads, h / G,
                           cache.block_size, cache.blocks, cache.head_dim, offsets);
        else
          key_offsets(table, walk[2], std::max<int64_t>(walk[3] - walk[2] + 1, 0), cache.kv_heads, h / G,
                      cache.block_size, cache.blocks, cache.head_dim, offsets);
        std::copy(walk, walk + 4, walked);
      }
      attend(task, b * T + t, offsets);
    }
  });
}

}  // namespace redline
