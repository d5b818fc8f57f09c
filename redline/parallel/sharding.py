"""Megatron-style sharding of a Llama model over N tensor-parallel ranks.

Column-parallel (each rank holds a block of output rows): q_proj, k_proj, v_proj, gate_proj, up_proj.
Row-parallel (a block of input columns; the ranks' partial outputs are summed by one all-reduce after
attention and one after the MLP): o_proj, down_proj. Vocabulary-parallel (a block of rows, vocab.py):
embed_tokens, lm_head. Replicated: norms, the MoE router. Llama 4 experts, routed and shared, split the
same way, by a block of every expert's intermediate dimension (gate and up columns of gate_up_proj
[E, H, 2I], rows of down_proj [E, I, H]). With expert parallelism a rank holds E / N whole routed experts
instead, and a token's choice of another rank's expert weighs 0 here (layers/moe.py), so the MLP's
all-reduce adds each routed output once.

Attention heads split with their projections: rank r holds query heads [r H/N, (r + 1) H/N). Key/value
heads split the same way when N divides their count; with fewer KV heads than ranks (N a multiple of
KV) each rank holds the one KV head its query heads read. Example, 8 query heads, 2 KV heads, N = 4:
rank 2 holds query heads 4, 5 and KV head 1 (query head j reads KV head j // 4).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from redline.config import ConfigError, ModelConfig
from redline.parallel.vocab import vocab_block

COLUMN = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias|weight_scale)$")
ROW = re.compile(r"\.(o_proj|down_proj)\.(weight|bias|weight_scale|input_scale)$")
EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)(_scale)?$")
VOCAB = ("model.embed_tokens.weight", "lm_head.weight", "lm_head.weight_scale")


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor a rank loads: tensor[index], or zeros of its shape when `zeroed`
    (a row-parallel bias lives on rank 0 only, so the all-reduce adds it once), or, with `also`, the
    concatenation along the last dimension of tensor[index] and tensor[also] (the gate and the up
    columns of a fused gate_up_proj)."""

    index: tuple[slice, ...]
    zeroed: bool = False
    also: tuple[slice, ...] | None = None
    rows: int | None = None  # zero rows appended up to this many (the last vocabulary block's padding)


def check_divisible(config: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Raises ConfigError unless the model splits evenly over `size` ranks."""
    problems = []
    if expert_parallel and not config.num_experts:
        problems.append("expert parallelism without experts")
    if expert_parallel and config.num_experts % size:
        problems.append(f"{config.num_experts} experts")
    if config.num_heads % size:
        problems.append(f"{config.num_heads} attention heads")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        problems.append(f"{kv} key/value heads (need a multiple or a divisor of the ranks)")
    if config.intermediate_size % size:
        problems.append(f"an MLP width of {config.intermediate_size}")
    if config.expert_intermediate_size % size:
        problems.append(f"an expert width of {config.expert_intermediate_size}")
    if problems:
        raise ConfigError(f"cannot split the model over {size} tensor-parallel ranks: {', '.join(problems)}")


def vocab_shard(vocab: int, rank: int, size: int) -> Shard:
    """Rank's rows of an embedding or head: [r B, (r + 1) B), B = ceil(vocab / size), the last block padded
    with zero rows (vocab 10, size 4: rank 3 reads row 9 and pads 2)."""
    block = vocab_block(vocab, size)
    return Shard((slice(rank * block, min((rank + 1) * block, vocab)),), rows=block)


def local_config(config: ModelConfig, size: int, expert_parallel: bool = False) -> ModelConfig:
    """The config of one rank's shard: its heads, KV heads and MLP widths (the routed experts' whole
    width under expert parallelism: the MoE splits only its shared expert then)."""
    check_divisible(config, size, expert_parallel)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=max(1, config.num_kv_heads // size),
        intermediate_size=config.intermediate_size // size,
        expert_intermediate_size=config.expert_intermediate_size // (1 if expert_parallel else size),
    )


def shard_of(
    config: ModelConfig, module_key: str, rank: int, size: int, expert_parallel: bool = False
) -> Shard | None:
    """What `rank` loads of the full tensor behind module_key; None: the whole tensor (replicated)."""
    if size == 1:
        return None
    if module_key in VOCAB:
        return vocab_shard(config.vocab_size, rank, size)
    expert_width = config.expert_intermediate_size  # routed and shared experts
    mlp_width = expert_width if ".shared_expert." in module_key else config.intermediate_size
    if (m := EXPERTS.search(module_key)) and expert_parallel:  # whole experts
        block = config.num_experts // size
        return Shard((slice(rank * block, (rank + 1) * block),))
    if m:
        block = expert_width // size
        mine = slice(rank * block, (rank + 1) * block)
        if m.group(1) == "down_proj":  # [E, I, H]: rows of I; its scale [E, H, 1] is per output: whole
            return None if m.group(2) else Shard((slice(None), mine))
        # gate_up_proj [E, H, 2I] and gate_up_proj_scale [E, 1, 2I]: gate | up columns
        up = slice(expert_width + mine.start, expert_width + mine.stop)
        return Shard((slice(None), slice(None), mine), also=(slice(None), slice(None), up))
    if m := COLUMN.search(module_key):
        return Shard((_output_rows(config, m.group(1), mlp_width, rank, size),))
    if m := ROW.search(module_key):
        if m.group(2) == "bias":
            return Shard((), zeroed=rank != 0)
        if m.group(2) != "weight":  # FP8 scales: per output channel or per tensor, neither split
            return None
        width = config.num_heads * config.head_dim if m.group(1) == "o_proj" else mlp_width
        block = width // size
        return Shard((slice(None), slice(rank * block, (rank + 1) * block)))
    return None


def _output_rows(config: ModelConfig, projection: str, mlp_width: int, rank: int, size: int) -> slice:
    """The rows of a column-parallel projection that `rank` holds."""
    d = config.head_dim
    if projection == "q_proj":
        heads = config.num_heads // size
        return slice(rank * heads * d, (rank + 1) * heads * d)
    if projection in ("k_proj", "v_proj"):
        kv = config.num_kv_heads
        first = rank * kv // size  # kv >= size: kv / size heads from here; else the one head shared
        return slice(first * d, (first + max(1, kv // size)) * d)
    block = mlp_width // size
    return slice(rank * block, (rank + 1) * block)
