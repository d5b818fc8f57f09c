"""nn.Linear with a faster product for the few rows of a decode step on CPU, chosen when the layer is built;
on CPUs with AVX-512 BF16 a bf16 weight packed once loaded (layers/packed.py) takes the packed C++ kernel
at every number of rows, prompts included.

torch's CPU GEMMs are slow for 1-8 rows (BENCHMARKS.md "Few-row linears"): the fp32 GEMM packs the
weight on every call, so x[M, K] @ W[N, K]^T costs about M times the M = 1 product, and without
AVX-512 the bf16 product is a loop over rows that reads W once per row. Three products stream W once:
the C++ kernel of kernels/cpu_ops.py for bf16 on CPUs with AVX-512 BF16 (eager and compiled), and

- `weight_times_xt`, fp32 weights in eager code: W @ x^T ([N, K] @ [K, M] -> [N, M], transposed back
  as a view) costs about what M = 1 does on AMD EPYC instances, AVX2 and AVX-512 alike (116 against 201
  us for [1536, 576] at M = 4, 3.3 against 16.1 ms for SmolLM2's [49152, 576] head), while on an
  AVX-512 Xeon F.linear is the faster (73 against 149 us): layers/backends.py picks it by the CPU's
  vendor and vector width (BENCHMARKS.md "Few-row linears");
- `streamed_rows`, weights of any float dtype inside torch.compile: inductor fuses the upcast, the M
  products and the M row sums into one C++ loop over W's rows, which loads each 16-weight vector
  once, converts it to fp32 and accumulates it against every x row (stored once in fp32). The loop
  also joins the step's other fused work instead of being an external GEMM call between kernels:
  compiled fp32 decode of the demo target ran 3.4-3.7x faster with it than with W @ x^T
  (BENCHMARKS.md "Compiled decode and prefill on an AVX-512 instance"). Eager torch would
  materialize W in fp32, so outside a compiled graph it is F.linear.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from redline.kernels import cpu_ops
from redline.kernels.attention_core import STEP_QUERIES
from redline.kernels.packed_layout import PACK_ROWS, is_packed, pack, packable
from redline.kernels.quantized_layout import dequantize, is_quantized

FEW_ROWS = 8
FewRows = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [M, K], weight [N, K]) -> [M, N]
ROW_INDEPENDENT: set[FewRows] = {cpu_ops.few_rows_bf16}  # each row's result does not depend on M


def weight_times_xt(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, K], [N, K] -> [M, N]
    return torch.mm(weight, x.t()).t()


def stored(x: torch.Tensor) -> torch.Tensor:
    """x, written to memory once inside a compiled graph. Inductor inlines a cheap producer into each of
    its consumers: an RMSNorm feeding a product was recomputed (and its bf16 input converted) for every
    weight row, M times per row. inductor_force_stride_order (a prim of inductor's, registered once
    torch._inductor.inductor_prims is imported, as Backends.choose does for a compiled model) makes it a
    buffer instead."""
    return torch.ops.prims.inductor_force_stride_order(x, x.stride())


def streamed_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, K], [N, K] -> [M, N]
    if not torch.compiler.is_dynamo_compiling():  # not is_compiling(): a flag for the whole process
        return F.linear(x, weight)
    w = weight.float()  # fused into the loop by inductor: never materialized
    rows = stored(x.float())  # [M, K] fp32: the loop loads each row as it is, no conversion
    return torch.stack([(w * row).sum(-1) for row in rows.unbind(0)]).to(x.dtype)


WHOLE_STEP_ROWS = 8 * STEP_QUERIES  # 8 slots of a K = 8 verify step


def product(
    x: torch.Tensor,  # [M, K]: the rows of sequences of `tokens` tokens each
    weight: torch.Tensor,  # [N, K], packed [N / 32, K / 2, 32, 2] (kernels/packed_layout.py) or quantized
    few_rows: FewRows | None,
    tokens: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    """x @ weight^T + bias. few_rows takes inputs of at most FEW_ROWS rows; a row-independent one
    (ROW_INDEPENDENT: the C++ kernel, whose rows are separate sums) also takes every decode step (at most
    STEP_QUERIES tokens a sequence) of up to WHOLE_STEP_ROWS rows, so a verify step's B x (K + 1) rows
    equal B x (K + 1) one-row products bit for bit. Past that the kernel's row loop is slower than
    F.linear's blocked GEMM (4x at 72 rows), and larger batches take F.linear. Prompts take F.linear. A
    packed weight takes the packed kernel (cpu_ops.few_rows_bf16) at any number of rows, and so does a
    quantized one (kernels/quantized_layout.py) where few_rows is that kernel; elsewhere a quantized weight
    takes quantized_product. On the 2-D x:
    torch's CPU bf16 matmul on a strided 3-D slice such as the prefill's last position hidden[:, -1:]
    ([1, 1, 576], strides (T*576, 576, 1)) took ~200 ms, not ~8 ms."""
    if is_packed(weight) or (is_quantized(weight) and few_rows is cpu_ops.few_rows_bf16):  # any rows
        y = cpu_ops.few_rows_bf16(x, weight)
        return y if bias is None else y + bias
    if is_quantized(weight):
        return quantized_product(x, weight, bias)
    rows = x.shape[0]
    whole_step = few_rows in ROW_INDEPENDENT and tokens <= STEP_QUERIES and rows <= WHOLE_STEP_ROWS
    if few_rows is None or (rows > FEW_ROWS and not whole_step):
        return F.linear(x, weight, bias)
    y = few_rows(x, weight)
    return y if bias is None else y + bias


def quantized_product(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # quantized (kernels/quantized_layout.py) [N / 32, K / G, ...]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    """x @ weight^T + bias off the AVX-512 BF16 kernel's path: the AVX2 kernel (cpu_ops.quantized_rows, once
    cpu_ops.load_avx2() has loaded it) for fp32 or bf16 rows on the CPU, any number of them (each row its own
    sums, so a verify step's rows equal one-row products; at 2,048 rows about as fast as the dequantized
    weight's GEMM, faster below: BENCHMARKS.md "Quantized weights on AVX2"), else the dequantized weight
    through F.linear (a machine without AVX2, an fp16 model)."""
    if x.is_cpu and x.dtype in (torch.float32, torch.bfloat16) and cpu_ops.quantized_rows_loaded():
        y = cpu_ops.quantized_rows(x, weight)
        return y if bias is None else y + bias
    return F.linear(x, dequantize(weight).to(x.dtype), bias)


def tokens_per_sequence(x: torch.Tensor) -> int:  # x [B, T, features] or [rows, features]
    """T for a batch of sequences; a 2-D input counts as one sequence of its rows."""
    return x.shape[-2] if x.dim() > 2 else x.shape[0]


def quantized_parts(linears: Sequence[nn.Module]) -> bool:
    """Whether the linears are plain Linears without biases holding quantized weights: fused (q/k/v, gate/up)
    whatever the backends say, so that a step makes one call of a quantized kernel where it made three."""
    return all(type(p) is Linear and p.bias is None and is_quantized(p.weight) for p in linears)


def fuse_weights(linears: Sequence[nn.Module], packed: bool = False) -> torch.Tensor | None:
    """After loading: the linears' weights become views of one [sum of out_features, in] weight (no extra
    memory), returned to be multiplied once (q/k/v, gate/up); None, changing nothing, when any is not a
    plain Linear (quantization replaced it) or the parts are quantized in different layouts. packed: the
    one weight is packed (kernels/packed_layout.py) where it and each part can be, and the parts are views
    of its blocks of PACK_ROWS rows; quantized parts (kernels/quantized_layout.py, in blocks of PACK_ROWS
    rows too) are joined block by block."""
    if any(type(p) is not Linear for p in linears):
        return None
    layouts = {(p.weight.dtype, tuple(p.weight.shape[1:])) for p in linears}
    if len(layouts) > 1 and any(is_quantized(p.weight) for p in linears):
        return None  # parts in different layouts: a GGUF's Q4_K q and k beside its Q6_K v
    fused = torch.cat([p.weight.detach() for p in linears])
    rows = [p.out_features for p in linears]  # of each part, in rows of fused
    if is_quantized(fused):
        rows = [n // PACK_ROWS for n in rows]
    elif packed and packable(fused) and all(n % PACK_ROWS == 0 for n in rows):
        fused, rows = pack(fused), [n // PACK_ROWS for n in rows]  # in blocks of PACK_ROWS rows
    start = 0
    for p, n in zip(linears, rows, strict=True):
        p.weight = nn.Parameter(fused[start : start + n], requires_grad=False)
        start += n
    return fused


class Linear(nn.Linear):
    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, few_rows: FewRows | None = None, **kw
    ):
        """few_rows: the product for few rows and decode steps (see `product`; None: F.linear for every M)."""
        super().__init__(in_features, out_features, bias, **kw)
        self.few_rows = few_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., T, in_features] or [rows, in_features]
        flat = x.reshape(-1, self.in_features)
        y = product(flat, self.weight, self.few_rows, tokens_per_sequence(x), self.bias)  # [rows, out]
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        few = "" if self.few_rows is None else f", few_rows={self.few_rows.__name__}"
        return super().extra_repr() + few
