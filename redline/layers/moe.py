"""Llama 4 mixture of experts: top-k sigmoid router, routing weight on the expert input, shared expert."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from redline.layers.linear import Linear
from redline.layers.mlp import MLP


class Experts(nn.Module):
    """Expert weights stored fused, in x @ W orientation, as Llama 4 checkpoints hold them."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * inter))  # gate first
        self.down_proj = nn.Parameter(torch.empty(num_experts, inter, hidden))

    def forward_selected(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Each row through its own expert, reading only the selected experts' weights.

        x [N, hidden], expert [N] -> [N, hidden]
        """
        gate, up = torch.bmm(x[:, None, :], self.gate_up_proj[expert]).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, self.down_proj[expert])[:, 0]

    def forward_all(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert over its own copy of the tokens. x [E, N, hidden] -> [E, N, hidden]"""
        gate, up = torch.bmm(x, self.gate_up_proj).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, self.down_proj)


class MoE(nn.Module):
    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, inter)
        self.shared_expert = MLP(hidden, inter)
        # kernels.select may set a top-1 dispatch kernel for few tokens:
        # (x [N, H], expert [N], weight [N], gate_up [E, H, 2I], down [E, I, H]) -> [N, H]
        self.top1: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, hidden]
        top_logit, top_expert = torch.topk(self.router(x), self.top_k, dim=-1)  # [N, k]
        weight = torch.sigmoid(top_logit.float()).to(x.dtype)
        n = x.shape[0]
        few_tokens = n * self.top_k <= self.num_experts
        if few_tokens and self.top1 is not None:  # set only when top_k == 1
            experts = self.experts
            routed = self.top1(x, top_expert[:, 0], weight[:, 0], experts.gate_up_proj, experts.down_proj)
        elif few_tokens:
            # Few tokens (decode): gather the chosen experts' weights; row r*k + j is token r's j-th choice.
            routed_in = x.repeat_interleave(self.top_k, dim=0) * weight.reshape(-1, 1)
            routed = self.experts.forward_selected(routed_in, top_expert.reshape(-1))
            routed = routed.view(n, self.top_k, -1).sum(dim=1)
        else:
            # Many tokens (prefill): all experts, each token scaled by its weight there (0 where unchosen).
            dense_weight = torch.zeros(n, self.num_experts, dtype=x.dtype, device=x.device)
            dense_weight.scatter_(1, top_expert, weight)
            routed = self.experts.forward_all(x[None] * dense_weight.T[:, :, None]).sum(dim=0)
        return (self.shared_expert(x) + routed).view(shape)
