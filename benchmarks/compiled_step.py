"""Decode step time, eager vs torch.compile(fullgraph=True), plain (K=0) and EAGLE-3 (K=3), batch 1, CPU.

The target is a random Llama 3 over a 2000-token BPE vocabulary (hidden 512, intermediate 1408, 8 layers,
8 heads, 4 kv heads; ~27M parameters) and the draft a random EAGLE-3 head for it. One prompt of
`--prompt-len` tokens is prefilled, then every step is timed. All timed steps stay inside one
KV-length bucket, so the compiled runner compiles exactly once: its first step is the compile time
(reported separately), the rest is the steady state. Step time does not depend on how many drafts are
accepted (the shapes are static), so random drafts measure it faithfully.

    .venv/bin/python benchmarks/compiled_step.py [--dtype float32] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from redline.engine.runner import ModelRunner
from redline.models.build import load_target
from redline.models.eagle3 import load_draft
from redline.models.random_init import write_random_draft, write_random_model
from redline.sampling import SamplingParams

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def time_steps(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[float, list[float]]:
    """Prefills `prompt` into slot 0; returns (first step seconds, later step seconds)."""
    assert runner.reserve(0, runner.cache_len)  # KV blocks for the slot's whole context
    runner.prefill(0, prompt, SamplingParams(), seed=0)
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        runner.decode(1, len(prompt) + i * (runner.k + 1))
        times.append(time.perf_counter() - start)
    return times[0], times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    # the furthest position a step may reach stays inside one KV bucket: no recompile while timing
    max_len = args.prompt_len + (args.steps + 1) * 4 + 8

    with tempfile.TemporaryDirectory() as tmp:
        target_dir = write_random_model(
            Path(tmp) / "target", vocab_size=2000, hidden_size=512, intermediate_size=1408,
            num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
        )  # fmt: skip
        draft_dir = write_random_draft(target_dir, Path(tmp) / "draft")
        target = load_target(target_dir, dtype, torch.device("cpu"))
        draft = load_draft(draft_dir, target, dtype, torch.device("cpu"))
        prompt = torch.randint(5, target.config.vocab_size, (args.prompt_len,)).tolist()

        print(f"torch {torch.__version__}, {args.dtype}, threads {torch.get_num_threads()}, batch 1")
        print(f"{'step':<14}{'eager ms':>10}{'compiled ms':>13}{'speedup':>9}{'compile s':>11}")
        for name, k in (("plain K=0", 0), ("eagle3 K=3", 3)):
            results = {}
            for compiled in (False, True):
                runner = ModelRunner(target, 1, max_len, draft if k else None, max(k, 1), compile=compiled)
                torch._dynamo.reset()
                first, rest = time_steps(runner, prompt, args.steps)
                results[compiled] = (first, statistics.median(rest))
            eager, compiled_ms, compile_s = results[False][1], results[True][1], results[True][0]
            print(
                f"{name:<14}{eager * 1e3:>10.2f}{compiled_ms * 1e3:>13.2f}"
                f"{eager / compiled_ms:>9.2f}{compile_s:>11.1f}"
            )


if __name__ == "__main__":
    main()
