"""Loading weight-only integer checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized: the schemes of
quant/int_scheme.py) into redline's int4 / int8 layouts, one linear at a time, with no high-precision copy.

Each decoder linear the scheme covers becomes, on the meta device, a CheckpointLinear holding the
checkpoint's own tensors under their names; once a linear's tensors are in (IntCheckpointLoad, a loader
hook), they are read as codes u (0 .. 2^bits - 1), a zero in code units zc and a scale s per group and
row, w = (u - zc) * s, as each format defines it:

- gptq: qweight [K b/32, N] (codes packed along K), qzeros [G, N b/32] (zc, packed along N; the v1
  format stores zc - 1), scales [G, N] fp16, g_idx [K];
- awq: qweight [K, N/8], qzeros [G, N/8] (both packed along N in AWQ_ORDER), scales [G, N] fp16;
- compressed-tensors: weight_packed [N, K b/32] (signed codes + 2^(b-1), packed along K), weight_scale
  [N, G], weight_shape [2], and where asymmetric weight_zero_point [N b/32, G] (zero points + 2^(b-1),
  packed along N; symmetric: zc = 2^(b-1)), with act order weight_g_idx [K];

and then written into the layout: kernels/quantized_layout.py on the C++ kernel's path (q = u for int4,
the same for int8; zero = -zc s in fp16, exact for symmetric schemes, where zc s is a power-of-two multiple of
s), on CUDA quant/weight_only_gpu.py's (the same q, scale and zero in fp16; made on the CPU, then moved),
else quant/int4.py's Int4Linear (int4) or the layout multiplied dequantized (int8). A per-channel
checkpoint (one group a row) repeats its scale over the layout's groups, exactly.
Act order (a g_idx that is not k // group): the inputs are sorted by group, so that groups are runs of
`group` inputs, and the linear permutes its input the same way (layers/input_order.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

from redline.kernels import quantized_layout
from redline.layers.input_order import InputOrdered
from redline.layers.linear import Linear
from redline.models.huge_pages import trim_heap
from redline.models.int_shards import first_group
from redline.models.loader import PendingModules
from redline.models.quantize import decoder_targets
from redline.parallel.group import SINGLE, TensorParallel
from redline.quant.int4 import OUT_MULTIPLE, Int4Linear
from redline.quant.int_packing import awq_unpack, pack_int32, unpack_int32
from redline.quant.int_scheme import IntScheme
from redline.quant.scheme import Fp8Scheme
from redline.quant.weight_only_gpu import GpuWeightOnlyLinear

GROUPS = (128, 64, 32)  # the layout's group sizes, largest first


def tensor_shapes(scheme: IntScheme, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The checkpoint tensors of a linear of n outputs and k inputs: name -> (shape, dtype on disk)."""
    b, groups = scheme.bits, 1 if scheme.group is None else k // scheme.group
    i32 = torch.int32
    if scheme.method == "gptq":
        return {"qweight": ((k * b // 32, n), i32), "qzeros": ((groups, n * b // 32), i32),
                "scales": ((groups, n), torch.float16), "g_idx": ((k,), i32)}  # fmt: skip
    if scheme.method == "awq":
        return {"qweight": ((k, n // 8), i32), "qzeros": ((groups, n // 8), i32),
                "scales": ((groups, n), torch.float16)}  # fmt: skip
    shapes = {"weight_packed": ((n, k * b // 32), i32), "weight_scale": ((n, groups), torch.bfloat16),
              "weight_shape": ((2,), torch.int64)}  # fmt: skip
    if not scheme.symmetric:
        shapes["weight_zero_point"] = ((n * b // 32, groups), i32)
    if scheme.act_order:
        shapes["weight_g_idx"] = ((k,), i32)
    return shapes


class CheckpointLinear(nn.Module):
    """A linear's checkpoint tensors until they are read into codes (meta device, checkpoint names)."""

    def __init__(self, linear: Linear, scheme: IntScheme, name: str, first_group: int = 0) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.few_rows, self.name, self.scheme = linear.few_rows, name, scheme
        self.first_group = first_group  # of a row-parallel rank's inputs (models/int_shards.first_group)
        for key, (shape, dtype) in tensor_shapes(scheme, self.out_features, self.in_features).items():
            self.register_parameter(key, nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), False))
        self.bias = linear.bias

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(u [N, K] int32, zc [N, G] fp32, s [N, G] fp32, each input's group [K] or None): w = (u - zc) s."""
        s, b, n = self.scheme, self.scheme.bits, self.out_features
        mid = float(1 << (b - 1))
        if s.method == "gptq":
            u = unpack_int32(self.qweight.t().contiguous(), b)  # [N, K]
            zc = (unpack_int32(self.qzeros, b) + s.zero_offset).t().float()  # [N, G]
            g_idx = None if self.g_idx.is_meta else self.g_idx - self.first_group
            return u, zc, self.scales.t().float(), g_idx
        if s.method == "awq":
            u = awq_unpack(self.qweight).t().contiguous()
            return u, awq_unpack(self.qzeros).t().float(), self.scales.t().float(), None
        u = unpack_int32(self.weight_packed, b)[:, : self.in_features]  # signed + 2^(b-1): 0 .. 2^b - 1
        if s.symmetric:
            zc = torch.full(self.weight_scale.shape, mid)
        else:  # zero points + 2^(b-1), packed along N
            zc = unpack_int32(self.weight_zero_point.t().contiguous(), b).t()[:n].float()
        g_idx = self.weight_g_idx if s.act_order else None
        return u, zc, self.weight_scale.float(), g_idx

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme}"


def int_skeleton(
    model: nn.Module, scheme: IntScheme, checkpoint_name: Callable[[str], str], tp: TensorParallel = SINGLE
) -> None:
    """On the meta device: the decoder linears the scheme covers (not in its ignore list, matched by
    redline's name or checkpoint_name's) replaced by CheckpointLinears of rank tp.rank's part."""
    ignore = Fp8Scheme(scheme.ignore)
    for parent, name, child, full in list(decoder_targets(model, ignore, checkpoint_name, experts=False)):
        first = first_group(scheme, full, child.in_features, tp.rank, tp.size)
        setattr(parent, name, CheckpointLinear(child, scheme, full, first))


def layout_group(size: int, k: int, name: str) -> int:
    """The layout's largest group that divides the checkpoint's (`size` inputs a scale) and k."""
    fits = [g for g in GROUPS if size % g == 0 and k % g == 0]
    if not fits:
        raise ValueError(f"{name}: a scale covers {size} of its {k} inputs; the layout's groups: {GROUPS}")
    return fits[0]


def input_order(
    g_idx: torch.Tensor | None,  # [K]: each input's group
    size: int,  # inputs a group
    name: str,
) -> torch.Tensor | None:  # [K] int64
    """The permutation sorting inputs by group (None: g_idx is absent or already k // size). Example, size 2,
    g_idx [1, 0, 1, 0]: order [1, 3, 0, 2], whose inputs' groups are [0, 0, 1, 1]."""
    if g_idx is None:
        return None
    k = g_idx.shape[0]
    runs = torch.arange(k) // size  # group i covers inputs [i * size, (i + 1) * size) once sorted
    if torch.equal(g_idx.long(), runs):
        return None
    order = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[order], runs):
        raise ValueError(f"{name}: its g_idx does not put {size} inputs in each group")
    return order


def loaded_linear(
    placeholder: CheckpointLinear, blocks: bool, dtype: torch.dtype, gpu: torch.device | None = None
) -> tuple[nn.Module, float]:
    """The linear in redline's layout (the module doc), and how far storing its scales and zeros moved its
    weights, in steps: fp16 in the C++ kernel's layout and the GPU kernel's, `dtype` in torch's int4 kernel.
    gpu: the device of the GPU kernel's layout (None: a CPU layout); the layout is made on the CPU (the
    linear's tensors copied there: an absent g_idx stays on meta), then moved to the device."""
    if gpu is not None:
        placeholder = placeholder._apply(lambda t: t if t.is_meta else t.cpu())
    scheme, name = placeholder.scheme, placeholder.name
    n, k = placeholder.out_features, placeholder.in_features
    u, zc, s, g_idx = placeholder.codes()
    size = k if scheme.group is None else scheme.group
    if scheme.act_order and g_idx is None:
        raise ValueError(f"{name}: the checkpoint is in act order (desc_act) but holds no g_idx for it")
    order = input_order(g_idx, size, name)
    if order is not None:
        u = u[:, order]
    group = layout_group(size, k, name)
    zc, s = zc.repeat_interleave(size // group, 1), s.repeat_interleave(size // group, 1)
    zero = -zc * s
    bias = None if placeholder.bias is None else placeholder.bias.detach().to(dtype)
    if gpu is not None:
        codes = pack_int32(u, 4) if scheme.bits == 4 else u.to(torch.uint8)
        module: nn.Module = GpuWeightOnlyLinear(codes, s.half(), zero.half(), bias)
        kept_s, kept_zero = s.half().float(), zero.half().float()
    elif scheme.bits == 4 and not blocks:
        module = Int4Linear.from_codes(u, s, zero, group, bias, dtype)
        kept_s = s.to(dtype).float()  # the kernel's zero is zero + 8 s, in dtype
        kept_zero = (zero + 8 * s).to(dtype).float() - 8 * kept_s
    else:
        module = Linear(k, n, bias is not None, placeholder.few_rows, device="meta")
        module.weight = nn.Parameter(quantized_layout.to_blocks(u, s, zero, scheme.bits), requires_grad=False)
        module.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        kept_s, kept_zero = s.half().float(), zero.half().float()
    # a weight moves by at most |dz| + 2^bits |ds|: in steps s
    moved = (kept_zero - zero).abs() + (1 << scheme.bits) * (kept_s - s).abs()
    moved = float((moved / s.clamp(min=2**-24)).max())
    module = module if order is None else InputOrdered(module, order)
    return (module if gpu is None else module.to(gpu)), moved


class IntCheckpointLoad:
    """A loader hook (models/loader.py LoadHook): each CheckpointLinear, once its tensors are in (a GPTQ g_idx
    only where the checkpoint holds one: `optional` lists the others), replaced by its loaded_linear. Its
    tensors load in their on-disk dtypes (fp16 scales stay fp16), its bias in the model's. Every linear's
    shape is checked against its layout before any weight is read. gpu: as loaded_linear's."""

    def __init__(
        self, model: nn.Module, present: set[str], blocks: bool, dtype: torch.dtype, gpu: torch.device | None
    ) -> None:  # fmt: skip
        self.blocks, self.model_dtype, self.gpu, self.moved, self.count = blocks, dtype, gpu, 0.0, 0
        self.optional: list[str] = []
        self._pending = PendingModules()
        self._coded: set[str] = set()  # the checkpoint's tensors of codes, scales and zeros
        for name, module in model.named_modules():
            if isinstance(module, CheckpointLinear):
                check_layout(module, blocks, gpu is not None)
                coded = {f"{name}.{key}" for key in tensor_shapes(module.scheme, 1, 1)}
                absent = {key for key in coded if key.endswith(".g_idx") and key not in present}
                self.optional += sorted(absent)
                self._coded |= coded
                keys = {f"{name}.{key}" for key, _ in module.named_parameters()} - absent
                parent, _, attribute = name.rpartition(".")
                self._pending.add(name, model.get_submodule(parent), attribute, keys)
        self.scheme = next((m.scheme for m in model.modules() if isinstance(m, CheckpointLinear)), None)

    def dtype(self, module_key: str, on_disk: torch.dtype, default: torch.dtype) -> torch.dtype:
        return on_disk if module_key in self._coded else default

    def extra_bias(self, module_key: str) -> bool:
        """A bias the checkpoint holds for a linear that has none (AutoGPTQ wrote zeros for every linear):
        skipped, as vLLM skips it."""
        name, _, key = module_key.rpartition(".")
        return key == "bias" and (module := self._pending.module(name)) is not None and module.bias is None

    def loaded(self, module_key: str) -> None:
        if (done := self._pending.complete(module_key)) is None:
            return
        parent, attribute, _ = done
        module, moved = loaded_linear(getattr(parent, attribute), self.blocks, self.model_dtype, self.gpu)
        setattr(parent, attribute, module)
        self.moved, self.count = max(self.moved, moved), self.count + 1
        trim_heap()

    def report(self) -> None:
        """One line on stderr: what was loaded, and what storing scales and zeros moved weights by, if any."""
        moved = f"; stored scales and zeros moved weights by up to {self.moved:.4f} of a step"
        moved = moved if self.moved else ", exactly"
        print(f"redline: {self.count} linears of a {self.scheme} checkpoint loaded{moved}", file=sys.stderr)


def check_layout(placeholder: CheckpointLinear, blocks: bool, gpu: bool = False) -> None:
    """ValueError naming the linear when its layout cannot take its shape: outputs in blocks of 32 rows (the
    C++ kernel's layout) or 16 (torch's int4 kernel), groups the layout holds (all the GPU kernel needs)."""
    scheme, n, k = placeholder.scheme, placeholder.out_features, placeholder.in_features
    group = layout_group(k if scheme.group is None else scheme.group, k, placeholder.name)
    if gpu:
        return
    kernel = scheme.bits == 4 and not blocks
    rows, kind = (OUT_MULTIPLE, "torch's int4") if kernel else (quantized_layout.BLOCK_ROWS, "quantized")
    quantized_layout.check_shape(k, n, group, placeholder.name, rows, kind)
