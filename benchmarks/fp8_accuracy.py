"""FP8 weights vs BF16 (and FP32) on the demo target: held-out perplexity, KL to FP32, greedy agreement.

    .venv/bin/python benchmarks/fp8_accuracy.py [--model DIR] [--prompts 16] [--max-tokens 64]

Perplexity: the held-out files (train/data.py HELD_OUT) as one token stream, 64 windows of 256 tokens.
KL: mean KL(FP32 || config) of next-token distributions over the same windows. Greedy agreement:
the fraction of generated positions where the configuration's greedy token equals BF16's, over
`--prompts` held-out prompts of 48 tokens.
"""

from __future__ import annotations

import argparse
import math

import torch

from redline import LLM, SamplingParams
from redline.demo import cache_root
from redline.models.build import load_target
from redline.tokenizer import Tokenizer
from redline.train import data
from redline.train.draft import held_out_prompts
from redline.train.target import causal_lm_loss

CONFIGS = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None), "fp8": (torch.bfloat16, "fp8")}


@torch.no_grad()
def evaluate(model_dir, windows: list[torch.Tensor]) -> dict:
    reference = load_target(model_dir, torch.float32)
    out = {}
    for name, (dtype, quantization) in CONFIGS.items():
        model = load_target(model_dir, dtype, quantization=quantization)
        losses, kls = [], []
        for window in windows:
            losses.append(causal_lm_loss(model, window[None]).item())
            positions = torch.arange(len(window) - 1)[None]
            p = reference.logits(reference(window[None, :-1], positions)[0]).log_softmax(-1)
            q = model.logits(model(window[None, :-1], positions)[0]).log_softmax(-1)
            kls.append((p.exp() * (p - q)).sum(-1).mean().item())
        out[name] = {"perplexity": math.exp(sum(losses) / len(losses)), "kl_to_fp32": sum(kls) / len(kls)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=cache_root() / "target")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_dir(args.model)
    stream = data.token_stream([tokenizer.encode(t) for t in data.split_stdlib()[1]], 4)
    windows = [stream[i * 256 : (i + 1) * 256 + 1] for i in range(min(64, (len(stream) - 1) // 256))]
    results = evaluate(args.model, windows)

    prompts = held_out_prompts(args.model, args.prompts, 48)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    outputs = {}
    for name in CONFIGS:
        llm = LLM(
            args.model,
            dtype={"fp32": "float32", "bf16": "bfloat16", "fp8": "fp8"}[name],
            max_batch=8,
            max_seq_len=48 + args.max_tokens + 8,
        )
        outputs[name] = [c.token_ids for c in llm.generate(prompts, params)]
    for name in CONFIGS:
        pairs = [
            (a, b)
            for x, y in zip(outputs[name], outputs["bf16"], strict=True)
            for a, b in zip(x, y, strict=True)
        ]
        results[name]["greedy_agreement_with_bf16"] = sum(a == b for a, b in pairs) / len(pairs)
    print(f"{'config':<8}{'perplexity':>12}{'vs bf16':>9}{'KL to fp32':>12}{'greedy = bf16':>15}")
    for name, r in results.items():
        rel = r["perplexity"] / results["bf16"]["perplexity"] - 1
        print(
            f"{name:<8}{r['perplexity']:>12.3f}{rel:>+9.2%}{r['kl_to_fp32']:>12.2e}{r['greedy_agreement_with_bf16']:>15.1%}"
        )


if __name__ == "__main__":
    main()
