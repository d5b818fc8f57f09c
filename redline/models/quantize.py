"""Swapping a model's decoder linears (and Llama 4 experts) for FP8 modules: the empty modules an FP8
checkpoint loads into, or quantized copies of loaded high-precision modules (all at once with `to_fp8`,
or each as soon as its weights are read with `QuantizeOnLoad`, which also makes int4 and int8 weight-only
linears)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from redline.kernels import quantized_layout
from redline.layers.linear import Linear
from redline.layers.moe import Experts
from redline.models.huge_pages import trim_heap
from redline.models.loader import PendingModules
from redline.quant.fp8 import Fp8Linear, Kind
from redline.quant.fp8_experts import Fp8Experts
from redline.quant.int4 import Int4Linear, check_int4_shape
from redline.quant.scheme import Fp8Scheme
from redline.quant.weight_only_gpu import GpuWeightOnlyLinear

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HIGH_PRECISION = ["lm_head", "re:.*router$"]  # plus embeddings and norms, which are not Linear


def decoder_targets(
    model: nn.Module,
    scheme: Fp8Scheme,
    checkpoint_name: Callable[[str], str] = lambda name: name,
    experts: bool = True,  # int4 covers linears only
) -> Iterator[tuple[nn.Module, str, nn.Module, str]]:
    """(parent, attribute, module, full name) of every decoder linear and expert module FP8 covers."""
    for parent_name, parent in list(model.get_submodule("model.layers").named_modules(prefix="model.layers")):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}"
            if scheme.keeps_high_precision(full, checkpoint_name(full)):
                continue
            if (isinstance(child, Linear) and name in QUANTIZED) or (experts and isinstance(child, Experts)):
                yield parent, name, child, full


def fp8_skeleton(
    model: nn.Module, scheme: Fp8Scheme, scaled_mm: bool, checkpoint_name: Callable[[str], str]
) -> None:
    """On the meta device: replaces the modules an FP8 checkpoint in `scheme` holds in FP8 by empty FP8
    modules; checkpoint_name maps redline's module names to the checkpoint's, for the `ignore` list."""
    for parent, name, child, _ in list(decoder_targets(model, scheme, checkpoint_name)):
        if isinstance(child, Linear):
            shape = (child.in_features, child.out_features, child.bias is not None)
            fp8 = Fp8Linear(*shape, scheme.per_tensor, scaled_mm, scheme.static_input)
        else:
            experts, hidden, two_inter = child.gate_up_proj.shape
            fp8 = Fp8Experts(experts, hidden, two_inter // 2)
        setattr(parent, name, fp8)


def _quantized(module: nn.Module, scaled_mm: bool) -> nn.Module:
    if isinstance(module, Linear):
        return Fp8Linear.from_linear(module, scaled_mm)
    return Fp8Experts.from_experts(module)


def to_fp8(model: nn.Module, scheme: Fp8Scheme, scaled_mm: bool) -> None:
    """Replaces model.layers.*'s loaded linears and experts by quantized copies, in place."""
    for parent, name, child, _ in list(decoder_targets(model, scheme)):
        setattr(parent, name, _quantized(child, scaled_mm))


def quantized_weights(model: nn.Module, scheme: Fp8Scheme, experts: bool = True) -> dict[str, Kind]:
    """Module keys of the weights quantization turns into FP8, with the layout of their scales:
    {"model.layers.0.self_attn.q_proj.weight": "linear", "model.layers.1.mlp.experts.down_proj": "down"}"""
    weights: dict[str, Kind] = {}
    for _, _, child, full in decoder_targets(model, scheme, experts=experts):
        if isinstance(child, Linear):
            weights[f"{full}.weight"] = "linear"
        else:
            weights |= {f"{full}.gate_up_proj": "gate_up", f"{full}.down_proj": "down"}
    return weights


@dataclass(frozen=True)
class WeightOnly:
    """Weight-only quantization on load: `bits` (4 or 8) in groups of `group` along the input dimension.
    gpu: quant/weight_only_gpu.py's linears (a Triton kernel), the head as it is. On CPU, blocks: the C++
    kernels' layout (kernels/quantized_layout.py, held by the Linear itself, which the backends' product
    and one-call layer take: AVX-512 BF16's, or AVX2's, layers/linear.quantized_product), and the head in
    int8 once loaded (quantize_head); else int4 as quant/int4.py's Int4Linear (torch's int4 kernel) and
    int8 in the layout, multiplied by its dequantized weight (no kernel), the head as it is."""

    bits: int
    group: int
    blocks: bool
    dtype: torch.dtype  # the model's: Int4Linear computes in it
    gpu: bool = False

    def check(self, linear: Linear, name: str) -> None:
        if self.gpu:  # the GPU layout takes any rows
            quantized_layout.check_shape(linear.in_features, linear.out_features, self.group, name, rows=1)
        elif self.blocks or self.bits == 8:
            quantized_layout.check_shape(linear.in_features, linear.out_features, self.group, name)
        else:
            check_int4_shape(linear.in_features, linear.out_features, self.group, name)

    def head(self, head: torch.Tensor) -> torch.Tensor | None:  # the loaded head [V, H]
        """In the layout, int8 (HEAD_BITS) in groups of `group`: with blocks, where its shape fits."""
        weight = head.detach()
        if not self.blocks or weight.shape[0] % quantized_layout.BLOCK_ROWS or weight.shape[1] % self.group:
            return None
        return quantized_layout.quantize(weight, HEAD_BITS, self.group)

    def report(self) -> None:
        """Nothing to report: every weight is rounded by the same rule."""

    def ahead(self, linear: Linear, name: str) -> nn.Module | None:
        """Nothing before loading: every weight is rounded from the checkpoint's."""
        return None

    def quantized(self, linear: Linear, name: str) -> nn.Module:
        if self.gpu:  # the Triton kernel (kernels/weight_only_mm.py)
            return GpuWeightOnlyLinear.from_linear(linear, self.bits, self.group, self.dtype)
        if not self.blocks and self.bits == 4:
            return Int4Linear.from_linear(linear, self.group, name, self.dtype)
        weight = quantized_layout.quantize(linear.weight.detach(), self.bits, self.group)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.detach().to(self.dtype), requires_grad=False)
        return linear


