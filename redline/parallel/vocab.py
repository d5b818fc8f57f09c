"""Vocabulary-parallel embedding and lm_head: rank r holds rows [r B, (r + 1) B) of each, B = ceil(V / N),
the last rank's block padded with zero rows (V = 49,152, N = 3: B = 16,384, no padding; V = 10, N = 4:
B = 3, rank 3 holds ids 9 and two zero rows).

An embedding lookup takes the rows of the ids in this rank's block, zeros elsewhere, and one all-reduce
adds the ranks' results: every id's row comes from exactly one rank, so the sum is exact. The lm_head
multiplies by this rank's rows (its block of the logits): `gather_vocab` joins the blocks (sampling
needs the whole distribution), `vocab_parallel_argmax` picks the greedy token from one (value, id) pair
per rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from redline.kernels.packed_layout import embedding_rows
from redline.parallel.group import TensorParallel


def vocab_block(vocab: int, size: int) -> int:
    return -(-vocab // size)


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab: int, hidden: int, tp: TensorParallel):
        super().__init__(vocab_block(vocab, tp.size), hidden)
        self.tp, self.first = tp, tp.rank * vocab_block(vocab, tp.size)
        self.rows_dtype = torch.bfloat16  # a quantized table's rows' (models/quantize.quantize_head sets it)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., hidden]
        """The table is [V, H], or packed or quantized where it is a head's (kernels/packed_layout.py)."""
        if self.tp.size == 1:
            return embedding_rows(self.weight, ids, self.rows_dtype)
        local = ids - self.first
        mine = (local >= 0) & (local < self.num_embeddings)
        rows = embedding_rows(self.weight, local.clamp(0, self.num_embeddings - 1), self.rows_dtype)
        return self.tp.all_reduce(rows * mine[..., None].to(rows.dtype))


def gather_vocab(local: torch.Tensor, tp: TensorParallel, vocab: int) -> torch.Tensor:
    """Every rank's logits block [..., B] joined into [..., vocab] (the last block's padding dropped)."""
    if tp.size == 1:
        return local
    return tp.gather_last_dim(local)[..., :vocab]


# a rank's logits block [..., N] and the id of its first token -> the block changed (masked, biased)
BlockShaping = Callable[[torch.Tensor, int], torch.Tensor]


def vocab_parallel_argmax(local: torch.Tensor, tp: TensorParallel, vocab: int) -> torch.Tensor:
    """argmax over the whole vocabulary of every rank's logits block [..., B] -> [...] int64, without
    gathering the blocks: each rank offers its best (value, id), and the first rank holding the highest
    value wins, which is argmax's first maximum.

    Example, vocabulary 5 over 2 ranks (blocks of 3, one padding row on rank 1), logits [1, 5, 2 | 5, 0]:
    rank 0 offers (5, 1), rank 1 (5, 3) (its padding row, logit 0, is left out): id 1."""
    if tp.size == 1:
        return local.argmax(-1)
    block = local.shape[-1]
    first = tp.rank * block
    padding = first + block - vocab  # zero rows at the end of the last block
    if padding > 0:
        local = local.index_fill(-1, torch.arange(block - padding, block, device=local.device), float("-inf"))
    value, index = local.max(-1)  # the first maximum
    offers = tp.gather_last_dim(torch.stack((value, (index + first).float()), dim=-1))  # [..., 2N]
    best = offers[..., 0::2].argmax(-1, keepdim=True)  # [..., 1] the first rank holding the maximum
    return offers[..., 1::2].gather(-1, best)[..., 0].long()  # ids < 2^24 are exact in fp32
