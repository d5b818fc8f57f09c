"""Swapping a model's decoder linears (and Llama 4 experts) for FP8 modules."""

from __future__ import annotations

from redline.layers.linear import Linear
from redline.layers.moe import Experts
from redline.models.llama import LlamaForCausalLM
from redline.quant.fp8 import Fp8Experts, Fp8Linear
from redline.quant.scheme import Fp8Scheme

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HIGH_PRECISION = ["lm_head", "re:.*router$"]  # plus embeddings and norms, which are not Linear


def to_fp8(model: LlamaForCausalLM, scheme: Fp8Scheme, scaled_mm: bool) -> None:
    """Replaces model.layers.*'s linears and experts in place. Real weights are quantized; on the meta
    device this makes the empty FP8 modules a quantized checkpoint loads into."""
    for parent_name, parent in list(model.model.layers.named_modules(prefix="model.layers")):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}"
            if scheme.keeps_high_precision(full):
                continue
            if isinstance(child, Linear) and name in QUANTIZED:
                setattr(parent, name, Fp8Linear.from_linear(child, scaled_mm))
            elif isinstance(child, Experts):
                setattr(parent, name, Fp8Experts.from_experts(child))
