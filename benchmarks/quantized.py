"""Quantized weights on the real SmolLM2-135M-Instruct (CPU): perplexity on held-out ShareGPT and compiled
batch-1 decode speed, bf16 against int8 and int4 weight-only on load in groups of 32 (and int4 in groups of
64): the C++ kernel's layout on AVX-512 BF16 CPUs (kernels/quantized_layout.py), else quant/int4.py.

    .venv/bin/python benchmarks/quantized.py [--tokens 1024] [--no-compile]

Perplexity: one whole forward over the first `tokens` tokens of held-out ShareGPT conversations (the
same text for every engine). Decode: a 128-token prompt, then 128 tokens greedy: the time of 129 minus
that of 1 (the prefill), best of 3.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from redline import LLM, SamplingParams
from redline.benchmark.machine import describe, read_bandwidth_gbps
from redline.data import sharegpt
from redline.models.gguf import gguf_model_dir, smollm2_gguf

ENGINES = [(None, 32), ("int8", 32), ("int4", 32), ("int4", 64)]


def decode_tok_s(llm: LLM, prompt: list[int], tokens: int = 128) -> float:
    llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))  # warm
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
        middle = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        best = max(best, tokens / ((middle - start) - (time.perf_counter() - middle)))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    print(json.dumps(describe()))
    print(f"read bandwidth {read_bandwidth_gbps():.1f} GB/s")
    model_dir = gguf_model_dir(smollm2_gguf(), torch.bfloat16, progress=False)
    text = " ".join(m["content"] for c in sharegpt.conversations("held_out")[:30] for m in c.messages)
    print("| weights | perplexity | decode tok/s |\n|---|---:|---:|")
    for quantization, group in ENGINES:
        options = dict(quantization=quantization, quantization_group_size=group, compile=not args.no_compile)
        llm = LLM(
            model_dir, dtype="bfloat16", max_batch=1, max_seq_len=args.tokens + 200, progress=False, **options
        )
        ids = llm.tokenizer.encode(text, add_special_tokens=False)[: args.tokens]
        nll = -llm.log_probs(ids).gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
        name = "bf16" if quantization is None else f"{quantization} g{group}"
        print(f"| {name} | {math.exp(nll):.3f} | {decode_tok_s(llm, ids[:128]):.1f} |", flush=True)


if __name__ == "__main__":
    main()
