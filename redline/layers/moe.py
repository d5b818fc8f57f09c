"""Llama 4 mixture of experts: top-k sigmoid router, routing weight on the expert input, shared expert.

Few tokens (decode: N * top_k <= E) gather each row's chosen expert weights. Many tokens (prefill) sort
the N * top_k (token, choice) pairs by expert and run one grouped GEMM over the contiguous groups
(kernels/grouped_mm.py), so the work is proportional to N * top_k, not to N * E.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from redline.kernels.grouped_mm import grouped_mm
from redline.layers.backends import TORCH, Backends, backend_name
from redline.layers.linear import Linear
from redline.layers.mlp import MLP
from redline.parallel.group import SINGLE, TensorParallel


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

    def forward_grouped(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Rows grouped by expert, each group through its expert: x [M, hidden] sorted by expert,
        offs [E] int32 group ends (offs[E-1] == M) -> [M, hidden]"""
        gate, up = grouped_mm(x, self.gate_up_proj, offs).chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, self.down_proj, offs)


def sort_by_expert(expert: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The order that groups pairs by expert (stable) and each expert's group end.

    expert [P] -> order [P] (pair indices, grouped by expert), offs [E] int32
    e.g. expert = [2, 0, 2, 0, 3], E = 4: order = [1, 3, 0, 2, 4] (sorted experts [0, 0, 2, 2, 3]);
    offs[e] = number of sorted experts <= e = [2, 2, 4, 5] (expert 1 owns rows 2:2, none)
    """
    sorted_expert, order = torch.sort(expert, stable=True)
    ids = torch.arange(num_experts, device=expert.device, dtype=expert.dtype)
    return order, torch.searchsorted(sorted_expert, ids, right=True, out_int32=True)


def routed_sorted(
    x: torch.Tensor,  # [N, hidden]
    top_expert: torch.Tensor,  # [N, k] chosen experts
    weight: torch.Tensor,  # [N, k] routing weights, x's dtype
    experts: nn.Module,  # forward_grouped(x [M, hidden] sorted, offs [E]) -> [M, hidden]
    num_experts: int,
    elsewhere: bool = False,
) -> torch.Tensor:  # [N, hidden]: sum over j of expert top_expert[:, j] applied to weight[:, j] * x
    """Every (token, choice) pair through its expert in one grouped pass; cost proportional to N * k.

    Pair p = r * k + j is token r's j-th choice. Example, k = 2, top_expert = [[1, 0], [1, 2]]:
    pairs' experts [1, 0, 1, 2] -> order [1, 0, 2, 3], tokens order // k = [0, 0, 1, 1];
    outputs come back to pair positions through order, then [N, k, hidden] sums over k.
    With `elsewhere` (expert parallel), a choice of num_experts is another rank's expert: its pairs sort
    after the last group, are not computed here, and give 0 (their rows past offs[E-1] are zeroed).
    """
    n, k = top_expert.shape
    order, offs = sort_by_expert(top_expert.reshape(-1), num_experts)
    routed_in = x[order // k] * weight.reshape(-1, 1)[order]  # [N * k, hidden], grouped by expert
    out = experts.forward_grouped(routed_in, offs)
    if elsewhere:  # rows offs[E-1]: were not computed (torch.empty or no group's)
        computed = torch.arange(out.shape[0], device=out.device) < offs[-1]
        out = torch.where(computed[:, None], out, 0)
    by_pair = torch.empty_like(out).index_copy_(0, order, out)  # by_pair[order[i]] = out[i]
    return by_pair.view(n, k, -1).sum(dim=1)


class MoE(nn.Module):
    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        tp: TensorParallel = SINGLE,
        backends: Backends = TORCH,
    ):
        """inter: this rank's expert width (parallel/sharding.local_config). With tp.expert_parallel this
        rank holds experts [r E/N, (r + 1) E/N) whole and a 1/N block of the shared expert's width; many
        tokens (prefill) run only the pairs that chose this rank's experts, few tokens (decode, fixed
        shapes for CUDA graphs) run every row, other ranks' choices at weight 0."""
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = Linear(hidden, num_experts, False, backends.few_rows)
        local = num_experts // tp.size if tp.expert_parallel else num_experts
        self.first_expert = tp.rank * local if tp.expert_parallel else 0
        self.experts = Experts(local, hidden, inter)
        self.shared_expert = MLP(hidden, inter // tp.size if tp.expert_parallel else inter, backends=backends)
        # a top-1 dispatch kernel for few tokens, reading only the chosen experts' weights:
        # (x [N, H], expert [N], weight [N], gate_up [E, H, 2I], down [E, I, H]) -> [N, H]
        self.top1 = backends.moe_top1 if top_k == 1 else None

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, few_tokens={backend_name(self.top1)}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
        shape, sequences = x.shape, x  # router and shared expert see [B, T, hidden]: linear.product's rule
        x = x.reshape(-1, shape[-1])  # [N, hidden]
        logits = self.router(sequences).reshape(-1, self.num_experts)  # [N, E]
        top_logit, top_expert = torch.topk(logits, self.top_k, dim=-1)  # [N, k]
        weight = torch.sigmoid(top_logit.float()).to(x.dtype)
        local = self.experts.down_proj.shape[0]
        elsewhere = local < self.num_experts  # expert parallel: some choices are other ranks' experts
        if elsewhere:
            # their choices become `local` (no expert here) and weigh 0; e.g. 8 experts, rank 1 of 2
            # (experts 4-7): choices [5, 2] -> [1, 4], weights [w, 0]
            top_expert = top_expert - self.first_expert
            mine = (top_expert >= 0) & (top_expert < local)
            weight = weight * mine.to(weight.dtype)
            top_expert = torch.where(mine, top_expert, local)
        n = x.shape[0]
        few_tokens = n * self.top_k <= self.num_experts
        # few rows gather their experts' weights: another rank's choice runs the last one at weight 0
        selected = top_expert.clamp(max=local - 1) if elsewhere else top_expert
        if few_tokens and self.top1 is not None:  # set only when top_k == 1
            experts = self.experts
            routed = self.top1(x, selected[:, 0], weight[:, 0], experts.gate_up_proj, experts.down_proj)
        elif few_tokens:
            # Few tokens (decode): gather the chosen experts' weights; row r*k + j is token r's j-th choice.
            routed_in = x.repeat_interleave(self.top_k, dim=0) * weight.reshape(-1, 1)
            routed = self.experts.forward_selected(routed_in, selected.reshape(-1))
            routed = routed.view(n, self.top_k, -1).sum(dim=1)
        else:
            routed = routed_sorted(x, top_expert, weight, self.experts, local, elsewhere)
        return (self.shared_expert(sequences).reshape(-1, shape[-1]) + routed).view(shape)
