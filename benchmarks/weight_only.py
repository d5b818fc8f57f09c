"""Weight-only int8 and int4 products on CPU against redline's bf16 kernel, SmolLM2-135M's shapes (issue 29).

    .venv/bin/python benchmarks/weight_only.py [--rounds 200] [--rows 1,4]

Each candidate computes y = x @ W^T for x [M, K] bf16, M in --rows (1 and 4: plain decode, a K = 3 verify
step), over SmolLM2's decoder shapes (q/k/v fused [960, 576], o [576, 576], gate/up fused [3072, 576], down
[576, 1536]) and its head [49152, 576]. Copies of each weight, 300 MB of bf16 in all, are cycled so that
every product reads its weight from memory, as a decode step does (269 MB of bf16 weights a step: no
cache holds them). Candidates:
- bf16, redline's packed C++ kernel (kernels/cpu_ops.py; what the demo runs on AVX-512 BF16 CPUs), and
  F.linear;
- int8 with per-channel scales, torch._weight_int8pack_mm (torchao's int8 weight-only CPU path);
- int4 with groups of 32 and 64 (asymmetric: a scale and a zero per group), torch's tinygemm layout
  (_convert_weight_to_int4pack_for_cpu, _weight_int4pack_mm_for_cpu: torchao's int4 weight-only CPU path);
- redline's grouped int4 and int8 C++ kernels (kernels/quantized_layout.py: fp16 scale and zero per group
  of 32; csrc/quantized_rows_bf16.cpp, csrc/int8_rows_vnni.cpp), what `--quantization int4|int8` runs on
  AVX-512 BF16 CPUs;
- on CPUs with AVX2, the same layout through csrc_avx2/quantized_rows_avx2.cpp with x in fp32 (what fp32
  models there run) and the dequantized weight through F.linear (what ran before it), beside fp32 F.linear.
A K of 576 takes no groups of 128. Per candidate: microseconds per product (the median over rounds) and
the weight bytes it read per second, against the read bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from statistics import median

import torch

from redline.benchmark.machine import describe, read_bandwidth_gbps
from redline.kernels import cpu_ops
from redline.kernels.packed_layout import pack
from redline.kernels.quantized_layout import dequantize, quantize
from redline.quant.int4 import INNER_K_TILES, quantize_int4

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
STREAMED_BYTES = 300e6  # bf16 bytes of the copies cycled through


def int8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, K] -> int8 [N, K], bf16 [N]
    scale = (w.abs().amax(1) / 127).clamp(min=1e-8)
    return (w / scale[:, None]).round().clamp(-128, 127).to(torch.int8), scale.bfloat16()


def int4_weight(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> the kernel's packed int4 weight and scales-and-zeros [K / group, N, 2] (quant/int4.py)."""
    q, scale, zero = quantize_int4(w, group, torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)
    return packed, torch.stack([scale.t(), zero.t()], -1).bfloat16().contiguous()


def candidates(w: torch.Tensor) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
    """name -> (the product of x with w, weight bytes it reads)"""
    n, k = w.shape
    bf16 = w.bfloat16()
    out: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {
        "bf16 F.linear": (lambda x: torch.nn.functional.linear(x, bf16), 2 * n * k)
    }
    if cpu_ops.load():
        packed = pack(bf16)
        out["bf16 packed C++"] = (lambda x: cpu_ops.few_rows_bf16(x, packed), 2 * n * k)
        for bits in (4, 8):
            grouped = quantize(w, bits, 32)
            out[f"int{bits} g32 redline C++"] = (
                lambda x, t=grouped: cpu_ops.few_rows_bf16(x, t),
                grouped.numel(),
            )
    if cpu_ops.load_avx2():
        w32 = w.float()
        out["fp32 F.linear"] = (lambda x: torch.nn.functional.linear(x.float(), w32), 4 * n * k)
        for bits in (4, 8):
            grouped = quantize(w, bits, 32)
            out[f"int{bits} g32 AVX2, fp32 x"] = (
                lambda x, t=grouped: cpu_ops.quantized_rows(x.float(), t),
                grouped.numel(),
            )
            out[f"int{bits} g32 dequantized, fp32 x"] = (
                lambda x, t=grouped: torch.nn.functional.linear(x.float(), dequantize(t)),
                grouped.numel(),
            )
    q8, s8 = int8_weight(w)
    out["int8 per channel"] = (lambda x: torch._weight_int8pack_mm(x, q8, s8), n * k + 2 * n)
    for group in (32, 64):
        q4, sz = int4_weight(w, group)
        out[f"int4 g{group}"] = (
            lambda x, q4=q4, sz=sz, g=group: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q4, g, sz),
            n * k // 2 + 4 * n * k // group,
        )
    return out


def timed(products: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, rounds: int) -> float:
    """Median microseconds per product, cycling through the copies."""
    for f in products:
        f(x)
    times = []
    for i in range(rounds):
        f = products[i % len(products)]
        start = time.perf_counter()
        f(x)
        times.append(time.perf_counter() - start)
    return median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--rows", default="1,4", help="Ms, comma-separated")
    args = parser.parse_args()
    print(json.dumps(describe()))
    bandwidth = read_bandwidth_gbps()
    print(f"read bandwidth {bandwidth:.1f} GB/s")
    torch.manual_seed(0)
    rows = []
    for n, k in SHAPES:
        copies = [
            candidates(torch.randn(n, k) * 0.02) for _ in range(max(1, int(STREAMED_BYTES // (2 * n * k))))
        ]
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            for name in copies[0]:
                us = timed([c[name][0] for c in copies], x, args.rounds)
                gbps = copies[0][name][1] / us / 1e3
                rows.append(f"| [{n}, {k}] | {m} | {name} | {us:.0f} | {gbps:.1f} |")
    print("| weight | M | product | us | GB/s of weights |\n|---|---:|---|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
