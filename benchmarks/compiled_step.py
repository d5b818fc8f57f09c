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

from redline.config import ModelConfig
from redline.engine_config import EngineConfig
from redline.parallel.group import SINGLE
from redline.runner.build import build_runner
from redline.runner.model_runner import ModelRunner
from redline.runner.one_slot import fill_slot
from redline.train.random_init import write_random_draft, write_random_model


@torch.inference_mode()  # as the engine runs the step (ModelRunner.execute)
def time_steps(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[float, list[float]]:
    """Prefills `prompt` into slot 0; returns (first step seconds, later step seconds)."""
    fill_slot(runner, prompt)
    k, times = runner.shapes.k, []
    for i in range(steps + 1):
        start = time.perf_counter()
        runner.run_step(1, runner.shapes.kv_len_for(len(prompt) + i * (k + 1)), False)
        times.append(time.perf_counter() - start)
    return times[0], times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # the furthest position a step may reach stays inside one KV bucket: no recompile while timing
    max_len = args.prompt_len + (args.steps + 1) * 4 + 8

    with tempfile.TemporaryDirectory() as tmp:
        target_dir = write_random_model(
            Path(tmp) / "target", vocab_size=2000, hidden_size=512, intermediate_size=1408,
            num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
        )  # fmt: skip
        draft_dir = write_random_draft(target_dir, Path(tmp) / "draft")
        vocab = ModelConfig.from_dir(target_dir).vocab_size
        prompt = torch.randint(5, vocab, (args.prompt_len,)).tolist()

        print(f"torch {torch.__version__}, {args.dtype}, threads {torch.get_num_threads()}, batch 1")
        print(f"{'step':<14}{'eager ms':>10}{'compiled ms':>13}{'speedup':>9}{'compile s':>11}")
        for name, k in (("plain K=0", 0), ("eagle3 K=3", 3)):
            results = {}
            for compiled in (False, True):
                drafting = {"draft": draft_dir, "num_speculative_tokens": k} if k else {}
                config = EngineConfig.create(target_dir, dtype=args.dtype, max_num_seqs=1,
                                             max_model_len=max_len, compile=compiled, **drafting)  # fmt: skip
                runner = build_runner(config, SINGLE)  # as the engine builds it, kernels and all
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
