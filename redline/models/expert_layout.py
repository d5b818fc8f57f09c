"""Llama 4 experts stored one projection per expert, as nn.Linear weights ([out, in]): how each fills the
fused tensors redline computes with (layers/moe.py `Experts`, quant/fp8_experts.py `Fp8Experts`).

llm-compressor writes this layout for the FP8 Llama 4 releases (RedHatAI/Llama-4-Scout-17B-16E-Instruct-
FP8-dynamic, Maverick FP8): it unpacks the experts into Llama4TextMLP modules before quantizing, so every
`experts.N.{gate,up,down}_proj` is a Linear with its own `weight_scale` ([out, 1], per output channel).
vLLM reads the same keys into its fused w13 / w2 (FusedMoE.make_expert_params_mapping).

    experts.N.gate_proj.weight [I, H]   -> gate_up_proj[N, :, :I]   ([H, I], transposed)
    experts.N.up_proj.weight   [I, H]   -> gate_up_proj[N, :, I:]
    experts.N.down_proj.weight [H, I]   -> down_proj[N]             ([I, H], transposed)
    experts.N.gate_proj.weight_scale [I, 1] -> gate_up_proj_scale[N, :, :I]   ([1, I])
    experts.N.up_proj.weight_scale   [I, 1] -> gate_up_proj_scale[N, :, I:]
    experts.N.down_proj.weight_scale [H, 1] -> down_proj_scale[N]             ([H, 1], as stored)

FP8 values move unchanged (a transpose is exact), so the fused FP8 tensors equal a fused checkpoint's.
"""

from __future__ import annotations

import re

from redline.models.loader import Part

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
