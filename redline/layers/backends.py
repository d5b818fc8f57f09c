"""What runs inside each layer, chosen once from the device, the dtype and the compile mode, and handed to
every layer when it is built (as mini-sglang picks its backends by name at construction).

    backends = Backends.choose(device, dtype, compiled=True)
    model = LlamaForCausalLM(config, backends=backends)   # every layer keeps what it was given

The rules (BENCHMARKS.md "Few-row linears", "Compiled bf16 decode"):

| where                     | CUDA with Triton                      | CPU                                    |
|---------------------------|---------------------------------------|----------------------------------------|
| cached attention, <= 9 q  | split-KV decode kernel (PDL with pdl) | bf16 with AVX-512 BF16: a C++ kernel   |
|  (or a token tree's rows) |                                       | (kernels/cpu_ops); fp32 or bf16 with   |
|                           |                                       | AVX2: another (csrc_avx2); else the    |
|                           |                                       | core over the gathered cache           |
| cached attention, prompts | flash-attention prefill kernel        | the core (SDPA: its flash kernel)      |
| attention core            | SDPA                                  | compiled: reductions inductor fuses    |
| add + post-attention norm | one fused kernel                      | torch                                  |
| dense MLP (not FP8)       | one gate/up GEMM + SwiGLU kernel      | with the C++ kernel: one gate/up       |
|                           |                                       | product (q/k/v too); else torch        |
| top-1 MoE, few tokens     | a kernel reading the chosen experts   | torch                                  |
| decode-step linears       | F.linear                              | bf16 with AVX-512 BF16: a C++ kernel   |
|                           |                                       | (kernels/cpu_ops); else compiled:      |
|                           |                                       | streamed rows; eager fp32 on AMD or    |
|                           |                                       | without AVX-512: W @ x^T               |
| decoder layers            | one graph                             | compiled: one compile region each kind |
| dense layer, decode step  | its ops                               | bf16 with AVX-512 BF16: one C++ call   |
| linear weights            | [N, K]                                | bf16 with AVX-512 BF16: packed for the |
|                           |                                       | C++ kernel (layers/packed.py), prompts |
|                           |                                       | too                                    |

`describe()` names what was chosen (`redline info` prints it) and each layer's repr shows its own.
`TORCH` is the plain torch choice, for models built outside the engine (training, tests).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from redline.draft_tree import TREE_SLOTS
from redline.kernels import HAS_TRITON, cpu_ops
from redline.kernels.attention_core import STEP_QUERIES, attention_by_reductions, sdpa_attention
from redline.layers.linear import FewRows, streamed_rows, weight_times_xt

# (q [B, T, Hq, D], k_cache, v_cache [blocks, Hkv, BLOCK, D], positions [B, T], tables [B, n] int32, kv_len,
#  chunk) -> [B, T, Hq, D]: attention of the T queries over positions [0, kv_len) of their block tables; the
#  kernels also take a token tree's tree_base [B] and tree_bits [B, T] after chunk (its mask instead)
CachedAttention = Callable[..., torch.Tensor]
# (q [B, T, Hq, D], keys, values [B, Hkv, S, D], mask [B or 1, 1, T, S] bool) -> [B, T, Hq, D]
AttentionCore = Callable[..., torch.Tensor]
# (attended, residual [..., H], norm weight [H], eps) -> (normed, residual + attended)
AddNorm = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# (x [B, T, H], k_cache, v_cache, positions [B, T], tables, kv_len, chunk, cos, sin [B, T, 1, D / 2],
#  interleaved, weights, eps, heads, tree_base, tree_bits) -> [B, T, H]: a dense layer's decode step
#  (cpu_ops.dense_layer_bf16; a token tree's rows at their slots under its mask when tree_base is given)
DenseLayer = Callable[..., torch.Tensor]


def backend_name(fn: Callable[..., Any] | None) -> str:
    """ "torch" for None, a function's name, a partial's with its keywords: "decode_attention(pdl=True)"."""
    if fn is None:
        return "torch"
    if isinstance(fn, functools.partial):
        keywords = ", ".join(f"{k}={v}" for k, v in fn.keywords.items())
        return f"{backend_name(fn.func)}({keywords})"
    # a torch.library op (the Triton kernels) is named by its _name
    return getattr(fn, "__name__", None) or getattr(fn, "_name", type(fn).__name__)


@dataclass(frozen=True)
class Backends:
    decode_attention: CachedAttention | None = None  # None: the core over the gathered cache
    prefill_attention: CachedAttention | None = None
    attention_core: AttentionCore = sdpa_attention
    add_norm: AddNorm | None = None  # None: torch's add, then the RMSNorm module
    swiglu: Callable[[torch.Tensor], torch.Tensor] | None = None  # [M, 2I] -> [M, I] after one gate/up GEMM
    moe_top1: Callable[..., torch.Tensor] | None = None  # moe_top1.py's signature
    few_rows: FewRows | None = None  # few-row and decode-step products (linear.product); None: F.linear
    layer_regions: bool = False  # decoder layers as nested compile regions (models/llama.run_layer)
    fused_projections: bool = False  # q/k/v and gate/up multiplied as one weight each, once loaded
    dense_layer: DenseLayer | None = None  # a dense layer's decode step in one call; None: the layer's ops
    packed_weights: bool = False  # linear weights packed for few_rows once loaded (layers/packed.py)
    # a token tree's rows that decode_attention (and dense_layer) take under its mask; a larger tree takes
    # prefill_attention under its mask where there is one (CUDA), else the core over the gathered cache (and
    # the layer's ops), whose arithmetic differs from a plain step's
    tree_rows: int = STEP_QUERIES

    @classmethod
    def choose(
        cls,
        device: torch.device | str,
        dtype: torch.dtype,
        compiled: bool,
        pdl: bool = False,
        fp8_weights: bool = False,
    ) -> Backends:
        """The table above. pdl (programmatic dependent launch) needs Triton on a Hopper or newer GPU;
        fp8_weights (an FP8 checkpoint, or quantization on load) keeps the dense MLPs' and experts' torch
        paths, whose kernels read high-precision weights."""
        device = torch.device(device)
        if device.type == "cuda" and HAS_TRITON:
            return cls._triton(device, dtype, pdl, fp8_weights)
        if pdl:
            raise ValueError("programmatic dependent launch needs Triton and a Hopper or newer GPU")
        if device.type != "cpu":
            return TORCH
        core = attention_by_reductions if compiled else sdpa_attention
        if compiled:
            importlib.import_module("torch._inductor.inductor_prims")  # registers what linear.stored uses
        if dtype == torch.bfloat16 and cpu_ops.load():  # a call per weight: fewer, larger weights
            return cls(
                decode_attention=cpu_ops.decode_attention_bf16,
                attention_core=core,
                few_rows=cpu_ops.few_rows_bf16,
                layer_regions=compiled,
                fused_projections=True,
                dense_layer=cpu_ops.dense_layer_bf16,
                packed_weights=True,
                tree_rows=TREE_SLOTS + 1,  # any tree: one task per (row, query, head), no row limit
            )
        few_rows = None
        if compiled and dtype in (torch.float32, torch.bfloat16, torch.float16):
            few_rows = streamed_rows
        elif dtype == torch.float32 and (cpu_vendor() == "AuthenticAMD" or not avx512()):
            few_rows = weight_times_xt
        if dtype in (torch.float32, torch.bfloat16) and cpu_ops.load_avx2():
            return cls(
                decode_attention=cpu_ops.decode_attention_avx2,
                attention_core=core,
                few_rows=few_rows,
                layer_regions=compiled,
                tree_rows=TREE_SLOTS + 1,  # as the AVX-512 kernel: any tree
            )
        return cls(attention_core=core, few_rows=few_rows, layer_regions=compiled)

    @classmethod
    def _triton(cls, device: torch.device, dtype: torch.dtype, pdl: bool, fp8_weights: bool) -> Backends:
        from redline.kernels.decode_attention import decode_attention
        from redline.kernels.moe_top1 import moe_top1
        from redline.kernels.prefill_attention import prefill_attention
        from redline.kernels.rms_norm import fused_add_norm
        from redline.kernels.swiglu import swiglu

        if pdl and torch.cuda.get_device_capability(device) < (9, 0):
            raise ValueError("programmatic dependent launch needs a Hopper or newer GPU (compute 9.0+)")
        return cls(
            decode_attention=functools.partial(decode_attention, pdl=pdl),
            prefill_attention=functools.partial(prefill_attention, **prefill_tiles(dtype)),
            add_norm=fused_add_norm,
            swiglu=None if fp8_weights else swiglu,
            moe_top1=None if fp8_weights else moe_top1,
        )

    def describe(self) -> dict[str, str]:
        """What runs where: {"decode attention": "decode_attention(pdl=False)", ...}."""
        return {
            "decode attention": backend_name(self.decode_attention),
            "prefill attention": backend_name(self.prefill_attention),
            "attention core": backend_name(self.attention_core),
            "add + norm": backend_name(self.add_norm),
            "dense MLP": "gate/up GEMM + " + backend_name(self.swiglu) if self.swiglu else "torch",
            "top-1 MoE": backend_name(self.moe_top1),
            "decode-step linears": backend_name(self.few_rows),
            "layer compile regions": str(self.layer_regions),
            "fused q/k/v and gate/up": str(self.fused_projections),
            "dense layer decode step": backend_name(self.dense_layer),
            "packed weights": str(self.packed_weights),
        }


def avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


@functools.cache
def cpu_vendor() -> str:
    """ "AuthenticAMD", "GenuineIntel", ... ("" where /proc/cpuinfo does not say)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":")[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def prefill_tiles(dtype: torch.dtype) -> dict[str, int]:
    """Query x key tile of the prefill kernel: 128 x 64 for 16-bit models (flash-attention's forward
    tile on Hopper, 8 warps); 64 x 32 in fp32, whose tiles take twice the registers and shared memory."""
    if dtype.itemsize <= 2:
        return {"block_m": 128, "block_n": 64}
    return {"block_m": 64, "block_n": 32}


TORCH = Backends()
