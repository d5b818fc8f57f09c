"""The packed layout of a bf16 weight for the CPU product kernel (csrc/packed_rows_bf16.cpp): [N, K] stored as
[N / 32, K / 2, 32, 2], so that one 64-byte load holds two adjacent k of 16 rows and each of its lanes is one
output's sum.

    w[n, k] = packed[n // 32, k // 2, n % 32, k % 2]

Example, N = 64, K = 4: packed[1, 0] holds w[32, 0], w[32, 1], w[33, 0], w[33, 1], ..., w[63, 1], and
packed[1, 1] the same rows at k = 2, 3. layers/packed.py packs a loaded model's weights.
"""

from __future__ import annotations

import torch
from torch import nn

from redline.kernels.quantized_layout import is_quantized, rows_of

PACK_ROWS = 32  # csrc/kernels.h PACK_ROWS


def packable(weight: torch.Tensor) -> bool:
    return (
        weight.dim() == 2
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[0] % PACK_ROWS == 0
        and weight.shape[1] % 2 == 0
        and weight.numel() > 0
    )


def is_packed(weight: torch.Tensor) -> bool:
    return weight.dim() == 4


def pack(weight: torch.Tensor) -> torch.Tensor:  # [N, K] -> [N / 32, K / 2, 32, 2]
    n, k = weight.shape
    return weight.reshape(n // PACK_ROWS, PACK_ROWS, k // 2, 2).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:  # [N / 32, K / 2, 32, 2] -> [N, K]
    blocks, pairs, rows, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * rows, pairs * 2)


def out_features(weight: torch.Tensor) -> int:  # N of a weight [N, K], packed or quantized
    """Example: packed [2, 288, 32, 2] has 64; quantized (quantized_layout.py) [2, 18, 640] has 2 * 32."""
    if is_packed(weight):
        return weight.shape[0] * weight.shape[2]
    return weight.shape[0] * PACK_ROWS if weight.dim() == 3 else weight.shape[0]


def embedding_rows(
    table: torch.Tensor,  # [V, H], packed or quantized
    ids: torch.Tensor,  # [...]
    dtype: torch.dtype = torch.bfloat16,  # a quantized table's rows' (the model's)
) -> torch.Tensor:  # [..., H]
    """table[ids] of a table [V, H], packed, or quantized (rows in dtype: quantized_layout.rows_of).
    Example: id 37 of a packed table is packed[1, :, 5] ([H / 2, 2]: its pairs of features), flattened."""
    if is_quantized(table):
        return rows_of(table, ids, dtype)
    if not is_packed(table):
        return nn.functional.embedding(ids, table)
    flat = ids.reshape(-1)
    rows = table[flat // PACK_ROWS, :, flat % PACK_ROWS]  # [T, H / 2, 2]: the indexed dims come first
    return rows.reshape(*ids.shape, table.shape[1] * 2)  # no -1: ids may be empty
