"""A linear whose inputs are taken in another order: an act-order GPTQ (or compressed-tensors `actorder:
group`) checkpoint's groups are runs of inputs only once the inputs are sorted by group (models/
int_checkpoint.input_order), so its weight's columns are stored sorted and the input is permuted to match:
W[:, order] @ x[order] = W @ x. Example, order [1, 3, 0, 2]: x [a, b, c, d] is multiplied as [b, d, a, c].
Such a linear is not fused with its neighbours (q/k/v, gate/up) and its layer runs op by op."""

from __future__ import annotations

import torch
from torch import nn


class InputOrdered(nn.Module):
    def __init__(self, linear: nn.Module, order: torch.Tensor) -> None:  # order [in_features] int64
        super().__init__()
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("order", order)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        return self.linear(x.index_select(-1, self.order))
