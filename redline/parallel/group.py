"""The tensor-parallel group a model runs in: this process's rank, the group's size, and the collectives
its layers use.

The collectives are torch's functional collectives (`torch.distributed._functional_collectives`): they
return new tensors instead of writing in place, so torch.compile(fullgraph=True) traces them into the
step's graph. On CPU the group is gloo (how tests run here), on CUDA NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None: one rank, nothing to reduce
    expert_parallel: bool = False  # MoE experts: E / N whole experts per rank, not a block of each

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (x itself on one rank)."""
        if self.size == 1:
            return x
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", self.group))

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dimension, in rank order, by one all-reduce: each
        rank places its block in zeros of the whole width, and every element is nonzero on one rank
        only, so the sum is exact. x [..., 4] on 2 ranks -> [..., 8], rank 1's x in [..., 4:8]."""
        if self.size == 1:
            return x
        width = x.shape[-1]
        placed = torch.nn.functional.pad(x, (self.rank * width, (self.size - 1 - self.rank) * width))
        return self.all_reduce(placed)

    def from_first_rank(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank. A step with an EAGLE-3 draft sends its tokens through it: the draft
        is replicated and may round differently on different ranks (a BLAS choosing another kernel),
        and ranks that proposed different tokens would feed different inputs to the next all-reduce.
        (Without a draft every rank already holds the same all-reduced logits, hence the same tokens.)"""
        if self.size == 1:
            return x
        return funcol.wait_tensor(funcol.broadcast(x, 0, self.group))

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (value itself on one rank): what all ranks can agree on,
        such as the KV pool's size when each rank measured its own memory."""
        if self.size == 1:
            return value
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        x = torch.tensor([value], dtype=torch.int64, device=device)
        return int(funcol.wait_tensor(funcol.all_reduce(x, "min", self.group)).item())

    @classmethod
    def current(cls, expert_parallel: bool = False) -> TensorParallel:
        """The default process group as the tensor-parallel group (one rank when none is initialized)."""
        if not dist.is_initialized():
            return cls()
        return cls(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, expert_parallel)


SINGLE = TensorParallel()  # one rank: the default everywhere
