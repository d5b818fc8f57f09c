"""nn.Linear with a faster product for the few rows of a decode step on CPU, chosen once per layer.

torch's CPU GEMMs are slow for 1-8 rows (BENCHMARKS.md "Few-row linears"): the fp32 GEMM packs the
weight on every call, so x[M, K] @ W[N, K]^T costs about M times the M = 1 product, and without
AVX-512 the bf16 product is a loop over rows that reads W once per row. Two products stream W once:

- `weight_times_xt`, fp32 weights in eager code: W @ x^T ([N, K] @ [K, M] -> [N, M], transposed back
  as a view) costs about what M = 1 does on some CPUs (on others F.linear is faster: timed per shape,
  `faster_fp32_product`);
- `streamed_rows`, weights of any float dtype inside torch.compile: inductor fuses the upcast, the M
  products and the M row sums into one C++ loop over W's rows, which loads each 16-weight vector
  once, converts it to fp32 and accumulates it against every x row (stored once in fp32). The loop
  also joins the step's other fused work instead of being an external GEMM call between kernels:
  compiled fp32 decode of the demo target ran 3.4-3.7x faster with it than with W @ x^T
  (BENCHMARKS.md "Compiled decode and prefill on an AVX-512 instance"). Eager torch would
  materialize W in fp32, so outside a compiled graph it is F.linear.

`kernels.select.select_cpu_paths` sets `Linear.few_rows` per layer when the runner is built.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

FEW_ROWS = 8


def weight_times_xt(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, K], [N, K] -> [M, N]
    return torch.mm(weight, x.t()).t()


_FP32_CHOICE: dict[tuple[int, int], bool] = {}  # (N, K) -> W @ x^T beat F.linear on this machine


def faster_fp32_product(weight: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """weight_times_xt, or None (F.linear), whichever multiplies FEW_ROWS // 2 rows (a K = 3 verify) by
    this fp32 weight faster here, timed once per weight shape. Which wins depends on the CPU's BLAS:
    at M = 4, W @ x^T cost about what M = 1 does on the AVX2 EPYC instances (BENCHMARKS.md "Few-row
    linears"), while on an AVX-512 Xeon F.linear took 73 us against 149 for [1536, 576]."""
    shape = tuple(weight.shape)
    if shape not in _FP32_CHOICE:
        x = torch.randn(FEW_ROWS // 2, weight.shape[1])
        times = {}
        with torch.inference_mode():
            for name, product in (("xt", weight_times_xt), ("linear", F.linear)):
                product(x, weight)
                rounds = []  # the fastest of 3 rounds of 5: one descheduled round does not decide
                for _ in range(3):
                    start = time.perf_counter()
                    for _ in range(5):
                        product(x, weight)
                    rounds.append(time.perf_counter() - start)
                times[name] = min(rounds)
        _FP32_CHOICE[shape] = times["xt"] < times["linear"]
    return weight_times_xt if _FP32_CHOICE[shape] else None


def stored(x: torch.Tensor) -> torch.Tensor:
    """x, written to memory once inside a compiled graph. Inductor inlines a cheap producer into each of
    its consumers: an RMSNorm feeding a product was recomputed (and its bf16 input converted) for every
    weight row, M times per row. inductor_force_stride_order (a prim of inductor's, registered once
    torch._inductor is imported, as kernels.select does) makes it a buffer instead."""
    return torch.ops.prims.inductor_force_stride_order(x, x.stride())


def streamed_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, K], [N, K] -> [M, N]
    if not torch.compiler.is_compiling():
        return F.linear(x, weight)
    w = weight.float()  # fused into the loop by inductor: never materialized
    rows = stored(x.float())  # [M, K] fp32: the loop loads each row as it is, no conversion
    return torch.stack([(w * row).sum(-1) for row in rows.unbind(0)]).to(x.dtype)


class Linear(nn.Linear):
    # (x [M <= FEW_ROWS, in_features], weight) -> [M, out_features]; None: F.linear for every M
    few_rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

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
