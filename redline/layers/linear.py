"""nn.Linear with a faster product for the few rows of a decode step on CPU.

torch's CPU fp32 GEMM packs the weight for every call, so x[M, K] @ W[N, K]^T costs about M times the
M = 1 product for M = 2..8: a K = 3 verify step (M = 4) would cost three plain steps. Computed as
W @ x^T ([N, K] @ [K, M] -> [N, M], transposed back as a view), the same product streams W once and
costs about what M = 1 does (benchmarks/compiled_step.py; BENCHMARKS.md). bf16 is the other way round
on the same machine, so it keeps the default path.
"""

from __future__ import annotations

import torch
from torch import nn

FEW_ROWS = 8


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in_features]
        rows = x.numel() // self.in_features
        if rows > FEW_ROWS or not self.weight.is_cpu or self.weight.dtype != torch.float32:
            return super().forward(x)
        flat = x.reshape(rows, self.in_features)
        y = torch.mm(self.weight, flat.t()).t()  # [rows, out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)
