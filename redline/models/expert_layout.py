"""Llama 4 experts stored one projection per expert, as nn.Linear weights ([out, in]): how each fills the
fused tensors redline computes with (layers/moe.py `Experts`, quant/fp8_experts.py `Fp8Experts`).
The FP8 Llama 4 releases (llm-compressor's RedHatAI/...-FP8-dynamic) store their experts so, each
projection with its own `weight_scale` ([out, 1], per output channel):

    experts.N.gate_proj.weight [I, H]   -> gate_up_proj[N, :, :I]   ([H, I], transposed)
    experts.N.up_proj.weight   [I, H]   -> gate_up_proj[N, :, I:]
    experts.N.down_proj.weight [H, I]   -> down_proj[N]             ([I, H], transposed)
    experts.N.gate_proj.weight_scale [I, 1] -> gate_up_proj_scale[N, :, :I]   ([1, I])
    experts.N.up_proj.weight_scale   [I, 1] -> gate_up_proj_scale[N, :, I:]
    experts.N.down_proj.weight_scale [H, 1] -> down_proj_scale[N]             ([H, 1], as stored)

FP8 values move unchanged (a transpose is exact), so the fused FP8 tensors equal a fused checkpoint's.
"""

from __future__ import annotations

import dataclasses
import re

from redline.models.loader import Part
from redline.parallel.group import TensorParallel
from redline.parallel.sharding import Shard

_PER_EXPERT = re.compile(
    r"(?P<experts>.+\.experts)\.(?P<n>\d+)\.(?P<proj>gate|up|down)_proj\.(?P<what>weight(?:_scale)?)$"
)


def per_expert_part(module_key: str, inter: int) -> Part | None:
    """The Part of a fused expert tensor that a per-expert key fills; None for any other key.

    model.layers.1.mlp.experts.3.up_proj.weight, inter 8 ->
    Part("model.layers.1.mlp.experts.gate_up_proj", (3, slice(None), slice(8, 16)), transpose=True)"""
    match = _PER_EXPERT.match(module_key)
    if match is None:
        return None
    n, proj, what = int(match["n"]), match["proj"], match["what"]
    suffix = "_scale" if what == "weight_scale" else ""
    if proj == "down":
        # down_proj [E, I, H] takes the weight [H, I] transposed; down_proj_scale [E, H, 1] the scale as is
        return Part(f"{match['experts']}.down_proj{suffix}", (n,), transpose=not suffix)
    columns = slice(0, inter) if proj == "gate" else slice(inter, 2 * inter)
    return Part(f"{match['experts']}.gate_up_proj{suffix}", (n, slice(None), columns), transpose=True)


def rank_part(part: Part, inter: int, num_experts: int, tp: TensorParallel) -> Part | None:
    """What rank tp.rank loads of a per-expert tensor (`per_expert_part` of it, full width `inter`), into
    its own fused tensors; None: another rank's expert (expert parallel).

    Tensor parallel, width I = 8 over N = 2, rank 1 (local width 4): experts.3.up_proj.weight [8, H] ->
    rows 4:8 (Shard) into gate_up_proj[3, :, 4:8] (local columns: gate 0:4, up 4:8); down_proj.weight
    [H, 8] -> columns 4:8 into down_proj[3]; down_proj.weight_scale [H, 1] (per output channel) whole.
    Expert parallel, 8 experts over N = 2: rank 1 takes experts 4-7 whole, expert 5 into slot 1."""
    if tp.size == 1:
        return part
    n = part.index[0]
    if tp.expert_parallel:
        local = num_experts // tp.size
        mine = tp.rank * local <= n < (tp.rank + 1) * local
        return dataclasses.replace(part, index=(n - tp.rank * local, *part.index[1:])) if mine else None
    block = inter // tp.size
    rows = slice(tp.rank * block, (tp.rank + 1) * block)
    if part.module_key.endswith("down_proj"):  # weight [H, I]: columns of I
        return dataclasses.replace(part, shard=Shard((slice(None), rows)))
    if part.module_key.endswith("down_proj_scale"):  # [H, 1]: per output channel, not split
        return part
    gate = part.index[2].start == 0  # gate_up columns 0:I (gate) or I:2I (up)
    columns = slice(0, block) if gate else slice(block, 2 * block)
    return dataclasses.replace(part, index=(n, slice(None), columns), shard=Shard((rows,)))
