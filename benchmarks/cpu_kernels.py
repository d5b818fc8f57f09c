"""redline's C++ CPU kernels (redline/kernels/csrc) of this tree against another revision's, in one process.

    .venv/bin/python benchmarks/cpu_kernels.py --before 283cd88 [--reps 30]

The other revision's sources are built under their own op namespace (redline_before) beside this tree's
(redline_cpu), so both run in one process and their calls alternate (before, this, before, this ...):
on a VM whose memory bandwidth drifts by tens of percent between runs, the paired ratio of neighbouring
calls is what compares them. Without --before, this tree alone.

- few_rows_bf16 over SmolLM2-135M's decode weights at its real shapes (30 layers of fused q/k/v
  [960, 576], o [576, 576], fused gate/up [3072, 576], down [576, 1536], and the [49152, 576] head:
  distinct random tensors, 269 MB, so every call reads memory) at M = 1, 2, 3, 4, 8, 72 rows (plain
  decode, the verify steps of K = 1, 2, 3, 8 slots, and 8 slots at K = 8); this tree's weights packed
  (layers/packed.py), as its engine loads them;
- decode_attention_bf16 at SmolLM2's heads (9 query heads over 3 kv heads, head_dim 64), 1 and 4
  queries (plain, K = 3), over 150 and 1,000 cached positions in shuffled 16-position blocks.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from redline.benchmark.machine import describe, read_bandwidth_gbps
from redline.kernels import cpu_ops
from redline.kernels.packed_layout import pack

MAIN = Path(__file__).resolve().parents[1]
CSRC = "redline/kernels/csrc"
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD_SHAPE = (49152, 576)


def build_before(revision: str) -> None:
    """That revision's csrc files, namespace renamed, built and loaded (torch.ops.redline_before), in a
    directory of its own per revision (a second run reuses the build)."""
    name = "redline_before_" + re.sub(r"\W", "_", revision)
    root = Path(tempfile.gettempdir()) / name
    root.mkdir(exist_ok=True)
    listed = subprocess.run(["git", "-C", str(MAIN), "ls-tree", "--name-only", f"{revision}:{CSRC}"],
                            check=True, capture_output=True, text=True).stdout.split()  # fmt: skip
    for name in listed:
        text = subprocess.run(["git", "-C", str(MAIN), "show", f"{revision}:{CSRC}/{name}"],
                              check=True, capture_output=True, text=True).stdout  # fmt: skip
        (root / name).write_text(text.replace("redline_cpu", "redline_before"))
    sources = [str(root / name) for name in listed if name.endswith(".cpp")]
    load(name, sources, extra_cflags=cpu_ops.FLAGS, extra_ldflags=["-fopenmp"],
         is_python_module=False)  # fmt: skip


def agree(namespaces: list[str], op: str, *args: object, per_space: dict[str, tuple] | None = None) -> None:
    """Both builds compute the same function (to bf16 rounding: their sums may run in another order);
    per_space: a namespace's own arguments."""
    per_space = per_space or {}
    first, *others = (getattr(getattr(torch.ops, s), op)(*per_space.get(s, args)) for s in namespaces)
    for other in others:
        torch.testing.assert_close(other.float(), first.float(), atol=2e-2, rtol=2e-2)


def alternated(runs: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """ms per call of each, calls alternating between them."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def report(label: str, times: dict[str, list[float]]) -> None:
    parts = [f"{name} min {min(t):.3f} median {statistics.median(t):.3f} ms" for name, t in times.items()]
    if len(times) == 2:
        ratio = statistics.median(b / a for a, b in zip(*times.values(), strict=True))
        parts.append(f"this / before (paired median) {ratio:.3f}")
    print(f"{label:28s} " + " | ".join(parts), flush=True)


def in_features(weight: torch.Tensor) -> int:  # K of [N, K] or packed [N / 32, K / 2, 32, 2]
    return weight.shape[1] * 2 if weight.dim() == 4 else weight.shape[1]


def products(namespaces: list[str], reps: int) -> None:
    """This tree's product takes the weights packed, as its engine loads them (layers/packed.py); an
    earlier revision's takes them [N, K]."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g).bfloat16() for n, k in LAYER_SHAPES * 30 + [HEAD_SHAPE]]
    packed = [pack(w) for w in weights]
    print(f"few_rows_bf16 over {sum(w.nbytes for w in weights) / 1e6:.0f} MB of weights, one decode step's")
    for m in (1, 2, 3, 4, 8, 72):
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in (576, 1536)}
        runs = {}
        for space in namespaces:
            op, ws = getattr(torch.ops, space).few_rows_bf16, packed if space == "redline_cpu" else weights
            runs[space] = lambda op=op, xs=xs, ws=ws: [op(xs[in_features(w)], w) for w in ws]
        agree(
            namespaces, "few_rows_bf16", xs[576], weights[0], per_space={"redline_cpu": (xs[576], packed[0])}
        )
        report(f"  {m} rows", alternated(runs, reps))


def attention(namespaces: list[str], reps: int) -> None:
    g = torch.Generator().manual_seed(1)
    blocks, kv_heads, block, head_dim, heads = 130, 3, 16, 64, 9
    k_cache, v_cache = torch.randn(2, blocks, kv_heads, block, head_dim, generator=g).bfloat16().unbind(0)
    tables = torch.randperm(blocks, generator=g)[:128].int()[None]
    print("decode_attention_bf16, 9 query heads over 3 kv heads, head_dim 64 (100 calls each)")
    for kv_len in (150, 1000):
        for queries in (1, 4):
            q = torch.randn(1, queries, heads, head_dim, generator=g).bfloat16()
            positions = (torch.arange(queries) + kv_len - queries)[None]
            agree(namespaces, "decode_attention_bf16", q, k_cache, v_cache, positions, tables, kv_len, 0)
            runs = {}
            for space in namespaces:
                op = getattr(torch.ops, space).decode_attention_bf16
                runs[space] = lambda op=op, q=q, p=positions, n=kv_len: [
                    op(q, k_cache, v_cache, p, tables, n, 0) for _ in range(100)
                ]
            report(f"  {queries} queries, {kv_len} keys", alternated(runs, reps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="a git revision whose kernels to compare")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    if not cpu_ops.load():
        raise SystemExit("the kernels need a CPU with AVX-512 BF16, a C++ compiler and ninja")
    namespaces = ["redline_cpu"]
    if args.before:
        build_before(args.before)
        namespaces = ["redline_before", "redline_cpu"]
    print(describe(), f"read bandwidth {read_bandwidth_gbps():.1f} GB/s", flush=True)
    products(namespaces, args.reps)
    attention(namespaces, args.reps)


if __name__ == "__main__":
    main()
