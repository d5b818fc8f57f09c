"""Choosing kernels once, when the runner is built: never a device check inside the step."""

from __future__ import annotations

import functools
import importlib
import os

import torch
from torch import nn

from redline.kernels import HAS_TRITON
from redline.layers.attention import Attention
from redline.layers.linear import Linear, faster_fp32_product, streamed_rows
from redline.layers.mlp import MLP
from redline.layers.moe import Experts, MoE
from redline.layers.norm import RMSNorm
from redline.layers.reduced_attention import attention_by_reductions, sdpa_attention
from redline.models.llama import DecoderLayer, LlamaForCausalLM


def triton_by_default(device: torch.device) -> bool:
    return HAS_TRITON and device.type == "cuda"


def compile_by_default(device: torch.device) -> bool:
    """torch.compile the step and the prefill unless asked not to: on CPU, where it is the fast path
    (3-4x eager decode), unless the environment sets REDLINE_COMPILE=0 (the test suite does, so that only
    the tests that ask for it compile); CUDA captures every step as a CUDA graph instead."""
    return device.type == "cpu" and os.environ.get("REDLINE_COMPILE", "1") != "0"


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: Hopper (compute capability 9.0) and newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def select_cpu_paths(model: nn.Module, compiled: bool) -> None:
    """Few-row products on CPU (layers/linear.py): in a compiled step, the streamed loop inductor
    generates (every float dtype); eager, fp32 weights as W @ x^T where that is faster than F.linear
    (timed per shape), others F.linear. Attention of a compiled step on CPU as reductions inductor
    fuses (layers/reduced_attention.py), else SDPA. A compiled
    CPU target compiles each kind of decoder layer once (models/llama.run_layer); on CUDA the Triton
    kernels stay visible to inductor in the whole graph instead."""
    if compiled:
        importlib.import_module("torch._inductor.inductor_prims")  # registers what layers/linear.stored uses
    for module in model.modules():
        if isinstance(module, Attention):
            on_cpu = next(module.parameters()).is_cpu
            module.core = attention_by_reductions if on_cpu and compiled else sdpa_attention
        elif isinstance(module, LlamaForCausalLM):
            module.layer_regions = compiled and next(module.parameters()).is_cpu
        elif isinstance(module, Linear):
            weight = module.weight
            module.few_rows = None
            if weight.is_cpu and compiled and weight.dtype in (torch.float32, torch.bfloat16, torch.float16):
                module.few_rows = streamed_rows
            elif weight.is_cpu and weight.dtype == torch.float32:
                module.few_rows = faster_fp32_product(weight)


def fused_add_norm(
    attended: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
) -> tuple[torch.Tensor, torch.Tensor]:  # [..., H] each -> (normed, residual + attended)
    from redline.kernels.rms_norm import add_rms_norm

    shape = attended.shape
    out, total, _ = add_rms_norm(
        attended.reshape(-1, shape[-1]).contiguous(),
        residual.reshape(-1, shape[-1]).contiguous(),
        norm.weight,
        norm.eps,
    )
    return out.view(shape), total.view(shape)


def select_kernels(model: nn.Module, triton: bool, pdl: bool = False) -> None:
    """With triton: cached attention through the Triton kernels (split-KV for a decode step, launched with
    programmatic dependent launch when pdl; flash-attention forward for prompts), the residual add +
    post-attention RMSNorm fused, dense MLPs as one gate/up GEMM + the SwiGLU kernel, and top-1 MoE
    layers through the dispatch kernel that reads only the chosen experts' weights; else SDPA and torch
    ops. Every kernel is a torch.library.triton_op (kernels/launch.py)."""
    step = prefill = add_norm = swiglu = top1 = None
    if triton:
        from redline.kernels.decode_attention import decode_attention
        from redline.kernels.moe_top1 import moe_top1 as top1
        from redline.kernels.prefill_attention import prefill_attention
        from redline.kernels.swiglu import swiglu

        step = functools.partial(decode_attention, pdl=pdl)
        prefill = functools.partial(prefill_attention, **prefill_tiles(next(model.parameters()).dtype))
        add_norm = fused_add_norm
    for module in model.modules():
        if isinstance(module, Attention):
            module.step_kernel, module.prefill_kernel = step, prefill
        elif isinstance(module, DecoderLayer):
            module.add_norm = add_norm
        elif isinstance(module, MLP):
            module.swiglu = swiglu if swiglu is not None and module.fuse_gate_up() else None
        elif isinstance(module, MoE):
            plain = module.top_k == 1 and type(module.experts) is Experts  # not FP8 experts
            module.top1 = top1 if plain else None


def prefill_tiles(dtype: torch.dtype) -> dict[str, int]:
    """Query x key tile of the prefill kernel: 128 x 64 for 16-bit models (flash-attention's forward
    tile on Hopper, 8 warps); 64 x 32 in fp32, whose tiles take twice the registers and shared memory."""
    if dtype.itemsize <= 2:
        return {"block_m": 128, "block_n": 64}
    return {"block_m": 64, "block_n": 32}
