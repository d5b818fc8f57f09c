"""A loaded model's linear weights packed for the CPU product kernel (kernels/packed_layout.py: [N, K] as
[N / 32, K / 2, 32, 2]), where the backends choose it (Backends.packed_weights). The kernel then reads each
weight once for all the rows of a step with no horizontal sums: a 4-row verify step cost about what a 1-row
step does, where the row-major kernel took twice as long, and prompts ran as fast as torch's bf16 GEMM
(BENCHMARKS.md "Packed weights").

`pack_weights` packs fused q/k/v and gate/up whole (their parts become views of the packed whole), and an
embedding table tied to a head (the lookup gathers rows from the packed table: embedding_rows). A weight
whose N is not a multiple of 32 or whose K is odd stays [N, K] (the row-major kernel takes it), and so
does a fused weight any of whose parts is not (head_dim 80 with one kv head: k and v of 80 rows).
"""

from __future__ import annotations

import torch
from torch import nn

from redline.kernels.packed_layout import PACK_ROWS, pack, packable
from redline.layers.linear import Linear
from redline.parallel.vocab import VocabParallelEmbedding

FUSED = {"qkv_weight": ("q_proj", "k_proj", "v_proj"), "gate_up_weight": ("gate_proj", "up_proj")}


def pack_weights(model: nn.Module) -> None:
    """Packs the model's packable linear weights in place (see the module's doc); a weight shared by several
    modules (a tied table, a draft's head that is the target's) is packed once and stays shared."""
    unpacked_parts: set[int] = set()  # linears whose weights are views of a fused weight left [N, K]
    for module in model.modules():
        for name, part_names in FUSED.items():
            fused = getattr(module, name, None)
            if fused is None:
                continue
            parts = [getattr(module, p) for p in part_names]
            if not packable(fused) or any(p.out_features % PACK_ROWS for p in parts):
                unpacked_parts.update(id(p) for p in parts)
                continue
            whole = pack(fused)
            setattr(module, name, whole)
            start = 0  # in blocks of PACK_ROWS rows
            for part in parts:
                end = start + part.out_features // PACK_ROWS
                part.weight = nn.Parameter(whole[start:end], requires_grad=False)
                start = end
    owners: dict[int, tuple[torch.Tensor, list[nn.Module]]] = {}  # id of a weight -> (it, who holds it)
    for module in model.modules():
        if isinstance(module, Linear) and id(module) not in unpacked_parts and packable(module.weight):
            owners.setdefault(id(module.weight), (module.weight, []))[1].append(module)
    for module in model.modules():  # a table tied to a head: the lookup reads the packed one
        if isinstance(module, VocabParallelEmbedding) and id(module.weight) in owners:
            owners[id(module.weight)][1].append(module)
    while owners:  # one at a time, each original freed before the next: one weight's worth of extra memory
        _, (weight, holders) = owners.popitem()
        packed = nn.Parameter(pack(weight.detach()), requires_grad=False)
        for module in holders:
            module.weight = packed
        del weight, holders, packed
