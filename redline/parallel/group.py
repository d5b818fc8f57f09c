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

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (x itself on one rank)."""
        if self.size == 1:
            return x
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", self.group))

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x, concatenated along dim in rank order."""
        if self.size == 1:
            return x
        gathered = funcol.wait_tensor(funcol.all_gather_tensor(x.movedim(dim, 0).contiguous(), 0, self.group))
        return gathered.movedim(0, dim)

    def from_first_rank(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank. The step's tokens go through it: the replicated parts of the model
        (lm_head, the draft) may round differently on different ranks (a BLAS choosing another kernel),
        and ranks that emitted different tokens would feed different inputs to the next all-reduce."""
        if self.size == 1:
            return x
        return funcol.wait_tensor(funcol.broadcast(x, 0, self.group))

    @classmethod
    def current(cls) -> TensorParallel:
        """The default process group as the tensor-parallel group (one rank when none is initialized)."""
        if not dist.is_initialized():
            return cls()
        return cls(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)


SINGLE = TensorParallel()  # one rank: the default everywhere
