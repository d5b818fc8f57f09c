"""`redline eval`: configurations of one model side by side: BF16 vs FP8, speculation on vs off, or
another checkpoint. One row per configuration:
- perplexity on held-out text (strings, or conversations rendered with the chat template), and the
  mean per-token KL(base || config) over the same windows;
- greedy token agreement with the base configuration (position-wise, over the task completions);
- accuracy per task column (tasks.py); for code tasks under greedy decoding this is pass@1.
The first configuration is the base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from redline.data.sharegpt import Messages
from redline.engine.llm import LLM
from redline.evaluate.tasks import Task, score
from redline.sampling import SamplingParams
from redline.tokenizer import Tokenizer
from redline.train import data

MODES = ("bf16", "fp32", "fp16", "fp8")  # LLM dtypes; "fp8" is bf16 activations with FP8 weights
QUANTIZED = ("int4", "int8", "gguf")  # the base quantized on load, in its dtype (engine_config.WEIGHT_ONLY)


@dataclass(frozen=True)
class EvalConfig:
    name: str
    model_dir: Path
    dtype: str  # an LLM dtype: "bf16", "fp32", "fp8", ...
    draft: Path | None = None
    quantization: str | None = None  # weight-only on load: one of QUANTIZED


def parse_config(spec: str, base: EvalConfig) -> EvalConfig:
    """'fp8' | 'bf16' | 'fp32': the base model in that mode; 'int4' | 'int8' | 'gguf': the base's weights
    quantized on load (gguf: a .gguf import's own tensors); 'spec:DIR': the base with that EAGLE-3 draft;
    else a checkpoint directory in the base's dtype (FP8 and int4 / int8 checkpoints load as they are)."""
    if spec in MODES:
        return EvalConfig(spec, base.model_dir, spec)
    if spec in QUANTIZED:
        return EvalConfig(spec, base.model_dir, base.dtype, quantization=spec)
    if spec.startswith("spec:"):
        return EvalConfig(f"{base.name}+eagle3", base.model_dir, base.dtype, Path(spec[5:]))
    path = Path(spec)
    if not path.is_dir():
        modes = ", ".join((*MODES, *QUANTIZED))
        raise ValueError(f"--compare {spec!r} is neither a mode ({modes}, spec:DRAFT_DIR) nor a directory")
    return EvalConfig(path.name, path, base.dtype)


def text_windows(
    tokenizer: Tokenizer, texts: list[str | Messages], length: int, count: int
) -> list[torch.Tensor]:
    """Up to `count` windows of length + 1 tokens from the texts joined by eos (encoded only as far as
    needed); a conversation is rendered with the chat template."""
    separator = min(tokenizer.eos_token_ids, default=0)
    encoded: list[list[int]] = []
    for text in texts:
        chat = not isinstance(text, str)
        encoded.append(tokenizer.encode_chat(list(text), False) if chat else tokenizer.encode(text))
        if sum(map(len, encoded)) + len(encoded) > count * length:
            break
    stream = data.token_stream(encoded, separator)
    return [stream[i * length : (i + 1) * length + 1] for i in range(min(count, (len(stream) - 1) // length))]


def evaluate(
    configs: list[EvalConfig], tasks: list[Task], texts: list[str | Messages], windows: int = 16,
    window_len: int = 256, device: str = "cpu", tensor_parallel_size: int = 1, expert_parallel: bool = False,
) -> list[dict]:  # fmt: skip
    rows, base_lp, base_tokens = [], None, None
    for config in configs:
        llm = LLM(config.model_dir, dtype=config.dtype, device=device, max_num_seqs=8, draft=config.draft,
                  quantization=config.quantization, tensor_parallel_size=tensor_parallel_size,
                  enable_expert_parallel=expert_parallel, compile_sampling=False)  # fmt: skip
        # compile_sampling off: the tasks decode greedily, the logits path's steps never run
        samples = text_windows(llm.tokenizer, texts, window_len, windows)
        lp = [llm.log_probs(w.tolist()) for w in samples]  # [T, V] fp32 per window (every TP rank joins)
        nll = [-x[torch.arange(len(w) - 1), w[1:]].mean().item() for x, w in zip(lp, samples, strict=True)]
        base_lp = base_lp or lp
        kl = [(b.exp() * (b - c)).sum(-1).mean().item() for b, c in zip(base_lp, lp, strict=True)]
        params = [SamplingParams(max_tokens=t.max_tokens, stop=list(t.stop) or None) for t in tasks]
        prompts = [llm.tokenizer.encode_chat(list(t.messages)) if t.messages else t.prompt for t in tasks]
        completions = llm.generate(prompts, params)
        tokens = [c.token_ids for c in completions]
        base_tokens = base_tokens or tokens
        pairs = [(a, b) for x, y in zip(tokens, base_tokens, strict=True) for a, b in zip(x, y, strict=False)]
        row = {
            "config": config.name,
            "perplexity": math.exp(sum(nll) / len(nll)),
            "kl_to_base": sum(kl) / len(kl),
            "greedy_agreement": sum(a == b for a, b in pairs) / len(pairs) if pairs else math.nan,
        }
        correct: dict[str, list[bool]] = {}
        scored = [(t, c) for t, c in zip(tasks, completions, strict=True) if t.kind != "open"]
        for task, c in tqdm(scored, desc=f"scoring {config.name}", leave=False):
            correct.setdefault(task.task, []).append(score(task, c.text))
        row["accuracy"] = {name: sum(v) / len(v) for name, v in correct.items()}
        rows.append(row)
        llm.close()
    return rows


def eval_table(rows: list[dict]) -> str:
    widths = {c: max(10, len(c) + 2) for c in sorted({c for r in rows for c in r["accuracy"]})}
    head = "".join(f"{c:>{w}}" for c, w in widths.items())
    lines = [f"{'config':<18}{'perplexity':>12}{'KL to base':>12}{'greedy = base':>15}{head}"]
    for r in rows:
        cells = "".join(f"{100 * r['accuracy'].get(c, float('nan')):>{w - 1}.1f}%" for c, w in widths.items())
        lines.append(
            f"{r['config']:<18}{r['perplexity']:>12.3f}{r['kl_to_base']:>12.2e}{r['greedy_agreement']:>15.1%}{cells}"
        )
    return "\n".join(lines)
