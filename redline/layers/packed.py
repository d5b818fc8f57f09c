"""A loaded model's linear weights packed for the CPU product kernel (kernels/packed_layout.py: [N, K] as
[N / 32, K / 2, 32, 2]), where the backends choose it (Backends.packed_weights). The kernel then reads each
weight once for all the rows of a step with no horizontal sums: a 4-row verify step's products cost about
what 1-row ones do (1.4-1.7x with the row-major kernel), and prompts run at least as fast as torch's bf16
GEMM (BENCHMARKS.md "Packed weights").

Fused q/k/v and gate/up are packed whole when fused (linear.fuse_weights: their parts become views of
the packed whole); `pack_weights` packs the other linears, and an embedding table tied to a head (the
lookup gathers rows from the packed table: embedding_rows). A weight whose N is not a multiple of 32 or
whose K is odd stays [N, K] (the row-major kernel takes it), and so does a fused weight any of whose parts
is not (head_dim 80 with one kv head: k and v of 80 rows).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from redline.kernels.packed_layout import pack, packable
from redline.layers.linear import Linear
from redline.parallel.vocab import VocabParallelEmbedding


def pack_weights(model: nn.Module) -> None:
    """Packs the model's packable linear weights in place (see the module's doc); a weight shared by several
    modules (a tied table, a draft's head that is the target's) is packed once and stays shared. Fused
    weights were packed when fused (linear.fuse_weights); the parts of one left [N, K] (several weights on
    one storage) stay as they are."""
    owners: dict[int, tuple[torch.Tensor, list[nn.Module]]] = {}  # id of a weight -> (it, who holds it)
    linears = {id(m.weight): m.weight for m in model.modules() if isinstance(m, Linear)}
    for module in model.modules():
        if isinstance(module, Linear) and packable(module.weight):
            owners.setdefault(id(module.weight), (module.weight, []))[1].append(module)
    # every linear's weight counts, packable or not: q_proj (160 rows) beside k and v of 80 is a part too
    weights_of_storage = Counter(w.untyped_storage().data_ptr() for w in linears.values())
    for key, (weight, _) in list(owners.items()):
        if weights_of_storage[weight.untyped_storage().data_ptr()] > 1:  # parts of a fused weight
            del owners[key]
    for module in model.modules():  # a table tied to a head: the lookup reads the packed one
        if isinstance(module, VocabParallelEmbedding) and id(module.weight) in owners:
            owners[id(module.weight)][1].append(module)
    while owners:  # one at a time, each original freed before the next: one weight's worth of extra memory
        _, (weight, holders) = owners.popitem()
        packed = nn.Parameter(pack(weight.detach()), requires_grad=False)
        for module in holders:
            module.weight = packed
        del weight, holders, packed
