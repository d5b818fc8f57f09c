"""`redline demo`: the embedded demo pair, end to end.

The first run trains the demo target (train/target.py's recipe) and its EAGLE-3 draft (DEMO_DRAFT) on
the standard library's source, about 10 minutes on 2 cores, and caches both under
$REDLINE_CACHE/demo-v1 (default ~/.cache/redline). Each is trained in a `.partial` directory and
renamed when complete; an interrupted run resumes from its last checkpoint. Later runs start in seconds.
It then completes held-out code prompts with and without speculation (greedy, so both must agree
token for token) and prints the completions, tokens/s per user, acceptance length and the speedup.
"""

from __future__ import annotations

import os
import shutil
import statistics
from pathlib import Path

from redline.engine.llm import LLM
from redline.sampling import SamplingParams
from redline.train.draft import DraftRecipe, held_out_prompts, run_acceptance_length, train_draft
from redline.train.target import TargetRecipe, train_target

DEMO_DRAFT = DraftRecipe(
    draft_vocab=1024, intermediate_size=384, ttt_steps=4, num_prompts=192, steps=250, lr=2e-3, warmup=20
)


def cache_root() -> Path:
    return Path(os.environ.get("REDLINE_CACHE") or Path.home() / ".cache" / "redline") / "demo-v1"


def demo_pair(root: Path | None = None) -> tuple[Path, Path]:
    """The demo target and draft directories, trained on first use."""
    root = root or cache_root()
    target, draft = root / "target", root / "draft"
    if not (target / "config.json").is_file():
        print(f"[redline] first run: training the demo target (about 5 minutes) into {target}")
        _build(target, lambda out, resume: train_target(out, TargetRecipe(), resume=resume))
    if not (draft / "config.json").is_file():
        print(f"[redline] training its EAGLE-3 draft (about 5 minutes) into {draft}")
        _build(draft, lambda out, resume: train_draft(target, out, DEMO_DRAFT, resume=resume))
    return target, draft


def _build(final: Path, trainer) -> None:
    partial = final.with_name(final.name + ".partial")
    trainer(partial, (partial / "checkpoint.pt").is_file())
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)


def run_demo(num_prompts: int = 3, max_tokens: int = 96, k: int = 3, compile: bool = False) -> dict:
    target, draft = demo_pair()
    prompts = held_out_prompts(target, num_prompts, 48, seed=7)
    max_len = 48 + max_tokens + 16
    plain = LLM(target, dtype="float32", max_batch=1, max_seq_len=max_len, compile=compile)
    spec = LLM(target, dtype="float32", max_batch=1, max_seq_len=max_len, draft=draft, num_draft_tokens=k,
               compile=compile)  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for llm in (plain, spec):  # warm-up (and compile) outside the timed runs
        llm.generate([prompts[0]], params)
    plain_runs, spec_runs = [], []
    for i, prompt in enumerate(prompts):
        a = plain.generate([prompt], params)[0]
        b = spec.generate([prompt], params)[0]
        plain_runs.append(a)
        spec_runs.append(b)
        print(f"\n--- held-out prompt {i + 1} " + "-" * 50)
        print(plain.tokenizer.decode(prompt), end="")
        print("\033[1m" + b.text + "\033[0m")
        print(
            f"[plain {a.tokens_per_s:.0f} tok/s | EAGLE-3 K={k} {b.tokens_per_s:.0f} tok/s, "
            f"acceptance length {b.acceptance_length:.2f} | identical tokens: {a.token_ids == b.token_ids}]"
        )
    result = {
        "plain_tps": statistics.median(c.tokens_per_s for c in plain_runs),
        "spec_tps": statistics.median(c.tokens_per_s for c in spec_runs),
        "acceptance_length": run_acceptance_length(spec_runs),
        "identical": all(a.token_ids == b.token_ids for a, b in zip(plain_runs, spec_runs, strict=True)),
    }
    print(
        f"\n[redline] demo pair, batch 1, greedy, float32: plain {result['plain_tps']:.1f} tok/s per user, "
        f"EAGLE-3 K={k} {result['spec_tps']:.1f} tok/s per user, speedup "
        f"{result['spec_tps'] / result['plain_tps']:.2f}x, acceptance length "
        f"{result['acceptance_length']:.2f}, outputs identical: {result['identical']}"
    )
    return result
