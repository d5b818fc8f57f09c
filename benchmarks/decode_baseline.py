"""Batch-1 greedy decode: redline vs HF transformers `generate` on the same weights, dtype and threads.

The model is a random Llama-3-shaped `LlamaForCausalLM` (seed 0, initializer_range 0.02): hidden 512,
intermediate 1408, 8 layers, 8 heads, 8 kv heads, untied head. The vocabulary is 8000, not 32000: with
a 32000 vocabulary the embedding and head alone would be 32.8M parameters; 8000 gives 33.9M parameters
in all, whose linears (8 layers + head) are the 59 MB bf16 of DESIGN.md "Numbers to know". The
tokenizer is a byte-level BPE trained on the Python standard library with that vocabulary (about a
second); the model's vocab is set to the trained tokenizer's actual size. Prompts are random token ids.

Decode tok/s is per user over the decode phase, (N - 1) / (t_last - t_first), for both engines:
redline's `Completion.tokens_per_s`; for HF a streamer timestamps each token as `generate` emits it.
Weight bytes per token = every parameter except the embedding table (one row of it is read);
KV-cache reads are left out. GB/s = weight bytes per token x tokens/s; "roofline" divides it by the
read bandwidth measured on this machine after the runs (machine.read_bandwidth_gbps). `--compile` runs
redline's compiled step and prefill (the warm-up, compile included, is timed and printed); HF stays eager.

    .venv/bin/python benchmarks/decode_baseline.py [--dtype float32] [--compile] [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from redline import LLM, SamplingParams
from redline.benchmark.hf import run_hf
from redline.benchmark.machine import busy_cores, cpu_model, read_bandwidth_gbps
from redline.train.bpe import train_bpe_tokenizer
from redline.train.data import stdlib_texts
from redline.train.random_init import llama3_config

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build_checkpoint(out_dir: Path, args: argparse.Namespace) -> tuple[int, int]:
    """Tokenizer + random Llama checkpoint in `out_dir`; returns (parameter count, weight bytes per token)."""
    train_bpe_tokenizer(stdlib_texts(max_files=1000, max_chars=200_000), args.vocab, out_dir)
    vocab = len(json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"])
    shape = dict(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
    )
    config = LlamaConfig(**llama3_config(vocab, **shape, tie_word_embeddings=False, initializer_range=0.02))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(DTYPES[args.dtype])
    model.save_pretrained(out_dir, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return params, weight_bytes - embed.numel() * embed.element_size() + embed[0].nbytes


def run_redline(llm: LLM, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    c = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0]
    return c.token_ids, c.ttft_s, c.tokens_per_s


def bench(
    run: Callable[[], tuple[list[int], float, float]], warmup: int, repeats: int
) -> tuple[list[int], list[float], list[float]]:
    for _ in range(warmup):
        run()
    tokens: list[int] = []
    ttfts, rates = [], []
    for _ in range(repeats):
        tokens, ttft, rate = run()
        ttfts.append(ttft)
        rates.append(rate)
    return tokens, ttfts, rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--compile", action="store_true", help="compiled step and prefill (HF stays eager)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    dtype = DTYPES[args.dtype]
    n = args.max_tokens
    busy = busy_cores()  # other processes on the cores slow multi-threaded torch down by far

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        params, weight_bytes = build_checkpoint(model_dir, args)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()

        hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        hf.generation_config.eos_token_id = None
        hf_result = bench(lambda: run_hf(hf, prompt, n), args.warmup, args.repeats)

        max_len = args.prompt_len + n
        llm = LLM(model_dir, dtype=args.dtype, max_batch=1, max_seq_len=max_len, compile=args.compile)
        if args.compile:  # every prefill and step shape, compiled as the engine was built
            print(f"redline warm-up and compile: {llm.warmup_s:.1f} s")
        rl_result = bench(lambda: run_redline(llm, prompt, n), args.warmup, args.repeats)
    bandwidth = read_bandwidth_gbps()

    machine = (
        f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, threads {torch.get_num_threads()}, {args.dtype}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}, other load at start {busy:.2f} cores, "
        f"read bandwidth {bandwidth:.1f} GB/s"
    )
    print(f"machine: {machine}")
    print(
        f"model: {params:,} parameters (vocab {vocab}, hidden {args.hidden}, "
        f"intermediate {args.intermediate}, {args.layers} layers, {args.heads} heads, "
        f"{args.kv_heads} kv heads); "
        f"weight bytes per token {weight_bytes / 1e6:.1f} MB"
    )
    print(f"batch 1, prompt {args.prompt_len} tokens, {n} new tokens, greedy, {args.repeats} repeats")
    redline_name = "redline compiled" if args.compile else "redline"
    header = f"{'engine':<18}{'tok/s median':>14}{'min':>9}{'max':>9}{'ms/token':>10}{'GB/s':>8}"
    print(header + f"{'roofline':>10}{'TTFT ms':>10}")
    results = {}
    for name, (tokens, ttfts, rates) in (("hf generate", hf_result), (redline_name, rl_result)):
        median = statistics.median(rates)
        gbps = weight_bytes * median / 1e9
        ttft_ms = statistics.median(ttfts) * 1e3
        print(
            f"{name:<18}{median:>14.1f}{min(rates):>9.1f}{max(rates):>9.1f}"
            f"{1e3 / median:>10.2f}{gbps:>8.2f}{gbps / bandwidth:>10.0%}{ttft_ms:>10.1f}"
        )
        results[name] = dict(
            tok_s_median=median, tok_s_min=min(rates), tok_s_max=max(rates), tok_s_all=rates,
            gb_s=gbps, roofline=gbps / bandwidth, ttft_ms_median=ttft_ms, tokens=tokens,
        )  # fmt: skip
    hf_tokens, rl_tokens = hf_result[0], rl_result[0]
    equal = next((i for i, (a, b) in enumerate(zip(hf_tokens, rl_tokens, strict=False)) if a != b), n)
    speedup = results[redline_name]["tok_s_median"] / results["hf generate"]["tok_s_median"]
    print(f"redline / hf decode speed: {speedup:.2f}x")
    print(f"greedy tokens: {equal} of {n} leading tokens equal between redline and hf")
    if args.json:
        report = dict(
            machine=machine, dtype=args.dtype, compile=args.compile, read_bandwidth_gbps=bandwidth,
            threads=torch.get_num_threads(), params=params, vocab=vocab,
            weight_bytes_per_token=weight_bytes, prompt_len=args.prompt_len, max_tokens=n,
            repeats=args.repeats, leading_equal_tokens=equal, results=results,
        )  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