HEAD_BITS = 8  # a weight-only model's head: int8, as llama.cpp's 4-bit files keep theirs (Q8_0, Q6_K)


class WeightSource(Protocol):
    """What QuantizeOnLoad asks of a weight-only scheme (WeightOnly, gguf_blocks.GgufWeights)."""

    def check(self, linear: Linear, name: str) -> None: ...  # before any weight is read

    def ahead(self, linear: Linear, name: str) -> nn.Module | None: ...  # before loading, or None

    def quantized(self, linear: Linear, name: str) -> nn.Module: ...  # once its weights are in

    def head(self, head: torch.Tensor) -> torch.Tensor | None: ...  # loaded, before tying (quantize_head)

    def report(self) -> None: ...  # once loaded


def quantize_head(model: nn.Module, quantized_of: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
    """Once the weights are in, before finish_loading (which ties and packs): the head (with tied
    embeddings the table, whose lookup reads the rows back: quantized_layout.rows_of, and which the head
    then shares) replaced by quantized_of(its weight [V, H]) where that is not None (WeightOnly.head: int8
    as the SmolLM2 Q4_1 GGUF holds its tied table, Q8_0; GgufWeights.head: the file's own)."""
    tied = model.config.tie_word_embeddings
    loaded = model.model.embed_tokens.weight if tied else model.lm_head.weight  # in the model's dtype
    weight = quantized_of(loaded)
    if weight is None:
        return
    quantized = nn.Parameter(weight, requires_grad=False)
    model.lm_head.weight = quantized
    if tied:  # (a tied head is not loaded: still the skeleton's, in fp32)
        model.model.embed_tokens.weight, model.model.embed_tokens.rows_dtype = quantized, loaded.dtype


def quantize_draft(draft: nn.Module, weight_only: WeightOnly) -> None:
    """Once an EAGLE-3 draft's weights are in, before they are fused: fc and its layer's linears quantized as
    `weight_only` says, its own head as int8 (HEAD_BITS), each where its shape fits the layout (else it
    stays); a head the draft does not ship (still on the meta device: the target's, shared later) is left."""
    head = dataclasses.replace(weight_only, bits=HEAD_BITS)
    for name, module in draft.named_modules():
        if type(module) is not Linear or module.weight.is_meta:
            continue
        rows, width = module.weight.shape
        if rows % quantized_layout.BLOCK_ROWS == 0 and width % weight_only.group == 0:
            (head if name == "lm_head" else weight_only).quantized(module, name)


class QuantizeOnLoad:
    """A loader hook (models/loader.py LoadHook) that swaps each decoder linear and expert module for
    its quantized copy as soon as all its tensors are loaded, so a high-precision checkpoint never sits in
    memory whole: the peak is the quantized model plus one module in high precision. Weights to quantize
    load in their on-disk precision (an fp32 checkpoint is not rounded to bf16 first), the rest in the
    model's dtype. weight_only: int4 / int8 weight-only linears, or a GGUF's own (a WeightSource; experts
    stay as they are, every shape checked before a weight is read), else FP8."""

    def __init__(
        self, model: nn.Module, scheme: Fp8Scheme, scaled_mm: bool, weight_only: WeightSource | None = None
    ) -> None:
        self._scaled_mm, self._weight_only = scaled_mm, weight_only
        experts = weight_only is None
        self._weights = quantized_weights(model, scheme, experts)
        self._pending = PendingModules()
        self.supplied: set[str] = set()  # weights the source gave before loading, not read from the file
        for parent, name, child, full in decoder_targets(model, scheme, experts=experts):
            if weight_only is not None:
                weight_only.check(child, full)
                if (ready := weight_only.ahead(child, full)) is not None:
                    setattr(parent, name, ready)
                    self.supplied.add(f"{full}.weight")
                    trim_heap()
                    continue
            self._pending.add(full, parent, name, {f"{full}.{key}" for key, _ in child.named_parameters()})

    def dtype(self, module_key: str, on_disk: torch.dtype, default: torch.dtype) -> torch.dtype:
        return on_disk if module_key in self._weights and on_disk.is_floating_point else default

    def loaded(self, module_key: str) -> None:
        if (done := self._pending.complete(module_key)) is None:
            return
        parent, attribute, name = done
        module = getattr(parent, attribute)
        if self._weight_only is not None:
            quantized = self._weight_only.quantized(module, name)
        else:
            quantized = _quantized(module, self._scaled_mm)
        setattr(parent, attribute, quantized)
        trim_heap()  # the module's high-precision copy and temporaries leave the process now
