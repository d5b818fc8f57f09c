"""Vocabulary-parallel embedding and lm_head: rank r holds rows [r B, (r + 1) B) of each, B = ceil(V / N),
the last rank's block padded with zero rows (V = 49,152, N = 3: B = 16,384, no padding; V = 10, N = 4:
B = 3, rank 3 holds ids 9 and two zero rows).

An embedding lookup takes the rows of the ids in this rank's block, zeros elsewhere, and one all-reduce
adds the ranks' results: every id's row comes from exactly one rank, so the sum is exact. The lm_head
multiplies by this rank's rows (its block of the logits); LlamaForCausalLM.logits gathers the blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from redline.parallel.group import TensorParallel


def vocab_block(vocab: int, size: int) -> int:
    return -(-vocab // size)


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab: int, hidden: int, tp: TensorParallel):
        super().__init__(vocab_block(vocab, tp.size), hidden)
        self.tp, self.first = tp, tp.rank * vocab_block(vocab, tp.size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., hidden]
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.first
        mine = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.tp.all_reduce(rows * mine[..., None].to(rows.dtype))
