"""nn.Linear with a faster product for the few rows of a decode step on CPU, chosen when the layer is built.

torch's CPU GEMMs are slow for 1-8 rows (BENCHMARKS.md "Few-row linears"): the fp32 GEMM packs the
weight on every call, so x[M, K] @ W[N, K]^T costs about M times the M = 1 product, and without
AVX-512 the bf16 product is a loop over rows that reads W once per row. Two products stream W once:

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

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

FEW_ROWS = 8
FewRows = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [M, K], weight [N, K]) -> [M, N]


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


class Linear(nn.Linear):
    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, few_rows: FewRows | None = None, **kw
    ):
        """few_rows: the product for inputs of at most FEW_ROWS rows (None: F.linear for every M)."""
        super().__init__(in_features, out_features, bias, **kw)
        self.few_rows = few_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in_features]
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features)
        if self.few_rows is None or rows > FEW_ROWS:
            # On the 2-D view: torch's CPU bf16 matmul on a strided 3-D slice such as the prefill's last
            # position hidden[:, -1:] ([1, 1, 576], strides (T*576, 576, 1)) took ~200 ms, not ~8 ms.
            y = F.linear(flat, self.weight, self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        y = self.few_rows(flat, self.weight)  # [rows, out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        few = "" if self.few_rows is None else f", few_rows={self.few_rows.__name__}"
        return super().extra_repr() + few
