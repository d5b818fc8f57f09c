"""Llama 4 MoE prefill on CPU: time and peak memory of one MoE layer over a prompt, two versions of the code.

    git worktree add /tmp/redline-before <commit>      # the code to compare against
    .venv/bin/python benchmarks/moe_prefill.py --before /tmp/redline-before [--repeats 7] [--threads N]
        [--json benchmarks/results/moe_prefill.json]

The layer: hidden 256, expert width 512 (the shared expert's too), top_k 1, a random normal router (so
tokens spread over the experts about evenly); 16 and 128 experts; prompts of 512 and 2,048 tokens;
fp32, bf16, and FP8 experts with bf16 activations. Eager, no grad.

Each (code, dtype, experts, tokens) runs in a fresh subprocess that imports redline from that code's
tree and warms the layer up on 2 x experts tokens (lazy imports, kernel setup). Memory: the first
full-size forward's peak resident set over the resident set just before it (Linux
/proc/self/status VmHWM after resetting it through /proc/self/clear_refs, minus VmRSS). torch's CPU
allocator is malloc; with MALLOC_MMAP_THRESHOLD_ fixed at 128 KiB, glibc returns every freed block of
that size or more to the system, so this counts the forward's own intermediates, not blocks kept from
the warm-up (bf16 products also grow oneDNN's primitive cache, about 0.6 MiB per new row count, which
is counted too). Time: the min and median of `repeats` forwards after that first one; the two versions of
each configuration run back to back, so they meet about the same background load (on a shared machine
the min is the steadier figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HIDDEN, INTER, TOP_K = 256, 512, 1
EXPERTS, TOKENS, DTYPES = (16, 128), (512, 2048), ("fp32", "bf16", "fp8")
MAIN = Path(__file__).resolve().parents[1]


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(dtype_name: str, num_experts: int, tokens: int, repeats: int) -> dict:
    """One configuration, in this process: build the layer, measure the first full-size forward's memory,
    time the rest. Imports redline from PYTHONPATH (the tree under test)."""
    import importlib.util

    import torch

    import redline
    from redline.layers.moe import MoE

    fp8_module = "redline.quant.fp8_experts"  # older trees keep Fp8Experts in redline.quant.fp8
    fp8_module = fp8_module if importlib.util.find_spec(fp8_module) else "redline.quant.fp8"
    dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    moe = MoE(HIDDEN, INTER, num_experts, TOP_K)
    with torch.no_grad():
        for p in moe.parameters():  # Linear [out, in]; experts [E, in, out]
            p.normal_(0, (p.shape[-1] if p.dim() == 2 else p.shape[-2]) ** -0.5)
    moe = moe.to(dtype)
    if dtype_name == "fp8":
        moe.experts = importlib.import_module(fp8_module).Fp8Experts.from_experts(moe.experts)
    x = torch.randn(tokens, HIDDEN, dtype=dtype)

    with torch.inference_mode():
        moe(x[: 2 * num_experts])  # the many-token path on a few rows: lazy imports and kernels load here
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = status_kib("VmRSS")
        moe(x)
        peak = status_kib("VmHWM")
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            moe(x)
            times.append(time.perf_counter() - start)
    return {
        "dtype": dtype_name,
        "experts": num_experts,
        "tokens": tokens,
        "ms_min": round(1e3 * min(times), 2),
        "ms_median": round(1e3 * statistics.median(times), 2),
        "peak_mib": round((peak - before) / 1024, 1),
        "threads": torch.get_num_threads(),
        "redline": str(Path(redline.__file__).parents[1]),
    }


def run_child(root: Path, config: tuple[str, int, int], repeats: int, threads: int) -> dict:
    """`child` in a fresh process with redline from `root`."""
    # a fixed mmap threshold turns off glibc's adaptive one, so every block of 128 KiB or more goes back
    # to the system when freed and VmRSS follows what is live
    env = {**os.environ, "PYTHONPATH": str(root), "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    env["OMP_NUM_THREADS"] = str(threads)
    command = [sys.executable, __file__, "--child", *map(str, config), "--repeats", str(repeats)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if Path(result["redline"]).resolve() != root.resolve():
        raise RuntimeError(f"child imported redline from {result['redline']}, not {root}")
    return result


def cpu_has(flag: str) -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.is_file() and any(
        line.startswith("flags") and flag in line.split() for line in cpuinfo.read_text().splitlines()
    )


def table(runs: list[dict]) -> str:
    rows = [
        "| dtype | experts | tokens | before ms min / median | after ms min / median | speedup (min) "
        "| before peak MiB | after peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_key = {(r["code"], r["dtype"], r["experts"], r["tokens"]): r for r in runs}
    for dtype in DTYPES:
        for e in EXPERTS:
            for n in TOKENS:
                b, a = by_key[("before", dtype, e, n)], by_key[("after", dtype, e, n)]
                rows.append(
                    f"| {dtype} | {e} | {n} | {b['ms_min']:.1f} / {b['ms_median']:.1f} "
                    f"| {a['ms_min']:.1f} / {a['ms_median']:.1f} | {b['ms_min'] / a['ms_min']:.1f}x "
                    f"| {b['peak_mib']:.0f} | {a['peak_mib']:.0f} |"
                )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="tree of the code to compare against")
    parser.add_argument("--after", type=Path, default=MAIN, help="tree of the new code (default: this one)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", type=Path, default=MAIN / "benchmarks/results/moe_prefill.json")
    parser.add_argument("--child", nargs=3, metavar=("DTYPE", "EXPERTS", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        dtype, num_experts, tokens = args.child
        print(json.dumps(child(dtype, int(num_experts), int(tokens), args.repeats)))
        return
    if args.before is None:
        parser.error("--before is required")

    from redline.benchmark.machine import describe

    machine = {**describe(), **{flag: cpu_has(flag) for flag in ("avx512f", "avx512_bf16", "amx_bf16")}}
    machine["threads"] = args.threads
    print(json.dumps(machine, indent=1))
    runs = []
    for dtype in DTYPES:
        for e in EXPERTS:
            for n in TOKENS:
                for code, root in (("before", args.before), ("after", args.after)):  # back to back
                    result = {"code": code, **run_child(root, (dtype, e, n), args.repeats, args.threads)}
                    print(json.dumps(result), flush=True)
                    runs.append(result)
    print(table(runs))
    layer = {
        "hidden": HIDDEN,
        "expert_inter": INTER,
        "shared_inter": INTER,
        "top_k": TOP_K,
        "router": "normal",
    }
    method = (
        "one subprocess per configuration, warmed up on 2 x experts tokens; peak_mib = VmHWM - VmRSS around "
        "the first full-size forward (VmHWM reset via /proc/self/clear_refs, MALLOC_MMAP_THRESHOLD_=131072); "
        "ms = min and median of the repeats after it; eager, inference_mode"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine, "layer": layer, "method": method, "runs": runs}
    args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
