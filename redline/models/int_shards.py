"""What a tensor-parallel rank reads of a weight-only integer checkpoint (GPTQ, AWQ, compressed-tensors
pack-quantized: their tensors in models/int_checkpoint.py): the codes, scales and zeros of the rows or
inputs parallel/sharding.py gives the rank of the weight they stand for, read in the checkpoint's own
packing, so a rank's codes are one process's codes of its part and nothing is re-quantized.

A column-parallel linear's rank holds outputs [n0, n1) of N; a row-parallel one's inputs [k0, k1) of K.
Along each tensor dimension a unit is one output or input, a word of 32 / bits packed codes, or a group
of inputs sharing a scale. Example, GPTQ int4 in groups of 32, o_proj with K = 128 over 2 ranks, rank 1
(inputs [64, 128)): qweight [K / 8, N] reads rows [8, 16), scales [K / 32, N] and qzeros rows [2, 4), g_idx
inputs [64, 128), whose groups 2, 3 the linear counts from 0 (CheckpointLinear.first_group = 2).

Act order (a permuted g_idx) puts a group's inputs anywhere in K, so a row-parallel rank would hold parts
of groups: such checkpoints run in one process (models/build.py refuses them by name), but for one group a
row (per channel), whose g_idx is all zeros.
"""

from __future__ import annotations

from redline.config import ModelConfig
from redline.parallel import sharding
from redline.parallel.sharding import Shard
from redline.quant.int_scheme import IntScheme

ONE, WORD, GROUP = "one", "word", "group"  # the unit a tensor dimension counts

# tensor -> (its outputs' dimension and unit, its inputs' dimension and unit); None: not along it
AXES: dict[str, dict[str, tuple[tuple[int, str] | None, tuple[int, str] | None]]] = {
    "gptq": {
        "qweight": ((1, ONE), (0, WORD)),
        "qzeros": ((1, WORD), (0, GROUP)),
        "scales": ((1, ONE), (0, GROUP)),
        "g_idx": (None, (0, ONE)),
    },
    "awq": {
        "qweight": ((1, WORD), (0, ONE)),
        "qzeros": ((1, WORD), (0, GROUP)),
        "scales": ((1, ONE), (0, GROUP)),
    },
    "compressed-tensors": {
        "weight_packed": ((0, ONE), (1, WORD)),
        "weight_scale": ((0, ONE), (1, GROUP)),
        "weight_zero_point": ((0, WORD), (1, GROUP)),
        "weight_g_idx": (None, (0, ONE)),
        "weight_shape": (None, None),
    },
}


def int_shard_of(
    scheme: IntScheme,
    config: ModelConfig,
    module_key: str,
    rank: int,
    size: int,
    expert_parallel: bool = False,
) -> Shard | None:
    """What `rank` of `size` reads of the checkpoint tensor behind module_key (None: all of it): an int
    tensor's part by its layout (AXES), anything else (experts left in high precision too) as
    sharding.shard_of shards it."""
    linear, _, name = module_key.rpartition(".")
    axes = AXES[scheme.method].get(name)
    if axes is None or size == 1:
        return sharding.shard_of(config, module_key, rank, size, expert_parallel)
    weight = sharding.shard_of(config, f"{linear}.weight", rank, size)  # over the [N, K] weight
    if weight is None:
        return None
    column = len(weight.index) == 1  # rows of N; else (all of N, inputs of K)
    along = axes[0] if column else axes[1]
    if along is None:  # g_idx of a column-parallel rank: every input; weight_shape: the file's
        return None
    part = weight.index[0] if column else weight.index[1]
    dimension, unit = along
    if unit == GROUP and scheme.group is None:  # per channel: one group, every rank's
        return None
    per = {ONE: 1, WORD: 32 // scheme.bits, GROUP: scheme.group}[unit]
    if part.start % per or part.stop % per:
        whose = "outputs" if column else "inputs"
        where = f"{linear}: rank {rank}'s {whose} [{part.start}, {part.stop}) of {size} ranks"
        raise ValueError(
            f"{where} split {unit}s of {per} in {name} ({scheme}): choose ranks that keep them whole"
        )
    index = (slice(None),) * dimension + (slice(part.start // per, part.stop // per),)
    return Shard(index)


def first_group(scheme: IntScheme, module_key: str, inputs: int, rank: int, size: int) -> int:
    """The first group of a linear's inputs on `rank` (a row-parallel rank holds inputs [r K', (r + 1) K')
    of K' = inputs each); 0 for a column-parallel or whole linear, or one group a row."""
    if size == 1 or scheme.group is None or not sharding.ROW.search(f"{module_key}.weight"):
        return 0
    return rank * inputs // scheme.group
