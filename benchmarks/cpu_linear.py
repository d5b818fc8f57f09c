"""Few-row linear layers on CPU: which torch product is fastest per shape, against the bandwidth roofline.

    .venv/bin/python benchmarks/cpu_linear.py [--threads 2] [--roofline-gbps GBPS]  (default: measured)

Every candidate computes y = x @ W^T for x [M, K], M in {1, 4} (plain decode, K=3 verify). Eight copies
of each weight are cycled so the small shapes are read from memory, not cache. GB/s counts weight bytes
in the candidate's own storage (bf16 2, fp32 4, int8 1 per weight); "ms" is what decides the choice.
Candidates: bf16 F.linear; bf16 `streamed_rows` compiled by inductor (the few-row path of compiled
steps, layers/linear.py); fp32 W @ x^T (the eager fp32 few-row path); fp32 `streamed_rows` compiled (the
compiled fp32 few-row path); int8 weights with per-channel scales through torch._weight_int8pack_mm
(lossy: for reference). oneDNN's bf16 linear needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, which AVX2-only
machines do not expose.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from redline.benchmark.machine import read_bandwidth_gbps
from redline.layers.linear import streamed_rows

SHAPES = [(2816, 512), (512, 1408), (2048, 256), (4096, 4096), (14336, 4096)]


def bf16_linear(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.nn.functional.linear(x, w) for w in weights]


def fp32_weight_times_xt(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.mm(w, x.t()) for w in weights]


@functools.partial(torch.compile, dynamic=False)
def compiled_streamed(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return [streamed_rows(x, w) for w in weights]


def int8_pack(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch._weight_int8pack_mm(x, w, s) for w, s in zip(weights, scales, strict=True)]


def seconds(fn, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--roofline-gbps", type=float, default=None, help="default: measured here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.roofline_gbps = args.roofline_gbps or read_bandwidth_gbps()
    torch._dynamo.config.recompile_limit = 64  # one graph per shape and M
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, roofline {args.roofline_gbps:.1f} GB/s")
    names = ("bf16 linear", "bf16 streamed", "fp32 W@x^T", "fp32 streamed", "int8 pack")
    print(f"{'N x K':>12}{'M':>3}  " + "".join(f"{c:>24}" for c in names))
    for n, k in SHAPES:
        copies = 8 if n * k < 4_000_000 else 2
        weights = [torch.randn(n, k) * 0.02 for _ in range(copies)]
        bf16 = [w.bfloat16() for w in weights]
        scales = [w.abs().amax(1) / 127 for w in weights]
        int8 = [(w / s[:, None]).round().to(torch.int8) for w, s in zip(weights, scales, strict=True)]
        scales = [s.bfloat16() for s in scales]
        for m in (1, 4):
            xb = torch.randn(m, k).bfloat16()
            candidates = [
                (functools.partial(bf16_linear, xb, bf16), 2),
                (functools.partial(compiled_streamed, xb, bf16), 2),
                (functools.partial(fp32_weight_times_xt, xb.float(), weights), 4),
                (functools.partial(compiled_streamed, xb.float(), weights), 4),
                (functools.partial(int8_pack, xb, int8, scales), 1),
            ]
            cells = []
            for fn, width in candidates:
                t = seconds(fn) / copies
                gbps = n * k * width / t / 1e9
                cells.append(f"{t * 1e3:7.3f} ms {gbps:5.1f} GB/s {gbps / args.roofline_gbps:4.0%}")
            print(f"{n:>6}x{k:<5}{m:>3}  " + "".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
